"""jmegatron's train step against a lean PyTorch GPT of the same shape, measured alternately.

    python benchmarks/compare_torch.py --config configs/gpt_tiny.py
    python benchmarks/compare_torch.py --config configs/gpt_small.py --rounds 5 --steps 2

The PyTorch model is nanoGPT-style (Karpathy's nanoGPT ``model.py``, not copied): token and
learned position embeddings, pre-LayerNorm blocks with one fused QKV ``nn.Linear``,
``F.scaled_dot_product_attention(is_causal=True)``, exact GELU MLP, tied output layer,
``torch.optim.AdamW`` (weight decay on matrices only) with gradient clipping, float32, as
jmegatron's step (same vocabulary padding, same micro-batch and sequence). Both run on the
same random token batch.

Fairness (each side its best settings, the same work):
- Every ``--dropout`` setting (default 0 and 0.1, hidden and attention dropout alike) is a
  row of its own. Dropout 0 is the headline: PyTorch's CPU ``scaled_dot_product_attention``
  takes its flash path only without dropout, so with dropout the ratio partly measures the
  dropout implementation.
- PyTorch gets the fastest of its AdamW implementations (for-loop, foreach, fused), chosen
  per process at warm-up by alternating timed steps (:func:`pick_adamw`) and reported;
  jmegatron runs its default step (optax AdamW inside the jitted step, "auto" kernels).
- Each (framework, dropout) runs in its own process; every round gives each one turn of
  ``--steps`` timed steps, in turn, after ``--settle`` seconds idle. Nothing runs untimed
  inside a round unless ``--round-warmup N`` is given, and then the figures with those N
  steps counted are printed too. At least 5 rounds.
- Host allocators (``--allocators``, jmegatron.runtime: glibc's ``default``, ``mimalloc``,
  ``tcmalloc``, ``jemalloc``, ``hugepages``): every framework runs under each one listed
  (a process each), and each framework's row uses its fastest (by median); the other
  allocators' medians are printed too.

The table per dropout setting gives ms/step as min / median / max over rounds (each
round's figure is the mean of its timed steps), tokens/s and TFLOP/s at the median
(Megatron's FLOPs formula, the same for all), MFU against the stored peak and against the
theoretical peak (jmegatron.reporting.peak); then ``ratio: <jmegatron tokens/s over PyTorch
eager tokens/s> at dropout D`` with the per-round ratios' min / median / max, and the same
against compiled PyTorch. ``--out FILE`` also writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
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


ADAMW_IMPLS = ("forloop", "foreach", "fused")


def torch_stepper(cfg, vocab: int, tokens: np.ndarray, labels: np.ndarray, compiled: bool,
                  adamw_impl: str = "fused"):
    """A function running one PyTorch train step (AdamW, clipping) on ``tokens``/``labels``
    ``[b, s]``; ``compiled`` wraps the model in ``torch.compile``; ``adamw_impl`` picks
    ``torch.optim.AdamW``'s implementation ("forloop": ``foreach=False``, "foreach",
    "fused"; the fused CPU kernel exists since PyTorch 2.4). Returns the loss (float).
    ``step.set_adamw(impl)`` swaps the optimizer (fresh moments) on the same model."""
    import torch

    if adamw_impl not in ADAMW_IMPLS:
        raise ValueError(f"adamw_impl={adamw_impl!r} must be one of {ADAMW_IMPLS}")
    torch.manual_seed(cfg.seed)
    model = torch_gpt(cfg, vocab).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]

    def make_opt(impl):
        flags = {"forloop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
        return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **flags)

    holder = {"opt": make_opt(adamw_impl), "impl": adamw_impl}
    fwd = torch.compile(model) if compiled else model
    t, y = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))

    def step():
        loss = fwd(t, y)
        holder["opt"].zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad,
                                       foreach=holder["impl"] != "forloop")
        holder["opt"].step()
        return float(loss.detach())

    step.set_adamw = lambda impl: holder.update(opt=make_opt(impl), impl=impl)
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
    from jmegatron.training.run import build

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


def step_times(step, n: int) -> list[float]:
    """Seconds of each of ``n`` consecutive calls of ``step`` (each waits for its result)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def alternating_rounds(steps: dict, rounds: int, steps_per_round: int) -> dict[str, list[float]]:
    """Seconds per step of each ``name -> step()`` in ``steps``, timed in turn: every round
    runs ``steps_per_round`` steps of each, so slow drifts of a shared machine hit all alike.
    Returns ``name -> [mean seconds per step of each round]`` and prints each round."""
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            times[name].append((time.perf_counter() - t0) / steps_per_round)
        print(f"[round {r + 1}/{rounds}] " + ", ".join(f"{n} {ts[-1] * 1e3:.0f} ms" for n, ts in times.items()),
              flush=True)
    return times


