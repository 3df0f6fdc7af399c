"""Context parallelism: the sequence split over the ``context`` mesh axis, and ring attention.

Megatron splits each sequence over ``context_parallel_size`` ranks with load balancing
(megatron/training/utils.py ``get_batch_on_this_cp_rank``): the sequence is cut into
``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so every rank has
the same causal attention work. Attention then runs as a ring (Transformer Engine's
``AttnFuncWithCPAndKVP2P``, the ``p2p`` ``cp_comm_type``; Liu et al. 2023, "Ring Attention
with Blockwise Transformers"): each rank keeps its queries, and the key/value blocks travel
around the ring (``cp - 1`` hops, K and V each: ``2 (cp - 1)`` block sends per layer
forward), each partial result merged with its log-sum-exp.

Here, as a pure-JAX layout:

* :func:`load_balance_index` gives the permutation of sequence positions that puts rank
  ``r``'s two chunks at ``[r * 2c, (r + 1) * 2c)`` (``c = s / (2 cp)``), so sharding the
  permuted sequence evenly over ``context`` is Megatron's split. Tokens, labels, loss mask
  and position ids are permuted together (the token mean of the loss does not depend on
  the order), and the batch carries the permutation itself as ``positions`` (int32 ``[b,
  s]``, :meth:`jmegatron.training.run.Run.put_batch`): the masks and the dropout masks use
  those, never the storage order.
* The block kernel (:func:`block_kernels`: XLA's
  :func:`jmegatron.kernels.xla.attention.attention_block`, the CPU or the Pallas kernel's)
  is softmax attention of a query block over a key/value block with an optional causal mask
  by positions, returning the float32 output and its log-sum-exp; :func:`merge_blocks`
  combines two partial results.
* :func:`ring_attention` runs inside ``shard_map`` with ``context`` manual. Which blocks a
  step computes follows Transformer Engine's load-balanced schedule: step 0 is the local
  causal block; a block from an earlier rank is seen whole by both local chunks but only
  its first chunk is visible (``[2c] x [c]``); a block from a later rank is visible whole
  to the second local chunk only (``[c] x [2c]``): every step costs the same on every rank.
  Its backward is a custom VJP that circulates K/V again with their dK/dV (Transformer
  Engine's scheme), keeping one block in memory instead of autodiff's every received block.

Masks: the causal order is each slot's *sequence position* (its index in the original
sequence, the batch's ``positions``), never its position id, which
restarts at every document under ``reset_position_ids`` and only feeds RoPE and the learned
position embeddings. Document masking (``reset_attention_mask``, Megatron's block-diagonal
causal ``attention_mask``) adds ``segments`` (int ``[b, 2c]``, the number of EODs before
each token, :func:`jmegatron.data.gpt_dataset.get_ltor_masks_and_position_ids`): a query
sees a key iff the key is at or before it in the sequence *and* in the same segment.
Every context-parallel attention takes ``(q, k, v, positions, axis_name, axis_size,
segments=None)``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.kernels.cpu.ops import cpu_attention_block, cpu_block_grads
from jmegatron.kernels.pallas.flash_attention import pallas_attention_block, pallas_block_grads
from jmegatron.kernels.xla.attention import BlockDropout, attention_block, block_grads

Array = jax.Array


def load_balance_index(seq_length: int, context_parallel_size: int) -> np.ndarray:
    """int64 ``[seq_length]``: the original position stored at each slot of the
    load-balanced layout (Megatron's ``get_batch_on_this_cp_rank``). Slots
    ``[r * 2c, (r + 1) * 2c)`` hold chunks ``r`` then ``2 cp - 1 - r`` (``c = seq_length /
    (2 cp)``). Identity for cp = 1. Raises ValueError when ``seq_length`` is not divisible
    by ``2 * context_parallel_size``."""
    cp = context_parallel_size
    if cp < 1:
        raise ValueError(f"context_parallel_size={cp} must be >= 1")
    if cp == 1:
        return np.arange(seq_length)
    if seq_length % (2 * cp):
        raise ValueError(f"seq_length={seq_length} must be divisible by 2 x context_parallel_size={2 * cp} "
                         f"(Megatron's load-balanced split)")
    c = seq_length // (2 * cp)
    chunks = np.arange(seq_length).reshape(2 * cp, c)
    order = [i for r in range(cp) for i in (r, 2 * cp - 1 - r)]
    return chunks[order].reshape(-1)


def merge_blocks(out1: Array, lse1: Array, out2: Array, lse2: Array) -> tuple[Array, Array]:
    """Combine two partial attention results over disjoint key sets: (out ``[b, s, nq, d]``,
    lse ``[b, s, nq]``), both float32; a side with lse -inf contributes nothing."""
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1 = jnp.where(jnp.isfinite(lse1), jnp.exp(lse1 - safe), 0.0)[..., None]
    w2 = jnp.where(jnp.isfinite(lse2), jnp.exp(lse2 - safe), 0.0)[..., None]
    return w1 * out1 + w2 * out2, lse


def block_kernels(block: str):
    """``(attention_block, block_grads)`` of a block kernel: ``"xla"``
    (:func:`jmegatron.kernels.xla.attention.attention_block`,
    :func:`jmegatron.kernels.xla.attention.block_grads`), ``"cpu"`` (the CPU attention kernel's block forms,
    :func:`jmegatron.kernels.cpu.ops.cpu_attention_block` / ``cpu_block_grads``: tiled, fully
    masked key tiles skipped, no ``[sq, sk]`` scores in memory; float32 only) or ``"pallas"``
    (:func:`jmegatron.kernels.pallas.flash_attention.pallas_attention_block` /
    ``pallas_block_grads``: FlashAttention-2 tiles, any float dtype, with the
    :class:`BlockDropout` masks). Raises ValueError for another name."""
    if block == "xla":
        return attention_block, block_grads
    if block == "cpu":
        return cpu_attention_block, cpu_block_grads
    if block == "pallas":
        return pallas_attention_block, pallas_block_grads
    raise ValueError(f"block={block!r}: choose 'xla', 'cpu' or 'pallas'")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _kernel_attention(q, k, v, q_positions, k_positions, q_segments, k_segments, block):
    """Differentiable ``attention_block(...)[0]`` in q's dtype by the ``block`` kernel
    (:func:`block_kernels`), its backward FlashAttention's from the saved log-sum-exp: what
    the all_gather and a2a attentions use with the CPU kernel."""
    out, _ = block_kernels(block)[0](q, k, v, q_positions, k_positions, q_segments, k_segments)
    return out.astype(q.dtype)


def _kernel_attention_fwd(q, k, v, q_positions, k_positions, q_segments, k_segments, block):
    out, lse = block_kernels(block)[0](q, k, v, q_positions, k_positions, q_segments, k_segments)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_positions, k_positions, q_segments, k_segments, out, lse)


def _kernel_attention_bwd(block, res, dout):
    q, k, v, q_positions, k_positions, q_segments, k_segments, out, lse = res
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    dq, dk, dv = block_kernels(block)[1](q, k, v, dout.astype(jnp.float32), lse, delta, q_positions, k_positions,
                                         q_segments, k_segments)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def _attend(q, k, v, q_positions, k_positions, q_segments, k_segments, block):
    """Whole-block attention in q's dtype: autodiff through :func:`attention_block` for
    ``"xla"``, :func:`_kernel_attention` for ``"cpu"``."""
    if block == "xla":
        return attention_block(q, k, v, q_positions, k_positions, q_segments, k_segments)[0].astype(q.dtype)
    return _kernel_attention(q, k, v, q_positions, k_positions, q_segments, k_segments, block)


def _gathered_segments(segments: Optional[Array], axis_name: str, cp: int) -> Optional[Array]:
    """int ``[b, s]``: every rank's segment ids in slot order (rank-major), or None. Every rank
    knows the whole sequence's document layout, as Transformer Engine's THD attention takes the
    global ``cu_seqlens`` on every context rank; an all-gather of ``[b, s]`` integers per call
    (the layers' identical gathers are one after XLA's CSE) instead of segment ids travelling
    beside every K/V block: nothing joins the ring's messages, whose forward/backward
    distinction keeps XLA from merging them (see :func:`_ring_bwd`)."""
    if segments is None:
        return None
    return jax.lax.all_gather(segments, axis_name, axis=1, tiled=True)


def _block_segments(all_segments: Optional[Array], source: Array, width: int) -> Optional[Array]:
    """The segment ids ``[b, width]`` of rank ``source``'s slots (traced int), or None."""
    if all_segments is None:
        return None
    return jax.lax.dynamic_slice_in_dim(all_segments, source * width, width, axis=1)


def _slot_positions(rank: Array, c: int, cp: int, b: int) -> Array:
    """int32 ``[b, 2c]``: the sequence positions of context rank ``rank``'s load-balanced
    slots (chunks ``rank`` and ``2 cp - 1 - rank``; ``rank`` may be traced)."""
    offsets = jnp.arange(c, dtype=jnp.int32)
    return jnp.broadcast_to(jnp.concatenate([rank * c + offsets, (2 * cp - 1 - rank) * c + offsets]), (b, 2 * c))


def _block_dropout(drop, q_index, k_index):
    """The :class:`BlockDropout` of a block from ``drop = (rate, key, sample_offset,
    seq_length)`` (None: no dropout), or None; the block kernel's keyword arguments."""
    if drop is None:
        return {}
    rate, key, offset, seq_length = drop
    return {"dropout": BlockDropout(key, rate, offset, seq_length, q_index, k_index)}


def _ring_dropout(dropout_rate, dropout_key, sample_offset, block, seq_length):
    if dropout_rate == 0.0:
        return None
    if block not in ("xla", "pallas"):
        raise ValueError(f"ring attention with attention dropout ({dropout_rate}) runs XLA's or the Pallas "
                         f"block kernel; got block={block!r}")
    return dropout_rate, dropout_key, sample_offset, seq_length


def _ring_forward(q, k, v, positions, axis_name, cp, segments=None, block="xla", drop=None):
    """(out float32, lse) of the forward ring (see :func:`ring_attention`); ``drop``: see
    :func:`_block_dropout`."""
    block_fwd, _ = block_kernels(block)
    # step 0: the local causal block
    out, lse = block_fwd(q, k, v, positions, positions, segments, segments,
                         **_block_dropout(drop, positions, positions))
    if cp == 1:
        return out, lse
    rank = jax.lax.axis_index(axis_name)
    c = q.shape[1] // 2
    q_seg2 = None if segments is None else segments[:, c:]
    all_segments = _gathered_segments(segments, axis_name, cp)
    ring = [(i, (i + 1) % cp) for i in range(cp)]
    kv = (k, v)
    for step in range(1, cp):
        kv = jax.lax.ppermute(kv, axis_name, ring)
        bk, bv = kv
        bseg = _block_segments(all_segments, (rank - step) % cp, 2 * c)
        bpos = None if drop is None else _slot_positions((rank - step) % cp, c, cp, q.shape[0])

        def earlier(bk=bk, bv=bv, bseg=bseg, bpos=bpos):  # both local chunks see the block's first chunk only
            return block_fwd(q, bk[:, :c], bv[:, :c], None, None, segments, None if bseg is None else bseg[:, :c],
                             **_block_dropout(drop, positions, None if bpos is None else bpos[:, :c]))

        def later(bk=bk, bv=bv, bseg=bseg, bpos=bpos):  # only the second local chunk sees it, whole
            o, l = block_fwd(q[:, c:], bk, bv, None, None, q_seg2, bseg,
                             **_block_dropout(drop, positions[:, c:], bpos))
            return (jnp.concatenate([jnp.zeros_like(o), o], axis=1),
                    jnp.concatenate([jnp.full_like(l, -jnp.inf), l], axis=1))

        # Segments only hide more keys: the load-balanced choice of chunks stays exact.
        o, l = jax.lax.cond((rank - step) % cp < rank, earlier, later)
        out, lse = merge_blocks(out, lse, o, l)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 7, 8))
