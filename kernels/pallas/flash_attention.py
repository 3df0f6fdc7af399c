"""FlashAttention-2 in Pallas: causal / GQA / document-masked attention, its block forms for
context parallelism, and the hash attention dropout, forward and backward.

Follows Dao 2023, "FlashAttention-2" (forward: one program per (batch, query head, query
block) looping over key blocks with the online softmax; backward: the probabilities
recomputed from the saved log-sum-exp, one kernel for dQ looping over key blocks and one for
dK/dV looping over query blocks and the query heads of a group), in the structure of JAX's
``jax/experimental/pallas/ops/gpu/attention.py`` (written here anew, with GQA, position
masks, log-sum-exp out and the dropout below).

Layout as the other cores (:func:`jmegatron.kernels.xla.attention.xla_attention`): q ``[b, s, nq,
d]``, k/v ``[b, s, nkv, d]``, query head ``i`` using key/value group ``i // (nq // nkv)``.
Scores ``q k^T / sqrt(d)`` and the softmax in float32.

Attention dropout draws :func:`jmegatron.kernels.xla.dropout.attention_keep_mask`'s hash inside
the kernel from (key, global sample, query head, global query row, global key column), so a
kernel's mask is element for element the XLA path's (``dropout_impl="hash"`` only).

On a GPU the kernels compile through Triton; elsewhere (``interpret=None`` and
``jax.default_backend() != "gpu"``) they run in Pallas interpret mode, the same kernel code
evaluated by XLA (slow: for tests). Sequence lengths must be multiples of the block sizes
(ValueError otherwise); a block size larger than the sequence is cut to it. On a GPU block
sizes should be powers of two >= 16 (Triton's tiles); a head dimension that is not a power
of two (96, 192) runs zero-padded to the next one, its scores still scaled by
``1 / sqrt(head_dim)``. The kernels pass Triton's compiler parameters
(:func:`jmegatron.kernels.pallas.common.triton_params`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jmegatron.kernels.pallas.common import default_interpret, fori_loop, out_struct, same_vma, triton_params
from jmegatron.kernels.xla.attention import check_qkv
from jmegatron.kernels.xla.dropout import check_hash_extent, key_words, mask_hash

Array = jax.Array

# Default tiles (GPU): FlashAttention-2's B_r x B_c for 16-bit inputs; float32 halves both
# (128 x 128 float32 tiles at head_dim 64 ask an H200 for 322 KiB of shared memory, over its 227)
BLOCK_Q = 128
BLOCK_K = 128
BLOCK_F32 = 64
MIN_BLOCK = 16  # Triton's dot needs tiles of at least 16 rows

_U = jnp.uint32


class _Config(NamedTuple):
    """Static kernel parameters (hashable: a ``custom_vjp`` nondiff argument)."""
    causal: str  # "none" | "index" (row i sees keys <= i) | "positions" (q_pos >= k_pos)
    segments: bool
    # None, or (threshold uint32, keep_scale = 1 - rate, seq_length S, indices "index" | "refs")
    dropout: Optional[tuple]
    block_q: int
    block_k: int
    interpret: bool
    scale: float = 0.0  # the score scale, 1 / sqrt(head dim before padding); 0: 1 / sqrt(the operands')


def _keep(seed_ref, batch, head, q_index, k_index, dropout) -> Array:
    """bool ``[bq, bk]``: attention_keep_mask's hash at (sample, head, q_index, k_index): the
    words sample, ``row = global head * S + q_index`` and ``col = k_index``
    (:func:`jmegatron.kernels.xla.dropout.mask_hash`; heads x S <= 2^32 is checked by
    :func:`_dropout_cfg`)."""
    threshold, _, seq_length, _ = dropout
    k0, k1, offset, head_offset = seed_ref[0], seed_ref[1], seed_ref[2], seed_ref[3]
    s = _U(seq_length % 2**32)
    row = (head.astype(_U) + head_offset) * s + q_index.astype(_U)[:, None]
    return mask_hash(k0, k1, offset + batch.astype(_U), row, k_index.astype(_U)[None, :]) >= _U(threshold)


def _iota(start, n) -> Array:
    return start + jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _visible(cfg: _Config, q_rows, k_rows, qpos, kpos, qseg, kseg):
    """bool ``[bq, bk]`` or None (every pair visible)."""
    visible = None
    if cfg.causal == "index":
        visible = q_rows[:, None] >= k_rows[None, :]
    elif cfg.causal == "positions":
        visible = qpos[:, None] >= kpos[None, :]
    if cfg.segments:
        same = qseg[:, None] == kseg[None, :]
        visible = same if visible is None else visible & same
    return visible


def _dot_t(a, b):
    """``a @ b^T`` with a float32 accumulator."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    """``a^T @ b`` with a float32 accumulator."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, qidx_ref, kidx_ref, seed_ref,
                o_ref, lse_ref, *, cfg: _Config, scale: float, seq_k: int):
    batch, head, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    q = q_ref[...]
    q_rows = _iota(qb * bq, bq)
    qpos = None if qpos_ref is None else qpos_ref[...]
    qseg = None if qseg_ref is None else qseg_ref[...]
    qidx = None if qidx_ref is None else qidx_ref[...]
    d = q.shape[-1]

    def body(j, carry):
        acc, m, l = carry
        ks = pl.ds(j * bk, bk)
        k_rows = _iota(j * bk, bk)
        s = _dot_t(q, k_ref[ks, :]) * scale
        visible = _visible(cfg, q_rows, k_rows, qpos, None if kpos_ref is None else kpos_ref[ks],
                           qseg, None if kseg_ref is None else kseg_ref[ks])
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that sees nothing yet
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1)
        if cfg.dropout is not None:  # the softmax sum is the undropped one (as xla_attention)
            by_index = cfg.dropout[3] == "index"
            keep = _keep(seed_ref, batch, head, q_rows if by_index else qidx,
                         k_rows if by_index else kidx_ref[ks], cfg.dropout)
            p = jnp.where(keep, p / jnp.float32(cfg.dropout[1]), 0.0)
        v = v_ref[ks, :]
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    n_k = seq_k // bk
    upper = jnp.minimum(((qb + 1) * bq + bk - 1) // bk, n_k) if cfg.causal == "index" else n_k
    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = fori_loop(0, upper, body, init)
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(l_safe), -jnp.inf)


