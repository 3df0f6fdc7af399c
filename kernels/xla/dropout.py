"""Dropout masks from a counter-based hash: the reference (XLA) form every kernel draws from.

``jax.random.bernoulli`` (threefry2x32) costs about 20-30 ns per element on this
machine's XLA CPU backend: for gpt_tiny's attention probabilities ``[8, 4, 256, 256]``
that is 40-70 ms per layer per step, and dropout was about 15% of the whole train step
(docs/PERFORMANCE.md). Megatron draws its masks with cuRAND's counter-based Philox; here
each element's bits are a keyed integer hash of its *global* element index (a counter
based generator in the manner of Salmon et al., "Parallel random numbers: as easy as 1,
2, 3", SC 2011), computed elementwise inside the consumer's fusion, at about the cost of
one elementwise op (measured in docs/PERFORMANCE.md).

The hash is Chris Wellons' ``triple32`` integer finalizer (an xorshift-multiply
permutation of 32-bit words with very low avalanche bias) chained over three 32-bit words
(:func:`mask_hash`): ``h = triple32(triple32(triple32(sample ^ k0) ^ row) ^ col ^ k1)``
where ``sample = sample_offset + i_lead`` is the *global sample number* of the leading
(batch) index, ``col`` the index on the last axis and ``row`` the row-major index over the
axes between (token, head, ...). Each stage is a bijection of its word given the previous
stage, so every (sample, row, col) is a distinct hash input as long as ``row`` and ``col``
fit 32 bits, which :func:`hash_bits` checks (a ``[b, nkv, g, s, s]`` attention mask: heads
x s <= 2^32 and s <= 2^32). It is statistically good for Bernoulli masks, not
a cryptographic generator and not a replacement for ``jax.random`` elsewhere.

Global positions, so the layout never changes a mask:

* **Data parallelism** (inside the train step's data-parallel ``shard_map``, where each
  rank sees only its rows): the caller passes ``sample_offset``, the global number of
  its first row in the step's batch, counted over micro-batches, ``(micro_batch *
  data_parallel_size + rank) * local_micro_batch_size``
  (:func:`jmegatron.training.step.make_train_step`). The step key is the same on every
  rank and every micro-batch; the sample number is what differs.
* **Tensor and sequence parallelism** (GSPMD, automatic axes): the ``iota`` of the index
  is partitioned with the tensor, so every shard computes its elements' global indices.

So a mask bit depends only on (step key, module, global sample, position within the
sample): 1 device, dp8, tp, SP, ZeRO-1 and FSDP runs of the same global batch draw the
same masks (tests/test_parallel_equivalence.py), as do runs that split that batch into a
different number of micro-batches; a resumed run draws the same masks (the key comes
from the state's base key). The CPU attention kernel (kernels/cpu/attention.cc) computes
the same hash, element for element.

The Flax module is :class:`jmegatron.models.dropout.Dropout`; the kernels (CPU, Pallas)
import :func:`mask_hash` / :func:`key_words` from here.

``config.dropout_impl="threefry"`` keeps ``jax.random.bernoulli`` for comparison, with
one key per global sample (``fold_in(key, sample)``), so it is layout-free as well.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

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


# The largest extent of the row and column words (each a uint32): a shape whose row or
# column index would reach 2^32 is refused, never wrapped.
HASH_WORD_LIMIT = 2**32


def mask_hash(k0, k1, sample, row, col) -> jax.Array:
    """uint32: the dropout hash of the words (sample, row, col) under the key words (k0, k1),
    ``triple32(triple32(triple32(sample ^ k0) ^ row) ^ col ^ k1)`` (broadcasting uint32
    arrays). The one definition shared by :func:`hash_bits`, :func:`attention_keep_mask`, the
    Pallas kernel (kernels/pallas/flash_attention.py) and, in C++, the CPU attention kernel
    (kernels/cpu/attention.cc, which computes the row stage once per query row)."""
    return _triple32(_triple32(_triple32(sample ^ k0) ^ row) ^ col ^ k1)


def check_hash_extent(fn: str, rows: int, cols: int, what: str = "") -> None:
    """ValueError naming ``fn`` unless ``rows`` (the number of distinct row words) and
    ``cols`` (of column words) are at most 2^32, so no two elements of one sample share a
    hash input. ``what``: how ``rows`` is formed, for the message."""
    for name, n in (("rows" + (f" ({what})" if what else ""), rows), ("columns", cols)):
        if n > HASH_WORD_LIMIT:
            raise ValueError(f"{fn}: the dropout hash indexes at most 2^32 {name} per sample, got {n}; "
                             f"use fewer heads per device (tensor parallelism) or a shorter sequence, or "
                             f"dropout 0")


def key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(k0, k1), uint32 scalars: the hash's key words from ``key`` (a JAX PRNG key or its raw
    uint32 data): its first word, and its last word xor the golden-ratio constant. The
    kernels (CPU, Pallas) take these two words as their seed."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    data = data.reshape(-1).astype(_U)
    return data[0], data[-1] ^ _U(0x9E3779B9)


def _samples(sample_offset, n: int) -> jax.Array:
    """uint32 ``[n]``: the global sample numbers ``sample_offset + 0 .. n - 1`` (mod 2^32)."""
    return jnp.asarray(sample_offset).astype(_U) + jnp.arange(n, dtype=_U)


def hash_bits(key: jax.Array, shape: Sequence[int], sample_offset=0,
              positions: Optional[jax.Array] = None) -> jax.Array:
    """uint32 ``shape`` of hashed global element indices under ``key`` (a JAX PRNG key or
    its raw uint32 data). Pure and elementwise: XLA fuses it into the consumer.

    Element ``(i, ..., j)`` hashes (:func:`mask_hash`) the words ``sample = sample_offset +
    i``, ``row`` = the row-major index over axes ``1 .. ndim - 2`` (0 for rank < 3) and ``col
    = j`` (the last axis; 0 for rank < 2). Raises ValueError when the product of the middle
    axes or the last axis exceeds 2^32 (the words would wrap).

    ``sample_offset`` (int or integer scalar array, may be traced): the global sample
    number of index 0 on the leading axis; the leading index hashed is ``sample_offset
    + i``. ``shape == ()`` hashes the single sample ``sample_offset``. ``positions``
    (integer ``[shape[1]]`` shared by the rows, or ``[shape[0], shape[1]]`` per row;
    optional): the global index of each slot of axis 1 (the sequence slots a
    context-parallel rank holds, the batch's ``positions``,
    :func:`jmegatron.parallel.context_parallel.load_balance_index`) used in place of
    ``0 .. shape[1] - 1``; the other axes' strides are unchanged. Per-row positions keep
    every row's mask local to the row's device (no row is read from another data rank).
    """
    shape = tuple(int(d) for d in shape)
    k0, k1 = key_words(key)
    offset = jnp.asarray(sample_offset).astype(_U)
    if not shape:
        return mask_hash(k0, k1, offset, _U(0), _U(0))
    check_hash_extent("hash_bits", math.prod(shape[1:-1]), shape[-1] if len(shape) > 1 else 1,
                      f"the product of axes 1..{len(shape) - 2} of {list(shape)}")
    lead = jax.lax.broadcasted_iota(_U, shape, 0) + offset

    def index(dim):
        if dim == 1 and positions is not None:
            p = jnp.asarray(positions).astype(_U)
            lead_axes = p.shape if p.ndim == 2 else (1, -1)
            return jnp.broadcast_to(p.reshape(lead_axes + (1,) * (len(shape) - 2)), shape)
        return jax.lax.broadcasted_iota(_U, shape, dim)

    row = jnp.zeros(shape, _U)
    stride = 1
    for dim in range(len(shape) - 2, 0, -1):
        row = row + index(dim) * _U(stride % 2**32)
        stride *= shape[dim]
    col = index(len(shape) - 1) if len(shape) > 1 else jnp.zeros(shape, _U)
    return mask_hash(k0, k1, lead, row, col)


def keep_mask(key: jax.Array, rate: float, shape: Sequence[int], impl: str = "hash",
              sample_offset=0, positions: Optional[jax.Array] = None) -> jax.Array:
    """bool ``shape``: True with probability ``1 - rate`` per element (to 2^-32).

    ``impl`` "hash" (:func:`hash_bits`) or "threefry" (``jax.random.bernoulli`` of
    ``shape[1:]`` under ``fold_in(key, sample)`` for each global sample number
    ``sample_offset + i`` of the leading axis). ``positions``: axis 1's global indices
    (:func:`hash_bits`; "hash" only). Raises ValueError for an unknown ``impl``, ``rate``
    outside [0, 1), or ``positions`` with "threefry".
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    shape = tuple(int(d) for d in shape)
    if impl == "threefry":
        if positions is not None:
            raise ValueError("dropout_impl='threefry' draws a sample's mask whole; context-parallel slots "
                             "(positions) need dropout_impl='hash'")
        if not shape:
            return jax.random.bernoulli(jax.random.fold_in(key, _samples(sample_offset, 1)[0]), 1.0 - rate)
        return jax.vmap(lambda n: jax.random.bernoulli(jax.random.fold_in(key, n), 1.0 - rate, shape[1:]))(
            _samples(sample_offset, shape[0]))
    if impl != "hash":
        raise ValueError(f"dropout impl {impl!r} is not one of {DROPOUT_IMPLS}")
    threshold = min(int(math.floor(rate * 2.0**32)), 2**32 - 1)
    return hash_bits(key, shape, sample_offset, positions) >= _U(threshold)