def ring_attention(q: Array, k: Array, v: Array, positions: Array, axis_name: str, axis_size: int,
                   segments: Optional[Array] = None, block: str = "xla", dropout_rate: float = 0.0,
                   dropout_key: Optional[Array] = None, sample_offset=0) -> Array:
    """Causal attention of this rank's load-balanced sequence shard against the whole
    sequence, inside ``shard_map`` with ``axis_name`` (the ``context`` axis, size
    ``axis_size``) manual (``cp_comm_type="p2p"``).

    q ``[b, 2c, nq, d]``, k/v ``[b, 2c, nkv, d]``: this rank's slots of the
    :func:`load_balance_index` layout (chunk ``r`` then chunk ``2 cp - 1 - r``);
    ``positions`` int ``[b, 2c]``: their sequence positions (the load-balanced slots'
    original indices, not position ids: the local causal mask and the choice of the other
    blocks' chunks assume them); ``segments`` int ``[b, 2c]`` or None: document ids
    (attention only within a segment). Returns ``[b, 2c, nq, d]`` in q's dtype.

    Forward: the K/V blocks hop ``axis_size - 1`` times around the ring by ``ppermute``
    (rank ``r`` sends to ``r + 1``). Backward (custom VJP, Transformer Engine's scheme): only
    q, k, v, the output and its log-sum-exp are saved; K/V circulate again with their dK/dV
    accumulating beside them, each block's probabilities recomputed from the saved
    log-sum-exp, and one last hop brings dK/dV home: memory stays at one block, not the
    whole sequence's K/V that autodiff through the ring would keep. The segment ids of the
    blocks come from one all-gather of ``segments`` (:func:`_gathered_segments`).
    ``block``: the block kernel (:func:`block_kernels`), ``"xla"`` or ``"cpu"`` (float32).
    ``dropout_rate`` > 0 (XLA's blocks only; ValueError otherwise) drops each block's
    probabilities with the one-device hash mask (:class:`BlockDropout`; ``dropout_key`` the
    layer's dropout key, ``sample_offset`` the global sample of row 0), forward and in the
    backward's recomputation, which redraws the same mask.
    """
    drop = _ring_dropout(dropout_rate, dropout_key, sample_offset, block, q.shape[1] * axis_size)
    out, _ = _ring_forward(q, k, v, positions, axis_name, axis_size, segments, block, drop)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, positions, axis_name, axis_size, segments=None, block="xla", dropout_rate=0.0,
              dropout_key=None, sample_offset=0):
    drop = _ring_dropout(dropout_rate, dropout_key, sample_offset, block, q.shape[1] * axis_size)
    out, lse = _ring_forward(q, k, v, positions, axis_name, axis_size, segments, block, drop)
    out = out.astype(q.dtype)
    return out, (q, k, v, positions, segments, dropout_key, sample_offset, out, lse)