def _probs(cfg, q, k, lse, q_rows, k_rows, qpos, kpos, qseg, kseg, scale):
    """float32 ``[bq, bk]``: the final probabilities recomputed from the saved log-sum-exp
    (0 where masked or where the query sees no key at all, lse = -inf)."""
    s = _dot_t(q, k) * scale
    live = lse != -jnp.inf
    p = jnp.exp(s - jnp.where(live, lse, 0.0)[:, None])
    keep = jnp.broadcast_to(live[:, None], p.shape)
    visible = _visible(cfg, q_rows, k_rows, qpos, kpos, qseg, kseg)
    if visible is not None:
        keep = keep & visible
    return jnp.where(keep, p, 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
               qidx_ref, kidx_ref, seed_ref, dq_ref, *, cfg: _Config, scale: float, seq_k: int):
    batch, head, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_rows = _iota(qb * bq, bq)
    qpos = None if qpos_ref is None else qpos_ref[...]
    qseg = None if qseg_ref is None else qseg_ref[...]
    qidx = None if qidx_ref is None else qidx_ref[...]

    def body(j, dq):
        ks = pl.ds(j * bk, bk)
        k_rows = _iota(j * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        p = _probs(cfg, q, k, lse, q_rows, k_rows, qpos, None if kpos_ref is None else kpos_ref[ks], qseg,
                   None if kseg_ref is None else kseg_ref[ks], scale)
        dp = _dot_t(do, v)
        if cfg.dropout is not None:  # dP reaches P through the forward's mask
            by_index = cfg.dropout[3] == "index"
            keep = _keep(seed_ref, batch, head, q_rows if by_index else qidx,
                         k_rows if by_index else kidx_ref[ks], cfg.dropout)
            dp = jnp.where(keep, dp / jnp.float32(cfg.dropout[1]), 0.0)
        ds = p * (dp - delta[:, None]) * scale
        return dq + _dot(ds.astype(k.dtype), k)

    n_k = seq_k // bk
    upper = jnp.minimum(((qb + 1) * bq + bk - 1) // bk, n_k) if cfg.causal == "index" else n_k
    dq_ref[...] = fori_loop(0, upper, body, jnp.zeros(q.shape, jnp.float32)).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
                qidx_ref, kidx_ref, seed_ref, dk_ref, dv_ref, *, cfg: _Config, scale: float, seq_q: int,
                group: int):
    batch, kv_head, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    k, v = k_ref[...], v_ref[...]
    k_rows = _iota(kb * bk, bk)
    kpos = None if kpos_ref is None else kpos_ref[...]
    kseg = None if kseg_ref is None else kseg_ref[...]
    kidx = None if kidx_ref is None else kidx_ref[...]
    n_q = seq_q // bq
    lower = (kb * bk) // bq if cfg.causal == "index" else 0
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for g in range(group):  # the query heads of this key/value group
        head = kv_head * group + g

        def body(i, carry, g=g, head=head):
            dk, dv = carry
            qs = pl.ds(i * bq, bq)
            q_rows = _iota(i * bq, bq)
            q, do = q_ref[qs, g, :], do_ref[qs, g, :]
            lse, delta = lse_ref[g, qs], delta_ref[g, qs]
            p = _probs(cfg, q, k, lse, q_rows, k_rows, None if qpos_ref is None else qpos_ref[qs], kpos,
                       None if qseg_ref is None else qseg_ref[qs], kseg, scale)
            dp = _dot_t(do, v)
            pd = p
            if cfg.dropout is not None:
                by_index = cfg.dropout[3] == "index"
                keep = _keep(seed_ref, batch, head, q_rows if by_index else qidx_ref[qs],
                             k_rows if by_index else kidx, cfg.dropout)
                pd = jnp.where(keep, p / jnp.float32(cfg.dropout[1]), 0.0)
                dp = jnp.where(keep, dp / jnp.float32(cfg.dropout[1]), 0.0)
            dv = dv + _dot_tn(pd.astype(do.dtype), do)
            ds = p * (dp - delta[:, None]) * scale
            dk = dk + _dot_tn(ds.astype(q.dtype), q)
            return dk, dv

        dk, dv = fori_loop(lower, n_q, body, (dk, dv))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls


def _fwd_call(cfg: _Config, q, k, v, qpos, kpos, qseg, kseg, qidx, kidx, seed, out_dtype):
    """(out ``[b, sq, nq, d]`` out_dtype, lse float32 ``[b, nq, sq]``)."""
    b, sq, nq, d = q.shape
    sk, nkv = k.shape[1], k.shape[2]
    group = nq // nkv
    bq = cfg.block_q
    q_blk = lambda bi, h, i: (bi, i)  # noqa: E731
    k_all = lambda bi, h, i: (bi, 0)  # noqa: E731
    ids = lambda x, shape, im: None if x is None else pl.BlockSpec(shape, im)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0)),
        pl.BlockSpec((None, sk, None, d), lambda bi, h, i: (bi, 0, h // group, 0)),
        pl.BlockSpec((None, sk, None, d), lambda bi, h, i: (bi, 0, h // group, 0)),
        ids(qpos, (None, bq), q_blk), ids(kpos, (None, sk), k_all),
        ids(qseg, (None, bq), q_blk), ids(kseg, (None, sk), k_all),
        ids(qidx, (None, bq), q_blk), ids(kidx, (None, sk), k_all),
        ids(seed, (4,), lambda bi, h, i: (0,)),
    ]
    out_specs = [pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0)),
                 pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i))]
    q, k, v, qpos, kpos, qseg, kseg, qidx, kidx, seed = same_vma(q, k, v, qpos, kpos, qseg, kseg, qidx, kidx, seed)
    kernel = functools.partial(_fwd_kernel, cfg=cfg, scale=cfg.scale or _scale(d), seq_k=sk)
    return pl.pallas_call(
        kernel, grid=(b, nq, sq // bq), in_specs=in_specs, out_specs=out_specs,
        out_shape=[out_struct(q.shape, out_dtype, q), out_struct((b, nq, sq), jnp.float32, q)],
        interpret=cfg.interpret, compiler_params=triton_params(d), name="jmegatron_flash_fwd",
    )(q, k, v, qpos, kpos, qseg, kseg, qidx, kidx, seed)


def _bwd_call(cfg: _Config, q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, qidx, kidx, seed):
    """(dq, dk, dv) float32; lse and delta float32 ``[b, nq, sq]``."""
    b, sq, nq, d = q.shape
    sk, nkv = k.shape[1], k.shape[2]
    group = nq // nkv
    bq, bk = cfg.block_q, cfg.block_k
    scale = cfg.scale or _scale(d)
    ids = lambda x, shape, im: None if x is None else pl.BlockSpec(shape, im)  # noqa: E731
    operands = same_vma(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, qidx, kidx, seed)
    q = operands[0]

    # dQ: grid over (batch, query head, query block), looping over key blocks
    q_blk = lambda bi, h, i: (bi, i)  # noqa: E731
    k_all = lambda bi, h, i: (bi, 0)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, scale=scale, seq_k=sk), grid=(b, nq, sq // bq),
        in_specs=[
            pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0)),
            pl.BlockSpec((None, sk, None, d), lambda bi, h, i: (bi, 0, h // group, 0)),
            pl.BlockSpec((None, sk, None, d), lambda bi, h, i: (bi, 0, h // group, 0)),
            pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i)),
            pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i)),
            ids(qpos, (None, bq), q_blk), ids(kpos, (None, sk), k_all),
            ids(qseg, (None, bq), q_blk), ids(kseg, (None, sk), k_all),
            ids(qidx, (None, bq), q_blk), ids(kidx, (None, sk), k_all),
            ids(seed, (4,), lambda bi, h, i: (0,)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0)),
        out_shape=out_struct(q.shape, jnp.float32, q),
        interpret=cfg.interpret, compiler_params=triton_params(d), name="jmegatron_flash_bwd_dq",
    )(*operands)

    # dK, dV: grid over (batch, key/value head, key block), looping over the group's query
    # heads and the query blocks
    q_all = lambda bi, h, j: (bi, 0)  # noqa: E731
    k_blk = lambda bi, h, j: (bi, j)  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, scale=scale, seq_q=sq, group=group), grid=(b, nkv, sk // bk),
        in_specs=[
            pl.BlockSpec((None, sq, group, d), lambda bi, h, j: (bi, 0, h, 0)),
            pl.BlockSpec((None, bk, None, d), lambda bi, h, j: (bi, j, h, 0)),
            pl.BlockSpec((None, bk, None, d), lambda bi, h, j: (bi, j, h, 0)),
            pl.BlockSpec((None, sq, group, d), lambda bi, h, j: (bi, 0, h, 0)),
            pl.BlockSpec((None, group, sq), lambda bi, h, j: (bi, h, 0)),
            pl.BlockSpec((None, group, sq), lambda bi, h, j: (bi, h, 0)),
            ids(qpos, (None, sq), q_all), ids(kpos, (None, bk), k_blk),
            ids(qseg, (None, sq), q_all), ids(kseg, (None, bk), k_blk),
            ids(qidx, (None, sq), q_all), ids(kidx, (None, bk), k_blk),
            ids(seed, (4,), lambda bi, h, j: (0,)),
        ],
        out_specs=[pl.BlockSpec((None, bk, None, d), lambda bi, h, j: (bi, j, h, 0))] * 2,
        out_shape=[out_struct(k.shape, jnp.float32, q)] * 2,
        interpret=cfg.interpret, compiler_params=triton_params(d), name="jmegatron_flash_bwd_dkv",
    )(*operands)
    return dq, dk, dv


