"""Training reports: console lines, TensorBoard events and ``metrics.jsonl``.

The console follows Megatron-LM (megatron/training/training.py ``training_log`` and
``evaluate_and_print_results``, megatron/training/utils.py ``report_memory``; the ByteMLPerf
fork, byte_train_perf/Megatron-LM/megatron/training/, prints the same lines), so
ByteMLPerf's log tools and :mod:`jmegatron.bench.megatron_log` read a jmegatron log as a
Megatron one:

* every ``log_interval`` iterations, ``' [YYYY-MM-DD HH:MM:SS] iteration {:8d}/{:8d} |
  consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} | learning rate:
  {:.6E} | global batch size: {:5d} | lm loss: {:.6E} |'`` (and each other loss, ``'
  {name}: {:.6E} |'``) ``' loss scale: {:.1f} | grad norm: {:.3f} |'`` [``' num zeros:
  {:.1f} |'`` with ``log_num_zeros_in_grad``] ``' number of skipped iterations: {:3d} |
  number of nan iterations: {:3d} |'``, then jmegatron's own fields by key: ``tokens/s``,
  ``TFLOP/s/device``, ``MFU`` (against the peak in use) and ``MFU (theoretical peak)``;
* at evaluations, Megatron's block: a line of dashes, `` validation loss at iteration N |
  lm loss value: {:.6E} | lm loss PPL: {:.6E} |`` (PPL = exp(min(20, loss)) as Megatron),
  dashes;
* after the first logged iteration (every logged iteration with ``test_memory``,
  ByteMLPerf's ``--test-memory``), ``[Rank r] (after N iterations) memory (MB) | allocated:
  X | max allocated: X | reserved: X | max reserved: X | source: ...``.

Differences from Megatron, on purpose: losses and grad norm are means over the log
interval (Megatron prints the interval's mean loss but the last iteration's grad norm;
equal with ``log_interval=1``, ByteMLPerf's setting); ``loss scale`` is the last
iteration's step metric ``loss_scale`` (fp16's; 1.0 without one, as Megatron prints in bf16);
skipped and nan iterations count step metrics ``skipped`` / ``nan`` when the step reports
them, else 0: Megatron's meaning (an iteration whose update was not applied is skipped; a
skipped one whose loss is inf/nan is also a nan iteration; docs/RELIABILITY.md).

Every scalar the forward step's loss function reports (its ``report`` dict:
:class:`jmegatron.training.forward_step.ForwardStep`) is printed as `` {name}: {:.6E} |``
after the known losses, as Megatron's ``training_log`` prints every key of the loss dict,
and reaches ``metrics.jsonl``, TensorBoard and W&B under its key: the loop passes the
step's metrics through and never names them. What the train step adds itself
(:data:`STEP_METRICS`) is not a report entry.

Beyond Megatron: a ``[jmegatron] compiling the train step for tokens [m, b, s] ...`` /
``[jmegatron] compiled ... in X s`` pair for each program compiled (the first step's, each
new sequence length's or batch size's, the evaluation step's: :mod:`jmegatron.compilation`),
its seconds left out of the iteration's elapsed time, a progress line (tqdm's ``format_meter``: elapsed time,
iterations/s, ETA) after each iteration line, and a closing summary line
(:meth:`MetricsLogger.log_summary`). Each is a single ``\n``-terminated line, so a log
file stays readable. ``metrics.jsonl`` is strict JSON: a non-finite value is ``null``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from jmegatron.config import ConfigError


# Report keys -> Megatron's console names (pretrain_gpt.py loss_func; the distillation
# loss_func's "kd loss", "logits distillation loss", "intermediate distillation loss";
# Megatron-Core MoE's "load_balancing_loss" as ByteMLPerf's Mixtral logs print it).
REPORT_NAMES = {
    "lm_loss": "lm loss",
    "kd_loss": "kd loss",
    "logits_distillation_loss": "logits distillation loss",
    "intermediate_distillation_loss": "intermediate distillation loss",
    "load_balancing_loss": "load_balancing_loss",
    "seq_load_balancing_loss": "seq_load_balancing_loss",
    "z_loss": "z_loss",
}


# What make_train_step adds to the forward step's report (jmegatron/training/step.py
# _metrics and _apply_gradients): step-level figures, not losses of the forward step.
STEP_METRICS = frozenset({"loss", "grad_norm", "lr", "num_tokens", "skipped", "nan", "loss_scale", "stop",
                          "num_zeros"})
# Report entries the record carries in their own form, not on the console line (the MoE
# router's statistics: tokens per expert [MoE layers, experts], dropped-token fraction).
RECORD_ONLY = frozenset({"moe_tokens_per_expert", "moe_dropped_token_fraction"})
_MTP_LOSS = re.compile(r"mtp_(\d+)_loss")


def report_name(key: str) -> str:
    """The console name of report ``key``: :data:`REPORT_NAMES`, Megatron's ``mtp_{k} loss``
    for a multi-token prediction depth's ``mtp_{k}_loss``, else the key itself (a custom
    forward step's metric, printed under the name its loss function gave it)."""
    if key in REPORT_NAMES:
        return REPORT_NAMES[key]
    mtp = _MTP_LOSS.fullmatch(key)
    return f"mtp_{mtp.group(1)} loss" if mtp else key


