"""``bench peak``: measure this device's matrix-multiply peak and store it for MFU.

Chains of square matmuls (:func:`jmegatron.training.peak.measure_peak`) in float32 and
bfloat16 at several sizes; per size the median of ``--repeats`` timed runs; the peak of a
dtype is its best size's median. The record goes to ``--peak-file`` (default
``runs/bench/peak.json`` or ``$JMEGATRON_PEAK_FILE``), where the trainer's MFU, ``bench
mfu`` and the report read it; ``peak.json``, ``peak.md`` and ``peak.png`` (TFLOP/s by size)
go to ``--out``.
"""

from __future__ import annotations

import argparse

from jmegatron.bench import common


def register(sub) -> None:
    """Add the ``peak`` subcommand to the bench CLI's subparsers."""
    p = sub.add_parser("peak", help="measure and store this device's matmul peak (TFLOP/s)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,512,1024,2048", help="square matrix sizes, comma separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16, comma separated")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per size (median taken)")
    p.add_argument("--chain", type=int, default=4, help="dependent matmuls per timed run")
    p.add_argument("--peak-file", default=None, help="where to store the peak (default runs/bench/peak.json "
                                                     "or $JMEGATRON_PEAK_FILE)")
    common.add_out_argument(p, "peak")
    p.set_defaults(func=run)


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise common.BenchError(f"--{name}={text!r} must be comma-separated integers") from None
    if not values or min(values) <= 0:
        raise common.BenchError(f"--{name}={text!r} must list positive integers")
    return values


def run(args) -> int:
    """Run ``bench peak`` from parsed arguments; returns the exit status."""
    from jmegatron.training import peak as peak_lib

    sizes = _ints(args.sizes, "sizes")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in peak_lib.DTYPES]
    if bad or not dtypes:
        raise common.BenchError(f"--dtypes={args.dtypes!r}: choose among {sorted(peak_lib.DTYPES)}")
    if args.repeats < 1 or args.chain < 1:
        raise common.BenchError("--repeats and --chain must be >= 1")
    record = peak_lib.measure_peak(sizes, dtypes, args.repeats, args.chain)
    stored = peak_lib.save_peak(record, args.peak_file)
    out = common.out_dir(args)
    result = {"command": "peak", "peak_file": stored, "environment": common.environment(), **record}
    common.write_json(out / "peak.json", result)
    _chart(record, out / "peak.png")
    common.write_text(out / "peak.md", markdown(result))
    for name, entry in record["dtypes"].items():
        print(f"[bench peak] {name}: {entry['peak_tflops']:.4f} TFLOP/s (best size {entry['best_size']})")
    print(f"[bench peak] stored in {stored}; results in {out}")
    return 0


def markdown(result: dict) -> str:
    """The markdown summary of a ``bench peak`` result (its JSON object)."""
    rows = []
    for name, entry in result["dtypes"].items():
        for size, s in entry["by_size"].items():
            rows.append([name, int(size), s["median_tflops"], min(s["samples_tflops"]), max(s["samples_tflops"])])
    peaks = ", ".join(f"{n} **{e['peak_tflops']:.4g} TFLOP/s** (size {e['best_size']})"
                      for n, e in result["dtypes"].items())
    return "\n".join([
        "# Matmul peak", "",
        f"Device: {result['platform']} / {result['device_kind']} ({result['num_local_devices']} local devices, "
        f"{result['cpu_count']} CPUs, host {result['hostname']}), measured {result['measured_at']}.", "",
        f"Peak per dtype (best size's median of {result['repeats']} runs of {result['chain']} chained "
        f"n x n matmuls, 2 n^3 FLOPs each): {peaks}. Stored in `{result['peak_file']}`; MFU everywhere "
        "uses it unless a config sets `peak_tflops`.", "",
        common.markdown_table(["dtype", "n", "median TFLOP/s", "min", "max"], rows), "",
        "![TFLOP/s by size](peak.png)"])


def _chart(record: dict, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, entry in record["dtypes"].items():
        sizes = [int(s) for s in entry["by_size"]]
        ax.plot(sizes, [entry["by_size"][str(s)]["median_tflops"] for s in sizes], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("matrix size n")
    ax.set_ylabel("TFLOP/s (median)")
    ax.set_title(f"Matmul throughput, {record['device_kind']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
