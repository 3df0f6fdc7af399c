"""JAX ops over the CPU kernels (:mod:`jmegatron.kernels.cpu`), each with autodiff rules.

* :func:`sgemm` -- ``op(a) @ op(b)``, float32, rank 2 (``jmegatron_sgemm``).
* :func:`blas_dot_general` -- a ``jax.lax.dot_general`` for dense layers (``x [..., K]``
  against a kernel ``[K..., N...]`` or ``[N..., K...]``) whose forward, input gradient and
  weight gradient are each one :func:`sgemm` with no transposing copies; other forms and
  dtypes fall back to :func:`jmegatron.kernels.xla.dense.dense_dot_general`.
* :func:`grouped_matmul` -- ``jax.lax.ragged_dot(x, w, group_sizes)`` (an MoE layer's
  experts), forward, input gradient and weight gradient each one grouped BLAS call.
* :func:`cpu_attention` -- the causal core attention of
  :func:`jmegatron.kernels.xla.attention.xla_attention` (same signature, same dropout masks),
  optionally within documents (``segment_ids``).
* :func:`cpu_attention_block` / :func:`cpu_block_grads` -- one block of ring attention,
  forward (output and log-sum-exp) and backward given the final log-sum-exp, with no mask,
  a causal mask by position ids and/or a document mask (no autodiff rules: for the ring's
  custom VJPs).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.kernels import cpu as _lib
from jmegatron.kernels.xla.attention import check_qkv, xla_attention
from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.kernels.xla.dropout import check_hash_extent, key_words

Array = jax.Array

# Query rows per block in the attention kernel (FlashAttention's B_r).
ATTENTION_BLOCK = 64


def _same_vma(*xs):
    """``xs`` cast to the union of their varying manual axes (inside ``shard_map`` with
    ``check_vma``), so a custom call's operands and results share one type. Outside
    custom_vjp rules autodiff transposes the cast (a psum), as for any JAX op."""
    sets = [jax.typeof(x).manual_axis_type.varying for x in xs]
    union = frozenset().union(*sets)
    return tuple(x if v == union else jax.lax.pcast(x, tuple(sorted(union - v)), to="varying")
                 for x, v in zip(xs, sets))


def _result(shape, like) -> jax.ShapeDtypeStruct:
    """A float32 result ``shape`` typed like ``like`` inside ``shard_map``: the same
    varying manual axes and mesh (tensor-level sharding is not carried: replicated)."""
    aval = jax.typeof(like)
    mat = aval.manual_axis_type
    if mat.empty:
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding, manual_axis_type=mat)


def sgemm(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
    """``op(a) @ op(b)`` for float32 ``a``, ``b`` of rank 2 (op = transpose when the flag is
    set): ``[M, K] x [K, N] -> [M, N]`` float32. No autodiff rule of its own (the callers
    define theirs). Raises ValueError on other ranks, dtypes or mismatched K."""
    if a.ndim != 2 or b.ndim != 2 or a.dtype != jnp.float32 or b.dtype != jnp.float32:
        raise ValueError(f"sgemm needs float32 matrices, got {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != kb:
        raise ValueError(f"sgemm: contracting sizes differ ({k} vs {kb})")
    _lib.load()
    a, b = _same_vma(a, b)
    return jax.ffi.ffi_call("jmegatron_sgemm", _result((m, n), a))(
        a, b, trans_a=bool(trans_a), trans_b=bool(trans_b))


def _kernel_form(x, kernel, dims) -> Optional[bool]:
    """False: kernel ``[K..., N...]``; True: kernel ``[N..., K...]`` (trans_b); None: other."""
    (xc, kc), batch = dims
    if batch != ((), ()) or x.dtype != jnp.float32 or kernel.dtype != jnp.float32:
        return None
    nc = len(xc)
    if nc == 0 or tuple(xc) != tuple(range(x.ndim - nc, x.ndim)):
        return None
    if tuple(kc) == tuple(range(nc)):
        return False
    if tuple(kc) == tuple(range(kernel.ndim - nc, kernel.ndim)):
        return True
    return None


def _as_matrices(x, kernel, dims, trans_b):
    nc = len(dims[0][0])
    tokens, k = math.prod(x.shape[:x.ndim - nc]), math.prod(x.shape[x.ndim - nc:])
    n = kernel.size // k if k else 0
    free = kernel.shape[:kernel.ndim - nc] if trans_b else kernel.shape[nc:]
    k2 = kernel.reshape((n, k) if trans_b else (k, n))
    return x.reshape(tokens, k), k2, x.shape[:x.ndim - nc] + free


def _matmul(a, b, trans_b, xla):
    """``a @ op(b)`` for 2-D float32 ``a``, ``b``: the BLAS kernel, or XLA's dot (which
    reads a transposed ``b`` in place too) when ``xla``."""
    if xla:
        return jax.lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())))
    return sgemm(a, b, False, trans_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _blas_dense(x, kernel, dims, weight_grad_only):
    trans_b = _kernel_form(x, kernel, dims)
    x2, k2, out_shape = _as_matrices(x, kernel, dims, trans_b)
    return _matmul(x2, k2, trans_b, weight_grad_only).reshape(out_shape)


def _blas_dense_fwd(x, kernel, dims, weight_grad_only):
    return _blas_dense(x, kernel, dims, weight_grad_only), (x, kernel)


def _blas_dense_bwd(dims, weight_grad_only, res, g):
    x, kernel = res
    trans_b = _kernel_form(x, kernel, dims)
    x2, k2, _ = _as_matrices(x, kernel, dims, trans_b)
    g2 = g.reshape(x2.shape[0], -1).astype(jnp.float32)
    dx = _matmul(g2, k2, not trans_b, weight_grad_only).reshape(x.shape)
    dk = sgemm(g2, x2, True, False) if trans_b else sgemm(x2, g2, True, False)
    return dx, dk.reshape(kernel.shape)


_blas_dense.defvjp(_blas_dense_fwd, _blas_dense_bwd)


def blas_dot_general(x: Array, kernel: Array, dims, precision=None, preferred_element_type=None,
                     weight_grad_only: bool = False) -> Array:
    """``jax.lax.dot_general(x, kernel, dims)`` through :func:`sgemm` (a drop-in
    ``dot_general`` for :class:`jmegatron.models.layers.Linear` and the models).

    Used when both are float32, there are no batch dimensions, ``x``'s contracting axes
    are its trailing ones and the kernel's are its leading (``[K..., N...]``) or trailing
    (``[N..., K...]``, the tied output layer) ones, in order; anything else goes to
    :func:`jmegatron.kernels.xla.dense.dense_dot_general_fn`. Gradients: ``dx = g op(W)^T``
    and ``dW = x^T g`` (or ``g^T x``), each one BLAS call reading its operands in place.

    ``weight_grad_only`` (``matmul_impl="hybrid"``): the forward and ``dx`` go to XLA's dot
    (YNNPACK), which reads ``op(W)`` in place and was 5-10% faster than the BLAS kernel for
    those shapes on the AMD machine of docs/PERFORMANCE.md; only ``dW``, where
    XLA would transpose an operand first, uses the BLAS kernel.
    """
    if precision is not None or preferred_element_type not in (None, jnp.float32):
        return dense_dot_general_fn(x, kernel, dims, precision, preferred_element_type)
    if _kernel_form(x, kernel, dims) is None or x.size == 0 or kernel.size == 0:
        return dense_dot_general_fn(x, kernel, dims)
    return _blas_dense(*_same_vma(x, kernel), dims, bool(weight_grad_only))


def _dropout_key(dropout_rng, sample_offset) -> Array:
    """uint32 ``[3]``: the hash's key words (k0, k1) and the global sample number of row 0."""
    k0, k1 = key_words(dropout_rng)
    return jnp.stack([k0, k1, jnp.asarray(sample_offset).astype(jnp.uint32)]).astype(jnp.uint32)


