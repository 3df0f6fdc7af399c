"""``bench peak``: the best sustained GEMM of every library here, beside the theoretical peak.

For each library that runs here -- XLA's dot (``xla``), the project's OpenBLAS custom call
``jmegatron_sgemm`` (``openblas``, float32, CPU, when it builds), ``torch.matmul`` (``torch``,
when torch imports; CUDA beside a JAX GPU backend) -- and each dtype (float32, bfloat16) and
square size ``n``: ``--repeats`` timed runs of ``--chain`` dependent ``[n, n] @ [n, n]``
products after one untimed run, each library alone in a fresh process; the median per
size, the best size's median per library.
The measured peak of a dtype is the best library's
(:func:`jmegatron.reporting.peak.measure_peak`). The theoretical peak (cores x clock x
FLOP/cycle from the CPU's ISA, or an accelerator's spec sheet;
:func:`jmegatron.reporting.peak.theoretical_peak`) is printed beside it with the ratio
measured / theoretical; a ratio above 1 means the theoretical assumptions are wrong for
this machine (say so with ``$JMEGATRON_CPU_FP32_FLOP_PER_CYCLE`` / ``$JMEGATRON_CPU_CLOCK_GHZ``).

The record goes to ``--peak-file`` (default ``runs/bench/peak.json`` or
``$JMEGATRON_PEAK_FILE``), keyed by the CPU model and a hash of its feature flags (or the
accelerator's device kind): the trainer's MFU, ``bench mfu`` and ``bench report`` use it on
this machine only. ``peak.json``, ``peak.md`` and ``peak.png`` (TFLOP/s by size) go to
``--out``. Timings on a loaded machine are low: measure on a quiet one.
"""

from __future__ import annotations


from jmegatron.bench import common

# Modules that import JAX are imported inside the commands: `python -m jmegatron.bench
# --devices N` sets XLA_FLAGS after importing every command module and before JAX starts
# (jmegatron.bench.__main__._set_devices).


def register(sub) -> None:
    """Add the ``peak`` subcommand to the bench CLI's subparsers."""
    p = common.add_command(sub, "peak",
                           "measure every GEMM library's sustained peak and store the best for MFU", __doc__)
    p.add_argument("--sizes", default="256,512,1024,2048", help="square matrix sizes, comma separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16, comma separated")
    p.add_argument("--libraries", default="xla,openblas,torch", help="xla, openblas and/or torch, comma separated")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per size (median taken)")
    p.add_argument("--chain", type=int, default=4, help="dependent matmuls per timed run")
    p.add_argument("--same-process", action="store_true",
                   help="measure every library in this process (default: each alone in a fresh process)")
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


def _names(text: str, name: str, allowed) -> list[str]:
    values = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in values if d not in allowed]
    if bad or not values:
        raise common.BenchError(f"--{name}={text!r}: choose among {', '.join(allowed)}")
    return values


def run(args) -> int:
    """Run ``bench peak`` from parsed arguments; returns the exit status."""
    from jmegatron.reporting import peak as peak_lib

    sizes = _ints(args.sizes, "sizes")
    dtypes = _names(args.dtypes, "dtypes", peak_lib.DTYPES)
    libraries = _names(args.libraries, "libraries", peak_lib.LIBRARIES)
    if args.repeats < 1 or args.chain < 1:
        raise common.BenchError("--repeats and --chain must be >= 1")
    try:
        record = peak_lib.measure_peak(sizes, dtypes, args.repeats, args.chain, libraries,
                                       separate_processes=not args.same_process, verbose=True)
    except ValueError as e:  # nothing could run
        raise common.BenchError(str(e)) from None
    stored = peak_lib.save_peak(record, args.peak_file)
    out = common.out_dir(args)
    result = {"command": "peak", "peak_file": stored, "environment": common.environment(), **record}
    common.write_json(out / "peak.json", result)
    _chart(record, out / "peak.png")
    text = markdown(result)
    common.write_text(out / "peak.md", text)
    print(text)
    for line in warnings(record):
        print(f"[bench peak] WARNING: {line}")
    print(f"[bench peak] stored in {stored} (key {record['key']}); results in {out}")
    return 0


def ratio(record: dict, dtype: str) -> float | None:
    """Measured / theoretical peak of ``dtype`` in a record (None when either is missing)."""
    theo = record.get("theoretical", {}).get(dtype)
    measured = record["dtypes"].get(dtype, {}).get("peak_tflops")
    return measured / theo if theo and measured else None