# ----------------------------------------------------------------------------- checks


def _scale(head_dim: int) -> float:
    """``1 / sqrt(head_dim)`` rounded to float32, the scores' scale."""
    return float(np.float32(1.0) / np.sqrt(np.float32(head_dim)))


def _pad_head_dim(*xs: Optional[Array]) -> tuple:
    """``xs`` (``[..., d]`` arrays or None) zero-padded to the next power of two of ``d``:
    Triton's tiles are powers of two (head dims 96, 192, ... would not lower). Zero columns
    add nothing to ``q k^T`` and give zero output columns, which the callers cut off."""
    d = next(x for x in xs if x is not None).shape[-1]
    width = 1 << max(d - 1, 0).bit_length()
    if width == d:
        return xs
    return tuple(None if x is None else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - d)]) for x in xs)


def _block_size(name: str, block: Optional[int], default: int, seq: int, dtype=None) -> int:
    if block is None and dtype is not None and jnp.dtype(dtype).itemsize >= 4:
        default = min(default, BLOCK_F32)
    block = min(default if block is None else int(block), seq)
    if block < 1 or seq % block:
        raise ValueError(f"pallas flash attention: sequence length {seq} must be a multiple of {name}={block} "
                         f"(choose {name} dividing it, or pad the sequence)")
    return block