def _threshold(rate: float) -> int:
    return min(int(math.floor(rate * 2.0**32)), 2**32 - 1)


def _attn_attrs(d: int, rate: float, block: int) -> dict:
    # keep_scale: the XLA path divides float32 probabilities by the weakly typed 1.0 - rate
    return dict(scale=np.float32(1.0 / np.sqrt(np.float32(d))), dropout_rate=np.float32(rate),
                keep_scale=np.float32(1.0 - rate), threshold=np.int64(_threshold(rate)), block=np.int64(block))


def _segments_operand(segment_ids, b: int, s: int) -> Array:
    """int32 ``[b, s]`` document ids, or the kernel's int32 ``[0]`` placeholder for None."""
    if segment_ids is None:
        return jnp.zeros((0,), jnp.int32)
    return _ids("cpu_attention: segment_ids", segment_ids, (b, s), "[b, s]")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, segment_ids, key, rate, block, segments):
    return _attention_fwd(q, k, v, segment_ids, key, rate, block, segments)[0]


def _attention_fwd(q, k, v, segment_ids, key, rate, block, segments):
    _lib.load()
    b, s, nq, d = q.shape
    out, lse = jax.ffi.ffi_call(
        "jmegatron_attention_fwd", (_result(q.shape, q), _result((b, nq, s), q)),
    )(q, k, v, segment_ids, key, segments=bool(segments), **_attn_attrs(d, rate, block))
    return out, (q, k, v, segment_ids, key, out, lse)