def pick_adamw(step, trials: int = 3, rounds: int = 2) -> tuple[str, dict]:
    """The fastest of PyTorch's AdamW implementations for ``step`` (a :func:`torch_stepper`):
    ``rounds`` alternating rounds of ``trials`` whole train steps per implementation (one
    untimed step after each swap: fresh moments), best median of the step time wins.
    Returns (name, {name: [seconds per step, ...]})."""
    samples = {impl: [] for impl in ADAMW_IMPLS}
    for _ in range(rounds):
        for impl in ADAMW_IMPLS:
            step.set_adamw(impl)
            step()
            samples[impl] += step_times(step, trials)
    best = min(samples, key=lambda k: statistics.median(samples[k]))
    step.set_adamw(best)
    return best, samples


def _worker(name: str, config: str, dropout: float, threads: int, warmup: int, conn, adamw_trials: int = 3) -> None:
    """One (framework, dropout) in its own process: build, warm up (PyTorch: also pick its
    fastest AdamW), then answer requests ``n`` with the seconds of each of ``n`` steps.
    Separate processes keep each framework's thread pools (XLA's, PyTorch's OpenMP and the
    compiled kernels') from competing with the other's timed steps."""
    if name != "jmegatron":
        import torch

        torch.set_num_threads(threads)
    cfg = bench_config(config, (f"hidden_dropout={dropout}", f"attention_dropout={dropout}"))
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(cfg.micro_batch_size, cfg.seq_length + 1))
    tokens, labels = toks[:, :-1].astype(np.int32), toks[:, 1:].astype(np.int32)
    info = {}
    if name == "jmegatron":
        step = jmegatron_stepper(cfg, tokens, labels)[0]
    else:
        step = torch_stepper(cfg, cfg.padded_vocab_size(), tokens, labels, compiled=name == "pytorch_compile")
    t0 = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    info["warmup_s"] = time.perf_counter() - t0
    if name != "jmegatron":
        best, samples = pick_adamw(step, trials=adamw_trials)
        info["adamw"] = best
        info["adamw_ms"] = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    conn.send((info, losses))
    while True:
        n = conn.recv()
        if n is None:
            break
        conn.send(step_times(step, n))


