"""``python -m jmegatron.tools.gpu_check [--steps N] [--platform gpu|cpu] [--tiny]``, or
``python -m jmegatron.tools.gpu_check --lower-only [--device-kind KIND] [--config C
[--config.FIELD=VALUE ...]]`` (no GPU needed: :mod:`jmegatron.tools.gpu_lower`; run as a
command it gives the CPU platform two devices for the tp2 / cp2 rows)

Trains a few steps of a small config (configs/gpt_tiny.py, mock data, no dropout) once per
kernel and precision on one device, compares each loss curve with the XLA float32 path's
(the largest relative difference over the steps, against a tolerance per precision) and
prints a table with tokens/s and MFU against the device's spec-sheet peak
(:mod:`jmegatron.reporting.peak`). Exit status 1 when a row fails or errors, else 0.

``--platform gpu`` (default): on a machine without an NVIDIA GPU among ``jax.devices()``
it says so and exits 0. ``--platform cpu``: the same machinery on the CPU with the
variants the CPU can run (its tests use this with ``--tiny``).

Which rows apply is decided before any row runs: a row runs on the platforms it names
(the cuDNN and TE rows on a GPU, the CPU-kernel row on the CPU), and the Transformer Engine
row shows "not applicable: Transformer Engine unavailable: <reason>" when TE does not import.
Every other row is built here and must pass: any exception while it is prepared, compiles or
runs (a ConfigError, ImportError or NotImplementedError as much as a Triton or cuDNN compile
error or an XLA runtime error), and a model that does not compute in the row's precision, is
printed with its traceback on stderr, shows as "ERROR: <type>: <first line>", and the table
goes on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from typing import Callable, Optional, Sequence

if __name__ == "__main__" and "--lower-only" in sys.argv and "jax" not in sys.modules:
    # the tp2 / cp2 lowering rows need two CPU devices, set before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import jax
import jax.numpy as jnp

from jmegatron.command_line import parse_args
from jmegatron.config import load_config_file
from jmegatron.data.gpt_dataset import MockGPTDataset
from jmegatron.data.loader import BatchLoader
from jmegatron.kernels import gpu_target
from jmegatron.models import te
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.parallel.mesh import create_mesh
from jmegatron.reporting import flops, peak
from jmegatron.tools import gpu_lower
from jmegatron.training.run import build

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "gpt_tiny.py")
# the largest relative loss difference from the XLA float32 curve, per compute precision: float32 on
# a GPU computes dots in TF32 (JAX's default precision) and kernels reorder sums; bf16 / fp16 carry
# 8 / 11 mantissa bits; FP8 quantizes every dense layer's operands
TOLERANCES = {"float32": 2e-3, "bfloat16": 2e-2, "float16": 2e-2, "float8": 5e-2}
TINY = dict(num_layers=1, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, seq_length=32,
            max_position_embeddings=32, micro_batch_size=2, global_batch_size=4, vocab_size=512)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row: config overrides on the reference's, its precision (the tolerance and the
    peak used), the platforms it runs on, an optional ``not_applicable() -> reason`` (a
    reason when this machine lacks what the row needs; asked before the row runs), and the
    float32 matmul precision it runs under (``"highest"``: no TF32)."""

    name: str
    overrides: dict
    precision: str
    platforms: tuple[str, ...] = ("gpu", "cpu")
    not_applicable: Optional[Callable[[], Optional[str]]] = None
    matmul_precision: Optional[str] = None  # jax.default_matmul_precision for the row; None: JAX's default


# fp16 rows start dynamic loss scaling at 2^12, not Megatron's 2^32: at 2^32 the gradients
# overflow and the first ~20 steps are skipped, so a short check would compare an untrained curve
FP16 = dict(fp16=True, initial_loss_scale=2.0 ** 12)
REFERENCE = dict(attention_impl="xla", matmul_impl="xla", cross_entropy_impl="xla", transformer_impl="local")


def compute_dtype_mismatch(cfg) -> Optional[str]:
    """Why the model built from ``cfg`` does not compute in the dtype its ``fp16`` / ``bf16``
    flags ask for, or None: a row whose model runs float32 would match the reference trivially."""
    want = jnp.float16 if cfg.fp16 else jnp.bfloat16 if cfg.bf16 else jnp.float32
    got = ModelConfig.from_config(cfg, cfg.vocab_size).dtype
    return None if got == want else f"the model computes in {jnp.dtype(got).name}, not {jnp.dtype(want).name}"