def _attention_bwd(rate, block, segments, res, g):
    q, k, v, segment_ids, key, out, lse = res
    dq, dk, dv = jax.ffi.ffi_call(
        "jmegatron_attention_bwd", (_result(q.shape, q), _result(k.shape, q), _result(v.shape, q)),
    )(q, k, v, out, g.astype(jnp.float32), lse, segment_ids, key, segments=bool(segments),
      **_attn_attrs(q.shape[-1], rate, block))
    return (dq, dk, dv, np.zeros(segment_ids.shape, jax.dtypes.float0),
            np.zeros(key.shape, jax.dtypes.float0))


_attention.defvjp(_attention_fwd, _attention_bwd)


def cpu_attention(q: Array, k: Array, v: Array, *, dropout_rate: float = 0.0,
                  dropout_rng: Optional[Array] = None, deterministic: bool = True,
                  dropout_impl: str = "hash", sample_offset=0, segment_ids: Optional[Array] = None) -> Array:
    """Causal ``softmax(q k^T / sqrt(d)) v`` by the CPU attention kernel.

    Shapes as :func:`jmegatron.kernels.xla.attention.xla_attention`: q ``[b, s, nq, d]``, k/v
    ``[b, s, nkv, d]`` float32 with ``nq % nkv == 0``; returns ``[b, s, nq, d]`` float32.
    ``segment_ids`` (integer ``[b, s]``, optional; document masking, Megatron's
    ``reset_attention_mask``): query ``i`` sees key ``j`` only if ``j <= i`` and
    ``segment_ids[:, i] == segment_ids[:, j]`` (the block-diagonal causal mask); key tiles
    of other documents are skipped, not computed and masked.
    Attention dropout draws :func:`jmegatron.kernels.xla.dropout.keep_mask`'s hash mask over
    ``[b, nkv, nq // nkv, s, s]`` with batch row ``i`` the global sample ``sample_offset +
    i``, element for element the XLA path's. Memory: saves only
    q, k, v, the output and the log-sum-exp ``[b, nq, s]`` (no ``[s, s]`` activations).
    Other dtypes and ``dropout_impl="threefry"`` with dropout go to ``xla_attention``.
    Raises ValueError for a dropout rate outside [0, 1), ``segment_ids`` of another
    shape or a non-integer dtype, or dropout with heads x s above 2^32 (the hash's row word,
    :func:`jmegatron.kernels.xla.dropout.check_hash_extent`).
    """
    rate = 0.0 if deterministic else float(dropout_rate)
    if (q.dtype != jnp.float32 or k.dtype != jnp.float32 or v.dtype != jnp.float32
            or (rate > 0.0 and dropout_impl != "hash")):
        documents = {} if segment_ids is None else {"segment_ids": segment_ids}
        return xla_attention(q, k, v, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                             deterministic=deterministic, dropout_impl=dropout_impl,
                             sample_offset=sample_offset, **documents)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    _check_qkv("cpu_attention", q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"cpu_attention: k and v must have q's sequence length {q.shape[1]}, got {k.shape[1]} "
                         f"(cpu_attention_block takes blocks of different lengths)")
    if rate > 0.0:  # the hash's row word head * s + i (the kernel checks it too)
        check_hash_extent("cpu_attention", q.shape[2] * q.shape[1], q.shape[1],
                          f"heads {q.shape[2]} x seq {q.shape[1]}")
    seg = _segments_operand(segment_ids, q.shape[0], q.shape[1])
    key = _dropout_key(dropout_rng, sample_offset) if rate > 0.0 else jnp.zeros((3,), jnp.uint32)
    return _attention(*_same_vma(q, k, v, seg, key), rate, ATTENTION_BLOCK, segment_ids is not None)


