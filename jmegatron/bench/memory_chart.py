"""``bench memory_chart -b BASELINE_LOG -i INPUT_LOG -o OUTDIR [--reserved | --fragment]
[-t 0.002]``: compare two training logs' memory lines per rank, ByteMLPerf's memory test.

ByteMLPerf's training suite (byte_train_perf/README.md, section 3) asks a vendor's memory
use to match the GPU run's within +-0.2 % for the same model and batch, and its
fragmentation (variable-length sequences, ``--test-memory``) to be comparable; it ships no
script for it. This is that script. It reads the ``[Rank r] (after N iterations) memory (MB)
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

PASS when every compared point is within ``-t`` (0.002). Ranks or iterations only one log
has are listed, not judged; none shared is bad input. Writes ``OUTDIR/memory_chart.png``
(per rank, the last shared iteration's figures of both logs and the worst difference),
``memory_chart.md`` and ``memory_chart.json``. Exit status: 0 PASS, 1 FAIL, 2 bad input (the
error names the file and line).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from jmegatron.bench import common, megatron_log
from jmegatron.bench.loss_chart import add_log_arguments

DEFAULT_THRESHOLD = 0.002  # ByteMLPerf: +-0.2 %


def register(sub) -> None:
    """Add the ``memory_chart`` subcommand to the bench CLI's subparsers."""
    p = sub.add_parser("memory_chart", help="compare two logs' memory lines per rank (ByteMLPerf: within 0.2%%)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_log_arguments(p, "memory_chart")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--reserved", action="store_true", help="compare reserved memory (default: allocated)")
    kind.add_argument("--fragment", action="store_true",
                      help="compare the fragmentation fraction (reserved - allocated) / reserved")
    p.add_argument("--max", action="store_true", help="the peaks: max allocated / max reserved")
    p.add_argument("-t", "--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="pass when every difference is within this (0.002 = 0.2%%)")
    p.set_defaults(func=run)


def metric_of(reserved: bool = False, fragment: bool = False, peak: bool = False) -> str:
    """The compared quantity's name: ``allocated``, ``max_allocated``, ``reserved``,
    ``max_reserved`` or ``fragment``."""
    if fragment:
        return "fragment"
    return ("max_" if peak else "") + ("reserved" if reserved else "allocated")


def _value(rec: megatron_log.MemoryRecord, metric: str) -> float:
    if metric == "fragment":
        return (rec.reserved - rec.allocated) / rec.reserved if rec.reserved else float("nan")
    return rec.value(metric)


def compare_memory(baseline: dict, candidate: dict, metric: str, threshold: float,
                   names: tuple[str, str] = ("baseline", "input")) -> dict:
    """Compare ``{rank: [MemoryRecord]}`` of two logs (module docstring). Returns
    ``points`` (rank, iteration, baseline, input, difference per shared point; the last
    record of a rank at a repeated iteration counts), ``per_rank`` (rank -> worst
    difference and the last shared point), ``max_difference``, ``ranks_only_in_baseline``,
    ``ranks_only_in_input``, ``threshold``, ``passed``. Raises BenchError when no (rank,
    iteration) is in both logs."""
    points = []
    for rank in sorted(set(baseline) & set(candidate)):
        b = {r.iteration: r for r in baseline[rank]}
        x = {r.iteration: r for r in candidate[rank]}
        for it in sorted(set(b) & set(x)):
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
            "threshold": threshold, "passed": bool(worst <= threshold)}


def _ranks(memory: dict) -> str:
    return f"{sorted(memory)}" if memory else "none"


