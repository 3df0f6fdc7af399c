"""Softmax attention in plain XLA ops: the reference (fallback and test oracle) of the
attention kernels (:mod:`jmegatron.kernels.cpu`, :mod:`jmegatron.kernels.pallas`).

One function, :func:`attention`, computes ``softmax(q k^T / sqrt(d)) v`` over a visibility
mask with optional dropout and returns the output and its log-sum-exp; the forms the
models and the context-parallel ring use are thin wrappers over it:

* :func:`xla_attention` -- the causal core attention of a whole sequence, optionally
  within documents (Megatron's dot_product_attention.py ``DotProductAttention``).
* :func:`cached_attention` -- decoding over a KV cache (Megatron-Core's static inference
  context: a cache slot is a position).
* :func:`attention_block` / :func:`block_grads` -- one block of ring attention, forward
  (unnormalised across blocks: output and log-sum-exp) and FlashAttention's backward
  (Dao et al. 2022, Algorithm 4) given the final log-sum-exp.

Layout: q ``[b, sq, nq, d]``, k/v ``[b, sk, nkv, d]`` with ``nq % nkv == 0`` (GQA: query
head ``i`` uses key/value group ``i // (nq // nkv)``, as Megatron and Hugging Face). Scores
and softmax in float32, scale ``1/sqrt(d)`` unless ``softmax_scale`` is given (megatron-core's
``softmax_scale``); ``softcap`` caps the scaled scores at ``c * tanh(s / c)`` before masking
(Gemma-2's ``attn_logit_softcapping``, transformers' ``eager_attention_forward``); a sliding
``window`` W keeps keys ``i - W < j <= i`` (W keys including the query's own: Hugging Face's
``sliding_window``, megatron-core's ``window_size = (W - 1, 0)``); ``sinks`` (float ``[nq]``) add one logit
per query head to every query's softmax denominator (megatron-core's ``softmax_type`` "learnable" /
"off-by-one", gpt-oss's attention sinks: transformers' ``eager_attention_forward`` of gpt_oss
concatenates the sink column to the scores, takes the softmax and drops it). Dropout masks are the counter hash of
:mod:`jmegatron.kernels.xla.dropout` over the probabilities' shape ``[b, nkv, g, sq, sk]``.
"""

from __future__ import annotations

import functools

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jmegatron.kernels.xla.dropout import attention_keep_mask, keep_mask

Array = jax.Array


def check_qkv(fn: str, q, k, v, *, float32: bool, hint: str = "") -> None:
    """Checks attention operands: q ``[b, sq, nq, d]``, k and v ``[b, sk, nkv, d]`` (the same
    shape), ``nq % nkv == 0`` (grouped-query attention), all float32 when ``float32`` else any
    floating dtype. Raises ValueError naming ``fn`` and the operand; ``hint`` ends the dtype
    or rank message (how to fix it)."""
    layout = "float32 [b, seq, heads, head_dim]" if float32 else "a float [b, seq, heads, head_dim] array"
    for name, x in (("q", q), ("k", k), ("v", v)):
        ok = x.dtype == jnp.float32 if float32 else jnp.issubdtype(x.dtype, jnp.floating)
        if x.ndim != 4 or not ok:
            raise ValueError(f"{fn}: {name} must be {layout}, got {x.dtype}{list(x.shape)}{hint}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    b, _, nq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[2] == 0 or nq % k.shape[2]:
        raise ValueError(f"{fn}: k/v {list(k.shape)} must be [b={b}, sk, nkv, d={d}] with nkv dividing q's {nq} "
                         f"heads (grouped-query attention)")


@jax.custom_jvp
def _softmax(scores: Array) -> Array:
    """Softmax over the last axis of float32 ``scores`` where -inf marks a masked key; a row
    with no finite score gives zeros. Its derivative is ``jax.nn.softmax``'s
    (``y * (dx - sum(y * dx))``), so a masked row has zero gradient."""
    peak = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)


@_softmax.defjvp
def _softmax_jvp(primals, tangents):
    y = _softmax(primals[0])
    dx = jnp.where(y > 0, tangents[0], 0.0)  # masked keys: no tangent (and no inf * 0)
    return y, y * (dx - jnp.sum(y * dx, axis=-1, keepdims=True))