def _check_qkv(fn: str, q, k, v) -> None:
    """:func:`~jmegatron.kernels.xla.attention.check_qkv` for the float32 kernels."""
    check_qkv(fn, q, k, v, float32=True,
              hint=" (cast to float32, or use jmegatron.kernels.xla.attention.attention_block)")


def _ids(name: str, ids, shape, what: str) -> Array:
    """``ids`` as int32 ``shape``; ValueError naming ``name`` for another shape or a
    non-integer dtype."""
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape != tuple(shape):
        raise ValueError(f"{name} must be integer {what} = {list(shape)}, got {ids.dtype}{list(ids.shape)}")
    return ids.astype(jnp.int32)


def _block_operands(fn, q, k, v, q_positions, k_positions, q_segments, k_segments):
    """The id operands of the block kernels (int32 ``[0]`` placeholders for absent ones)
    and their flags, after :func:`_check_qkv`; ValueError for half a pair or bad ids."""
    _check_qkv(fn, q, k, v)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    ops, flags = [], []
    for kind, qi, ki in (("positions", q_positions, k_positions), ("segments", q_segments, k_segments)):
        if (qi is None) != (ki is None):
            raise ValueError(f"{fn}: give both q_{kind} and k_{kind} or neither, got only "
                             f"{'q' if ki is None else 'k'}_{kind}")
        if qi is None:
            ops += [jnp.zeros((0,), jnp.int32)] * 2
        else:
            ops += [_ids(f"{fn}: q_{kind}", qi, (b, sq), "[b, sq]"), _ids(f"{fn}: k_{kind}", ki, (b, sk), "[b, sk]")]
        flags.append(qi is not None)
    return ops, dict(causal=flags[0], segments=flags[1])


def _block_attrs(d: int, flags: dict) -> dict:
    return dict(scale=np.float32(1.0 / np.sqrt(np.float32(d))), causal=bool(flags["causal"]),
                segments=bool(flags["segments"]), block=np.int64(ATTENTION_BLOCK))


def cpu_attention_block(q: Array, k: Array, v: Array, q_positions: Optional[Array] = None,
                        k_positions: Optional[Array] = None, q_segments: Optional[Array] = None,
                        k_segments: Optional[Array] = None) -> tuple[Array, Array]:
    """One block of ring attention by the CPU kernel (``jmegatron_attention_block_fwd``):
    :func:`jmegatron.kernels.xla.attention.attention_block` with document masks.

    q ``[b, sq, nq, d]``, k/v ``[b, sk, nkv, d]`` float32 (``sq != sk`` allowed; GQA: query
    head ``i`` uses key/value head ``i // (nq // nkv)``). Query ``i`` sees key ``j`` iff
    (no positions, or ``q_positions[:, i] >= k_positions[:, j]``: causal by position ids,
    any offset or order, e.g. the load-balanced chunks) and (no segments, or
    ``q_segments[:, i] == k_segments[:, j]``: same document). Ids are integer ``[b, sq]`` /
    ``[b, sk]``, given in pairs. Scale ``1/sqrt(d)``.

    Returns (out float32 ``[b, sq, nq, d]``, normalised within the block; lse float32
    ``[b, sq, nq]``, the log-sum-exp of the visible scaled scores), a query that sees no key
    of the block getting out 0 and lse -inf. Forward only, no autodiff rule: the callers'
    custom VJPs use :func:`cpu_block_grads`. FlashAttention's tiling (Dao et al. 2022):
    key tiles no query of a tile sees are skipped. Raises ValueError (naming the argument)
    for non-float32 or mis-shaped q/k/v, half a pair of ids, or ids of the wrong shape.
    """
    ids, flags = _block_operands("cpu_attention_block", q, k, v, q_positions, k_positions, q_segments, k_segments)
    _lib.load()
    b, sq, nq, d = q.shape
    q, k, v, *ids = _same_vma(q, k, v, *ids)
    return jax.ffi.ffi_call(
        "jmegatron_attention_block_fwd", (_result(q.shape, q), _result((b, sq, nq), q)),
    )(q, k, v, *ids, **_block_attrs(d, flags))