def reported_keys(metrics: dict) -> list:
    """The report keys of ``metrics`` (one step's metrics) that the console line prints: those
    of :data:`REPORT_NAMES` in its order, the multi-token prediction depths (``mtp_1_loss``,
    ``mtp_2_loss``, ...), then every other scalar entry in key order (what a custom forward
    step's loss function reports), leaving out :data:`STEP_METRICS` and :data:`RECORD_ONLY`."""
    mtp = sorted((k for k in metrics if _MTP_LOSS.fullmatch(k)), key=lambda k: int(k.split("_")[1]))
    known = [k for k in REPORT_NAMES if k in metrics] + mtp
    other = sorted(k for k in metrics if k not in known and k not in STEP_METRICS and k not in RECORD_ONLY
                   and np.ndim(metrics[k]) == 0)
    return known + other


def strict_json(value: Any) -> Any:
    """``value`` (nested dicts / lists / tuples of numbers and strings) with every
    non-finite float (NaN, +-inf) replaced by None, so ``json.dumps(..., allow_nan=False)``
    writes RFC 8259 JSON (``null``) instead of Python's ``NaN`` / ``Infinity`` tokens."""
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return None
    return value


MB = 1024.0 * 1024.0  # Megatron's report_memory "MB" (mega_bytes = 1024 * 1024)
# The " | source: ..." suffix of the memory line: which figures it holds (log_memory's docstring).
SOURCE_DEVICE = "device memory_stats"
SOURCE_HOST = "compiled train step per device (reserved: the largest step program's peak)"


def device_memory(devices) -> Optional[list[dict]]:
    """Megatron's four figures (bytes) for each device whose backend keeps allocator
    statistics (GPU/TPU ``Device.memory_stats()``: ``bytes_in_use``, ``peak_bytes_in_use``,
    reserved from the first nonzero of ``pool_bytes`` / ``bytes_reserved`` / ``bytes_limit``,
    named in ``reserved_key``, and its peak); None when a device has none (CPU)."""
    out = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_in_use" not in stats:
            return None
        # reserved: the allocator's pool (BFC's pool_bytes, torch's memory_reserved analogue), else
        # reserved bytes, else the pool's limit; the key used is named in the line's source
        key = next((k for k in ("pool_bytes", "bytes_reserved", "bytes_limit") if stats.get(k, 0) > 0), None)
        reserved = stats[key] if key else 0
        peak = {"pool_bytes": "peak_pool_bytes", "bytes_reserved": "peak_bytes_reserved"}.get(key)
        out.append({"rank": int(d.id), "allocated": stats["bytes_in_use"],
                    "max_allocated": stats.get("peak_bytes_in_use", stats["bytes_in_use"]),
                    "reserved": reserved, "max_reserved": max(stats.get(peak, 0) if peak else 0, reserved),
                    "reserved_key": key})
    return out


