"""Run benchmarks/step_time.py under several XLA_FLAGS / config settings, alternately.

    python benchmarks/xla_flags_sweep.py --config configs/gpt_tiny.py --rounds 3 \
        --variant base= --variant onednn=--xla_cpu_use_onednn=true ...

A variant is ``NAME=XLA_FLAGS`` or ``NAME=XLA_FLAGS|field=value,field=value`` (config
overrides after ``|``; ``devices=N`` there runs data parallel over N CPU devices, and
``src=DIR`` runs another checkout of jmegatron, e.g. a ``git worktree`` of an older
commit, so code changes are compared in the same alternating rounds). Each round starts one fresh process per variant, in turn, so
slow drifts of a shared machine hit every variant alike; the table gives the median over
rounds of each process's median step time, and its ratio to the first variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gpt_tiny.py")
    p.add_argument("--variant", action="append", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    variants = []
    for v in args.variant:
        name, _, rest = v.partition("=")
        flags, _, sets = rest.partition("|")
        variants.append((name, flags, [s for s in sets.split(",") if s]))
    results = {name: [] for name, _, _ in variants}
    for r in range(args.rounds):
        for name, flags, sets in variants:
            env = dict(os.environ, XLA_FLAGS=flags)
            src = [s.split("=", 1)[1] for s in sets if s.startswith("src=")]
            sets = [s for s in sets if not s.startswith("src=")]
            if src:
                env["JMEGATRON_SRC"] = os.path.abspath(src[0])
            devices = [s.split("=")[1] for s in sets if s.startswith("devices=")]
            cmd = [sys.executable, os.path.join(HERE, "step_time.py"), "--config", args.config,
                   "--steps", str(args.steps)] + [x for s in sets if not s.startswith("devices=")
                                                  for x in ("--set", s)]
            if devices:
                cmd += ["--devices", devices[0]]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"[{name}] failed:\n{out.stderr[-2000:]}", flush=True)
                results[name].append(None)
                continue
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            results[name].append(rec)
            print(f"[round {r + 1}] {name}: {rec['ms_per_step']:.0f} ms/step, matmul {rec['matmul_tflops'] * 1e3:.0f} "
                  f"GFLOP/s", flush=True)
    base = None
    print("| variant | XLA_FLAGS / overrides | ms/step (median of rounds) | vs first | matmul GFLOP/s |")
    print("|---|---|---|---|---|")
    summary = {}
    for name, flags, sets in variants:
        recs = [x for x in results[name] if x]
        if not recs:
            print(f"| {name} | `{flags}` {sets} | failed | | |")
            continue
        ms = statistics.median(x["ms_per_step"] for x in recs)
        mm = statistics.median(x["matmul_tflops"] for x in recs) * 1e3
        base = base or ms
        summary[name] = {"flags": flags, "overrides": sets, "ms_per_step": ms, "matmul_gflops": mm,
                         "rounds_ms": [x["ms_per_step"] for x in recs]}
        print(f"| {name} | `{flags}` {' '.join(sets)} | {ms:.0f} | {base / ms:.2f}x | {mm:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
