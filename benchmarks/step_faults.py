"""Page faults and system time per train step (why huge pages or a caching allocator help).

    python benchmarks/step_faults.py --config configs/gpt_tiny.py [--allocator mimalloc|tcmalloc|...] \
        [--steps 10] [--warmup 3] [--config.<field>=<value> ...]

Trains ``--warmup`` untimed steps (compilation included), then ``--steps`` steps on mock
data (the config's shapes; ``vocab_size`` 8192 unless given), each waited for, and prints
one JSON line with the medians per step of: minor and major page faults
(``getrusage(RUSAGE_SELF)``: ``ru_minflt``, ``ru_majflt``), system and user CPU seconds,
and wall milliseconds, plus the allocator. ``--allocator NAME`` restarts the process with
that host allocator, as ``JMEGATRON_HOST_ALLOCATOR=NAME`` does for the CLIs
(:mod:`jmegatron.runtime`; default: the CLIs' default). Timings on a shared machine are noisy; fault counts
much less so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    from jmegatron.runtime import ALLOCATORS, active, reexec_with_host_allocator, requested

    p.add_argument("--allocator", choices=ALLOCATORS, default=requested(),
                   help="host allocator (jmegatron.runtime; re-executes with its environment)")
    args, rest = p.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    os.environ["JMEGATRON_HOST_ALLOCATOR"] = args.allocator
    reexec_with_host_allocator()

    import jax

    from jmegatron.command_line import parse_args
    from jmegatron.config import load_config_file
    from jmegatron.data.builder import build_datasets
    from jmegatron.data.loader import BatchLoader
    from jmegatron.training.run import build

    path, overrides = parse_args(rest)
    overrides.setdefault("mock_data", True)
    overrides.setdefault("vocab_size", 8192)
    cfg = load_config_file(path, overrides)
    run = build(cfg)
    state = run.init_state()
    train_ds, _, _ = build_datasets(cfg, run.global_batch_size)
    loader = BatchLoader(train_ds, run.global_batch_size, run.num_microbatches)
    rows = []
    for i in range(args.warmup + args.steps):
        batch = run.put_batch(next(loader))
        jax.block_until_ready(batch)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        state, metrics = run.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if i >= args.warmup:
            rows.append({"minor_faults": r1.ru_minflt - r0.ru_minflt, "major_faults": r1.ru_majflt - r0.ru_majflt,
                         "system_s": r1.ru_stime - r0.ru_stime, "user_s": r1.ru_utime - r0.ru_utime,
                         "wall_ms": 1e3 * (t1 - t0)})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(json.dumps({"config": path, "overrides": {k: v for k, v in overrides.items()},
                      "allocator": active() or "default", "steps": args.steps,
                      "median_per_step": med, "per_step": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