def _ring_bwd(axis_name, cp, block, dropout_rate, res, dout):
    q, k, v, positions, segments, dropout_key, sample_offset, out, lse = res
    drop = _ring_dropout(dropout_rate, dropout_key, sample_offset, block, q.shape[1] * cp)
    block_grads = block_kernels(block)[1]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    # The recomputed scores must not start before the backward: otherwise XLA's scheduler
    # hoists every layer's dout-independent recompute (q k^T and its exp) into the forward
    # pass and keeps two [a, 2c, 2c] float32 blocks per layer alive until that layer's backward
    # (measured: +0.52 GB per layer at 16 heads x 2048 local tokens, 32 MB expected). A zero
    # taken from dout ties q and k to it (XLA does not fold x * 0.0 for floats: NaN and inf);
    # jax.lax.optimization_barrier does not survive XLA:CPU's pipeline (tried).
    tie = (jnp.sum(delta) * 0.0).astype(q.dtype)
    q, k = q + tie, k + tie.astype(k.dtype)
    dq, dk, dv = block_grads(q, k, v, dout, lse, delta, positions, positions, segments, segments,
                             **_block_dropout(drop, positions, positions))
    if cp > 1:
        rank = jax.lax.axis_index(axis_name)
        c = q.shape[1] // 2
        q_seg2 = None if segments is None else segments[:, c:]
        all_segments = _gathered_segments(segments, axis_name, cp)
        ring = [(i, (i + 1) % cp) for i in range(cp)]
        # A block travels as one [K | V] message beside one [dK | dV] (the gradients gathered
        # for it so far). Packed, the backward's hops are not the forward's ppermutes of K and V,
        # which XLA would otherwise merge with them (CSE; an optimization barrier does not
        # survive XLA:CPU's pipeline), keeping every received block alive from the forward to
        # the backward: the whole sequence's K/V per layer instead of one block.
        d = k.shape[-1]
        kv, dkv = jnp.concatenate([k, v], axis=-1), jnp.concatenate([dk, dv], axis=-1)
        for step in range(1, cp):
            kv, dkv = jax.lax.ppermute((kv, dkv), axis_name, ring)
            bk, bv = kv[..., :d], kv[..., d:]
            bseg = _block_segments(all_segments, (rank - step) % cp, 2 * c)
            bpos = None if drop is None else _slot_positions((rank - step) % cp, c, cp, q.shape[0])

            def earlier(bk=bk, bv=bv, bseg=bseg, bpos=bpos):
                gq, gk, gv = block_grads(q, bk[:, :c], bv[:, :c], dout, lse, delta, None, None, segments,
                                         None if bseg is None else bseg[:, :c],
                                         **_block_dropout(drop, positions, None if bpos is None else bpos[:, :c]))
                pad = jnp.zeros_like(gk)
                return gq, jnp.concatenate([gk, pad], axis=1), jnp.concatenate([gv, pad], axis=1)

            def later(bk=bk, bv=bv, bseg=bseg, bpos=bpos):
                gq, gk, gv = block_grads(q[:, c:], bk, bv, dout[:, c:], lse[:, c:], delta[:, c:], None, None,
                                         q_seg2, bseg, **_block_dropout(drop, positions[:, c:], bpos))
                return jnp.concatenate([jnp.zeros_like(gq), gq], axis=1), gk, gv

            gq, gk, gv = jax.lax.cond((rank - step) % cp < rank, earlier, later)
            dq = dq + gq
            dkv = dkv + jnp.concatenate([gk, gv], axis=-1)
        dkv = jax.lax.ppermute(dkv, axis_name, ring)  # home: the block came from r + 1
        dk, dv = dkv[..., :d], dkv[..., d:]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)


