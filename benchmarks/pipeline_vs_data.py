"""Pipeline parallel (pp=2, 1F1B) against data parallel (dp=2) on 2 simulated CPU devices,
the same global batch: tokens/s of each, alternating, and the ratio next to what the bubble
alone predicts (issue 12).

    python benchmarks/pipeline_vs_data.py [--config configs/gpt_tiny.py] [--m 8] [--rounds 5]

Both runs get the same model, ``micro_batch_size`` and global batch ``m * micro_batch_size``
(dp=2: each rank runs m/2 micro-batches; pp=2: m micro-batches through 2 stages). The bubble
predicts pp/dp = m / (m + p - 1); the printed prediction also counts jmegatron's
recomputation (each stage backward recomputes its chunk forward: with backward = 2 forward,
3 units of work become 4) and says it does not count the stages' imbalance (the embedding
and output layer sit on the first and last stage). ``--first N`` adds a third layout, pp=2
with N layers on the first stage (Megatron's ``decoder_first_pipeline_num_layers``), which
moves layers away from the stage that also runs the output layer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpt_tiny.py")
    p.add_argument("--m", type=int, default=8, help="micro-batches per global batch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout per round")
    p.add_argument("--set", action="append", default=[], help="field=python_literal override")
    p.add_argument("--first", type=int, default=None,
                   help="also time pp=2 with this many layers on the first stage (uneven split)")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    from compare_torch import alternating_rounds, bench_config
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.run import build

    layouts = {"dp2": dict(), "pp2_1f1b": dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b")}
    if args.first is not None:
        layouts[f"pp2_1f1b_first{args.first}"] = dict(layouts["pp2_1f1b"], decoder_first_pipeline_num_layers=args.first)
    runs = {}
    for name, kw in layouts.items():
        sets = list(args.set) + [f"{k}={v!r}" for k, v in kw.items()] + ["hidden_dropout=0.0", "attention_dropout=0.0"]
        cfg = bench_config(args.config, sets)
        cfg = cfg.replace(global_batch_size=args.m * cfg.micro_batch_size)
        run = build(cfg, create_mesh(cfg, jax.devices()[:2]))
        state = run.init_state()
        s, gbs = cfg.seq_length, run.global_batch_size
        toks = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(gbs, s + 1)).astype(np.int32)
        batch = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": np.ones((gbs, s), np.float32),
                 "position_ids": np.broadcast_to(np.arange(s, dtype=np.int32), (gbs, s)).copy()}
        batch = run.put_batch({k: v.reshape(run.num_microbatches, -1, s) for k, v in batch.items()})
        holder = {"state": state}

        def step(run=run, batch=batch, holder=holder):
            holder["state"], metrics = run.train_step(holder["state"], batch)
            return float(metrics["lm_loss"])

        t0 = time.perf_counter()
        losses = [step(), step()]
        print(f"[warm-up] {name}: mesh {dict(run.mesh.shape)}, {run.num_microbatches} micro-batches of "
              f"{cfg.micro_batch_size}, global batch {gbs}, seq {s}; 2 steps in {time.perf_counter() - t0:.1f}s, "
              f"losses {losses[0]:.4f} {losses[1]:.4f}", flush=True)
        runs[name] = (step, gbs * s)

    times = alternating_rounds({name: run[0] for name, run in runs.items()}, args.rounds, args.steps)

    print(f"\n{args.config}, m = {args.m}, 2 simulated CPU devices, {args.rounds} rounds x {args.steps} steps\n")
    print("| layout | ms/step min / median / max | tokens/s (median) |")
    print("|---|---|---|")
    tps = {}
    for name, ts in times.items():
        tps[name] = runs[name][1] / statistics.median(ts)
        print(f"| {name} | {min(ts) * 1e3:.1f} / {statistics.median(ts) * 1e3:.1f} / {max(ts) * 1e3:.1f} | {tps[name]:,.0f} |")
    per_round = [d / q for d, q in zip(times["dp2"], times["pp2_1f1b"])]
    bubble = args.m / (args.m + 1)
    print(f"\nratio pp2/dp2 tokens/s: {tps['pp2_1f1b'] / tps['dp2']:.3f} (per round min {min(per_round):.3f} / "
          f"median {statistics.median(per_round):.3f} / max {max(per_round):.3f})")
    print(f"predicted by the bubble alone, m/(m+p-1): {bubble:.3f}; with the stage recomputation (x 3/4): "
          f"{bubble * 0.75:.3f} (not counted: the embedding and output layer on the end stages)")
    for name in runs:
        if name.startswith("pp2_1f1b_first"):
            per_round = [e / u for e, u in zip(times["pp2_1f1b"], times[name])]
            print(f"ratio {name}/pp2_1f1b tokens/s: {tps[name] / tps['pp2_1f1b']:.3f} (per round min "
                  f"{min(per_round):.3f} / median {statistics.median(per_round):.3f} / max {max(per_round):.3f}); "
                  f"{name}/dp2: {tps[name] / tps['dp2']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
