"""Memory and step time of a distillation teacher in the student's layout vs on its own
(``kd_teacher_use_megatron_fsdp``: its parameters split over the data ranks, its top-K
computed before the student's loop), and of offline distillation (no teacher), on
simulated CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/teacher_layout.py \
        [--rounds 3] [--steps 4] [--dp 8] [--teacher-layers 8] [--teacher-hidden 512]

Each variant's train step is compiled once; the table gives its compiled memory per device
(``memory_analysis``: arguments, i.e. the student's state, the batch and the teacher's
parameters, and XLA's temporaries), the teacher's parameter bytes per device, and the
step time in rounds alternated across the variants (median and spread of the rounds, each
the mean of ``--steps`` steps after a warm-up). Same student, batch, top-K and data; the
teacher has fresh weights (its values do not change the work).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jmegatron.config import base_config, from_configdict  # noqa: E402
from jmegatron.data.builder import build_datasets  # noqa: E402
from jmegatron.data.loader import BatchLoader  # noqa: E402
from jmegatron.parallel.mesh import create_mesh  # noqa: E402
from jmegatron.pretrain_gpt import build  # noqa: E402
from jmegatron.reporting import memory  # noqa: E402
from jmegatron.tools.cache_teacher_logits import build_cache  # noqa: E402
from jmegatron.checkpoint import checkpointing  # noqa: E402
from jmegatron.training.run import checkpoint_meta  # noqa: E402

TOP_K = 64


def config(save, **kw):
    c = base_config()
    c.mock_data, c.vocab_size, c.seq_length = True, 8192, 256
    c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size = 4, 256, 4, 1024
    c.micro_batch_size, c.global_batch_size, c.train_iters, c.eval_interval = 1, 8, 1000, 0
    c.hidden_dropout = c.attention_dropout = 0.0
    c.save = str(save)
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--teacher-layers", type=int, default=8)
    p.add_argument("--teacher-hidden", type=int, default=512)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="teacher_layout_")
    teacher_dir = os.path.join(work, "teacher")
    tcfg = config(teacher_dir, num_layers=args.teacher_layers, hidden_size=args.teacher_hidden,
                  num_attention_heads=8, ffn_hidden_size=4 * args.teacher_hidden)
    trun = build(tcfg, create_mesh(tcfg, jax.devices()[:1]))
    ckpt = checkpointing.Checkpointer(teacher_dir)
    ckpt.save(1, trun.init_state(), checkpoint_meta(tcfg, trun, 1, 0))
    ckpt.wait()
    ckpt.close()
    kd = os.path.join(work, "kd.yaml")
    with open(kd, "w") as f:
        f.write(f"logit_kl_topk: {TOP_K}\nskip_lm_loss: false\n")
    cache = os.path.join(work, "cache")
    build_cache(config(os.path.join(work, "c"), kd_teacher_load=teacher_dir, train_iters=args.rounds * (args.steps + 1)),
                cache, TOP_K, batch_size=8)
    variants = {
        "teacher in the student's layout (replicated over data)": dict(kd_teacher_load=teacher_dir, kd_cfg=kd),
        "teacher on its own layout (kd_teacher_use_megatron_fsdp)": dict(kd_teacher_load=teacher_dir, kd_cfg=kd,
                                                                         kd_teacher_use_megatron_fsdp=True),
        "offline (cached top-K, no teacher)": dict(kd_teacher_logits_path=cache, kd_cfg=kd,
                                                   train_iters=args.rounds * (args.steps + 1)),
    }
    devices = jax.devices()[:args.dp]
    built = {}
    for name, kw in variants.items():
        cfg = config(os.path.join(work, str(len(built))), **kw)
        run = build(cfg, create_mesh(cfg, devices))
        train, _, _ = build_datasets(cfg, run.global_batch_size)
        batch = run.put_batch(next(iter(BatchLoader(train, run.global_batch_size, run.num_microbatches))))
        state = run.init_state()
        mem = run.train_step.lower(state, batch, *run.extra_args).compile().memory_analysis()
        state, m = run.train_step(state, batch, *run.extra_args)  # warm-up
        jax.block_until_ready(m)
        built[name] = dict(run=run, state=state, batch=batch, mem=mem, times=[],
                           teacher=memory.bytes_per_device(run.extra_args))
    for _ in range(args.rounds):  # alternated: each round runs every variant
        for name, b in built.items():
            run, state = b["run"], b["state"]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = run.train_step(state, b["batch"], *run.extra_args)
            jax.block_until_ready(m)
            b["times"].append((time.perf_counter() - t0) / args.steps)
            b["state"] = state
    mib = 1024 ** 2
    tokens = 8 * 256
    print(f"jax {jax.__version__}, {args.dp} simulated CPU devices on {os.cpu_count()} cores; student 4 x 256, "
          f"teacher {args.teacher_layers} x {args.teacher_hidden}, vocab 8192, global batch 8 x 256, top-{TOP_K}")
    print("| variant | teacher params MiB/device | arguments MiB/device | temporaries MiB/device | "
          "step s (median, spread) | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, b in built.items():
        t = b["times"]
        med = statistics.median(t)
        print(f"| {name} | {b['teacher'] / mib:.1f} | {b['mem'].argument_size_in_bytes / mib:.1f} | "
              f"{b['mem'].temp_size_in_bytes / mib:.1f} | {med:.3f} ({min(t):.3f}-{max(t):.3f}) | "
              f"{tokens / med:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
