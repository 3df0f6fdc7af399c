"""``bench loss_chart -b BASELINE_LOG -i INPUT_LOG -o OUTDIR -s 50 -t 0.002``: compare two
training logs' loss curves, ByteMLPerf's loss-curve precision test.

ByteMLPerf's training suite (byte_train_perf/README.md, section 1.2) compares a vendor run
with a GPU run by "the mean loss error over 50 consecutive steps", passing under 0.2 %. Its
scripts (byte_train_perf/Megatron-LM/examples/gpt3/run_345M.sh, run_857M.sh,
mixtral/run_moe.sh) run ``loss_chart.py -b BASELINE -i INPUT -o DIR -s 50 -t 0.002``, but the
repository ships no ``loss_chart.py``. This is that script, with the same arguments. With
``b_i`` the baseline's and ``x_i`` the
input's loss at iteration ``i``, over the first ``-s`` iterations both logs have (in
iteration order), the relative error is ``e_i = |x_i - b_i| / |b_i|``; the run **passes
when mean(e_i) < -t** (strictly, and every value finite). The largest single ``e_i`` is
reported beside it. Fewer than ``-s`` shared iterations is bad input (exit 2): the
criterion is over ``-s`` steps.

Logs (:mod:`jmegatron.bench.megatron_log`): Megatron-LM / ByteMLPerf / jmegatron stdout
logs (the ``lm loss`` of each iteration line; with ``--log-interval`` above 1 the logged
iterations' interval means) or JSON Lines (jmegatron's ``metrics.jsonl``: every
iteration). ``--loss NAME`` compares another printed loss (e.g. ``load_balancing_loss``);
every other loss both logs have is compared too and reported, not judged.

Writes ``OUTDIR/loss_chart.png`` (both curves and the relative error), ``loss_chart.md``
(the verdict) and ``loss_chart.json``. Exit status: 0 PASS, 1 FAIL, 2 bad input (a missing,
truncated or foreign log: the error names the file and line).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from jmegatron.bench import common, megatron_log

DEFAULT_STEPS = 50
DEFAULT_THRESHOLD = 0.002  # 0.2 %


def register(sub) -> None:
    """Add the ``loss_chart`` subcommand to the bench CLI's subparsers."""
    p = common.add_command(sub, "loss_chart",
                           "compare two logs' loss curves (ByteMLPerf: mean error < 0.2%% in 50 steps)", __doc__)
    common.add_log_arguments(p, "loss_chart")
    p.add_argument("-s", "--steps", type=int, default=DEFAULT_STEPS, help="iterations compared (50)")
    p.add_argument("-t", "--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="pass when the mean relative error is below this (0.002 = 0.2%%)")
    p.add_argument("--loss", default="lm loss", help="the loss judged, as the log prints it ('lm loss')")
    p.set_defaults(func=run)


def compare_losses(baseline: dict, candidate: dict, steps: int, threshold: float,
                   names: tuple[str, str] = ("baseline", "input")) -> dict:
    """Compare two ``{iteration: loss}`` curves over the first ``steps`` shared iterations
    (module docstring). Returns ``iterations``, ``baseline``, ``input``,
    ``relative_error`` (lists), ``mean_relative_error``, ``max_relative_error``,
    ``max_at`` (its iteration), ``threshold``, ``passed``. Raises BenchError when
    ``steps < 1`` or fewer than ``steps`` iterations are shared (both files named)."""
    if steps < 1:
        raise common.BenchError(f"-s/--steps={steps} must be >= 1")
    shared = sorted(set(baseline) & set(candidate))
    if len(shared) < steps:
        raise common.BenchError(
            f"{names[0]} and {names[1]} share {len(shared)} logged iterations, -s asks {steps} "
            f"(baseline {_span(baseline)}, input {_span(candidate)}); log every iteration (--log-interval 1) "
            "and train long enough, or lower -s")
    its = shared[:steps]
    b = np.array([baseline[i] for i in its], np.float64)
    x = np.array([candidate[i] for i in its], np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(x - b) / np.abs(b)
    finite = bool(np.all(np.isfinite(rel)))
    worst = int(np.nanargmax(rel)) if not np.all(np.isnan(rel)) else 0
    mean = float(np.mean(rel))
    return {"iterations": its, "baseline": b.tolist(), "input": x.tolist(), "relative_error": rel.tolist(),
            "mean_relative_error": mean, "max_relative_error": float(rel[worst]), "max_at": its[worst],
            "threshold": threshold, "passed": finite and mean < threshold}


def _span(curve: dict) -> str:
    return f"{len(curve)} iterations {min(curve)}..{max(curve)}" if curve else "no iterations"


def run(args) -> int:
    """Run ``bench loss_chart``; returns 0 PASS, 1 FAIL (BenchError for bad input: exit 2)."""
    if args.threshold <= 0:
        raise common.BenchError(f"-t/--threshold={args.threshold} must be > 0")
    base = megatron_log.read_log(args.baseline, "-b/--baseline")
    cand = megatron_log.read_log(args.input, "-i/--input")
    cmp = compare_losses(base.loss(args.loss), cand.loss(args.loss), args.steps, args.threshold,
                         (args.baseline, args.input))
    others = {}
    for name in sorted((set(base.losses) & set(cand.losses)) - {args.loss}):
        shared = min(args.steps, len(set(base.losses[name]) & set(cand.losses[name])))
        if shared:
            o = compare_losses(base.losses[name], cand.losses[name], shared, args.threshold)
            others[name] = {k: o[k] for k in ("mean_relative_error", "max_relative_error", "max_at", "passed")}
            others[name]["steps"] = shared
    result = {"command": "loss_chart", "baseline_log": args.baseline, "input_log": args.input, "loss": args.loss,
              "steps": args.steps, "baseline_format": base.format, "input_format": cand.format,
              "other_losses": others, "argv": sys.argv[1:], **cmp}
    out = common.out_dir(args)
    return common.finish(out, "loss_chart", result, _chart, markdown, cmp["passed"],
                         f"mean relative {args.loss} error over {args.steps} steps "
                         f"{common.pct(cmp['mean_relative_error'])} (threshold {common.pct(args.threshold)}), max "
                         f"{common.pct(cmp['max_relative_error'])} at iteration {cmp['max_at']}")


def markdown(r: dict) -> str:
    """The markdown verdict of a ``loss_chart`` result (its JSON object)."""
    its = r["iterations"]
    rows = [["baseline", f"`{r['baseline_log']}` ({r['baseline_format']})"],
            ["input", f"`{r['input_log']}` ({r['input_format']})"],
            ["iterations compared", f"{len(its)} ({its[0]}..{its[-1]})"],
            ["mean relative error", common.pct(r["mean_relative_error"])],
            ["max relative error", f"{common.pct(r['max_relative_error'])} (iteration {r['max_at']})"],
            ["baseline first / last", f"{r['baseline'][0]:.6f} / {r['baseline'][-1]:.6f}"],
            ["input first / last", f"{r['input'][0]:.6f} / {r['input'][-1]:.6f}"]]
    other = [[name, o["steps"], common.pct(o["mean_relative_error"]), common.pct(o["max_relative_error"]),
              "yes" if o["passed"] else "no"] for name, o in r["other_losses"].items()]
    return common.summary_page(
        "Loss curve comparison",
        f"{common.verdict(r['passed'])}: the mean relative `{r['loss']}` error over the first {len(its)} shared "
        f"iterations is {common.pct(r['mean_relative_error'])}; threshold {common.pct(r['threshold'])} "
        "(ByteMLPerf: mean loss error over 50 consecutive steps below 0.2%).",
        rows,
        *([f"Note: a {r['baseline_format']} log is compared with a {r['input_format']} log. A stdout log holds "
           "each logged iteration's mean over the log interval, metrics.jsonl every iteration's own loss: with "
           "a log interval above 1 they differ by construction.", ""]
          if r["baseline_format"] != r["input_format"] else []),
        *([common.markdown_table(["other loss (not judged)", "steps", "mean rel. error", "max rel. error",
                                  "within threshold"], other), ""] if other else []),
        "![loss curves and relative error](loss_chart.png)")


def _chart(r: dict, path) -> None:
    plt = common.pyplot()
    its = r["iterations"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.plot(its, r["baseline"], lw=2.5, alpha=0.5, label=f"baseline: {os.path.basename(r['baseline_log'])}")
    top.plot(its, r["input"], lw=1, label=f"input: {os.path.basename(r['input_log'])}")
    top.set_ylabel(r["loss"])
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    top.set_title(f"loss_chart: {'PASS' if r['passed'] else 'FAIL'} (mean relative error "
                  f"{common.pct(r['mean_relative_error'])}, threshold {common.pct(r['threshold'])})")
    rel = 100 * np.asarray(r["relative_error"])
    bottom.plot(its, rel, lw=1, marker=".", label="per step")
    bottom.axhline(100 * r["mean_relative_error"], color="green", lw=1, label="mean")
    bottom.axhline(100 * r["threshold"], color="red", ls="--", lw=1, label="threshold")
    bottom.set_ylabel("relative error (%)")
    bottom.set_xlabel("iteration")
    bottom.set_yscale("symlog", linthresh=1e-4)
    bottom.set_ylim(bottom=0)  # errors are >= 0
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    common.save_figure(fig, path)