def all_gather_attention(q: Array, k: Array, v: Array, positions: Array, axis_name: str, axis_size: int,
                         segments: Optional[Array] = None, block: str = "xla", dropout_rate: float = 0.0,
                         dropout_key: Optional[Array] = None, sample_offset=0) -> Array:
    """``cp_comm_type="all_gather"`` (Megatron-Core's ``all_gather`` CP: K/V all-gathered,
    queries local), inside ``shard_map`` with ``axis_name`` manual. Shapes as
    :func:`ring_attention`; the causal mask comes from the gathered sequence positions (and
    segment ids), so the load-balanced order needs nothing else. The backward
    reduce-scatters dK/dV (the all-gather's transpose). Every rank holds the whole
    sequence's K/V. ``block``: the block kernel (:func:`block_kernels`). Attention dropout
    (``dropout_rate`` > 0, XLA's block only) as :func:`ring_attention`'s, through autodiff."""
    k_positions, k_segments = positions, segments
    if axis_size > 1:
        k, v, k_positions = (jax.lax.all_gather(a, axis_name, axis=1, tiled=True) for a in (k, v, positions))
        k_segments = _gathered_segments(segments, axis_name, axis_size)
    drop = _ring_dropout(dropout_rate, dropout_key, sample_offset, block, q.shape[1] * axis_size)
    if drop is not None:
        return attention_block(q, k, v, positions, k_positions, segments, k_segments,
                               **_block_dropout(drop, positions, k_positions))[0].astype(q.dtype)
    return _attend(q, k, v, positions, k_positions, segments, k_segments, block)