def _te_unavailable() -> Optional[str]:
    ok, reason = te.te_available()
    return None if ok else f"Transformer Engine unavailable: {reason}"


VARIANTS: tuple[Variant, ...] = (
    Variant("xla float32 (reference)", {}, "float32"),
    Variant("xla float32 HIGHEST (no TF32)", {}, "float32", ("gpu",), matmul_precision="highest"),
    Variant("cpu kernels float32", dict(attention_impl="cpu", matmul_impl="hybrid"), "float32", ("cpu",)),
    Variant("cudnn attention bf16", dict(attention_impl="cudnn", bf16=True), "bfloat16", ("gpu",)),
    Variant("cudnn attention fp16", dict(attention_impl="cudnn", **FP16), "float16", ("gpu",)),
    Variant("pallas attention float32", dict(attention_impl="pallas"), "float32"),
    Variant("pallas attention bf16", dict(attention_impl="pallas", bf16=True), "bfloat16"),
    Variant("pallas cross-entropy float32", dict(cross_entropy_impl="pallas"), "float32"),
    Variant("xla bf16", dict(bf16=True), "bfloat16"),
    Variant("xla fp16", dict(FP16), "float16"),
    Variant("fp8 hybrid pure JAX (delayed)", dict(bf16=True, fp8="hybrid"), "float8"),
    Variant("fp8 hybrid TE (tensorwise)", dict(bf16=True, fp8="hybrid", fp8_recipe="tensorwise",
                                               transformer_impl="transformer_engine", attention_impl="auto",
                                               matmul_impl="auto"), "float8", ("gpu",), _te_unavailable),
)


@dataclasses.dataclass
class Row:
    name: str
    status: str  # "ok" | "FAIL" | "ERROR: <exception>" | "not applicable: <reason>" | "reference"
    precision: str
    losses: list = dataclasses.field(default_factory=list)
    max_rel_diff: Optional[float] = None
    tolerance: Optional[float] = None
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    dots: str = ""  # what the dense layers' dots compute in: "TF32", "float32", "bf16", "fp16", "fp8"
    memory: Optional[tuple] = None  # the device allocator's (bytes in use after the last step, peak so far)


def nvidia_devices() -> list:
    """``jax.devices()`` that are NVIDIA GPUs (CUDA), empty on a CPU-only (or ROCm) machine."""
    try:
        devices = jax.devices()
    except RuntimeError:
        return []
    return [d for d in devices if d.platform == "gpu" and "rocm" not in getattr(d.client, "platform_version", "")]


def dot_precision(device, precision: str, matmul_precision: Optional[str] = None) -> str:
    """What a row's dense dots compute in: float32 rows run "TF32" on an NVIDIA GPU of
    compute capability 8.0 or newer under JAX's default matmul precision (docs.jax.dev
    "Matmul precision"), else "float32"; the other precisions name their operand type."""
    if precision != "float32":
        return {"bfloat16": "bf16", "float16": "fp16", "float8": "fp8"}[precision]
    cc = getattr(device, "compute_capability", None)
    tensor_cores = device.platform == "gpu" and cc is not None and tuple(int(x) for x in str(cc).split(".")[:2]) >= (8, 0)
    full = matmul_precision in ("highest", "float32")
    return "TF32" if tensor_cores and not full else "float32"


def _peak_tflops(device, precision: str, dots: str = "") -> tuple[Optional[float], str]:
    """The spec-sheet (GPU) or theoretical (CPU) peak of ``device`` for ``precision``: a GPU's
    float32 at TF32's tensor-core figure when its dots run in TF32, else its SIMT figure."""
    try:
        if device.platform == "cpu":
            dtype = "float32" if precision == "float32" else "bfloat16"
            theo = peak.theoretical_peak("cpu", device.device_kind)
            return theo.tflops[dtype], theo.summary
        dtype = {"float16": "bfloat16"}.get(precision, precision)  # fp16 tensor cores run at bf16's rate
        if precision == "float32" and dots == "float32":
            dtype = "float32_simt"
        return peak.accelerator_peak(device.device_kind, dtype)
    except peak.PeakUnavailable as e:
        return None, str(e)


