"""``bench memory_chart -b BASELINE_LOG -i INPUT_LOG -o OUTDIR [--reserved] [--fragment] [--max]
[-s 50] [-t 0.002]``: compare two training logs' memory lines per rank, ByteMLPerf's memory test.

ByteMLPerf's training suite (byte_train_perf/README.md, section 3) asks a vendor's memory
use to match the GPU run's within +-0.2 % for the same model and batch, and its
fragmentation (variable-length sequences, ``--test-memory``) to be comparable. Its scripts
(byte_train_perf/Megatron-LM/examples/gpt3/run_345M_memory.sh and
run_345M_variable_memory.sh) run ``memory_chart.py -b BASELINE -i INPUT -o DIR -s 50 -t
0.002``, once plain, once with ``--reserved``, once with ``--fragment``, but the repository
ships no ``memory_chart.py``. This is that script, taking the same arguments. It reads the
``[Rank r] (after N iterations) memory (MB)
| allocated: ... | max allocated: ... | reserved: ... | max reserved: ...`` lines of both
logs (Megatron's ``report_memory``; :mod:`jmegatron.bench.megatron_log`; JSON Lines memory
records of jmegatron's ``metrics.jsonl`` too) and compares, for every rank and iteration
both logs report:

* default, ``allocated`` (``--max``: ``max allocated``): relative difference
  ``|x - b| / b``;
* ``--reserved`` (``--max``: ``max reserved``): the same on reserved memory;
* ``--fragment``: the fragmentation fraction ``f = (reserved - allocated) / reserved`` of
  each, compared as ``|f_x - f_b|`` (fraction points: a relative difference of two small
  fragmentations would be noise).

``--reserved --fragment`` together judge both (reserved memory and the fragmentation), each
as above; ``--max`` applies to the allocated / reserved comparison (with ``--fragment``
alone it has nothing to apply to: bad input). ``-s N`` (as ``loss_chart``'s): the first
``N`` iterations both logs report for a rank are compared (default: every shared one); a
rank with fewer is bad input, named (ByteMLPerf's ``-s 50`` needs a memory line at every
iteration: ``--test-memory`` / ``config.test_memory`` with ``--log-interval 1``).

PASS when every compared point of every judged quantity is within ``-t`` (0.002). Ranks or
iterations only one log has are listed, not judged; none shared is bad input. Writes
``OUTDIR/memory_chart.png`` (per quantity and rank, the last compared iteration's figures of
both logs and the worst difference), ``memory_chart.md`` and ``memory_chart.json`` (the first
quantity's comparison at the top level, every one under ``comparisons``). Exit status: 0
PASS, 1 FAIL, 2 bad input (the error names the file and line).
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np

from jmegatron.bench import common, megatron_log

DEFAULT_THRESHOLD = 0.002  # ByteMLPerf: +-0.2 %


def register(sub) -> None:
    """Add the ``memory_chart`` subcommand to the bench CLI's subparsers."""
    p = common.add_command(sub, "memory_chart",
                           "compare two logs' memory lines per rank (ByteMLPerf: within 0.2%%)", __doc__)
    common.add_log_arguments(p, "memory_chart")
    p.add_argument("--reserved", action="store_true", help="compare reserved memory (default: allocated)")
    p.add_argument("--fragment", action="store_true",
                   help="compare the fragmentation fraction (reserved - allocated) / reserved (with --reserved: "
                        "both are judged)")
    p.add_argument("--max", action="store_true", help="the peaks: max allocated / max reserved")
    p.add_argument("-s", "--steps", type=int, default=None,
                   help="compare the first STEPS iterations both logs report per rank (default: all shared)")
    p.add_argument("-t", "--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="pass when every difference is within this (0.002 = 0.2%%)")
    p.set_defaults(func=run)


def metric_of(reserved: bool = False, fragment: bool = False, peak: bool = False) -> str:
    """The compared quantity's name: ``allocated``, ``max_allocated``, ``reserved``,
    ``max_reserved`` or ``fragment`` (``fragment`` wins over ``reserved``; see
    :func:`metrics_of` for both)."""
    if fragment:
        return "fragment"
    return ("max_" if peak else "") + ("reserved" if reserved else "allocated")


def metrics_of(reserved: bool = False, fragment: bool = False, peak: bool = False) -> list[str]:
    """The quantities the flags judge, in order: ``--reserved --fragment`` gives
    ``[reserved (or max_reserved), fragment]``; otherwise one, :func:`metric_of`. Raises
    BenchError for ``--max`` with ``--fragment`` alone (no allocated / reserved figure to
    take the peak of)."""
    if fragment and peak and not reserved:
        raise common.BenchError("--max takes the peaks of allocated / reserved memory; --fragment alone compares the "
                                "fragmentation fraction, which has no peak: drop --max, or add --reserved to judge "
                                "max reserved beside the fragmentation")
    if fragment and reserved:
        return [metric_of(reserved=True, peak=peak), "fragment"]
    return [metric_of(reserved, fragment, peak)]


def _value(rec: megatron_log.MemoryRecord, metric: str) -> float:
    if metric == "fragment":
        return (rec.reserved - rec.allocated) / rec.reserved if rec.reserved else float("nan")
    return rec.value(metric)


def compare_memory(baseline: dict, candidate: dict, metric: str, threshold: float,
                   names: tuple[str, str] = ("baseline", "input"), steps: Optional[int] = None) -> dict:
    """Compare ``{rank: [MemoryRecord]}`` of two logs (module docstring) on ``metric``, over
    the first ``steps`` iterations both report for each rank (None: all). Returns
    ``points`` (rank, iteration, baseline, input, difference per compared point; the last
    record of a rank at a repeated iteration counts), ``per_rank`` (rank -> worst
    difference and the last compared point), ``max_difference``, ``ranks_only_in_baseline``,
    ``ranks_only_in_input``, ``steps``, ``threshold``, ``passed``. Raises BenchError when no
    (rank, iteration) is in both logs, ``steps < 1``, or a rank shares fewer than ``steps``."""
    if steps is not None and steps < 1:
        raise common.BenchError(f"-s/--steps={steps} must be >= 1")
    points = []
    for rank in sorted(set(baseline) & set(candidate)):
        b = {r.iteration: r for r in baseline[rank]}
        x = {r.iteration: r for r in candidate[rank]}
        shared = sorted(set(b) & set(x))
        if steps is not None and len(shared) < steps:
            raise common.BenchError(
                f"rank {rank}: {names[0]} and {names[1]} share {len(shared)} iterations with a memory line, -s asks "
                f"{steps}; print the memory line at every iteration (ByteMLPerf's --test-memory, jmegatron's "
                "config.test_memory=True, with log interval 1) and train long enough, or lower -s")
        for it in shared[:steps]:
            bv, xv = _value(b[it], metric), _value(x[it], metric)
            if metric == "fragment":
                diff = abs(xv - bv)
            else:
                diff = abs(xv - bv) / abs(bv) if bv else (0.0 if xv == bv else float("inf"))
            points.append({"rank": rank, "iteration": it, "baseline": bv, "input": xv, "difference": diff})
    if not points:
        raise common.BenchError(
            f"{names[0]} and {names[1]} share no (rank, iteration) memory line (baseline ranks "
            f"{_ranks(baseline)}, input ranks {_ranks(candidate)}); both runs need Megatron's memory lines "
            "('[Rank r] (after N iterations) memory (MB) | ...') at the same iterations")
    per_rank = {}
    for p in points:
        worst = per_rank.get(p["rank"])
        if worst is None or not p["difference"] <= worst["max_difference"]:
            per_rank[p["rank"]] = {"max_difference": p["difference"], "at_iteration": p["iteration"]}
        per_rank[p["rank"]].update(last_iteration=p["iteration"], baseline=p["baseline"], input=p["input"])
    diffs = np.array([p["difference"] for p in points], np.float64)
    worst = float(np.max(diffs)) if np.all(np.isfinite(diffs)) else float("inf")
    return {"metric": metric, "points": points, "per_rank": per_rank, "max_difference": worst,
            "ranks_only_in_baseline": sorted(set(baseline) - set(candidate)),
            "ranks_only_in_input": sorted(set(candidate) - set(baseline)),
            "steps": steps, "threshold": threshold, "passed": bool(worst <= threshold)}


def _ranks(memory: dict) -> str:
    return f"{sorted(memory)}" if memory else "none"


def run(args) -> int:
    """Run ``bench memory_chart``; returns 0 PASS, 1 FAIL (BenchError for bad input: exit 2)."""
    if args.threshold <= 0:
        raise common.BenchError(f"-t/--threshold={args.threshold} must be > 0")
    metrics = metrics_of(args.reserved, args.fragment, args.max)
    base = megatron_log.read_log(args.baseline, "-b/--baseline")
    cand = megatron_log.read_log(args.input, "-i/--input")
    for log, opt in ((base, "-b/--baseline"), (cand, "-i/--input")):
        if not log.memory:
            raise common.BenchError(f"{opt} {log.path} has no memory line ('[Rank r] (after N iterations) memory "
                                    "(MB) | allocated: ...'; Megatron prints it after the first logged iteration, "
                                    "ByteMLPerf's --test-memory at every one)")
    comparisons = {m: compare_memory(base.memory, cand.memory, m, args.threshold, (args.baseline, args.input),
                                     args.steps) for m in metrics}
    passed = all(c["passed"] for c in comparisons.values())
    sources = {"baseline": sorted({str(r.source) for rs in base.memory.values() for r in rs}),
               "input": sorted({str(r.source) for rs in cand.memory.values() for r in rs})}
    result = {"command": "memory_chart", "baseline_log": args.baseline, "input_log": args.input, "sources": sources,
              "argv": sys.argv[1:], **comparisons[metrics[0]], "metrics": metrics, "comparisons": comparisons,
              "passed": passed}
    out = common.out_dir(args)
    for m, cmp in comparisons.items():
        verdict = "PASS" if cmp["passed"] else "FAIL"
        print(f"[bench memory_chart] {verdict}: {m} of {len(cmp['per_rank'])} ranks, {len(cmp['points'])} points; "
              f"largest difference {common.pct(cmp['max_difference'])} (threshold {common.pct(args.threshold)})")
    return common.finish(out, "memory_chart", result, _chart, markdown, passed, " and ".join(metrics))


def _describe(metric: str) -> str:
    if metric == "fragment":
        return "fragmentation fraction (reserved - allocated) / reserved, difference in fraction points"
    return f"{metric.replace('_', ' ')} (MB), relative difference"


def markdown(r: dict) -> str:
    """The markdown verdict of a ``memory_chart`` result (its JSON object): one table per
    judged quantity."""
    comparisons = r.get("comparisons") or {r["metric"]: r}
    lines = ["# Memory comparison", "",
             f"{common.verdict(r['passed'])}: {' and '.join(comparisons)}, threshold {common.pct(r['threshold'])} "
             "(ByteMLPerf: within 0.2%).", "", f"Baseline `{r['baseline_log']}`, input `{r['input_log']}`.", ""]
    for metric, c in comparisons.items():
        show = common.pct if metric == "fragment" else (lambda v: f"{v:.2f}")
        rows = [[str(rank), p["last_iteration"], show(p["baseline"]), show(p["input"]),
                 common.pct(p["max_difference"]), p["at_iteration"]] for rank, p in sorted(c["per_rank"].items())]
        within = "first {} shared iterations per rank".format(c["steps"]) if c.get("steps") else "shared iterations"
        lines += [f"## {metric}: {'PASS' if c['passed'] else 'FAIL'}", "",
                  f"{_describe(metric)}; the largest over {len(c['points'])} (rank, iteration) points ({within}) is "
                  f"{common.pct(c['max_difference'])}.", "",
                  common.markdown_table(["rank", "last compared iteration", "baseline", "input",
                                         "largest difference", "at iteration"], rows), ""]
    if r["ranks_only_in_baseline"] or r["ranks_only_in_input"]:
        lines.append(f"- Ranks not compared: only in the baseline {r['ranks_only_in_baseline']}, only in the input "
                     f"{r['ranks_only_in_input']}.")
    lines += [f"- Figures' sources: baseline {r['sources']['baseline']}, input {r['sources']['input']} "
              "('None': a Megatron log, torch.cuda's caching allocator).", "", "![memory per rank](memory_chart.png)"]
    return "\n".join(lines)


def _chart(r: dict, path) -> None:
    """Per judged quantity two panels: both logs' figures per rank at the last compared
    iteration, and each rank's largest difference against the threshold."""
    plt = common.pyplot()
    comparisons = r.get("comparisons") or {r["metric"]: r}
    ranks = sorted(r["per_rank"])
    x = np.arange(len(ranks))
    fig, axes = plt.subplots(2 * len(comparisons), 1, figsize=(max(6, 0.6 * len(ranks) + 3), 6 * len(comparisons)),
                             sharex=True, gridspec_kw={"height_ratios": [2, 1] * len(comparisons)}, squeeze=False)
    for k, (metric, c) in enumerate(comparisons.items()):
        top, bottom = axes[2 * k, 0], axes[2 * k + 1, 0]
        scale = 100.0 if metric == "fragment" else 1.0
        shown = [rank for rank in ranks if rank in c["per_rank"]]
        at = [ranks.index(rank) for rank in shown]
        top.bar(x[at] - 0.2, [scale * c["per_rank"][rank]["baseline"] for rank in shown], 0.4, label="baseline")
        top.bar(x[at] + 0.2, [scale * c["per_rank"][rank]["input"] for rank in shown], 0.4, label="input")
        top.set_ylabel("fragmentation (%)" if metric == "fragment" else f"{metric.replace('_', ' ')} (MB)")
        top.set_title(f"memory_chart: {'PASS' if c['passed'] else 'FAIL'} ({metric}, last compared iteration)")
        top.legend(fontsize=8)
        top.grid(alpha=0.3, axis="y")
        bottom.bar(x[at], [100 * c["per_rank"][rank]["max_difference"] for rank in shown], 0.5, color="gray")
        bottom.axhline(100 * r["threshold"], color="red", ls="--", lw=1, label="threshold")
        bottom.set_ylabel("largest difference (%)")
        bottom.legend(fontsize=8)
        bottom.grid(alpha=0.3, axis="y")
    axes[-1, 0].set_xticks(x, [str(k) for k in ranks])
    axes[-1, 0].set_xlabel("rank")
    common.save_figure(fig, path)