def cpu_block_grads(q: Array, k: Array, v: Array, dout: Array, lse: Array, delta: Array,
                    q_positions: Optional[Array] = None, k_positions: Optional[Array] = None,
                    q_segments: Optional[Array] = None, k_segments: Optional[Array] = None
                    ) -> tuple[Array, Array, Array]:
    """The backward of one ring-attention block by the CPU kernel
    (``jmegatron_attention_block_bwd``): :func:`jmegatron.kernels.xla.attention.block_grads`
    with document masks (FlashAttention's backward, Dao et al. 2022 Algorithm 4, as
    Transformer Engine's ``AttnFuncWithCPAndKVP2P`` runs it per block).

    q, k, v and the ids as :func:`cpu_attention_block`; dout float32 ``[b, sq, nq, d]``;
    lse float32 ``[b, sq, nq]``: the *final* log-sum-exp of each query over all blocks
    (-inf: the query sees no key anywhere; it contributes nothing); delta float32
    ``[b, sq, nq]`` = ``sum(dout * out, -1)`` with the final output. Returns this block's
    (dq ``[b, sq, nq, d]``, dk ``[b, sk, nkv, d]``, dv ``[b, sk, nkv, d]``), float32, with
    ``p = exp(scale q k^T - lse)`` on visible pairs, ``dv = p^T dout``, ``ds = p (dout v^T -
    delta)``, ``dq = scale ds k``, ``dk = scale ds^T q``. Raises ValueError as
    :func:`cpu_attention_block`, and for dout/lse/delta of another shape or dtype.
    """
    ids, flags = _block_operands("cpu_block_grads", q, k, v, q_positions, k_positions, q_segments, k_segments)
    b, sq, nq, d = q.shape
    for name, x, shape in (("dout", dout, q.shape), ("lse", lse, (b, sq, nq)), ("delta", delta, (b, sq, nq))):
        if x.dtype != jnp.float32 or x.shape != tuple(shape):
            raise ValueError(f"cpu_block_grads: {name} must be float32 {list(shape)}, got {x.dtype}{list(x.shape)}")
    _lib.load()
    q, k, v, dout, lse, delta, *ids = _same_vma(q, k, v, dout, lse, delta, *ids)
    return jax.ffi.ffi_call(
        "jmegatron_attention_block_bwd", (_result(q.shape, q), _result(k.shape, q), _result(v.shape, q)),
    )(q, k, v, dout, lse, delta, *ids, **_block_attrs(d, flags))


def grouped_matmul(x: Array, w: Array, group_sizes: Array) -> Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` through ``jmegatron_grouped_sgemm``: ``x``
    ``[N, K]`` float32 with its rows sorted by group, ``w`` ``[E, K, P]`` float32,
    ``group_sizes`` ``[E]`` int32 (summing to at most N; rows past the groups give zeros)
    -> ``[N, P]`` float32. Gradients: ``dx`` = the grouped product with each ``w[e]``
    transposed (a BLAS flag), ``dw[e] = x_e^T g_e`` (``jmegatron_grouped_sgemm_wgrad``); no
    gradient for ``group_sizes``. Megatron-Core's GroupedMLP uses the grouped_gemm library
    on GPUs for the same product. Other shapes or dtypes go to ``jax.lax.ragged_dot``, the
    XLA reference path."""
    if x.ndim != 2 or w.ndim != 3 or x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.shape[1] != w.shape[1]:
        return jax.lax.ragged_dot(x, w, group_sizes)
    return _grouped(*_same_vma(x, w), group_sizes.astype(jnp.int32))


def _grouped_call(x, w, sizes, trans_b: bool) -> Array:
    _lib.load()
    out = w.shape[1] if trans_b else w.shape[2]
    return jax.ffi.ffi_call("jmegatron_grouped_sgemm", _result((x.shape[0], out), x))(
        x, w, _same_vma(sizes, x)[0], trans_b=bool(trans_b))


@jax.custom_vjp
def _grouped(x, w, sizes):
    return _grouped_call(x, w, sizes, False)


def _grouped_fwd(x, w, sizes):
    return _grouped_call(x, w, sizes, False), (x, w, sizes)


def _grouped_bwd(res, g):
    x, w, sizes = res
    g = g.astype(jnp.float32)
    dx = _grouped_call(g, w, sizes, True)
    _lib.load()
    dw = jax.ffi.ffi_call("jmegatron_grouped_sgemm_wgrad", _result(w.shape, w))(x, *_same_vma(g, x)[:1],
                                                                                 _same_vma(sizes, x)[0])
    return dx, dw, np.zeros(sizes.shape, jax.dtypes.float0)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)