def _default_tiles(s: int, dtype) -> tuple[int, int]:
    """(tile, padded length) for a length-``s`` sequence with the default tiles: the tile is
    the default (:data:`BLOCK_Q`, or :data:`BLOCK_F32` for float32) cut to the next power of
    two of ``s`` (at least :data:`MIN_BLOCK`); the length is padded to a multiple of it, so
    Triton's power-of-two tiles cover any ``s``."""
    default = min(BLOCK_Q, BLOCK_F32) if jnp.dtype(dtype).itemsize >= 4 else BLOCK_Q
    block = min(default, max(MIN_BLOCK, 1 << max(s - 1, 0).bit_length()))
    return block, -(-s // block) * block


def _ids(name: str, ids, shape) -> Optional[Array]:
    if ids is None:
        return None
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape != tuple(shape):
        raise ValueError(f"{name} must be integer {list(shape)}, got {ids.dtype}{list(ids.shape)}")
    return ids.astype(jnp.int32)


def _seed(key, sample_offset) -> Array:
    """uint32 ``[4]``: the hash's key words (k0, k1), the global sample of batch row 0, and
    the global number of query head 0 (0; :func:`_with_head_offset` under head parallelism)."""
    k0, k1 = key_words(key)
    return jnp.stack([k0, k1, jnp.asarray(sample_offset).astype(_U), _U(0)]).astype(_U)


def _dropout_cfg(rate: float, seq_length: int, indices: str, heads: int) -> Optional[tuple]:
    """The dropout part of :class:`_Config`; ValueError for a rate outside [0, 1) or when
    ``heads`` (global query heads) x ``seq_length`` exceeds 2^32 (the hash's row word)."""
    if rate == 0.0:
        return None
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    check_hash_extent("pallas attention dropout", int(heads) * int(seq_length), int(seq_length),
                      f"heads {heads} x seq_length {seq_length}")
    threshold = min(int(math.floor(rate * 2.0**32)), 2**32 - 1)
    return threshold, 1.0 - rate, int(seq_length), indices


# ----------------------------------------------------------------------------- the core


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, segments, seed, cfg: _Config):
    out, _ = _fwd_call(cfg, q, k, v, None, None, segments, segments, None, None, seed, q.dtype)
    return out


