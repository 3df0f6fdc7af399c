"""jmegatron's train step against a lean PyTorch GPT of the same shape, measured alternately.

    python benchmarks/compare_torch.py --config configs/gpt_tiny.py
    python benchmarks/compare_torch.py --config configs/gpt_small.py --rounds 5 --steps 3

The PyTorch model is nanoGPT-style (Karpathy's nanoGPT ``model.py``, not copied): token and
learned position embeddings, pre-LayerNorm blocks with one fused QKV ``nn.Linear``,
``F.scaled_dot_product_attention(is_causal=True)``, exact GELU MLP, tied output layer,
the config's dropout; ``torch.optim.AdamW`` (weight decay on matrices only) with gradient
clipping, float32, as jmegatron's step (same vocabulary padding, same micro-batch and
sequence). Both run on the same random token batch.

Each framework runs in its own process (so no framework's thread pools compete with
another's timed steps); each round times ``--steps`` steps of jmegatron, PyTorch eager
and ``torch.compile`` in turn, each turn after ``--round-warmup`` untimed steps (the
machine is shared and noisy: ratios come from the same rounds). Every framework's process
gets the same glibc malloc setting (``--allocator``: glibc's default, or huge pages as
``JMEGATRON_HOST_ALLOCATOR=hugepages``, jmegatron/runtime.py). The table
gives the median tokens/s, TFLOP/s (Megatron's FLOPs formula, the same for all three)
and MFU against the measured float32 matmul peak (``python -m jmegatron.bench peak``),
then ``ratio: <jmegatron tokens/s over PyTorch eager tokens/s>`` and the same against
compiled PyTorch. ``--out FILE`` also writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np


# ---------------------------------------------------------------------------- PyTorch side
def torch_gpt(cfg, vocab: int):
    """The lean PyTorch GPT (nanoGPT-style) of ``cfg``'s shape with ``vocab`` (padded) rows; float32, the config's dropout."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    h, heads, ffn, seq = cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.seq_length

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = tnn.LayerNorm(h, eps=cfg.norm_epsilon)
            self.qkv = tnn.Linear(h, 3 * h)
            self.proj = tnn.Linear(h, h)
            self.ln_2 = tnn.LayerNorm(h, eps=cfg.norm_epsilon)
            self.fc = tnn.Linear(h, ffn)
            self.fc2 = tnn.Linear(ffn, h)
            self.drop = tnn.Dropout(cfg.hidden_dropout)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(h, dim=2)
            q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=cfg.attention_dropout if self.training else 0.0)
            x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, s, h)))
            return x + self.drop(self.fc2(F.gelu(self.fc(self.ln_2(x)))))

    class GPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte = tnn.Embedding(vocab, h)
            self.wpe = tnn.Embedding(seq, h)
            self.drop = tnn.Dropout(cfg.hidden_dropout)
            self.blocks = tnn.ModuleList(Block() for _ in range(cfg.num_layers))
            self.ln_f = tnn.LayerNorm(h, eps=cfg.norm_epsilon)
            for p in self.parameters():
                if p.dim() == 2:
                    tnn.init.normal_(p, std=cfg.init_method_std)

        def forward(self, tokens, labels):
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.drop(self.wte(tokens) + self.wpe(pos))
            for blk in self.blocks:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.view(-1, vocab), labels.view(-1))

    return GPT()


