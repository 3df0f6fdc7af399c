"""An MoE model against the dense model of the same active FLOPs, on this CPU: tokens/s and
MFU of each (FLOPs counted as Megatron does, top-k routed experts only), measured in
alternating rounds, and the ratio (issue 13's target: MoE at least 0.7x the dense model).

    python benchmarks/moe_vs_dense.py [--moe configs/mixtral_tiny.py] [--dense configs/llama_tiny.py]
                                      [--rounds 5] [--steps 3] [--set field=value ...]

mixtral_tiny's 8 experts of FFN 344 with top-2 routing pass each token through 2 x 344 =
688 FFN columns, llama_tiny's dense FFN; both share attention, shapes and vocabulary, so
their FLOPs per token differ only by the router's ``h x E`` GEMM (which Megatron's formula
leaves out). Both get the same batch (one micro-batch of ``micro_batch_size`` rows), one
device, dropout as configured, the same mock tokens, and the MoE model its router losses.
The FLOPs reference is :mod:`jmegatron.reporting.peak`'s stored peak for this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moe", default="configs/mixtral_tiny.py")
    p.add_argument("--dense", default="configs/llama_tiny.py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per model per round")
    p.add_argument("--set", action="append", default=[], help="field=python_literal override for both")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compare_torch import alternating_rounds, bench_config
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.reporting import flops
    from jmegatron.reporting.peak import resolve_peak_for_config
    from jmegatron.training.run import build

    runs = {}
    for name, path in (("dense", args.dense), ("moe", args.moe)):
        cfg = bench_config(path, args.set)
        run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
        holder = {"state": run.init_state()}
        s, gbs = cfg.seq_length, run.global_batch_size
        toks = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(gbs, s + 1)).astype(np.int32)
        batch = run.put_batch({k: v.reshape(run.num_microbatches, -1, s) for k, v in {
            "tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": np.ones((gbs, s), np.float32),
            "position_ids": np.broadcast_to(np.arange(s, dtype=np.int32), (gbs, s)).copy()}.items()})

        def step(run=run, batch=batch, holder=holder):
            holder["state"], metrics = run.train_step(holder["state"], batch)
            return float(metrics["loss"])

        t0 = time.perf_counter()
        losses = [step(), step()]
        fl = flops.num_floating_point_operations(cfg, gbs, run.padded_vocab_size)
        print(f"[warm-up] {name} ({path}): {flops.num_parameters(cfg, run.padded_vocab_size):,} parameters, "
              f"{flops.num_active_parameters(cfg, run.padded_vocab_size):,} active, {fl / (gbs * s):.4g} FLOPs/token, "
              f"batch {gbs} x {s}; 2 steps in {time.perf_counter() - t0:.1f}s, losses {losses[0]:.4f} {losses[1]:.4f}",
              flush=True)
        runs[name] = (step, gbs * s, fl, resolve_peak_for_config(cfg, num_local_devices=1))

    times = alternating_rounds({name: run[0] for name, run in runs.items()}, args.rounds, args.steps)

    peak = runs["dense"][3]
    print(f"\n{args.dense} vs {args.moe}, 1 device, {args.rounds} rounds x {args.steps} steps; "
          f"MFU against {peak.describe()}\n")
    print("| model | ms/step min / median / max | tokens/s (median) | MFU (median) |")
    print("|---|---|---|---|")
    tps = {}
    for name, ts in times.items():
        _, tokens, fl, pk = runs[name]
        med = statistics.median(ts)
        tps[name] = tokens / med
        print(f"| {name} | {min(ts) * 1e3:.1f} / {med * 1e3:.1f} / {max(ts) * 1e3:.1f} | {tps[name]:,.0f} | "
              f"{fl / med / (pk.tflops * 1e12):.1%} |")
    per_round = [d / m for d, m in zip(times["dense"], times["moe"])]
    print(f"\nratio moe/dense tokens/s: {tps['moe'] / tps['dense']:.3f} (per round min {min(per_round):.3f} / "
          f"median {statistics.median(per_round):.3f} / max {max(per_round):.3f}); target >= 0.7")
    return 0


if __name__ == "__main__":
    sys.exit(main())
