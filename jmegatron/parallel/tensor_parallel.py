"""Explicit sequence-parallel collectives: Megatron-Core's ColumnParallelLinear,
RowParallelLinear and VocabParallelEmbedding with ``sequence_parallel=True``
(megatron/core/tensor_parallel/layers.py and mappings.py: the all-gather before a
column-parallel layer, the reduce-scatter after a row-parallel one, and their transposes
in the backward pass).

Without sequence parallelism the compiler's automatic partitioning already produces
Megatron's collectives (one all-reduce per row-parallel layer). With it, XLA's CPU
backend turns every reduction into the sequence-sharded layout into all-reduce + slice
(it has no reduce-scatter creation pass). So, when the rules split the residual stream's
``activation_length`` over a mesh axis, these functions compute the layer in a
``shard_map`` over that axis with the collectives written out, each with a
``custom_vjp`` whose backward pass is Megatron's: reduce-scatter of the input gradient
of a column-parallel layer, all-gather of the output gradient of a row-parallel one.
Otherwise they return None and the caller computes the plain product.

Arrays are in the global view: ``x`` is ``[batch, seq, ...]`` with ``seq`` split over
the tensor axis (sequence-parallel layout); kernels carry their tensor-parallel split.
Inside the data-parallel ``shard_map`` of the train step the outputs keep the inputs'
"varying over data" type (``pcast``), since these nested maps run unchecked.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

SEQ = 1  # sequence dimension of activations


def sequence_parallel_axis() -> Optional[str]:
    """The mesh axis the residual stream's sequence is split over, or None."""
    try:
        spec = nn.logical_to_mesh_axes(("activation_length",))
    except Exception:  # no rules in context
        return None
    axis = spec[0] if len(spec) else None
    if not isinstance(axis, str):
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names or mesh.shape[axis] == 1:
        return None
    return axis


def _spec(ndim: int, dim: Optional[int], axis: str) -> P:
    return P(*[axis if d == dim else None for d in range(ndim)])


