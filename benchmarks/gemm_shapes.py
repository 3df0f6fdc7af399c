"""GFLOP/s of the train step's matmul shapes: the BLAS custom call (``kernels.cpu.ops.sgemm``)
against XLA's ``dot_general`` with the same transposes as dimension numbers (what
``matmul_impl="hybrid"`` chooses between; docs/PERFORMANCE.md attempt 18).

    python benchmarks/gemm_shapes.py [--hidden 256] [--tokens 2048] [--vocab 8192] [--rounds 15] [--torch]

Alternating in one process, each call timed twice per round; medians. ``--torch`` also
times ``torch.matmul``: PyTorch's OpenMP threads keep spinning after it returns and slow
whatever runs next, so those rows are not comparable with the others.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--torch", action="store_true")
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jmegatron.kernels.cpu import ops

    t, h, v = args.tokens, args.hidden, args.vocab
    f = 4 * h
    # (name, M, K, N, trans_a, trans_b): C[M, N] = op(A) @ op(B)
    shapes = [("fc1 fwd", t, h, f, False, False), ("fc2 fwd", t, f, h, False, False),
              ("fc2 dX", t, h, f, False, True), ("fc1 dX", t, f, h, False, True),
              ("fc2 dW", f, t, h, True, False), ("fc1 dW", h, t, f, True, False),
              ("qkv fwd", t, h, 3 * h, False, False), ("qkv dW", h, t, 3 * h, True, False),
              ("logits fwd", t, h, v, False, True), ("logits dX", t, v, h, False, False),
              ("emb dW", v, t, h, True, False)]
    rs = np.random.RandomState(0)
    print("| shape | M | K | N | trans_a | trans_b | blas GFLOP/s | xla GFLOP/s |" + (" torch GFLOP/s |" if args.torch else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.torch else ""))
    for name, m, k, n, ta, tb in shapes:
        a = rs.randn(*((k, m) if ta else (m, k))).astype(np.float32)
        b = rs.randn(*((n, k) if tb else (k, n))).astype(np.float32)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        blas = jax.jit(lambda x, y, ta=ta, tb=tb: ops.sgemm(x, y, ta, tb))
        dims = (((0 if ta else 1),), ((1 if tb else 0),)), ((), ())
        xla = jax.jit(lambda x, y, dims=dims: jax.lax.dot_general(x, y, dims))
        fns = {"blas": lambda: blas(ja, jb).block_until_ready(), "xla": lambda: xla(ja, jb).block_until_ready()}
        if args.torch:
            import torch
            ta_, tb_ = torch.from_numpy(a), torch.from_numpy(b)
            A, B, out = (ta_.t() if ta else ta_), (tb_.t() if tb else tb_), torch.empty(m, n)
            fns["torch"] = lambda: torch.matmul(A, B, out=out)
        for fn in fns.values():
            fn(), fn()
        times = {key: [] for key in fns}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                fn(), fn()
                times[key].append((time.perf_counter() - t0) / 2)
        rate = {key: 2 * m * k * n / statistics.median(ts) / 1e9 for key, ts in times.items()}
        print(f"| {name} | {m} | {k} | {n} | {int(ta)} | {int(tb)} | " + " | ".join(f"{r:.1f}" for r in rate.values()) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
