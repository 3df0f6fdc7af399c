"""Dropout masks from a counter-based hash: the same masks as threefry's role, ~50x cheaper on CPU.

``jax.random.bernoulli`` (threefry2x32) costs about 20-30 ns per element on this
machine's XLA CPU backend: for gpt_tiny's attention probabilities ``[8, 4, 256, 256]``
that is 40-70 ms per layer per step, and dropout was about 15% of the whole train step
(docs/PERFORMANCE.md). Megatron draws its masks with cuRAND's counter-based Philox; here
each element's bits are a keyed integer hash of its *global* element index (a counter
based generator in the manner of Salmon et al., "Parallel random numbers: as easy as 1,
2, 3", SC 2011), computed elementwise inside the consumer's fusion, at about the cost of
one elementwise op (measured in docs/PERFORMANCE.md).

The hash is Chris Wellons' ``triple32`` integer finalizer (an xorshift-multiply
permutation of 32-bit words with very low avalanche bias) applied in two keyed stages:
``h = triple32(triple32(i_lead ^ k0) ^ i_rest ^ k1)`` where ``i_lead`` is the index on
the leading axis and ``i_rest`` the row-major index over the others (so tensors of more
than 2^32 elements do not wrap as long as one leading slice has fewer). It is
statistically good for Bernoulli masks, not a cryptographic generator and not a
replacement for ``jax.random`` elsewhere.

Because the counter is the global index, GSPMD partitions the ``iota`` with the tensor:
every layout (data, tensor, sequence parallel) draws the same mask for the same element,
and a resumed run draws the same masks (the key comes from the state's base key).

``config.dropout_impl="threefry"`` keeps ``jax.random.bernoulli`` for comparison.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

DROPOUT_IMPLS = ("hash", "threefry")

_U = jnp.uint32


def _triple32(x: jax.Array) -> jax.Array:
    # Wellons' triple32 (https://nullprogram.com/blog/2018/07/31/): a bijection on uint32
    x = x ^ (x >> 17)
    x = x * _U(0xED5AD4BB)
    x = x ^ (x >> 11)
    x = x * _U(0xAC4C1B51)
    x = x ^ (x >> 15)
    x = x * _U(0x31848BAB)
    return x ^ (x >> 14)


def _key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    data = data.reshape(-1).astype(_U)
    return data[0], data[-1] ^ _U(0x9E3779B9)


def hash_bits(key: jax.Array, shape: Sequence[int]) -> jax.Array:
    """uint32 ``shape`` of hashed global element indices under ``key`` (a JAX PRNG key or
    its raw uint32 data). Pure and elementwise: XLA fuses it into the consumer."""
    shape = tuple(int(d) for d in shape)
    k0, k1 = _key_words(key)
    if not shape:
        return _triple32(_triple32(k0) ^ k1)
    lead = jax.lax.broadcasted_iota(_U, shape, 0)
    rest = jnp.zeros(shape, _U)
    stride = 1
    for dim in range(len(shape) - 1, 0, -1):
        rest = rest + jax.lax.broadcasted_iota(_U, shape, dim) * _U(stride % 2**32)
        stride *= shape[dim]
    return _triple32(_triple32(lead ^ k0) ^ rest ^ k1)


def keep_mask(key: jax.Array, rate: float, shape: Sequence[int], impl: str = "hash") -> jax.Array:
    """bool ``shape``: True with probability ``1 - rate`` per element (to 2^-32).

    ``impl`` "hash" (:func:`hash_bits`) or "threefry" (``jax.random.bernoulli``).
    Raises ValueError for an unknown ``impl`` or ``rate`` outside [0, 1).
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    if impl == "threefry":
        return jax.random.bernoulli(key, 1.0 - rate, tuple(shape))
    if impl != "hash":
        raise ValueError(f"dropout impl {impl!r} is not one of {DROPOUT_IMPLS}")
    threshold = min(int(math.floor(rate * 2.0**32)), 2**32 - 1)
    return hash_bits(key, shape) >= _U(threshold)


def dropout(x: jax.Array, rate: float, key: Optional[jax.Array], impl: str = "hash") -> jax.Array:
    """Inverted dropout of ``x`` (any shape and float dtype): zero with probability
    ``rate``, else scaled by ``1 / (1 - rate)``; ``x`` itself when ``rate == 0``."""
    if rate == 0.0:
        return x
    keep = keep_mask(key, rate, x.shape, impl)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """Flax module form of :func:`dropout` (the ``"dropout"`` RNG collection), a drop-in for
    ``nn.Dropout(rate, deterministic)`` with the mask generator chosen by ``impl``."""

    rate: float
    deterministic: Optional[bool] = None
    impl: str = "hash"

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: Optional[bool] = None) -> jax.Array:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"), self.impl)