def warnings(record: dict) -> list[str]:
    """Lines for measurements above the theoretical peak: a median, or any single run (the
    theoretical peak is an upper bound, so either means its assumptions are wrong here)."""
    lines, theo = [], record.get("theoretical", {})
    fix = (f"the theoretical peak's assumptions ({theo.get('summary', '')}) are wrong for this machine; set "
           "$JMEGATRON_CPU_FP32_FLOP_PER_CYCLE or $JMEGATRON_CPU_CLOCK_GHZ, or config.peak_tflops")
    for dtype in record["dtypes"]:
        r = ratio(record, dtype)
        if r is not None and r > 1.0:
            lines.append(f"{dtype}: the measured peak {record['dtypes'][dtype]['peak_tflops']:.4g} TFLOP/s is "
                         f"{r:.2f}x the theoretical {theo[dtype]:.4g}: {fix}")
            continue
        runs = [(x, lib, n) for lib, by in record["libraries"].items() if dtype in by
                for n, s in by[dtype]["by_size"].items() for x in s["samples_tflops"]]
        if theo.get(dtype) and runs and max(runs)[0] > theo[dtype]:
            x, lib, n = max(runs)
            lines.append(f"{dtype}: one {lib} run at n={n} reached {x:.4g} TFLOP/s, {x / theo[dtype]:.2f}x the "
                         f"theoretical {theo[dtype]:.4g}: {fix}")
    return lines


def markdown(result: dict) -> str:
    """The markdown summary of a ``bench peak`` result (its JSON object): one row per
    library x dtype x size (median, min, max TFLOP/s), the theoretical peak and the ratio."""
    rows = []
    for lib, by_dtype in result["libraries"].items():
        for name, entry in by_dtype.items():
            for size, s in entry["by_size"].items():
                best = " (best)" if int(size) == entry["best_size"] else ""
                rows.append([lib, name, f"{int(size)}{best}", s["median_tflops"], min(s["samples_tflops"]),
                             max(s["samples_tflops"])])
    theo = result.get("theoretical", {})
    peaks = [[name, e["peak_tflops"], f"{e['library']} n={e['best_size']}", theo.get(name),
              common.fmt(ratio(result, name), 3)] for name, e in result["dtypes"].items()]
    skipped = [f"{lib} {d}: {why}" for lib, by in result.get("skipped", {}).items() for d, why in by.items()]
    device = (f"{result['cpu']['model_name']} ({result['cpu']['cores']} cores, {result['cpu']['logical_cpus']} "
              f"logical CPUs usable)" if result.get("cpu") else result["device_kind"])
    lines = [
        "# GEMM peak", "",
        f"Device: {result['platform']} / {device}, host {result['hostname']}, measured {result['measured_at']}; "
        f"record key `{result['key']}`.", "",
        f"Per library, dtype and size: the median, min and max TFLOP/s of {result['repeats']} runs of "
        f"{result['chain']} chained n x n matmuls (2 n^3 FLOPs each).", "",
        common.markdown_table(["library", "dtype", "n", "median TFLOP/s", "min", "max"], rows), "",
        common.markdown_table(["dtype", "measured peak TFLOP/s", "from", "theoretical TFLOP/s",
                               "measured / theoretical"], peaks), "",
        "Theoretical: " + (theo.get("description") or theo.get("error", "-")), "",
        f"Stored in `{result['peak_file']}`: MFU everywhere uses the measured peak on this machine unless a "
        "config sets `peak_tflops`, and reports MFU against the theoretical peak as well."]
    if skipped:
        lines += ["", "Not measured: " + "; ".join(skipped) + "."]
    warn = warnings(result)
    if warn:
        lines += ["", *[f"**Warning**: {w}." for w in warn]]
    return "\n".join(lines + ["", "![TFLOP/s by size](peak.png)"])


def _chart(record: dict, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for lib, by_dtype in record["libraries"].items():
        for name, entry in by_dtype.items():
            sizes = sorted(int(s) for s in entry["by_size"])
            ax.plot(sizes, [entry["by_size"][str(s)]["median_tflops"] for s in sizes], "o-", label=f"{lib} {name}")
    for name, style in zip(("float32", "bfloat16"), ("--", ":")):
        theo = record.get("theoretical", {}).get(name)
        if theo:
            ax.axhline(theo, color="gray", ls=style, lw=1, label=f"theoretical {name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("matrix size n")
    ax.set_ylabel("TFLOP/s (median)")
    ax.set_title(f"GEMM throughput, {record['device_kind']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    common.save_figure(fig, path)