def allocator_memory(device) -> Optional[tuple[int, int]]:
    """(bytes in use, peak bytes in use) of ``device``'s allocator (``Device.memory_stats()``;
    the peak is the process's so far: XLA's allocator cannot reset it), None where the
    backend keeps none (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_in_use" not in stats:
        return None
    return int(stats["bytes_in_use"]), int(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))


def train_losses(cfg, device, steps: int) -> tuple[list[float], float, int, Optional[tuple]]:
    """``steps`` iterations of ``cfg`` on one ``device``: the lm losses, the seconds the
    steps after the first (compilation) took, how many steps the optimizer skipped (fp16
    overflow, non-finite gradients), and :func:`allocator_memory` after the last step with
    the state alive."""
    run = build(cfg, create_mesh(cfg, [device]))
    state = run.init_state()
    data = MockGPTDataset(num_samples=steps * run.global_batch_size, seq_length=cfg.seq_length,
                          vocab_size=cfg.vocab_size, seed=cfg.seed)
    loader = BatchLoader(data, run.global_batch_size, run.num_microbatches)
    losses, start, skipped = [], None, 0
    for it in range(steps):
        state, metrics = run.train_step(state, run.put_batch(next(loader)))
        losses.append(float(metrics["lm_loss"]))  # float() waits for the step
        skipped += int(float(metrics.get("skipped", 0.0)) > 0)
        if it == 0:
            start = time.perf_counter()
    return losses, time.perf_counter() - start, skipped, allocator_memory(device)


def _first_line(e: BaseException) -> str:
    lines = [l for l in str(e).splitlines() if l.strip()]
    return lines[0][:200] if lines else ""


def run_variant(variant: Variant, base: dict, device, steps: int, reference: Optional[list]) -> Row:
    """Decide whether the variant applies here, then prepare, train and compare it. Any
    exception once it applies is the row's ERROR (a built row never skips)."""
    row = Row(variant.name, "ok", variant.precision, dots=dot_precision(device, variant.precision,
                                                                        variant.matmul_precision))
    reason = variant.not_applicable() if variant.not_applicable else None
    if reason:
        row.status = f"not applicable: {reason}"
        return row
    try:
        cfg = load_config_file(base["config"], {**base["overrides"], **REFERENCE, **variant.overrides})
        mismatch = compute_dtype_mismatch(cfg)
        if mismatch:
            raise RuntimeError(mismatch)
        with jax.default_matmul_precision(variant.matmul_precision):
            row.losses, seconds, skipped, row.memory = train_losses(cfg, device, steps)
    except Exception as e:  # a compile, run or set-up failure: this row fails, the table goes on
        traceback.print_exc(file=sys.stderr)
        row.status = f"ERROR: {type(e).__name__}: {_first_line(e)}"
        return row
    gbs = cfg.global_batch_size
    if steps > 1 and seconds > 0:
        row.tokens_per_s = (steps - 1) * gbs * cfg.seq_length / seconds
        peak_tflops, _ = _peak_tflops(device, variant.precision, row.dots)
        if peak_tflops:
            achieved = flops.num_floating_point_operations(cfg, gbs, cfg.vocab_size) * (steps - 1) / seconds
            row.mfu = achieved / (peak_tflops * 1e12)
    if reference is None:
        row.status = "reference"
        return row
    row.tolerance = TOLERANCES[variant.precision]
    row.max_rel_diff = max(abs(a - b) / abs(b) for a, b in zip(row.losses, reference))
    finite = all(l == l and abs(l) != float("inf") for l in row.losses)
    row.status = "ok" if finite and row.max_rel_diff <= row.tolerance and not skipped else "FAIL"
    if skipped:
        row.status += f" ({skipped} of {steps} steps skipped by the optimizer)"
    return row


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width table. "dots": what the dense dots compute in (TF32 or
    not for float32); "GB live/peak": the allocator's bytes in use after the row's last step
    and its peak so far (10^9 bytes; "-" on the CPU)."""
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    def gb(m):
        return "-" if m is None else f"{m[0] / 1e9:.2f}/{m[1] / 1e9:.2f}"
    lines = [f"{'variant':34} {'precision':9} {'dots':7} {'final loss':>10} {'max rel diff':>12} {'tol':>7} "
             f"{'tokens/s':>10} {'MFU':>7} {'GB live/peak':>13}  status"]
    for r in rows:
        lines.append(f"{r.name:34} {r.precision:9} {r.dots:7} {num(r.losses[-1] if r.losses else None, '.4f'):>10} "
                     f"{num(r.max_rel_diff, '.2e'):>12} {num(r.tolerance, '.0e'):>7} "
                     f"{num(r.tokens_per_s, ',.0f'):>10} {num(None if r.mfu is None else 100 * r.mfu, '.1f'):>7} "
                     f"{gb(r.memory):>13}  {r.status}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jmegatron.tools.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                   help="gpu: the first NVIDIA GPU (exit 0 without one); cpu: the CPU-possible variants")
    p.add_argument("--steps", type=int, default=10, help="training iterations per variant (>= 2; default 10)")
    p.add_argument("--config", default=None, help="config file (default configs/gpt_tiny.py; with --lower-only "
                                                 "the shipped shapes of jmegatron.tools.gpu_lower)")
    p.add_argument("--device-kind", default=gpu_target.DEFAULT_DEVICE_KIND,
                   help="with --lower-only: the NVIDIA GPU to lower for, as jax names it (default %(default)r)")
    p.add_argument("--lower-only", action="store_true",
                   help="lower the train steps for an NVIDIA GPU on this machine (no GPU needed; "
                        "jmegatron.tools.gpu_lower); --config.FIELD=VALUE overrides apply")
    p.add_argument("--tiny", action="store_true", help="1 layer x 64 hidden, seq 32, batch 4 (tests)")
    p.add_argument("--only", nargs="*", default=None, help="variant names containing any of these words")
    args, rest = p.parse_known_args(argv)
    if args.lower_only:
        bad = [a for a in rest if not a.startswith("--config.")]
        if bad:
            p.error(f"unrecognized arguments: {' '.join(bad)}")
        _, overrides = parse_args(rest)
        try:
            gpu_target.compute_capability_of(args.device_kind)
        except ValueError as e:
            p.error(f"--device-kind: {e}")
        cases = gpu_lower.default_cases([args.config] if args.config else gpu_lower.DEFAULT_CONFIGS)
        return gpu_lower.report_lowering(cases, overrides, args.device_kind)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)} (--config.FIELD=VALUE goes with --lower-only)")
    args.config = args.config or DEFAULT_CONFIG
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step compiles)")
    if args.platform == "gpu":
        gpus = nvidia_devices()
        if not gpus:
            kinds = sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()})
            print(f"gpu_check: no NVIDIA GPU found (jax.devices(): {', '.join(kinds)}); nothing to check. "
                  f"Run with --platform cpu for the CPU variants.")
            return 0
        device = gpus[0]
    else:
        device = jax.devices("cpu")[0]
    overrides = dict(mock_data=True, hidden_dropout=0.0, attention_dropout=0.0, train_iters=args.steps,
                     lr_warmup_iters=1, eval_interval=0, save=None, log_interval=1)
    overrides.update(TINY if args.tiny else dict(vocab_size=50257))  # mock data: GPT-2's vocabulary
    base = {"config": args.config, "overrides": overrides}
    variants = [v for v in VARIANTS if args.platform in v.platforms]
    if args.only:
        variants = [v for v in variants if v is VARIANTS[0] or any(w in v.name for w in args.only)]
    print(f"gpu_check: {device.device_kind} ({device.platform}), {args.steps} steps of "
          f"{os.path.basename(args.config)}{' (tiny)' if args.tiny else ''} per variant, mock data, no dropout",
          flush=True)
    rows: list[Row] = []
    reference = None
    for v in variants:
        row = run_variant(v, base, device, args.steps, reference)
        if v is VARIANTS[0]:
            if row.status != "reference":
                print(format_table([row]))
                print(f"gpu_check: the XLA float32 reference did not run ({row.status})", file=sys.stderr)
                return 1
            reference = row.losses
        rows.append(row)
        print(f"  {row.name}: {row.status}", flush=True)
    print(format_table(rows))
    failed = [r.name for r in rows if r.status not in ("ok", "reference") and not r.status.startswith("not applicable: ")]
    if failed:
        print(f"gpu_check: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