def spread(values: list[float]) -> dict:
    """min / median / max of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(times: dict, untimed: int, tokens_per_step: int, flop: float, peak: float,
              theoretical: float | None) -> dict:
    """Per framework: ms per step (min / median / max over rounds of each round's mean over
    its counted steps), tokens/s and TFLOP/s at the median, MFU against ``peak`` and the
    theoretical peak. ``times[name]`` = per round, the seconds of each step; the first
    ``untimed`` steps of each round are left out here (the caller shows both)."""
    out = {}
    for name, rounds in times.items():
        per_round = [statistics.mean(r[untimed:]) for r in rounds]
        ms = {k: v * 1e3 for k, v in spread(per_round).items()}
        med = ms["median"] / 1e3
        tflops = flop / med / 1e12
        out[name] = {"ms_per_step": ms, "ms_per_step_rounds": [t * 1e3 for t in per_round],
                     "tokens_per_s": tokens_per_step / med, "tflops": tflops, "mfu": tflops / peak if peak else None,
                     "mfu_theoretical": tflops / theoretical if theoretical else None}
    return out


def ratios(times: dict, untimed: int, other: str) -> dict:
    """jmegatron's tokens/s over ``other``'s: per round (jmegatron's and the other's turns of
    the same round), as min / median / max, and the ratio of the median step times."""
    jm = [statistics.mean(r[untimed:]) for r in times["jmegatron"]]
    ot = [statistics.mean(r[untimed:]) for r in times[other]]
    per_round = [o / j for j, o in zip(jm, ot)]
    return {"of_medians": statistics.median(ot) / statistics.median(jm), "per_round": per_round,
            **spread(per_round)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpt_tiny.py")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (at least 5)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per framework per round")
    p.add_argument("--warmup", type=int, default=3, help="steps run once after building, before any round")
    p.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1],
                   help="hidden and attention dropout settings, each a row of the table (0 first: the "
                        "headline, PyTorch's CPU flash attention path needs dropout 0)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--adamw-trials", type=int, default=3,
                   help="timed steps per AdamW implementation per choosing round (2 rounds) at warm-up")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="PyTorch intra-op threads")
    p.add_argument("--round-warmup", type=int, default=0,
                   help="steps at the start of each framework's turn that the headline leaves out "
                        "(every framework alike); they are still timed and the figures with them are "
                        "printed too")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds of idle before each framework's turn (OpenMP worker threads "
                        "busy-wait for a while after a parallel region)")
    p.add_argument("--allocators", default="default,mimalloc",
                   help="comma-separated host allocators (jmegatron.runtime.ALLOCATORS); every framework "
                        "runs under each, and its row uses its fastest")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error(f"--rounds {args.rounds}: at least 5 rounds are needed for a spread worth reporting")

    import multiprocessing as mp

    from jmegatron import runtime
    from jmegatron.reporting import flops
    from jmegatron.reporting.peak import resolve_peak_for_config

    cfg = bench_config(args.config)
    vocab = cfg.padded_vocab_size()
    frameworks = ["jmegatron", "pytorch_eager"] + ([] if args.no_compile else ["pytorch_compile"])
    allocators = [a.strip() for a in args.allocators.split(",") if a.strip()]
    envs = {}
    for alloc in allocators:
        try:
            envs[alloc] = runtime.allocator_env(alloc)
        except runtime.AllocatorUnavailable as e:
            p.error(f"--allocators: {e}")
    ctx = mp.get_context("spawn")
    workers, infos = {}, {}
    saved_env = dict(os.environ)
    for dropout in args.dropout:
        for alloc in allocators:
            for name in frameworks:  # built and warmed up one at a time, so compilations do not overlap
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(name, args.config, dropout, args.threads, args.warmup,
                                                         child, args.adamw_trials))
                os.environ.clear()
                os.environ.update(envs[alloc])  # the spawned interpreter starts with this allocator
                try:
                    proc.start()
                finally:
                    os.environ.clear()
                    os.environ.update(saved_env)
                info, losses = parent.recv()
                infos[(name, dropout, alloc)] = info
                extra = ""
                if "adamw" in info:
                    extra = f"; AdamW {info['adamw']} (ms/step: " + ", ".join(
                        f"{k} {v:.0f}" for k, v in info["adamw_ms"].items()) + ")"
                print(f"[warm-up] {name} dropout {dropout} {alloc}: {args.warmup} steps in {info['warmup_s']:.1f}s, losses "
                      + ", ".join(f"{x:.4f}" for x in losses) + extra, flush=True)
                workers[(name, dropout, alloc)] = (proc, parent)

    times = {key: [] for key in workers}
    for r in range(args.rounds):
        for key, (_, conn) in workers.items():
            time.sleep(args.settle)
            conn.send(args.round_warmup + args.steps)
            times[key].append(conn.recv())
        print(f"[round {r + 1}/{args.rounds}] " + ", ".join(
            f"{n}@{d}/{a} {statistics.mean(ts[-1][args.round_warmup:]) * 1e3:.0f} ms"
            for (n, d, a), ts in times.items()), flush=True)
    for proc, conn in workers.values():
        conn.send(None)
        proc.join()

    tokens_per_step = cfg.micro_batch_size * cfg.seq_length
    choice = resolve_peak_for_config(cfg, num_local_devices=1)  # every framework runs on the whole host
    peak, theoretical = choice.tflops, choice.theoretical_tflops
    print(f"\n{choice.describe()}")
    result = {"config": args.config, "shape": {k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "micro_batch_size")},
        "padded_vocab_size": vocab, "peak_tflops": peak, "peak_source": choice.source,
        "theoretical_peak_tflops": theoretical, "theoretical_peak_source": choice.theoretical_source,
        "rounds": args.rounds, "steps_per_round": args.steps, "round_warmup": args.round_warmup,
        "torch_threads": args.threads, "allocators": allocators, "by_dropout": {}}
    print(f"\n{args.config}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}, "
          f"ffn {cfg.ffn_hidden_size}, vocab {vocab}, seq {cfg.seq_length}, batch {cfg.micro_batch_size}; "
          f"float32"
          + f"; allocators {', '.join(allocators)}; {args.rounds} rounds x {args.steps} timed steps per framework"
          + (f" after {args.round_warmup} left-out steps" if args.round_warmup else ""))
    for dropout in args.dropout:
        def median_ms(name, alloc):
            return statistics.median(statistics.mean(r[args.round_warmup:]) for r in times[(name, dropout, alloc)])

        best = {name: min(allocators, key=lambda a: median_ms(name, a)) for name in frameworks}
        sub = {name: times[(name, dropout, best[name])] for name in frameworks}
        flop = flops.num_floating_point_operations(cfg, cfg.micro_batch_size, vocab)
        entry = {"frameworks": summarize(sub, args.round_warmup, tokens_per_step, flop, peak, theoretical)}
        for name in frameworks:
            entry["frameworks"][name].update(infos[(name, dropout, best[name])], allocator=best[name],
                                            ms_per_step_by_allocator={a: median_ms(name, a) * 1e3
                                                                      for a in allocators})
        if args.round_warmup:
            entry["frameworks_all_steps"] = summarize(sub, 0, tokens_per_step, flop, peak, theoretical)
        print(f"\ndropout {dropout}:\n| framework | ms/step min / median / max | tokens/s | TFLOP/s | MFU | "
              f"MFU (theoretical) | AdamW | allocator (median ms/step under each) |\n|---|---|---|---|---|---|---|---|")
        for name, fw in entry["frameworks"].items():
            ms = fw["ms_per_step"]
            mfu = f"{100 * fw['mfu']:.1f}%" if fw["mfu"] else "n/a"
            mfu_t = f"{100 * fw['mfu_theoretical']:.1f}%" if fw["mfu_theoretical"] else "n/a"
            print(f"| {name} | {ms['min']:.1f} / {ms['median']:.1f} / {ms['max']:.1f} | {fw['tokens_per_s']:,.0f} | "
                  f"{fw['tflops']:.4f} | {mfu} | {mfu_t} | {fw.get('adamw', 'optax adamw')} | {fw['allocator']} ("
                  + ", ".join(f"{a} {v:.1f}" for a, v in fw["ms_per_step_by_allocator"].items()) + ") |")
        labels = {"pytorch_eager": "", "pytorch_compile": " vs torch.compile"}
        for other in frameworks[1:]:
            rt = ratios(sub, args.round_warmup, other)
            entry[f"ratio_{other.split('_')[1]}"] = rt
            print(f"ratio{labels[other]}: {rt['of_medians']:.3f} at dropout {dropout} (jmegatron tokens/s over "
                  f"{other}; per round min {rt['min']:.3f} / median {rt['median']:.3f} / max {rt['max']:.3f})")
            if args.round_warmup:
                ra = ratios(sub, 0, other)
                entry[f"ratio_{other.split('_')[1]}_all_steps"] = ra
                print(f"  with the {args.round_warmup} left-out steps counted: {ra['of_medians']:.3f} "
                      f"(per round {ra['min']:.3f} / {ra['median']:.3f} / {ra['max']:.3f})")
        result["by_dropout"][str(dropout)] = entry
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