def program_peak(analysis: Any) -> float:
    """A compiled program's peak bytes per device from its ``memory_analysis()``: arguments
    + outputs - aliased (donated) + temporaries (0 for None)."""
    def get(name):
        return float(getattr(analysis, name, 0) or 0) if analysis is not None else 0.0

    return (get("argument_size_in_bytes") + get("output_size_in_bytes") - get("alias_size_in_bytes")
            + get("temp_size_in_bytes"))


def host_memory(rank: int, analysis: Any, pool: Sequence[Any] = ()) -> dict:
    """Megatron's four figures (bytes) where the backend keeps no allocator statistics (the
    CPU), from compiled programs' ``memory_analysis()`` (per device; deterministic: the
    same program gives the same figures in every run):

    * allocated: ``analysis``'s arguments (this iteration's program: the state and batch,
      live between steps; 0 for None);
    * max allocated: its peak (:func:`program_peak`), so each sequence length's line
      gives that length's memory;
    * reserved = max reserved: the largest peak of ``analysis`` and ``pool`` (the other
      programs the run has compiled or can run: under variable data the longest length's),
      the pool a caching allocator must hold to run every one of them (torch's
      ``memory_reserved``, XLA's BFC ``pool_bytes``), fragmentation not counted."""
    peak = program_peak(analysis)
    reserved = max([peak] + [program_peak(a) for a in pool])
    args = float(getattr(analysis, "argument_size_in_bytes", 0) or 0) if analysis is not None else 0.0
    return {"rank": rank, "allocated": args, "max_allocated": peak, "reserved": reserved, "max_reserved": reserved}


def memory_line(iteration: int, m: dict, source: Optional[str]) -> str:
    """ByteMLPerf's memory line (Megatron's report_memory behind ``[Rank r]``): MB =
    bytes / 2**20, printed with Python's ``str(float)`` as Megatron's ``'{}'.format``;
    jmegatron adds `` | source: ...``."""
    text = (f"[Rank {m['rank']}] (after {iteration} iterations) memory (MB) | allocated: {m['allocated'] / MB}"
            f" | max allocated: {m['max_allocated'] / MB} | reserved: {m['reserved'] / MB}"
            f" | max reserved: {m['max_reserved'] / MB}")
    return text + (f" | source: {source}" if source else "")



def _summary_writer(logdir: str):
    """tensorboardX's ``SummaryWriter`` for ``logdir``. tensorboardX imports torch, when it is
    installed, only to accept torch tensors (about 1 s of every run's start); this logger
    writes floats and numpy arrays, so torch is hidden from that import unless the process
    has already imported it."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None  # makes ``import torch`` raise ImportError
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
    return SummaryWriter(logdir)

def init_wandb(project: str, exp_name: str, save_dir: str, config: dict, entity: Optional[str] = None):
    """A Weights & Biases run for the training scalars, as Megatron's ``_set_wandb_writer``
    (megatron/training/global_vars.py): ``wandb.init(project, name=exp_name, dir=save_dir,
    config=config[, entity])`` after creating ``save_dir`` (W&B writes its run under
    ``save_dir/wandb/``). ``WANDB_MODE=offline`` writes the run there with no network
    (``wandb sync`` uploads it later). Console capture is off and W&B's own closing report
    is quiet: the trainer's stdout stays Megatron's log (W&B gets the scalars).

    wandb is imported here only (an optional dependency). Raises ConfigError naming
    ``pip install wandb`` when it is missing, and naming ``wandb login`` /
    ``WANDB_MODE=offline`` when ``wandb.init`` fails (no credentials, no network)."""
    wandb = import_wandb()
    os.makedirs(save_dir, exist_ok=True)
    kwargs = dict(project=project, name=exp_name, dir=save_dir, config=config,
                  settings=wandb.Settings(console="off", quiet=True))
    if entity:
        kwargs["entity"] = entity
    try:
        return wandb.init(**kwargs)
    except Exception as e:  # wandb raises its own UsageError / CommError types
        raise ConfigError(f"config.wandb_project={project!r}: wandb.init failed ({type(e).__name__}: {e}); run "
                          f"`wandb login`, or set WANDB_MODE=offline to write the run under {save_dir} and upload "
                          "it later with `wandb sync`") from e


def import_wandb():
    """The ``wandb`` module; ConfigError naming ``pip install wandb`` when it is not installed."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError("config.wandb_project is set but the wandb package is not installed: pip install wandb "
                          "(or unset config.wandb_project)") from e
    return wandb


