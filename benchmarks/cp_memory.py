"""Per-device compiled memory of ByteMLPerf's gpt3 345M shape against sequence length, at
context_parallel_size 1, 2, 4 and 8 (issue 14's chart), with the theory beside it.

    python benchmarks/cp_memory.py [--seqs 4096,8192,16384,32768] [--cps 1,2,4,8]
                                   [--micro-batch 1] [--out docs/bench/cp_memory]

Each point compiles the train step of ``configs/bytemlperf/gpt3_345m_memory.py`` (24 layers,
hidden 1024, 16 heads) at that sequence length from abstract shapes (no allocation:
``compile().memory_analysis()``; 8 simulated CPU devices, a cp-device mesh, dp 1) and
records arguments + outputs - aliased + temporaries per device, next to
:func:`jmegatron.reporting.memory.theoretical_memory`. Every point is measured with both
attention paths: the CPU flash-style kernel (``attention_impl="cpu"``: at cp = 1 no ``s^2``
scores kept; at cp > 1 the ring's blocks are the kernel's tiled block forms) and XLA's
(``"xla"``: ``[b, a, s, s]`` scores at cp = 1, whole ``[a, 2c, 2c]`` blocks in the ring);
cp > 1 is the ring (``cp_comm_type="p2p"``). Dropout is 0 for every point (the ring has no
attention dropout yet), compute in float32 for every point (ByteMLPerf's bf16 would send
the CPU kernel back to XLA's attention: the kernel is float32 only), the micro-batch
``--micro-batch`` (ByteMLPerf uses 4), the vocabulary GPT-2's 50257. ``--impls`` limits
the attention paths.

Writes ``cp_memory.json``, ``cp_memory.md`` and ``cp_memory.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="4096,8192,16384,32768")
    p.add_argument("--cps", default="1,2,4,8")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--impls", default="cpu,xla", help="attention paths measured at every point")
    p.add_argument("--out", default="docs/bench/cp_memory")
    p.add_argument("--rows-from", default=None,
                   help="a cp_memory.json of an earlier run: its rows of points not measured now are kept "
                        "(labelled with that run's command), so one chart can be assembled from several runs")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    from jmegatron.bench.memory import layout_report
    from jmegatron.config import load_config_file
    from jmegatron.reporting.memory import ParallelLayout

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for seq in (int(x) for x in args.seqs.split(",")):
        for cp in (int(x) for x in args.cps.split(",")):
            for impl in args.impls.split(","):
                cfg = load_config_file(os.path.join(repo, "configs", "bytemlperf", "gpt3_345m_memory.py"), {
                    "mock_data": True, "vocab_size": 50257, "seq_length": seq, "max_position_embeddings": seq,
                    "micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch,
                    "hidden_dropout": 0.0, "attention_dropout": 0.0, "attention_impl": impl, "bf16": False,
                    "context_parallel_size": cp})
                r = layout_report(cfg, ParallelLayout(1, 1, context_parallel_size=cp), 1)
                c = r["compiled"]
                compiled = (c["argument_size_in_bytes"] + c["output_size_in_bytes"] - c["alias_size_in_bytes"]
                            + c["temp_size_in_bytes"])
                t = r["theoretical"]
                attention = {"cpu": "CPU kernel", "xla": "XLA"}[impl]
                row = {"seq_length": seq, "cp": cp, "attention": f"ring, {attention} blocks" if cp > 1 else attention,
                       "compiled_bytes": compiled, "temp_bytes": c["temp_size_in_bytes"],
                       "theoretical_bytes": t["total"], "theoretical_activations": t["activations"],
                       "compile_seconds": r["compile_seconds"]}
                rows.append(row)
                print(json.dumps(row), flush=True)

    command = "python benchmarks/cp_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for r in rows:
        r.setdefault("command", command)
    if args.rows_from:
        with open(args.rows_from) as f:
            earlier = json.load(f)
        have = {(r["seq_length"], r["cp"], r["attention"]) for r in rows}
        rows += [dict(r, command=r.get("command", earlier["command"])) for r in earlier["rows"]
                 if (r["seq_length"], r["cp"], r["attention"]) not in have]
        rows.sort(key=lambda r: (r["seq_length"], r["cp"], r["attention"]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cp_memory.json"), "w") as f:
        json.dump({"command": command, "rows": rows}, f, indent=1)
    gib = 2 ** 30
    lines = ["| seq | cp | attention | compiled GiB/device | theoretical GiB/device | ratio |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['seq_length']} | {r['cp']} | {r['attention']} | {r['compiled_bytes'] / gib:.3f} | "
                     f"{r['theoretical_bytes'] / gib:.3f} | {r['compiled_bytes'] / r['theoretical_bytes']:.2f} |")
    commands = sorted({r["command"] for r in rows})
    with open(os.path.join(args.out, "cp_memory.md"), "w") as f:
        f.write("# Compiled memory per device vs sequence length, gpt3 345M shape\n\n"
                + "".join(f"`{c}`\n" for c in commands)
                + f"\n(micro-batch {args.micro_batch}, dropout 0, float32, dp 1; compile only)\n\n"
                + "\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {cp: f"C{i}" for i, cp in enumerate(sorted({r["cp"] for r in rows}))}
    for key in sorted({(r["cp"], r["attention"]) for r in rows}):
        pts = sorted((r["seq_length"], r["compiled_bytes"] / gib) for r in rows if (r["cp"], r["attention"]) == key)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colours[key[0]],
                linestyle="--" if "XLA" in key[1] else "-", label=f"cp={key[0]} ({key[1]})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("compiled memory per device (GiB)")
    ax.set_title(f"gpt3 345M, micro-batch {args.micro_batch}: per-device memory vs sequence length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "cp_memory.png"), dpi=120)
    print(f"wrote {args.out}/cp_memory.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