def attention(q: Array, k: Array, v: Array, visible: Optional[Array] = None, *,
              keep: Optional[Callable[[tuple], Array]] = None, dropout_rate: float = 0.0,
              float32_values: bool = False, softmax_scale: Optional[float] = None,
              softcap: Optional[float] = None, sinks: Optional[Array] = None) -> tuple[Array, Array]:
    """``softmax(q k^T / sqrt(d)) v`` of queries over keys where ``visible``.

    ``softmax_scale`` replaces ``1 / sqrt(d)``; ``softcap`` (> 0) maps the scaled scores
    ``s`` to ``softcap * tanh(s / softcap)`` before the mask. ``sinks`` (float ``[nq]``, or None):
    one more logit per query head in each query's softmax, whose probability is dropped
    (``softmax([s, sink])[:-1]``), so a query's probabilities sum to less than 1.

    q/k ``[b, sq | sk, nq | nkv, d]``, v ``[b, sk, nkv, dv]`` (``dv`` may differ from ``d``:
    multi-latent attention). ``visible``: bool broadcastable to
    ``[b, sq, sk]`` (key j visible to query i), or None (all visible). ``keep``: attention
    dropout (Megatron's ``attention_dropout`` on the probabilities), a function of the
    probabilities' shape ``[b, nkv, g, sq, sk]`` returning the bool mask of kept elements,
    which are scaled by ``1 / (1 - dropout_rate)``; None: no dropout. The product with v
    runs in v's dtype (the probabilities cast to it), or in float32 with
    ``float32_values``.

    Returns (out ``[b, sq, nq, dv]`` in v's dtype or float32; lse float32 ``[b, sq, nq]``, the
    log-sum-exp of the visible scaled scores, the undropped one). A query that sees no key
    gets output 0 and lse -inf; with ``sinks`` the log-sum-exp includes the sink's term.
    """
    b, sq, nq, d = q.shape
    nkv = k.shape[2]
    qg = q.reshape(b, sq, nkv, nq // nkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(d)) if softmax_scale is None else jnp.float32(softmax_scale))
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if visible is not None:  # [b, sq, sk] against scores [b, nkv, g, sq, sk]
        scores = jnp.where(jnp.asarray(visible)[:, None, None], scores, -jnp.inf)
    if sinks is not None:  # the sink column [b, nkv, g, sq, 1], dropped after the softmax
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(1, nkv, nq // nkv, 1, 1),
                                scores.shape[:-1] + (1,))
        scores = jnp.concatenate([scores, sink], axis=-1)
    probs = _softmax(scores)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jnp.sum(jnp.exp(scores - safe), axis=-1, keepdims=True)
    if sinks is not None:
        probs = probs[..., :-1]
    if keep is not None:
        probs = jnp.where(keep(probs.shape), probs / (1.0 - dropout_rate), 0.0)
    values_dtype = jnp.float32 if float32_values else v.dtype
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(values_dtype), v.astype(values_dtype))
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + safe, -jnp.inf)  # [b, h, g, q, 1]
    lse = jnp.moveaxis(lse[..., 0], 3, 1).reshape(b, sq, nq)
    return out.reshape(b, sq, nq, v.shape[-1]), lse


def within_window(q_positions: Array, k_positions: Array, window: Any) -> Array:
    """bool, broadcast of ``q_positions[..., :, None]`` against ``k_positions[..., None, :]``:
    the key lies in the query's sliding window, ``q - k < window`` (``window``: int, may be
    traced; the causal ``k <= q`` is the caller's)."""
    return q_positions[..., :, None] - k_positions[..., None, :] < window


def causal_mask(s: int, segment_ids: Optional[Array] = None, window: Any = None) -> Array:
    """bool ``[s, s]`` (``[b, s, s]`` with ``segment_ids`` int ``[b, s]``): query i sees key j
    iff ``j <= i`` (and ``segment_ids[:, i] == segment_ids[:, j]``: Megatron's block-diagonal
    causal ``attention_mask``, megatron/core/datasets/gpt_dataset.py
    ``_get_ltor_masks_and_position_ids``; and ``i - j < window`` with a sliding ``window``,
    an int that may be traced)."""
    visible = jnp.tril(jnp.ones((s, s), dtype=jnp.bool_))
    if window is not None:
        positions = jnp.arange(s, dtype=jnp.int32)
        visible = visible & within_window(positions, positions, window)
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return visible