def torch_stepper(cfg, vocab: int, tokens: np.ndarray, labels: np.ndarray, compiled: bool):
    """A function running one PyTorch train step (AdamW, clipping) on ``tokens``/``labels`` ``[b, s]``; ``compiled`` wraps the model in ``torch.compile``. Returns the loss (float)."""
    import torch

    torch.manual_seed(cfg.seed)
    model = torch_gpt(cfg, vocab).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    fwd = torch.compile(model) if compiled else model
    t, y = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))

    def step():
        loss = fwd(t, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        return float(loss)

    return step


# ---------------------------------------------------------------------------- jmegatron side
def bench_config(path: str, sets=(), devices: int = 1):
    """The config of ``path`` for speed runs: mock data (vocabulary 8192 unless the config
    sets one, gpt_tiny's Shakespeare tokenizer size), one micro-batch per step split over
    ``devices`` data-parallel devices, then ``sets`` (``field=python_literal`` strings)."""
    import ast

    from jmegatron.config import from_configdict, get_config_of

    cd = get_config_of(path)
    cd.mock_data, cd.data_path = True, None
    cd.vocab_size = cd.vocab_size or 8192
    cd.global_batch_size = cd.micro_batch_size
    if devices > 1:
        cd.micro_batch_size = cd.global_batch_size // devices
    for item in sets:
        key, value = item.split("=", 1)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        setattr(cd, key, value)
    return from_configdict(cd)


def jmegatron_stepper(cfg, tokens: np.ndarray, labels: np.ndarray, num_devices: int = 1):
    """A function running one jmegatron train step on ``tokens``/``labels`` ``[b, s]``
    (``b`` = the config's global batch) over the first ``num_devices`` devices
    (data parallel when > 1: each CPU device then runs its share of the batch)."""
    import jax

    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.loop import build

    run = build(cfg, create_mesh(cfg, jax.devices()[:num_devices]))
    state = run.init_state()
    b, s = tokens.shape
    batch = {"tokens": tokens, "labels": labels, "loss_mask": np.ones((b, s), np.float32),
             "position_ids": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()}
    batch = run.put_batch({k: v.reshape(run.num_microbatches, -1, s) for k, v in batch.items()})
    holder = {"state": state}

    def step():
        holder["state"], metrics = run.train_step(holder["state"], batch)
        return float(metrics["lm_loss"])  # waits for the step

    step.compiled_text = lambda: run.train_step.lower(holder["state"], batch).compile().as_text()
    return step, run


def time_steps(step, n: int) -> float:
    """Mean seconds per step of ``n`` consecutive calls of ``step`` (each waits for its result)."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def _worker(name: str, config: str, threads: int, warmup: int, conn) -> None:
    """One framework in its own process: build, warm up, then time ``n`` steps per request.
    Separate processes keep each framework's thread pools (XLA's, PyTorch's OpenMP and the
    compiled kernels') from competing with the other's timed steps."""
    if name != "jmegatron":
        import torch

        torch.set_num_threads(threads)
    cfg = bench_config(config)
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(cfg.micro_batch_size, cfg.seq_length + 1))
    tokens, labels = toks[:, :-1].astype(np.int32), toks[:, 1:].astype(np.int32)
    if name == "jmegatron":
        step = jmegatron_stepper(cfg, tokens, labels)[0]
    else:
        step = torch_stepper(cfg, cfg.padded_vocab_size(), tokens, labels, compiled=name == "pytorch_compile")
    t0 = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    conn.send((time.perf_counter() - t0, losses))
    while True:
        request = conn.recv()
        if request is None:
            break
        n, untimed = request
        for _ in range(untimed):
            step()
        conn.send(time_steps(step, n))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpt_tiny.py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per framework per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="PyTorch intra-op threads")
    p.add_argument("--round-warmup", type=int, default=1,
                   help="untimed steps at the start of each framework's turn in a round (all frameworks "
                        "alike): the step after a few seconds idle pays extra kernel time for its fresh "
                        "memory (docs/PERFORMANCE.md, attempt 16); 0 times it too")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds of idle before each framework's timed steps (OpenMP worker threads "
                        "busy-wait for a while after a parallel region)")
    p.add_argument("--allocator", choices=("hugepages", "default"), default="default",
                   help="glibc malloc of every framework's process alike: 'hugepages' = "
                        "glibc.malloc.hugetlb=1 (jmegatron.runtime, JMEGATRON_HOST_ALLOCATOR=hugepages), "
                        "'default' = glibc's")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    import multiprocessing as mp

    from jmegatron.training import flops
    from jmegatron.training.loop import default_peak_tflops

    cfg = bench_config(args.config)
    vocab = cfg.padded_vocab_size()
    names = ["jmegatron", "pytorch_eager"] + ([] if args.no_compile else ["pytorch_compile"])
    from jmegatron import runtime

    if args.allocator == "hugepages":
        os.environ["JMEGATRON_HOST_ALLOCATOR"] = "hugepages"
        if runtime.wanted():
            os.environ.update(runtime.host_tunables_env())  # inherited by every worker below
        else:
            args.allocator = "default"
    ctx = mp.get_context("spawn")
    workers = {}
    for name in names:  # built and warmed up one at a time, so compilations do not overlap
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(name, args.config, args.threads, args.warmup, child))
        proc.start()
        seconds, losses = parent.recv()
        print(f"[warm-up] {name}: {args.warmup} steps in {seconds:.1f}s, losses "
              + ", ".join(f"{x:.4f}" for x in losses), flush=True)
        workers[name] = (proc, parent)

    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name, (_, conn) in workers.items():
            time.sleep(args.settle)
            conn.send((args.steps, args.round_warmup))
            times[name].append(conn.recv())
        print(f"[round {r + 1}/{args.rounds}] " + ", ".join(f"{n} {t * 1e3:.0f} ms/step" for n, t in
                                                          ((n, ts[-1]) for n, ts in times.items())), flush=True)
    for proc, conn in workers.values():
        conn.send(None)
        proc.join()

    tokens_per_step = cfg.micro_batch_size * cfg.seq_length
    flop = flops.num_floating_point_operations(cfg, cfg.micro_batch_size, vocab)
    peak = default_peak_tflops(cfg)
    result = {"config": args.config, "shape": {k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "micro_batch_size")},
        "padded_vocab_size": vocab, "flops_per_step": flop, "peak_tflops": peak, "rounds": args.rounds,
        "steps_per_round": args.steps, "torch_threads": args.threads, "allocator": args.allocator,
        "round_warmup": args.round_warmup,
        "frameworks": {}}
    print(f"\n{args.config}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}, "
          f"ffn {cfg.ffn_hidden_size}, vocab {vocab}, seq {cfg.seq_length}, batch {cfg.micro_batch_size}, "
          f"dropout {cfg.hidden_dropout}; float32 peak {peak * 1e3:.1f} GFLOP/s; malloc {args.allocator}; "
          f"{args.round_warmup} untimed + {args.steps} timed steps per framework per round")
    print(f"| framework | ms/step (median) | tokens/s | TFLOP/s | MFU |\n|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        tps, tflops = tokens_per_step / med, flop / med / 1e12
        result["frameworks"][name] = {"ms_per_step": med * 1e3, "tokens_per_s": tps, "tflops": tflops,
                                      "mfu": tflops / peak, "ms_per_step_rounds": [t * 1e3 for t in ts]}
        print(f"| {name} | {med * 1e3:.1f} | {tps:,.0f} | {tflops:.4f} | {100 * tflops / peak:.1f}% |")
    fw = result["frameworks"]
    result["ratio_eager"] = fw["jmegatron"]["tokens_per_s"] / fw["pytorch_eager"]["tokens_per_s"]
    print(f"ratio: {result['ratio_eager']:.3f}  (jmegatron tokens/s over PyTorch eager tokens/s)")
    if "pytorch_compile" in fw:
        result["ratio_compile"] = fw["jmegatron"]["tokens_per_s"] / fw["pytorch_compile"]["tokens_per_s"]
        print(f"ratio vs torch.compile: {result['ratio_compile']:.3f}  (jmegatron tokens/s over compiled PyTorch)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