class ProgressLine:
    """The trainer's progress line: tqdm's ``format_meter`` (percentage, an ASCII bar,
    ``iteration/total``, elapsed time, ETA, iterations/s), printed as one ordinary line per
    log interval, so a log file gets no carriage returns.

    ``total``: the run's last iteration; ``start_iteration``: where this run started (a
    resumed run's rate counts its own iterations). Elapsed time is from construction; the
    rate (and so the ETA) is measured from :meth:`start_rate` on (after the first step's
    compilation), falling back to tqdm's own ``(n - start_iteration) / elapsed`` before it.
    ``clock``: seconds (``time.perf_counter``)."""

    def __init__(self, total: int, start_iteration: int = 0, clock: Callable[[], float] = time.perf_counter):
        self.total, self.start_iteration, self.clock = total, start_iteration, clock
        self.started = clock()
        self._rate_from: Optional[tuple[int, float]] = None

    def start_rate(self, iteration: int) -> None:
        """Measure the rate from now and ``iteration`` on."""
        self._rate_from = (iteration, self.clock())

    def line(self, iteration: int) -> str:
        """The progress line at ``iteration`` (no newline)."""

        now = self.clock()
        rate = None
        if self._rate_from is not None and iteration > self._rate_from[0] and now > self._rate_from[1]:
            rate = (iteration - self._rate_from[0]) / (now - self._rate_from[1])
        return tqdm.format_meter(iteration, self.total, now - self.started, prefix="[jmegatron] progress",
                                 ascii=True, unit="it", rate=rate, initial=self.start_iteration)


def _duration(seconds: float) -> str:
    """``12.3 s`` below a minute, else tqdm's ``[H:]MM:SS``."""

    return f"{seconds:.1f} s" if seconds < 60 else tqdm.format_interval(seconds)