def _keep(key, rate: float, impl: str, sample_offset, shape):
    """The keep mask of ``shape`` (:func:`keep_mask`), argument order for ``functools.partial``."""
    return keep_mask(key, rate, shape, impl, sample_offset)


def xla_attention(q: Array, k: Array, v: Array, *, dropout_rate: float = 0.0,
                  dropout_rng: Optional[Array] = None, deterministic: bool = True,
                  dropout_impl: str = "hash", sample_offset=0, segment_ids: Optional[Array] = None,
                  softmax_scale: Optional[float] = None, softcap: Optional[float] = None,
                  window: Any = None, sinks: Optional[Array] = None) -> Array:
    """Causal attention of a whole sequence (:func:`attention` under :func:`causal_mask`).
    ``softmax_scale``, ``softcap``, the sliding ``window`` (int, may be traced; None: off) and
    the attention ``sinks`` (float ``[nq]``; None: off) as the module docstring says.

    q ``[b, s, nq, d]``, k/v ``[b, s, nkv, d]``; returns ``[b, s, nq, d]`` in q's dtype.
    Attention dropout (unless ``deterministic`` or ``dropout_rate == 0``) draws
    :func:`jmegatron.kernels.xla.dropout.keep_mask` by ``dropout_impl`` ("hash" |
    "threefry") over ``[b, nkv, nq // nkv, s, s]``, batch row ``i`` being global sample
    ``sample_offset + i``. ``segment_ids`` (int ``[b, s]``, optional; document masking,
    Megatron's ``reset_attention_mask``): query i sees key j only if ``j <= i`` and
    ``segment_ids[:, i] == segment_ids[:, j]``.
    """
    keep = None
    if not deterministic and dropout_rate > 0.0:
        keep = functools.partial(_keep, dropout_rng, dropout_rate, dropout_impl, sample_offset)
    visible = causal_mask(q.shape[1], segment_ids, window)
    visible = visible[None] if segment_ids is None else visible
    out, _ = attention(q, k, v, visible, keep=keep, dropout_rate=dropout_rate, softmax_scale=softmax_scale,
                       softcap=softcap, sinks=sinks)
    return out.astype(q.dtype)


def cached_attention(q: Array, k_cache: Array, v_cache: Array, q_positions: Array, *,
                     softmax_scale: Optional[float] = None, softcap: Optional[float] = None,
                     window: Any = None, sinks: Optional[Array] = None) -> Array:
    """Causal attention of ``q [b, s, nq, d]`` over a KV cache ``[b, L, nkv, d]``.

    Query ``(i, t)`` at position ``q_positions[i, t]`` (int ``[b, s]``) sees cache slots
    ``0 .. q_positions[i, t]`` (slot = position), so stale or padded slots beyond a row's
    length never contribute; with a sliding ``window`` only the last ``window`` of them.
    :func:`attention` with the cache cast to q's dtype (``softmax_scale``, ``softcap``,
    ``sinks`` as there); no dropout (inference). Returns ``[b, s, nq, d]`` in q's dtype.
    """
    length = k_cache.shape[1]
    slots = jnp.arange(length, dtype=jnp.int32)
    visible = slots[None, None, :] <= q_positions[:, :, None]  # [b, s, L]
    if window is not None:
        visible = visible & within_window(q_positions, slots[None], window)
    out, _ = attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), visible, softmax_scale=softmax_scale,
                       softcap=softcap, sinks=sinks)
    return out


def visible_mask(q_positions: Optional[Array], k_positions: Optional[Array], q_segments: Optional[Array],
                 k_segments: Optional[Array]) -> Optional[Array]:
    """bool ``[b, sq, sk]``: key j visible to query i (causal by position when positions are
    given, same segment when segments are given), or None when nothing is masked."""
    visible = None
    if q_positions is not None:
        visible = q_positions[:, :, None] >= k_positions[:, None, :]
    if q_segments is not None:
        same = q_segments[:, :, None] == k_segments[:, None, :]
        visible = same if visible is None else visible & same
    return visible


