"""Where the train step's time goes: per-HLO-op time from a JAX profiler trace.

    python benchmarks/profile_step.py --config configs/gpt_tiny.py [--set field=value] [--top 30]

Runs a few steps under ``jax.profiler.trace`` with ``--xla_cpu_enable_xprof_traceme=true``
(XLA's CPU runtime then records one event per executed thunk: fusions, dots, copies ...),
reads the XSpace back with ``jax.profiler.ProfileData`` and prints the ops that took the
most time, summed over the traced steps, grouped by HLO op name and by op kind.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

import numpy as np  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gpt_tiny.py")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--hlo-out", default=None, help="also write the compiled HLO text here")
    p.add_argument("--explain", action="store_true", help="show each top op's HLO shape and source")
    args = p.parse_args(argv)
    from jmegatron.runtime import reexec_with_host_allocator
    reexec_with_host_allocator()  # $JMEGATRON_HOST_ALLOCATOR, as python -m jmegatron.train

    import jax
    from jax.profiler import ProfileData

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compare_torch import bench_config, jmegatron_stepper


    cfg = bench_config(args.config, args.set)
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(cfg.micro_batch_size, cfg.seq_length + 1))
    step, run = jmegatron_stepper(cfg, toks[:, :-1].astype(np.int32), toks[:, 1:].astype(np.int32))
    step()
    step()
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(args.steps):
            step()
    path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    data = ProfileData.from_file(path)
    by_name, by_kind = collections.Counter(), collections.Counter()
    total = 0.0
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                name = ev.name
                if not re.match(r"^[\w.\-]+$", name) or name.startswith(("Thunk", "PjRt", "ThreadPool")):
                    continue
                dur = ev.duration_ns / 1e6 / args.steps
                by_name[name] += dur
                kind = re.sub(r"[.\d]+$", "", name)
                by_kind[kind] += dur
                total += dur
    print(f"per step, summed over threads (ms); total {total:.1f}")
    print("by kind:")
    for k, v in by_kind.most_common(20):
        print(f"  {v:9.2f}  {100 * v / total:5.1f}%  {k}")
    hlo = {}
    if args.hlo_out or args.explain:
        text = step.compiled_text()
        if args.hlo_out:
            with open(args.hlo_out, "w") as f:
                f.write(text)
        for line in text.splitlines():
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\((.*)", line)
            if m:
                operands = len(re.findall(r"%[\w.\-]+", m.group(4).split("), ")[0]))
                meta = re.search(r'op_name="([^"]+)"', line)
                target = re.search(r'custom_call_target="([^"]+)"', line)
                kind = f"{target.group(1)} " if target else ""
                hlo[m.group(1)] = f"{kind}{m.group(2)} {operands} operands  {meta.group(1)[-90:] if meta else ''}"
        by_target = collections.Counter()
        for k, v in by_name.items():
            target = re.match(r"(jmegatron_\w+) ", hlo.get(k, ""))
            if target:
                by_target[target.group(1)] += v
        if by_target:
            print("custom calls by target:")
            for k, v in by_target.most_common():
                print(f"  {v:9.2f}  {100 * v / total:5.1f}%  {k}")
    print("top ops:")
    for k, v in by_name.most_common(args.top):
        print(f"  {v:9.2f}  {100 * v / total:5.1f}%  {k}  {hlo.get(k, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