class MetricsLogger:
    """Writes training and validation metrics.

    ``metrics.jsonl`` gets one JSON object per logged iteration with ``iteration``,
    ``consumed_samples``, ``global_batch_size``, ``lm_loss``, ``lr``, ``grad_norm``,
    ``loss_scale``, ``skipped_iterations``, ``nan_iterations`` (``num_zeros`` with
    ``log_num_zeros_in_grad``; for MoE models the router losses on the console line,
    ``moe_tokens_per_expert`` ``[MoE layers][experts]`` and ``moe_dropped_token_fraction``,
    and a TensorBoard histogram of tokens per expert for each MoE layer), ``tokens_per_sec``, ``tflops_per_device``, ``mfu``
    (fraction of ``peak_tflops``), ``mfu_theoretical`` (fraction of
    ``theoretical_peak_tflops``, NaN without one), plus ``val_loss`` and ``val_ppl`` at
    evaluations, and the distillation losses (``kd_loss``, ``logits_distillation_loss``,
    ``intermediate_distillation_loss``) when distilling. Losses and ``grad_norm`` are means
    over the iterations since the last log; ``step_losses`` lists each of those iterations'
    own ``lm_loss`` (or, when the LM loss is not computed, the optimised loss). A record
    with a memory report has ``memory``: a list of ``{rank, allocated_mb,
    max_allocated_mb, reserved_mb, max_reserved_mb, source}``.

    Every report entry of the forward step (:func:`reported_keys`: a custom loss function's
    metrics too) is a key of the record, a TensorBoard scalar and a W&B scalar, the interval's
    mean. Non-finite values (``mfu`` without a peak, a nan iteration's loss) are ``null`` in
    the file (:func:`strict_json`), NaN in the returned record, and left out of TensorBoard
    and W&B.

    ``flops_per_iteration`` (FLOPs of one iteration, all devices), ``peak_tflops`` and
    ``theoretical_peak_tflops`` (per device, TFLOP/s) give TFLOP/s and MFU; an MFU above
    100 % means the peak is wrong, said once on stderr. ``wandb_run`` (a ``wandb`` run,
    :func:`init_wandb`, or None) gets the TensorBoard scalars at the same steps and the
    closing summary, and is finished by :meth:`close`. ``start_iteration``: where this run
    starts (a resumed run's), for the progress line (:class:`ProgressLine`).
    """

    def __init__(self, save_dir: Optional[str], tensorboard_dir: Optional[str],
                 flops_per_iteration: float, num_devices: int, peak_tflops: float,
                 train_iters: int, stream=None, theoretical_peak_tflops: Optional[float] = None,
                 wandb_run: Any = None, start_iteration: int = 0):
        self.flops_per_iteration = flops_per_iteration
        self.num_devices = num_devices
        self.peak_tflops = peak_tflops
        self.theoretical_peak_tflops = theoretical_peak_tflops
        self.train_iters = train_iters
        self.stream = stream or sys.stdout
        self._warned_mfu = False
        self.metrics_path = self.tensorboard_dir = None
        self._jsonl = None
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            self.metrics_path = os.path.join(save_dir, "metrics.jsonl")
            self._jsonl = open(self.metrics_path, "a", buffering=1)
        self._tb = None
        if tensorboard_dir:
            self.tensorboard_dir = tensorboard_dir
            self._tb = _summary_writer(tensorboard_dir)
        self._wandb = wandb_run
        self.progress = ProgressLine(train_iters, start_iteration)
        self.start_iteration = start_iteration
        # totals over the logged intervals, for log_summary
        self._iterations = 0
        self._elapsed = 0.0
        self._tokens = 0.0
        self._compile_s = 0.0
        self._pool_bytes = 0.0  # the CPU memory line's reserved: the largest compiled step's peak so far

    def count_compile(self, seconds: float, iteration: int) -> None:
        """Count ``seconds`` of compilation in iteration ``iteration`` (the loop leaves them
        out of the elapsed time it passes :meth:`log_train`; the compile lines are
        :mod:`jmegatron.compilation`'s); the first starts the progress line's rate."""
        if self._compile_s == 0.0:
            self.progress.start_rate(iteration)
        self._compile_s += seconds

    def log_train(self, iteration: int, step_metrics: list[dict[str, Any]], elapsed_s: float,
                  consumed_samples: Optional[int] = None, global_batch_size: Optional[int] = None,
                  flops: Optional[float] = None, memory_devices=None, memory_rank: int = 0,
                  compiled_memory: Optional[Callable[[], Any]] = None) -> dict:
        """Report the host-side metrics of the last ``len(step_metrics)`` iterations, which
        took ``elapsed_s`` seconds of wall time. ``consumed_samples``: samples trained so
        far, this iteration's included (Megatron's ``args.consumed_train_samples``);
        ``global_batch_size``: this iteration's (a ramping batch reports its own);
        ``flops``: floating-point operations of all ``len(step_metrics)`` iterations
        together (default ``flops_per_iteration * len(step_metrics)``). With
        ``memory_devices`` (the devices of this process), the memory line(s) of
        :meth:`log_memory` follow the iteration line and the record gets ``memory`` (their
        list). Returns the JSON record."""
        n = len(step_metrics)
        main = "lm_loss" if "lm_loss" in step_metrics[0] else "loss"
        losses = [float(m[main]) for m in step_metrics]
        tokens = float(sum(float(m["num_tokens"]) for m in step_metrics))
        flops = self.flops_per_iteration * n if flops is None else float(flops)
        tflops = flops / max(elapsed_s, 1e-9) / self.num_devices / 1e12
        reported = reported_keys(step_metrics[0])
        record = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "global_batch_size": global_batch_size,
            **{k: float(np.mean([float(m[k]) for m in step_metrics])) for k in reported},
            "lr": float(step_metrics[-1]["lr"]),
            # over the applied iterations (a skipped fp16 iteration's norm is inf/nan; Megatron logs none)
            "grad_norm": float(np.mean([float(m["grad_norm"]) for m in step_metrics if not float(m.get("skipped", 0))]
                                       or [float("nan")])),
            "loss_scale": float(step_metrics[-1].get("loss_scale", 1.0)),
            "skipped_iterations": int(sum(int(m.get("skipped", 0)) for m in step_metrics)),
            "nan_iterations": int(sum(int(m.get("nan", 0)) for m in step_metrics)),
            "tokens_per_sec": tokens / max(elapsed_s, 1e-9),
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else float("nan"),
            "mfu_theoretical": (tflops / self.theoretical_peak_tflops if self.theoretical_peak_tflops
                                else float("nan")),
            "step_time_s": elapsed_s / n,
            "step_losses": losses,
        }
        if "num_zeros" in step_metrics[-1]:
            record["num_zeros"] = float(step_metrics[-1]["num_zeros"])
        moe_tokens = None
        if "moe_tokens_per_expert" in step_metrics[0]:  # [MoE layers, experts], per micro-batch
            moe_tokens = np.mean([np.asarray(m["moe_tokens_per_expert"], np.float64) for m in step_metrics], axis=0)
            record["moe_tokens_per_expert"] = moe_tokens.tolist()
            record["moe_dropped_token_fraction"] = float(np.mean([float(m["moe_dropped_token_fraction"])
                                                                  for m in step_metrics]))
        for key, name, peak in (("mfu", "peak", self.peak_tflops),
                                ("mfu_theoretical", "theoretical peak", self.theoretical_peak_tflops)):
            if record[key] > 1.0 and not self._warned_mfu:  # NaN (no peak) compares False
                self._warned_mfu = True
                print(f"[jmegatron] WARNING: MFU {100 * record[key]:.1f}% > 100% of the {name} at iteration "
                      f"{iteration}: that peak ({peak:.4g} TFLOP/s/device) is wrong (too low); set "
                      "config.peak_tflops or rerun python -m jmegatron.bench peak on a quiet machine",
                      file=sys.stderr, flush=True)
        self._iterations += n
        self._elapsed += elapsed_s
        self._tokens += tokens
        self.stream.write(self._train_line(record, reported) + "\n")
        self.stream.write(self.progress.line(iteration) + "\n")
        self.stream.flush()
        if memory_devices is not None:
            record["memory"] = self.log_memory(iteration, memory_devices, memory_rank, compiled_memory)
        scalars = [*reported, "lr", "grad_norm", "loss_scale", "tokens_per_sec", "tflops_per_device", "mfu",
                   "mfu_theoretical", "skipped_iterations", "nan_iterations", "num_zeros", "consumed_samples",
                   "global_batch_size", "moe_dropped_token_fraction"]
        self._write(record, {k: record[k] for k in scalars
                             if record.get(k) is not None and math.isfinite(record[k])}, iteration)
        if moe_tokens is not None and self._tb:
            self._expert_histograms(moe_tokens, iteration)
        return record

    def _expert_histograms(self, tokens_per_expert: np.ndarray, iteration: int) -> None:
        """One TensorBoard histogram per MoE layer, ``moe/tokens_per_expert/layer_{i}``: a
        bucket per expert (bucket e spans (e - 0.5, e + 0.5]) holding its tokens."""
        num_experts = tokens_per_expert.shape[-1]
        experts = np.arange(num_experts, dtype=np.float64)
        for i, counts in enumerate(tokens_per_expert):
            self._tb.add_histogram_raw(
                f"moe/tokens_per_expert/layer_{i}", min=0.0, max=float(num_experts - 1), num=float(counts.sum()),
                sum=float((experts * counts).sum()), sum_squares=float((experts ** 2 * counts).sum()),
                bucket_limits=(experts + 0.5).tolist(), bucket_counts=counts.tolist(), global_step=iteration)

    def _train_line(self, r: dict, reported: list) -> str:
        """The Megatron console line of a log_train record (module docstring)."""
        gbs = r["global_batch_size"]
        text = f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
        text += f" iteration {r['iteration']:8d}/{self.train_iters:8d} |"
        if r["consumed_samples"] is not None:
            text += f" consumed samples: {r['consumed_samples']:12d} |"
        text += f" elapsed time per iteration (ms): {1e3 * r['step_time_s']:.1f} |"
        text += f" learning rate: {r['lr']:.6E} |"
        if gbs is not None:
            text += f" global batch size: {gbs:5d} |"
        text += "".join(f" {report_name(k)}: {r[k]:.6E} |" for k in reported)
        text += f" loss scale: {r['loss_scale']:.1f} |"
        text += f" grad norm: {r['grad_norm']:.3f} |"
        if "num_zeros" in r:
            text += f" num zeros: {r['num_zeros']:.1f} |"
        text += f" number of skipped iterations: {r['skipped_iterations']:3d} |"
        text += f" number of nan iterations: {r['nan_iterations']:3d} |"
        text += f" tokens/s: {r['tokens_per_sec']:.0f} | TFLOP/s/device: {r['tflops_per_device']:.4f} |"
        if self.peak_tflops:  # no peak (none measured, none stated): no MFU column, not "nan%"
            text += f" MFU: {100 * r['mfu']:.1f}% |"
        if self.theoretical_peak_tflops:
            text += f" MFU (theoretical peak): {100 * r['mfu_theoretical']:.1f}% |"
        return text

    def log_eval(self, iteration: int, val_loss: float, prefix: str = "validation") -> dict:
        """Report a validation loss (nats per token) and its perplexity (``val_ppl`` =
        exp(min(loss, 700)); the console prints Megatron's exp(min(20, loss)))."""
        ppl = math.exp(min(val_loss, 700.0))
        record = {"iteration": iteration, "val_loss": val_loss, "val_ppl": ppl}
        at = f"iteration {iteration}"
        if prefix != "validation":
            record = {"iteration": iteration, f"{prefix}_loss": val_loss, f"{prefix}_ppl": ppl}
            at += f" for {prefix} data"
        text = f" validation loss at {at} | lm loss value: {val_loss:.6E} | lm loss PPL: " \
               f"{math.exp(min(20.0, val_loss)):.6E} | "
        bar = "-" * (len(text) + 1)
        self.stream.write(f"{bar}\n{text}\n{bar}\n")
        self.stream.flush()
        self._write(record, {k: v for k, v in record.items() if k != "iteration"}, iteration)
        return record

    def log_memory(self, iteration: int, devices, rank: int = 0,
                   compiled_memory: Optional[Callable[[], Any]] = None) -> list[dict]:
        """Print ByteMLPerf's memory line(s) after ``iteration`` iterations (TensorBoard:
        Megatron's ``mem-*-bytes`` scalars); the JSON Lines get them through
        :meth:`log_train`'s record.

        With allocator statistics (:func:`device_memory`: GPU), one line per device in
        ``devices``, ``[Rank <device id>]``. Without (CPU), one line for this process,
        ``[Rank <rank>]``, from :func:`host_memory` with ``compiled_memory()``: a callable
        returning ``(analysis, pool)``, the ``memory_analysis()`` of this iteration's
        compiled train step and those of the run's other step programs (called at each
        report: under variable data each length's program gives its own line). Reserved
        never falls (a pool keeps what it took). The line ends with `` | source: device
        memory_stats (reserved: <key>)`` or `` | source: compiled train step per device
        (reserved: the largest step program's peak)`` (:func:`host_memory`). Returns the
        records (figures in MB)."""
        stats = device_memory(devices)
        if stats is not None:
            source = f"{SOURCE_DEVICE} (reserved: {stats[0]['reserved_key']})"
        else:
            analysis, pool = compiled_memory() if compiled_memory is not None else (None, ())
            host = host_memory(rank, analysis, pool)
            self._pool_bytes = max(self._pool_bytes, host["reserved"])
            host["reserved"] = host["max_reserved"] = self._pool_bytes
            stats, source = [host], SOURCE_HOST
        records = []
        for m in stats:
            self.stream.write(memory_line(iteration, m, source) + "\n")
            records.append({"rank": m["rank"], **{f"{k}_mb": m[k] / MB for k in
                                                  ("allocated", "max_allocated", "reserved", "max_reserved")},
                            "source": source})
        self.stream.flush()
        if stats:  # Megatron's --log-memory-to-tensorboard names (first rank)
            self._scalars({name: float(stats[0][key]) for name, key in (
                ("mem-allocated-bytes", "allocated"), ("mem-max-allocated-bytes", "max_allocated"),
                ("mem-reserved-bytes", "reserved"), ("mem-max-reserved-bytes", "max_reserved"))}, iteration)
        return records

    def log_summary(self, iteration: int, wall_s: float, final_loss: Optional[float] = None,
                    val_loss: Optional[float] = None, checkpoint: Optional[str] = None,
                    loss_name: str = "lm loss") -> dict:
        """Print the closing line of a run and return its figures: ``iterations`` (this run's,
        up to ``iteration``), ``wall_time_s`` (``wall_s``: the whole run, setup and
        evaluations included), ``mean_step_time_s`` and ``tokens_per_sec`` (over the logged
        intervals, which leave compilation out; None before any log), ``compile_time_s``,
        ``final_loss``, ``val_loss``, ``checkpoint`` (the directory holding the last save, or
        None) and where the metrics, TensorBoard events and W&B run are. W&B's run summary
        gets the figures."""
        train_s = self._elapsed
        out = {"iterations": iteration - self.start_iteration, "iteration": iteration, "wall_time_s": wall_s,
               "compile_time_s": self._compile_s,
               "mean_step_time_s": train_s / self._iterations if self._iterations and train_s else None,
               "tokens_per_sec": self._tokens / train_s if train_s else None,
               "final_loss": final_loss, "val_loss": val_loss, "checkpoint": checkpoint,
               "metrics": self.metrics_path, "tensorboard": self.tensorboard_dir,
               "wandb": os.path.dirname(self._wandb.dir.rstrip("/")) if self._wandb is not None else None}
        text = f"[jmegatron] done: {out['iterations']} iterations"
        if out["iterations"] != iteration:
            text += f" ({self.start_iteration + 1}..{iteration})"
        text += f" in {_duration(wall_s)}"
        if out["mean_step_time_s"] is not None:
            text += f", mean step {1e3 * out['mean_step_time_s']:.1f} ms, {out['tokens_per_sec']:,.0f} tokens/s"
        text += f" | final {loss_name}: {final_loss:.6E}" if final_loss is not None else ""
        text += f" | validation {loss_name}: {val_loss:.6E}" if val_loss is not None else " | no validation"
        text += f" | checkpoint: {checkpoint}" if checkpoint else " | no checkpoint saved"
        text += f" | metrics: {self.metrics_path}" if self.metrics_path else ""
        text += f" | TensorBoard: {self.tensorboard_dir}" if self.tensorboard_dir else ""
        if out["wandb"]:
            offline = getattr(self._wandb, "offline", False)
            text += f" | W&B{' (offline: wandb sync uploads it)' if offline else ''}: {out['wandb']}"
        self.stream.write(text + "\n")
        self.stream.flush()
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in out.items() if isinstance(v, (int, float))})
        return out

    def _write(self, record: dict, scalars: dict, iteration: int) -> None:
        if self._jsonl:
            self._jsonl.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        self._scalars(scalars, iteration)

    def _scalars(self, scalars: dict, iteration: int) -> None:
        """TensorBoard scalars and the same to W&B, at step ``iteration``."""
        if self._tb:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, iteration)
        if self._wandb is not None and scalars:
            self._wandb.log(dict(scalars), step=iteration)

    def close(self, failed: bool = False) -> None:
        """Close the files; finish the W&B run (exit code 1 when ``failed``)."""
        try:
            if self._jsonl:
                self._jsonl.close()
            if self._tb:
                self._tb.close()
        finally:
            if self._wandb is not None:
                self._wandb.finish(exit_code=1 if failed else 0)
                self._wandb = None