def a2a_attention(q: Array, k: Array, v: Array, positions: Array, axis_name: str, axis_size: int,
                  segments: Optional[Array] = None, block: str = "xla", dropout_rate: float = 0.0,
                  dropout_key: Optional[Array] = None, sample_offset=0) -> Array:
    """``cp_comm_type="a2a"`` (DeepSpeed-Ulysses, Jacobs et al. 2023; Megatron-Core's
    ``a2a``): an all-to-all turns the sequence split into a head split (``[b, 2c, n, d]`` ->
    ``[b, s, n / cp, d]``), each rank attends its heads over the whole sequence (causal by
    sequence positions, within segments: both all-gathered), and a second all-to-all turns
    the result back. Shapes as :func:`ring_attention`; ``nq`` and ``nkv`` (per tensor rank)
    must be divisible by ``axis_size`` (ValueError otherwise). ``block``: the block kernel
    (:func:`block_kernels`). No attention dropout (ValueError for ``dropout_rate`` > 0: the
    head split would need each rank's global head numbers for the one-device masks).
    ``dropout_key`` and ``sample_offset`` are accepted for the common signature."""
    if dropout_rate:
        raise ValueError(f"cp_comm_type='a2a' has no attention dropout (dropout_rate={dropout_rate}); "
                         f"use cp_comm_type='p2p' or 'all_gather'")
    if axis_size == 1:
        return _attend(q, k, v, positions, positions, segments, segments, block)
    if q.shape[2] % axis_size or k.shape[2] % axis_size:
        raise ValueError(f"cp_comm_type='a2a' splits heads over {axis_size} context ranks: {q.shape[2]} query "
                         f"and {k.shape[2]} key/value heads per rank must be divisible by it")

    def to_heads(x):  # [b, 2c, n, d] -> [b, s, n / cp, d] (the sequence in rank order)
        return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)

    full = jax.lax.all_gather(positions, axis_name, axis=1, tiled=True)
    full_segments = _gathered_segments(segments, axis_name, axis_size)
    out = _attend(to_heads(q), to_heads(k), to_heads(v), full, full, full_segments, full_segments, block)
    out = jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)
    return out


# cp_comm_type -> (q, k, v, positions, axis_name, axis_size, segments=None, block="xla",
#                  dropout_rate=0.0, dropout_key=None, sample_offset=0) -> out
CP_ATTENTIONS = {"p2p": ring_attention, "all_gather": all_gather_attention, "a2a": a2a_attention}