def run(args) -> int:
    """Run ``bench memory_chart``; returns 0 PASS, 1 FAIL (BenchError for bad input: exit 2)."""
    if args.threshold <= 0:
        raise common.BenchError(f"-t/--threshold={args.threshold} must be > 0")
    if args.fragment and args.max:
        raise common.BenchError("--max applies to allocated/reserved, not --fragment")
    base = megatron_log.read_log(args.baseline, "-b/--baseline")
    cand = megatron_log.read_log(args.input, "-i/--input")
    for log, opt in ((base, "-b/--baseline"), (cand, "-i/--input")):
        if not log.memory:
            raise common.BenchError(f"{opt} {log.path} has no memory line ('[Rank r] (after N iterations) memory "
                                    "(MB) | allocated: ...'; Megatron prints it after the first logged iteration, "
                                    "ByteMLPerf's --test-memory at every one)")
    metric = metric_of(args.reserved, args.fragment, args.max)
    cmp = compare_memory(base.memory, cand.memory, metric, args.threshold, (args.baseline, args.input))
    sources = {"baseline": sorted({str(r.source) for rs in base.memory.values() for r in rs}),
               "input": sorted({str(r.source) for rs in cand.memory.values() for r in rs})}
    result = {"command": "memory_chart", "baseline_log": args.baseline, "input_log": args.input, "sources": sources,
              "argv": sys.argv[1:], **cmp}
    out = common.out_dir(args)
    common.write_json(out / "memory_chart.json", result)
    _chart(result, out / "memory_chart.png")
    common.write_text(out / "memory_chart.md", markdown(result))
    verdict = "PASS" if cmp["passed"] else "FAIL"
    print(f"[bench memory_chart] {verdict}: {metric} of {len(cmp['per_rank'])} ranks, {len(cmp['points'])} points; "
          f"largest difference {common.pct(cmp['max_difference'])} (threshold {common.pct(args.threshold)}); "
          f"results in {out}")
    return 0 if cmp["passed"] else 1


def _describe(metric: str) -> str:
    if metric == "fragment":
        return "fragmentation fraction (reserved - allocated) / reserved, difference in fraction points"
    return f"{metric.replace('_', ' ')} (MB), relative difference"


def markdown(r: dict) -> str:
    """The markdown verdict of a ``memory_chart`` result (its JSON object)."""
    verdict = "**PASS**" if r["passed"] else "**FAIL**"
    frac = r["metric"] == "fragment"
    show = (lambda v: common.pct(v)) if frac else (lambda v: f"{v:.2f}")
    rows = [[str(rank), p["last_iteration"], show(p["baseline"]), show(p["input"]), common.pct(p["max_difference"]),
             p["at_iteration"]] for rank, p in sorted(r["per_rank"].items())]
    notes = []
    if r["ranks_only_in_baseline"] or r["ranks_only_in_input"]:
        notes.append(f"- Ranks not compared: only in the baseline {r['ranks_only_in_baseline']}, only in the input "
                     f"{r['ranks_only_in_input']}.")
    notes.append(f"- Figures' sources: baseline {r['sources']['baseline']}, input {r['sources']['input']} "
                 "('None': a Megatron log, torch.cuda's caching allocator).")
    return "\n".join([
        "# Memory comparison", "",
        f"{verdict}: {_describe(r['metric'])}; the largest over {len(r['points'])} (rank, iteration) points is "
        f"{common.pct(r['max_difference'])}, threshold {common.pct(r['threshold'])} (ByteMLPerf: within 0.2%).", "",
        f"Baseline `{r['baseline_log']}`, input `{r['input_log']}`.", "",
        common.markdown_table(["rank", "last shared iteration", "baseline", "input", "largest difference",
                               "at iteration"], rows), "", *notes, "",
        "![memory per rank](memory_chart.png)"])


def _chart(r: dict, path) -> None:
    plt = common.pyplot()
    ranks = sorted(r["per_rank"])
    x = np.arange(len(ranks))
    scale = 100.0 if r["metric"] == "fragment" else 1.0
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.6 * len(ranks) + 3), 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    top.bar(x - 0.2, [scale * r["per_rank"][k]["baseline"] for k in ranks], 0.4, label="baseline")
    top.bar(x + 0.2, [scale * r["per_rank"][k]["input"] for k in ranks], 0.4, label="input")
    top.set_ylabel("fragmentation (%)" if r["metric"] == "fragment" else f"{r['metric'].replace('_', ' ')} (MB)")
    top.set_title(f"memory_chart: {'PASS' if r['passed'] else 'FAIL'} ({r['metric']}, last shared iteration)")
    top.legend(fontsize=8)
    top.grid(alpha=0.3, axis="y")
    bottom.bar(x, [100 * r["per_rank"][k]["max_difference"] for k in ranks], 0.5, color="gray")
    bottom.axhline(100 * r["threshold"], color="red", ls="--", lw=1, label="threshold")
    bottom.set_ylabel("largest difference (%)")
    bottom.set_xticks(x, [str(k) for k in ranks])
    bottom.set_xlabel("rank")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