def attention_keep_mask(key: jax.Array, rate: float, shape: Sequence[int], q_positions: jax.Array,
                        k_positions: jax.Array, seq_length: int, sample_offset=0) -> jax.Array:
    """bool ``shape = [b, nkv, g, sq, sk]``: the ``"hash"`` :func:`keep_mask` of the whole
    sequence's attention probabilities ``[b, nkv, g, seq_length, seq_length]`` (as
    :func:`jmegatron.kernels.xla.attention.xla_attention` draws it on one device) at query rows
    ``q_positions`` and key columns ``k_positions`` (int ``[b, sq]`` / ``[b, sk]``, global
    sequence positions): the mask of one block of a context-parallel attention, element for
    element the one-device mask. Row ``i`` is global sample ``sample_offset + i``; the hash
    words are ``row = head * seq_length + q_position`` and ``col = k_position``
    (:func:`mask_hash`). Raises ValueError for ``rate`` outside [0, 1), or heads x
    ``seq_length`` or ``seq_length`` above 2^32."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    shape = tuple(int(d) for d in shape)
    check_hash_extent("attention_keep_mask", shape[1] * shape[2] * int(seq_length), int(seq_length),
                      f"heads {shape[1] * shape[2]} x seq_length {seq_length}")
    k0, k1 = key_words(key)
    lead = jax.lax.broadcasted_iota(_U, shape, 0) + jnp.asarray(sample_offset).astype(_U)
    head = jax.lax.broadcasted_iota(_U, shape, 1) * _U(shape[2]) + jax.lax.broadcasted_iota(_U, shape, 2)
    q = jnp.asarray(q_positions).astype(_U)[:, None, None, :, None]
    k = jnp.asarray(k_positions).astype(_U)[:, None, None, None, :]
    row = head * _U(int(seq_length) % 2**32) + q  # hash_bits' row-major index over [nkv, g, S]
    threshold = min(int(math.floor(rate * 2.0**32)), 2**32 - 1)
    return mask_hash(k0, k1, lead, row, k) >= _U(threshold)


def dropout(x: jax.Array, rate: float, key: Optional[jax.Array], impl: str = "hash",
            sample_offset=0, positions: Optional[jax.Array] = None) -> jax.Array:
    """Inverted dropout of ``x`` (any shape and float dtype; the leading axis is the
    batch, its row 0 the global sample ``sample_offset``; ``positions``: axis 1's global
    indices, see :func:`hash_bits`): zero with probability ``rate``, else scaled by
    ``1 / (1 - rate)``; ``x`` itself when ``rate == 0``."""
    if rate == 0.0:
        return x
    keep = keep_mask(key, rate, x.shape, impl, sample_offset, positions)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
