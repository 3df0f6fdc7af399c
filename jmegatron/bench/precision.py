"""``bench precision``: train N steps and compare the loss curve with a reference run.

ByteMLPerf's precision criterion: the mean relative loss error over 50 consecutive steps
stays under 0.2 %. Here, with ``l_i`` jmegatron's loss and ``r_i`` the reference's at
iteration ``i`` (iterations both logs have), the per-step relative error is
``|l_i - r_i| / |r_i|``; its mean over **every** window of ``--window`` (50) consecutive
compared steps is computed and the run passes when the worst window's mean is below
``--threshold`` (0.002). With fewer than ``--window`` steps there is one window of all the
steps (reported as ``short_window``).

Reference log (``--reference LOG``, read by :mod:`jmegatron.bench.megatron_log`):

* a Megatron-LM / ByteMLPerf / jmegatron **stdout log**: the ``lm loss`` of each
  `` iteration i/N | ... | lm loss: X | ...`` line (Megatron's ``training_log``; with a
  log interval above 1, the interval's mean at the logged iteration); or JSON Lines:
* ``iteration`` (int, 1-based optimizer step) and a loss under ``"lm loss"``,
  ``"lm_loss"`` or ``"loss"`` (the first present): one iteration per line; or
* jmegatron's ``metrics.jsonl``: a record at iteration ``I`` with ``step_losses`` (the
  list of each logged iteration's loss) covers iterations ``I - len + 1 .. I``.

Lines without a loss (validation records) are skipped; a repeated iteration keeps its
last value (a resumed run's). A truncated or foreign log is an error naming its file
and line. ``--reference torch`` first runs
``benchmarks/reference_torch.py`` (Hugging Face GPT-2 / Llama in float32 from the same
initial weights and batches) with the same config and uses its ``metrics.jsonl``.

Outputs in ``--out``: ``precision.json``, ``precision.md``, ``precision.png`` (both curves,
the per-step and windowed relative error with the threshold) and ``jmegatron_metrics.jsonl``
(this run's losses, usable as a reference later).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Mapping

import numpy as np

from jmegatron.bench import common, megatron_log

# Modules that import JAX are imported inside the commands: `python -m jmegatron.bench
# --devices N` sets XLA_FLAGS after importing every command module and before JAX starts
# (jmegatron.bench.__main__._set_devices).

DEFAULT_WINDOW = 50
DEFAULT_THRESHOLD = 0.002  # 0.2 %
LOSS_KEYS = megatron_log.JSONL_PLAIN_LOSS_KEYS
REFERENCE_SCRIPT = common.REPO_ROOT / "benchmarks" / "reference_torch.py"


def register(sub) -> None:
    """Add the ``precision`` subcommand to the bench CLI's subparsers."""
    p = common.add_command(sub, "precision", "compare the loss curve with a reference log", __doc__)
    common.add_config_arguments(p, required=False)
    p.add_argument("--reference", required=True, metavar="LOG|torch",
                   help="reference log (Megatron/jmegatron stdout or JSON Lines), or 'torch' to run "
                        "benchmarks/reference_torch.py first")
    p.add_argument("--train-iters", type=int, default=None, metavar="N",
                   help="steps to train (sets config.train_iters; default the config's)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="consecutive steps per window (50)")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="pass when every window's mean relative error is below this (0.002 = 0.2%%)")
    common.add_out_argument(p, "precision")
    p.set_defaults(func=run)


# ------------------------------------------------------------------ pure functions
def read_loss_log(path: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from a reference log in any format of the module docstring
    (:func:`jmegatron.bench.megatron_log.read_log`). Raises BenchError naming the file
    (and line) when it is missing, truncated, foreign or holds no per-iteration loss."""
    return megatron_log.read_log(path, "--reference").loss("lm loss")


def write_loss_log(path, losses: Mapping[int, float], source: str) -> None:
    """One ``{"iteration", "lm loss", "source"}`` line per iteration (readable by
    :func:`read_loss_log`)."""
    with open(path, "w") as f:
        for it in sorted(losses):
            f.write(json.dumps({"iteration": it, "lm loss": losses[it], "source": source}) + "\n")


def windowed_relative_error(losses: Mapping[int, float], reference: Mapping[int, float],
                            window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD) -> dict:
    """Compare two ``{iteration: loss}`` curves on the iterations both have.

    Returns ``iterations`` (compared, ascending), ``relative_error`` (per step,
    ``|l - r| / |r|``), ``window`` (the length used: ``window`` or, with fewer steps,
    all of them, and then ``short_window`` True), ``window_means`` (mean relative error
    of each window of consecutive compared steps, sliding by one), ``max_window_mean``,
    ``worst_window`` ([first, last] iteration), ``mean_relative_error``,
    ``max_step_relative_error``, ``contiguous`` (compared iterations have no gaps),
    ``threshold`` and ``passed`` (``max_window_mean < threshold``, all finite).
    Raises BenchError when no iteration is shared or ``window < 1``.
    """
    if window < 1:
        raise common.BenchError(f"--window={window} must be >= 1")
    its = sorted(set(losses) & set(reference))
    if not its:
        raise common.BenchError(f"the curves share no iteration (run: {min(losses, default=None)}.."
                                f"{max(losses, default=None)}, reference: {min(reference, default=None)}.."
                                f"{max(reference, default=None)})")
    ours = np.array([losses[i] for i in its], np.float64)
    ref = np.array([reference[i] for i in its], np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(ours - ref) / np.abs(ref)
    w = min(window, len(its))
    csum = np.concatenate([[0.0], np.cumsum(rel)])
    means = (csum[w:] - csum[:-w]) / w
    worst = int(np.argmax(means)) if np.all(np.isfinite(means)) else int(np.argmax(~np.isfinite(means)))
    max_mean = float(means[worst])
    finite = bool(np.all(np.isfinite(rel)))
    return {
        "iterations": its, "losses": ours.tolist(), "reference_losses": ref.tolist(),
        "relative_error": rel.tolist(), "window": w, "requested_window": window,
        "short_window": w < window, "window_means": means.tolist(), "max_window_mean": max_mean,
        "worst_window": [its[worst], its[worst + w - 1]], "mean_relative_error": float(np.mean(rel)),
        "max_step_relative_error": float(np.max(rel)), "contiguous": its == list(range(its[0], its[-1] + 1)),
        "threshold": threshold, "passed": finite and max_mean < threshold,
    }


# ------------------------------------------------------------------ the command
def _run_torch_reference(args, cfg, train_iters: int, dp: int, out) -> str:
    if not REFERENCE_SCRIPT.is_file():
        raise common.BenchError(f"--reference torch needs {REFERENCE_SCRIPT} (run from a jmegatron checkout)")
    ref_dir = out / "reference"
    cmd = [sys.executable, str(REFERENCE_SCRIPT), *common.config_argv(args), "--train-iters", str(train_iters),
           "--data-parallel-size", str(dp), "--out", str(ref_dir)]
    print(f"[bench precision] reference: {' '.join(cmd)}", flush=True)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the reference needs one device only
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise common.BenchError(f"the torch reference failed (exit {proc.returncode}); command: {' '.join(cmd)}")
    return str(ref_dir / "metrics.jsonl")


def run(args) -> int:
    """Run ``bench precision`` from parsed arguments; returns the exit status (0 pass, 1 a check failed, 2 bad input)."""
    overrides = {} if args.train_iters is None else {"train_iters": args.train_iters}
    if args.train_iters is not None and args.train_iters < 1:
        raise common.BenchError(f"--train-iters={args.train_iters} must be >= 1")
    cfg = common.load_config(args, **overrides)
    if args.reference != "torch":
        reference = read_loss_log(args.reference)  # fail before training on a bad log
    out = common.out_dir(args)

    import jax

    from jmegatron.pretrain_gpt import pretrain

    dp = cfg.data_parallel_size(jax.device_count())
    reference_path = args.reference
    if args.reference == "torch":
        if cfg.hidden_dropout or cfg.attention_dropout:
            raise common.BenchError("--reference torch cannot reproduce jmegatron's dropout masks; add "
                                    "--config.hidden_dropout=0 --config.attention_dropout=0")
        reference_path = _run_torch_reference(args, cfg, cfg.train_iters, dp, out)
        reference = read_loss_log(reference_path)
    t0 = time.perf_counter()
    summary = pretrain(common.bench_config(cfg))
    seconds = time.perf_counter() - t0
    losses = {int(k): float(v) for k, v in summary["losses"].items()}
    write_loss_log(out / "jmegatron_metrics.jsonl", losses, "jmegatron")
    cmp = windowed_relative_error(losses, reference, args.window, args.threshold)
    missing = sorted(set(losses) - set(reference))
    result = {
        "command": "precision", "config": args.config, "config_overrides": args.config_overrides,
        "train_iters": cfg.train_iters, "bf16": cfg.bf16, "data_parallel_size": dp,
        "reference": reference_path, "reference_kind": "torch" if args.reference == "torch" else "log",
        "iterations_missing_in_reference": missing, "train_seconds": seconds,
        "environment": common.environment(), **cmp}
    return common.finish(out, "precision", result, _chart, markdown, cmp["passed"],
                         f"worst {cmp['window']}-step window mean relative error "
                         f"{common.pct(cmp['max_window_mean'])} (threshold {100 * args.threshold:.2f}%), over "
                         f"{len(cmp['iterations'])} steps{' (short window)' if cmp['short_window'] else ''}")


def markdown(r: dict) -> str:
    """The markdown summary of a ``bench precision`` result (its JSON object)."""
    notes = []
    if r["short_window"]:
        notes.append(f"- Fewer than {r['requested_window']} steps: one window of all {r['window']} steps.")
    if not r["contiguous"]:
        notes.append("- The compared iterations are not contiguous (the reference logs only some iterations): "
                     "windows are over consecutive *compared* steps.")
    if r["iterations_missing_in_reference"]:
        notes.append(f"- {len(r['iterations_missing_in_reference'])} trained iterations are missing in the "
                     "reference and were not compared.")
    return common.summary_page(
        "Precision",
        f"{common.verdict(r['passed'])}: the worst mean relative loss error over {r['window']} consecutive steps is "
        f"{common.pct(r['max_window_mean'])} (iterations {r['worst_window'][0]}-{r['worst_window'][1]}); "
        f"threshold {100 * r['threshold']:.2f}%.",
        [
            ["config", f"`{r['config']}` {' '.join(r['config_overrides'])}"],
            ["steps compared", len(r["iterations"])],
            ["reference", f"`{r['reference']}` ({r['reference_kind']})"],
            ["bf16", r["bf16"]],
            ["mean relative error (all steps)", common.pct(r['mean_relative_error'])],
            ["max single-step relative error", f"{common.pct(r['max_step_relative_error'])}"],
            ["first / last loss", f"{r['losses'][0]:.6f} / {r['losses'][-1]:.6f}"],
            ["reference first / last loss", f"{r['reference_losses'][0]:.6f} / {r['reference_losses'][-1]:.6f}"],
        ], *notes, "" if notes else "", "![loss curves and relative error](precision.png)")


def _chart(r: dict, path) -> None:
    plt = common.pyplot()
    its = r["iterations"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.plot(its, r["reference_losses"], lw=2.5, alpha=0.5, label=f"reference ({r['reference_kind']})")
    top.plot(its, r["losses"], lw=1, label="jmegatron")
    top.set_ylabel("lm loss")
    top.legend()
    top.grid(alpha=0.3)
    top.set_title("Precision: loss curves")
    bottom.plot(its, 100 * np.asarray(r["relative_error"]), lw=0.8, alpha=0.6, label="per step")
    w = r["window"]
    bottom.plot(its[w - 1:], 100 * np.asarray(r["window_means"]), lw=1.5, label=f"mean of last {w} steps")
    bottom.axhline(100 * r["threshold"], color="red", ls="--", lw=1, label="threshold")
    bottom.set_ylabel("relative error (%)")
    bottom.set_xlabel("iteration")
    bottom.set_yscale("symlog", linthresh=1e-4)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    common.save_figure(fig, path)