class BlockDropout(NamedTuple):
    """Attention dropout of one block (Megatron's ``attention_dropout`` on the probabilities):
    the ``"hash"`` mask of the whole sequence's probabilities at this block's rows and
    columns (:func:`jmegatron.kernels.xla.dropout.attention_keep_mask`), so a context-parallel
    run drops exactly the one-device run's elements. ``q_index`` / ``k_index``: int
    ``[b, sq]`` / ``[b, sk]``, the block's queries' and keys' sequence positions."""

    key: Array
    rate: float
    sample_offset: Any
    seq_length: int
    q_index: Array
    k_index: Array

    def keep(self, shape) -> Array:
        """bool ``shape`` ``[b, nkv, g, sq, sk]``: the elements kept."""
        return attention_keep_mask(self.key, self.rate, shape, self.q_index, self.k_index, self.seq_length,
                                   self.sample_offset)


def attention_block(q: Array, k: Array, v: Array, q_positions: Optional[Array] = None,
                    k_positions: Optional[Array] = None, q_segments: Optional[Array] = None,
                    k_segments: Optional[Array] = None, dropout: Optional[BlockDropout] = None
                    ) -> tuple[Array, Array]:
    """Softmax attention of a query block over a key/value block, unnormalised across blocks.

    q ``[b, sq, nq, d]``, k/v ``[b, sk, nkv, d]``; ``q_positions`` int ``[b, sq]`` and
    ``k_positions`` int ``[b, sk]`` (sequence positions, not position ids): when given, query
    at position p sees keys at positions <= p (causal); None: no causal mask. ``q_segments``
    int ``[b, sq]`` and ``k_segments`` int ``[b, sk]`` (document masking): when given, a query
    sees only keys of its own segment as well. Returns :func:`attention`'s (out float32
    ``[b, sq, nq, d]``, normalised within the block; lse float32 ``[b, sq, nq]``, -inf for a
    query that sees no key here, whose output is 0). ``dropout``: attention dropout of the
    block's probabilities (:class:`BlockDropout`; the log-sum-exp is the undropped one, so
    blocks merge as without dropout).
    """
    visible = visible_mask(q_positions, k_positions, q_segments, k_segments)
    return attention(q, k, v, visible, keep=None if dropout is None else dropout.keep,
                     dropout_rate=0.0 if dropout is None else dropout.rate, float32_values=True)


def block_grads(q: Array, k: Array, v: Array, dout: Array, lse: Array, delta: Array,
                 q_positions: Optional[Array] = None, k_positions: Optional[Array] = None,
                 q_segments: Optional[Array] = None, k_segments: Optional[Array] = None,
                 dropout: Optional[BlockDropout] = None) -> tuple[Array, Array, Array]:
    """FlashAttention's backward for one block (Dao et al. 2022, Algorithm 4) given the
    *final* log-sum-exp ``lse [b, sq, nq]`` and ``delta = sum(dout * out, -1) [b, sq, nq]``:
    (dq ``[b, sq, nq, d]``, dk ``[b, sk, nkv, d]``, dv ``[b, sk, nkv, d]``), float32, this
    block's contributions. Shapes and masks as :func:`attention_block`; the XLA reference of
    :func:`jmegatron.kernels.cpu.ops.cpu_block_grads` and
    :func:`jmegatron.kernels.pallas.flash_attention.pallas_block_grads`."""
    b, sq, nq, d = q.shape
    nkv = k.shape[2]
    g = nq // nkv
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    qg = q.astype(jnp.float32).reshape(b, sq, nkv, g, d)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k32) * scale

    def per_head(x):  # [b, sq, nq] -> [b, nkv, g, sq, 1]
        return jnp.moveaxis(x.reshape(b, sq, nkv, g), 1, 3)[..., None]

    finite = jnp.isfinite(lse)
    p = jnp.exp(scores - per_head(jnp.where(finite, lse, 0.0)))
    keep = per_head(finite)
    visible = visible_mask(q_positions, k_positions, q_segments, k_segments)
    if visible is not None:
        keep = keep & visible[:, None, None]
    p = jnp.where(keep, p, 0.0)
    dout_g = dout.astype(jnp.float32).reshape(b, sq, nkv, g, d)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dout_g, v32)
    if dropout is None:
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dout_g)
    else:  # the kept probabilities went into out; dP reaches P through the same mask
        kept = dropout.keep(p.shape)
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", jnp.where(kept, p / (1.0 - dropout.rate), 0.0), dout_g)
        dp = jnp.where(kept, dp / (1.0 - dropout.rate), 0.0)
    ds = p * (dp - per_head(delta)) * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k32).reshape(b, sq, nq, d)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg)
    return dq, dk, dv
