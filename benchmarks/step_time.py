"""Median train-step time of one config in this process (for XLA flag / option experiments).

    XLA_FLAGS=... python benchmarks/step_time.py --config configs/gpt_tiny.py [--set field=value ...]

Prints one JSON line: config, overrides, XLA_FLAGS, median ms/step, tokens/s, TFLOP/s and
the 1024^3 float32 matmul TFLOP/s measured in the same process (the flags affect both).
``benchmarks/xla_flags_sweep.py`` runs it alternately under several settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gpt_tiny.py")
    p.add_argument("--set", action="append", default=[], help="field=python_literal override")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--devices", type=int, default=1,
                   help="data-parallel CPU devices for the same global batch (set "
                        "--xla_force_host_platform_device_count in XLA_FLAGS)")
    args = p.parse_args(argv)
    from jmegatron.runtime import reexec_with_host_allocator
    reexec_with_host_allocator()  # $JMEGATRON_HOST_ALLOCATOR, as python -m jmegatron.train
    if os.environ.get("JMEGATRON_SRC"):  # another checkout (xla_flags_sweep's src=DIR)
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                            and "editable" not in getattr(f, "__name__", "").lower()]
        sys.path.insert(0, os.environ["JMEGATRON_SRC"])

    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compare_torch import bench_config, jmegatron_stepper

    import jmegatron
    from jmegatron.reporting import flops
    from jmegatron.reporting.peak import measure_matmul_tflops

    cfg = bench_config(args.config, args.set, args.devices)
    overrides = dict(item.split("=", 1) for item in args.set)
    rs = np.random.RandomState(0)
    toks = rs.randint(0, cfg.vocab_size, size=(cfg.global_batch_size, cfg.seq_length + 1)).astype(np.int32)
    step, run = jmegatron_stepper(cfg, toks[:, :-1], toks[:, 1:], args.devices)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    flop = flops.num_floating_point_operations(cfg, cfg.global_batch_size, run.padded_vocab_size)
    print(json.dumps({"config": args.config, "overrides": overrides, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                      "ms_per_step": med * 1e3, "tokens_per_s": cfg.global_batch_size * cfg.seq_length / med,
                      "tflops": flop / med / 1e12, "matmul_tflops": measure_matmul_tflops(1024),
                      "devices": len(jax.devices()), "source": os.path.dirname(jmegatron.__file__)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