def _vary_like(out, *inputs):
    """Give ``out`` the manual axes its inputs vary over (lost by an unchecked shard_map)."""
    want = set()
    for x in inputs:
        want |= set(jax.typeof(x).mat.varying)
    missing = tuple(sorted(want - set(jax.typeof(out).mat.varying)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def _plain(*xs):
    """Inside an unchecked shard_map, values keep their outer "varying over data" type but
    the ops on them drop it; ``x * 1`` (folded away by XLA) gives jax.vjp consistent types."""
    return tuple(x * jnp.ones((), x.dtype) for x in xs)


def _on_sp_axis(fn, *args):
    """``fn(axis, *args)`` on the sequence-parallel mesh axis; None without sequence parallelism."""
    axis = sequence_parallel_axis()
    return None if axis is None else fn(axis, *args)


def _smap(fn, axis, in_specs, out_specs):
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names={axis}, check_vma=False)


# --------------------------------------------------------------------------- column
def column_parallel(x, kernel, dims, k_shard: int, out_shard: int, dot_general: Callable):
    """``dot_general(all_gather_seq(x), kernel)`` with the kernel split on ``k_shard``
    (an output dimension) and the result split on ``out_shard``; None without SP.

    ``x``: ``[b, s, *in]`` (s split over tensor), ``kernel``: ``[*in, *out]``,
    ``dims``: dot_general dimension numbers contracting ``*in``; returns ``[b, s, *out]``
    in the dtype of the product. Megatron: ColumnParallelLinear with sequence_parallel."""
    return _on_sp_axis(_column, dims, k_shard, out_shard, dot_general, x, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _column(axis, dims, k_shard, out_shard, dot_general, x, kernel):
    return _column_fwd(axis, dims, k_shard, out_shard, dot_general, x, kernel)[0]


def _column_fwd(axis, dims, k_shard, out_shard, dot_general, x, kernel):
    def local(xl, kl):
        xf = jax.lax.all_gather(xl, axis, axis=SEQ, tiled=True)
        return dot_general(xf, kl, dims), xf

    out_ndim = x.ndim + kernel.ndim - 2 * len(dims[0][0])
    y, xf = _smap(local, axis, (_spec(x.ndim, SEQ, axis), _spec(kernel.ndim, k_shard, axis)),
                  (_spec(out_ndim, out_shard, axis), P()))(x, kernel)
    return _vary_like(y, x, kernel), (_vary_like(xf, x), x, kernel)


def _column_bwd(axis, dims, k_shard, out_shard, dot_general, res, ct):
    xf, x, kernel = res

    def local(xfl, kl, ctl):
        xfl, kl, ctl = _plain(xfl, kl, ctl)
        _, vjp = jax.vjp(lambda a, b: dot_general(a, b, dims), xfl, kl)
        dxf, dk = vjp(ctl)
        return jax.lax.psum_scatter(dxf, axis, scatter_dimension=SEQ, tiled=True), dk

    dx, dk = _smap(local, axis, (P(), _spec(kernel.ndim, k_shard, axis), _spec(ct.ndim, out_shard, axis)),
                   (_spec(x.ndim, SEQ, axis), _spec(kernel.ndim, k_shard, axis)))(xf, kernel, ct)
    return _vary_like(dx, x), _vary_like(dk, kernel)


_column.defvjp(_column_fwd, _column_bwd)


# ------------------------------------------------------------------------------ row
def row_parallel(x, kernel, dims, x_shard: int, k_shard: int, dot_general: Callable):
    """``reduce_scatter_seq(dot_general(x, kernel))`` with ``x`` split on ``x_shard`` and the
    kernel on ``k_shard`` (the contracted, tensor-split dimension); None without SP.

    ``x``: ``[b, s, *in]`` (full sequence, ``*in`` holding the heads or FFN axis),
    ``kernel``: ``[*in, h]``; returns ``[b, s, h]`` with s split over tensor. Megatron:
    RowParallelLinear with sequence_parallel."""
    return _on_sp_axis(_row, dims, x_shard, k_shard, dot_general, x, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _row(axis, dims, x_shard, k_shard, dot_general, x, kernel):
    def local(xl, kl):
        return jax.lax.psum_scatter(dot_general(xl, kl, dims), axis, scatter_dimension=SEQ, tiled=True)

    out_ndim = x.ndim + kernel.ndim - 2 * len(dims[0][0])
    y = _smap(local, axis, (_spec(x.ndim, x_shard, axis), _spec(kernel.ndim, k_shard, axis)),
              _spec(out_ndim, SEQ, axis))(x, kernel)
    return _vary_like(y, x, kernel)


def _row_fwd(axis, dims, x_shard, k_shard, dot_general, x, kernel):
    return _row(axis, dims, x_shard, k_shard, dot_general, x, kernel), (x, kernel)


def _row_bwd(axis, dims, x_shard, k_shard, dot_general, res, ct):
    x, kernel = res

    def local(xl, kl, ctl):
        xl, kl, ctl = _plain(xl, kl, ctl)
        ctf = jax.lax.all_gather(ctl, axis, axis=SEQ, tiled=True)
        _, vjp = jax.vjp(lambda a, b: dot_general(a, b, dims), xl, kl)
        return vjp(ctf)

    dx, dk = _smap(local, axis, (_spec(x.ndim, x_shard, axis), _spec(kernel.ndim, k_shard, axis),
                                 _spec(ct.ndim, SEQ, axis)),
                   (_spec(x.ndim, x_shard, axis), _spec(kernel.ndim, k_shard, axis)))(x, kernel, ct)
    return _vary_like(dx, x), _vary_like(dk, kernel)


_row.defvjp(_row_fwd, _row_bwd)


# ------------------------------------------------------------------------ embedding
def vocab_parallel_embed(ids, table):
    """Vocab-parallel lookup ``ids [b, s]`` -> ``[b, s, h]`` (seq split): each tensor rank
    looks up the ids in its rows of ``table [V, h]`` and the partial results are
    reduce-scattered onto the sequence; None without SP."""
    return _on_sp_axis(_embed, ids, table)


def _local_lookup(axis, ids, rows):
    n = rows.shape[0]
    start = jax.lax.axis_index(axis) * n
    inside = (ids >= start) & (ids < start + n)
    out = jnp.take(rows, jnp.where(inside, ids - start, 0), axis=0)
    return jnp.where(inside[..., None], out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _embed(axis, ids, table):
    local = lambda i, r: jax.lax.psum_scatter(_local_lookup(axis, i, r), axis, scatter_dimension=SEQ,  # noqa: E731
                                              tiled=True)
    y = _smap(local, axis, (P(), P(axis, None)), _spec(ids.ndim + 1, SEQ, axis))(ids, table)
    return _vary_like(y, ids, table)


def _lookup_fwd(lookup):
    """The custom-VJP forward of ``lookup(axis, ids, table)``: its output, ``(ids, table)`` saved."""
    return lambda axis, ids, table: (lookup(axis, ids, table), (ids, table))


def _lookup_bwd(axis, ids, table, ct, local_lookup, in_specs, table_spec, sharded: bool):
    """The table's cotangent of a sequence-parallel lookup: ``local_lookup(ids, rows)``'s VJP
    on each rank under shard_map (``in_specs`` for ids, table, ct; ``table_spec`` out). A
    vocab-``sharded`` table's rank takes the whole sequence's cotangent (all-gathered); a
    replicated one's partial gradients are all-reduced over ``axis``."""

    def local(i, rows, ctl):
        rows, ctl = _plain(rows, ctl)
        if sharded:
            ctl = jax.lax.all_gather(ctl, axis, axis=SEQ, tiled=True)
        _, vjp = jax.vjp(lambda r: local_lookup(i, r), rows)
        grad = vjp(ctl)[0]
        return grad if sharded else jax.lax.psum(grad, axis)

    dt = _smap(local, axis, in_specs, table_spec)(ids, table, ct)
    return None, _vary_like(dt, table)


def _embed_bwd(axis, res, ct):
    ids, table = res
    return _lookup_bwd(axis, ids, table, ct, lambda i, r: _local_lookup(axis, i, r),
                       (P(), P(axis, None), _spec(ct.ndim, SEQ, axis)), P(axis, None), sharded=True)


_embed.defvjp(_lookup_fwd(_embed), _embed_bwd)


# ----------------------------------------------------- replicated table, local rows
def sequence_local_embed(ids, table):
    """Lookup in a tensor-replicated table (position embeddings) straight into the
    sequence-parallel layout: each rank looks up its own positions; in the backward pass
    the table's partial gradients are all-reduced over the tensor axis, as Megatron does
    for parameters replicated across sequence-parallel ranks. None without SP."""
    return _on_sp_axis(_seq_embed, ids, table)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _seq_embed(axis, ids, table):
    y = _smap(lambda i, t: jnp.take(t, i, axis=0), axis, (_spec(ids.ndim, SEQ, axis), P()),
              _spec(ids.ndim + 1, SEQ, axis))(ids, table)
    return _vary_like(y, ids, table)


def _seq_embed_bwd(axis, res, ct):
    ids, table = res
    return _lookup_bwd(axis, ids, table, ct, lambda i, r: jnp.take(r, i, axis=0),
                       (_spec(ids.ndim, SEQ, axis), P(), _spec(ct.ndim, SEQ, axis)), P(), sharded=False)


_seq_embed.defvjp(_lookup_fwd(_seq_embed), _seq_embed_bwd)