def _flash_fwd(q, k, v, segments, seed, cfg):
    out, lse = _fwd_call(cfg, q, k, v, None, None, segments, segments, None, None, seed, q.dtype)
    return out, (q, k, v, segments, seed, out, lse)


def _flash_bwd(cfg, res, dout):
    q, k, v, segments, seed, out, lse = res
    delta = jnp.einsum("bsnd,bsnd->bns", dout.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = _bwd_call(cfg, q, k, v, dout.astype(q.dtype), lse, delta, None, None, segments, segments,
                           None, None, seed)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _with_head_offset(seed: Optional[Array], axis: str, local_heads: int) -> Optional[Array]:
    """Inside shard_map over ``axis`` (heads split): the seed with this rank's first global
    query head, so the dropout hash indexes global heads as on one device."""
    if seed is None:
        return None
    return seed.at[3].set(jax.lax.axis_index(axis).astype(_U) * _U(local_heads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash_heads(q, k, v, segments, seed, cfg, axis):
    """:func:`_flash` with the heads split over the automatic (GSPMD) mesh axis ``axis``: the
    kernels run per rank on its heads inside shard_maps (a Triton custom call would otherwise
    have its operands replicated: every rank computing every head), the custom VJP outside
    them (a nested shard_map's autodiff residuals fail Shardy's verifier inside the train
    step's shard_map, JAX 0.10)."""
    return _flash_heads_fwd(q, k, v, segments, seed, cfg, axis)[0]


def _flash_heads_fwd(q, k, v, segments, seed, cfg, axis):
    from jax.sharding import PartitionSpec as P
    heads, rows = P(None, None, axis, None), P(None, axis, None)

    def body(q, k, v, segments, seed):
        return _fwd_call(cfg, q, k, v, None, None, segments, segments, None, None,
                         _with_head_offset(seed, axis, q.shape[2]), q.dtype)

    out, lse = jax.shard_map(body, in_specs=(heads, heads, heads, P(), P()), out_specs=(heads, rows),
                             axis_names={axis})(q, k, v, segments, seed)
    return out, (q, k, v, segments, seed, out, lse)


def _flash_heads_bwd(cfg, axis, res, dout):
    from jax.sharding import PartitionSpec as P
    q, k, v, segments, seed, out, lse = res
    heads, rows = P(None, None, axis, None), P(None, axis, None)
    delta = jnp.einsum("bsnd,bsnd->bns", dout.astype(jnp.float32), out.astype(jnp.float32))

    def body(q, k, v, dout, lse, delta, segments, seed):
        return _bwd_call(cfg, q, k, v, dout, lse, delta, None, None, segments, segments, None, None,
                         _with_head_offset(seed, axis, q.shape[2]))

    dq, dk, dv = jax.shard_map(body, in_specs=(heads,) * 4 + (rows, rows, P(), P()), out_specs=(heads,) * 3,
                               axis_names={axis})(q, k, v, dout.astype(q.dtype), lse, delta, segments, seed)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_flash_heads.defvjp(_flash_heads_fwd, _flash_heads_bwd)


def _head_split(axis: Optional[str], nkv: int) -> tuple[int, bool]:
    """(size, manual) of mesh axis ``axis`` where the heads are split over it (size > 1),
    else (1, False). ValueError when ``nkv`` does not divide over it."""
    if axis is None:
        return 1, False
    mesh = jax.sharding.get_abstract_mesh()
    size = 1 if mesh.empty else dict(mesh.shape).get(axis, 1)
    if size > 1 and nkv % size:
        raise ValueError(f"pallas_attention: {nkv} key/value heads must divide over {axis}={size} "
                         f"(num_query_groups divisible by tensor_model_parallel_size)")
    return size, size > 1 and axis in mesh.manual_axes


def pallas_attention(q: Array, k: Array, v: Array, *, dropout_rate: float = 0.0,
                     dropout_rng: Optional[Array] = None, deterministic: bool = True,
                     dropout_impl: str = "hash", sample_offset=0, segment_ids: Optional[Array] = None,
                     block_q: Optional[int] = None, block_k: Optional[int] = None,
                     interpret: Optional[bool] = None, tensor_axis: Optional[str] = "tensor") -> Array:
    """Causal ``softmax(q k^T / sqrt(d)) v`` by the Pallas FlashAttention-2 kernels, the
    signature and results of :func:`jmegatron.kernels.xla.attention.xla_attention`.

    q ``[b, s, nq, d]``, k/v ``[b, s, nkv, d]`` (float32 / bfloat16 / float16, ``nq % nkv ==
    0``) -> ``[b, s, nq, d]`` in q's dtype. ``segment_ids`` (integer ``[b, s]``, optional):
    document masking, query i sees key j iff ``j <= i`` and the ids are equal. Attention
    dropout (``dropout_rate`` > 0 and not ``deterministic``): the ``"hash"`` mask of
    :func:`jmegatron.kernels.xla.dropout.keep_mask` over ``[b, nkv, nq // nkv, s, s]``, drawn in
    the kernel, batch row ``i`` the global sample ``sample_offset + i``. Saves q, k, v, the
    output and the log-sum-exp ``[b, nq, s]``; the backward recomputes the probabilities.
    ``block_q`` / ``block_k``: tiles, which must divide ``s``; both None (the default):
    :data:`BLOCK_Q` (:data:`BLOCK_F32` for float32 inputs) cut to the next power of two of
    ``s``, the sequence zero-padded to a multiple of it (padded keys come after every real
    query, so the causal mask hides them; padded query rows are cut off); ``interpret``: None = :func:`default_interpret`. ``tensor_axis``: where this mesh
    axis has size > 1 the heads are split over it (Megatron's tensor-parallel attention): an
    automatic (GSPMD) axis gets shard_maps around the kernels, a manual one means q/k/v
    already hold this rank's heads; either way the dropout hash sees global head numbers.

    Raises ValueError for ``s`` not a multiple of a given block, mis-shaped inputs or segment ids,
    a rate outside [0, 1), or dropout with ``dropout_impl="threefry"`` (its masks cannot be
    drawn inside a kernel: use ``"hash"`` or ``attention_impl="xla"``).
    """
    check_qkv("pallas_attention", q, k, v, float32=False)
    b, s = q.shape[:2]
    if k.shape[1] != s:
        raise ValueError(f"pallas_attention: k/v must have q's sequence length {s}, got {k.shape[1]} "
                         f"(pallas_attention_block takes blocks of different lengths)")
    rate = 0.0 if deterministic else float(dropout_rate)
    if rate > 0.0 and dropout_impl != "hash":
        raise ValueError(f"attention_impl='pallas' draws the dropout mask inside the kernel from the 'hash' "
                         f"generator; dropout_impl={dropout_impl!r} is not supported there: set "
                         f"config.dropout_impl='hash' or config.attention_impl='xla'")
    if rate > 0.0 and dropout_rng is None:
        raise ValueError("pallas_attention: dropout_rate > 0 in training needs dropout_rng")
    size, manual = _head_split(tensor_axis, k.shape[2])
    heads = q.shape[2] * (size if manual else 1)  # global query heads (the hash's row word)
    d = q.shape[-1]
    if block_q is None and block_k is None:
        bq, padded = _default_tiles(s, q.dtype)
        bk = bq
    else:
        bq = _block_size("block_q", block_q, BLOCK_Q, s, q.dtype)
        bk, padded = _block_size("block_k", block_k, BLOCK_K, s, q.dtype), s
    cfg = _Config(causal="index", segments=segment_ids is not None, dropout=_dropout_cfg(rate, s, "index", heads),
                  block_q=bq, block_k=bk, interpret=default_interpret() if interpret is None else bool(interpret),
                  scale=_scale(d))
    segments = _ids("pallas_attention: segment_ids", segment_ids, (b, s))
    seed = _seed(dropout_rng, sample_offset) if rate > 0.0 else None
    q, k, v = _pad_head_dim(q, k, v)
    if padded != s:  # the padded keys come after every real query: causality hides them
        q, k, v = (jnp.pad(x, ((0, 0), (0, padded - s), (0, 0), (0, 0))) for x in (q, k, v))
        segments = None if segments is None else jnp.pad(segments, ((0, 0), (0, padded - s)), constant_values=-1)
    if size > 1 and not manual:
        out = _flash_heads(q, k, v, segments, seed, cfg, tensor_axis)
    else:
        if manual:  # q/k/v are this rank's heads already
            seed = _with_head_offset(seed, tensor_axis, q.shape[2])
        out = _flash(q, k, v, segments, seed, cfg)
    return out[:, :s, :, :d]


# ----------------------------------------------------------------------------- block forms


def _block_setup(fn, q, k, v, q_positions, k_positions, q_segments, k_segments, dropout, block_q, block_k,
                 interpret):
    """(cfg, ids tuple) for the block kernels; ValueError for half a pair or bad shapes."""
    check_qkv(fn, q, k, v, float32=False)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    ids = []
    for kind, qi, ki in (("positions", q_positions, k_positions), ("segments", q_segments, k_segments)):
        if (qi is None) != (ki is None):
            raise ValueError(f"{fn}: give both q_{kind} and k_{kind} or neither")
        ids += [_ids(f"{fn}: q_{kind}", qi, (b, sq)), _ids(f"{fn}: k_{kind}", ki, (b, sk))]
    seed, drop = None, None
    if dropout is not None and dropout.rate > 0.0:
        drop = _dropout_cfg(float(dropout.rate), dropout.seq_length, "refs", q.shape[2])
        ids += [_ids(f"{fn}: dropout.q_index", dropout.q_index, (b, sq)),
                _ids(f"{fn}: dropout.k_index", dropout.k_index, (b, sk))]
        seed = _seed(dropout.key, dropout.sample_offset)
    else:
        ids += [None, None]
    cfg = _Config(causal="positions" if q_positions is not None else "none", segments=q_segments is not None,
                  dropout=drop, block_q=_block_size("block_q", block_q, BLOCK_Q, sq, q.dtype),
                  block_k=_block_size("block_k", block_k, BLOCK_K, sk, q.dtype),
                  interpret=default_interpret() if interpret is None else bool(interpret), scale=_scale(q.shape[-1]))
    return cfg, tuple(ids) + (seed,)


def pallas_attention_block(q: Array, k: Array, v: Array, q_positions: Optional[Array] = None,
                           k_positions: Optional[Array] = None, q_segments: Optional[Array] = None,
                           k_segments: Optional[Array] = None, dropout=None, *, block_q: Optional[int] = None,
                           block_k: Optional[int] = None, interpret: Optional[bool] = None
                           ) -> tuple[Array, Array]:
    """One block of context-parallel attention by the Pallas forward kernel: the interface
    and results of :func:`jmegatron.kernels.xla.attention.attention_block` (and the CPU
    kernel's ``cpu_attention_block``).

    q ``[b, sq, nq, d]``, k/v ``[b, sk, nkv, d]`` (``sq != sk`` allowed). Query ``i`` sees
    key ``j`` iff (no positions, or ``q_positions[:, i] >= k_positions[:, j]``) and (no
    segments, or equal segment ids); ids are integer ``[b, sq]`` / ``[b, sk]``, in pairs.
    ``dropout``: a :class:`jmegatron.kernels.xla.attention.BlockDropout` (the one-device
    hash mask at the block's global rows and columns) or None. Returns (out float32 ``[b,
    sq, nq, d]``, normalised within the block; lse float32 ``[b, sq, nq]``, -inf for a query
    that sees no key here, whose output is 0). No autodiff rule (the ring's custom VJP uses
    :func:`pallas_block_grads`). Raises ValueError for half a pair of ids, bad shapes, or
    lengths not multiples of the blocks.
    """
    cfg, ids = _block_setup("pallas_attention_block", q, k, v, q_positions, k_positions, q_segments, k_segments,
                            dropout, block_q, block_k, interpret)
    d = q.shape[-1]
    out, lse = _fwd_call(cfg, *_pad_head_dim(q, k, v), *ids, jnp.float32)
    return out[..., :d], jnp.swapaxes(lse, 1, 2)


def pallas_block_grads(q: Array, k: Array, v: Array, dout: Array, lse: Array, delta: Array,
                       q_positions: Optional[Array] = None, k_positions: Optional[Array] = None,
                       q_segments: Optional[Array] = None, k_segments: Optional[Array] = None, dropout=None,
                       *, block_q: Optional[int] = None, block_k: Optional[int] = None,
                       interpret: Optional[bool] = None) -> tuple[Array, Array, Array]:
    """The backward of one block by the Pallas dQ and dK/dV kernels: the interface of
    :func:`jmegatron.kernels.xla.attention.block_grads` (and ``cpu_block_grads``).

    q, k, v, the ids and ``dropout`` as :func:`pallas_attention_block`; dout ``[b, sq, nq,
    d]``; lse float32 ``[b, sq, nq]``: the *final* log-sum-exp of each query over all blocks
    (-inf: it sees no key anywhere); delta float32 ``[b, sq, nq]`` = ``sum(dout * out, -1)``
    with the final output. Returns this block's (dq ``[b, sq, nq, d]``, dk / dv ``[b, sk,
    nkv, d]``), float32. Raises ValueError as :func:`pallas_attention_block`, and for
    lse/delta of another shape.
    """
    cfg, ids = _block_setup("pallas_block_grads", q, k, v, q_positions, k_positions, q_segments, k_segments,
                            dropout, block_q, block_k, interpret)
    b, sq, nq, _ = q.shape
    for name, x in (("lse", lse), ("delta", delta)):
        if x.shape != (b, sq, nq):
            raise ValueError(f"pallas_block_grads: {name} must be [b, sq, nq] = {[b, sq, nq]}, got {list(x.shape)}")
    if dout.shape != q.shape:
        raise ValueError(f"pallas_block_grads: dout must have q's shape {list(q.shape)}, got {list(dout.shape)}")
    d = q.shape[-1]
    q, k, v, dout = _pad_head_dim(q, k, v, dout.astype(q.dtype))
    dq, dk, dv = _bwd_call(cfg, q, k, v, dout, jnp.swapaxes(lse.astype(jnp.float32), 1, 2),
                           jnp.swapaxes(delta.astype(jnp.float32), 1, 2), *ids)
    return dq[..., :d], dk[..., :d], dv[..., :d]
