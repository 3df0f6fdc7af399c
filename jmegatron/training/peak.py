"""A quick measurement of this device's matrix-multiply peak (for MFU when none is configured)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def measure_matmul_tflops(n: int = 1024, dtype=jnp.float32, repeats: int = 5, chain: int = 4) -> float:
    """Median TFLOP/s of ``chain`` back-to-back ``[n, n] @ [n, n]`` products on this process's first device."""
    a = jax.device_put(jnp.ones((n, n), dtype) / n, jax.local_devices()[0])

    @jax.jit
    def f(x):
        for _ in range(chain):
            x = x @ a
        return x

    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 * chain / float(np.median(times)) / 1e12
