"""What the Pallas kernels share: interpret-mode choice and ``shard_map`` typing."""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmegatron.kernels import gpu_target


def default_interpret() -> bool:
    """True (Pallas interpret mode: the kernel code evaluated by XLA) unless JAX's default
    backend is a GPU, where the kernels compile through Triton, or inside
    :func:`jmegatron.kernels.gpu_target.lowering_for` (traced for a named GPU)."""
    return not gpu_target.is_gpu()


def triton_params(head_dim: int, num_stages: int = 2) -> pltriton.CompilerParams:
    """The Triton compiler parameters of a kernel whose tiles are ``head_dim`` wide: 4 warps
    up to 64, else 8, and ``num_stages`` software-pipelining stages, as JAX's reference
    Pallas flash attention (``jax/experimental/pallas/ops/gpu/attention.py``) chooses them.
    Passing them also selects the Triton lowering on a GPU whatever JAX's default: where
    ``jax_pallas_use_mosaic_gpu`` is on (jax 0.10.2's default) a ``pallas_call`` without
    compiler parameters lowers through Mosaic GPU, which these kernels are not written for.
    Interpret mode ignores them."""
    return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=num_stages)


def same_vma(*xs):
    """``xs`` (arrays or None) cast to the union of their varying manual axes (inside
    ``shard_map`` with ``check_vma``), so a ``pallas_call``'s operands and results share one
    type; outside ``shard_map`` they are returned unchanged."""
    live = [x for x in xs if x is not None]
    sets = [jax.typeof(x).manual_axis_type.varying for x in live]
    union = frozenset().union(*sets)
    return tuple(x if x is None or jax.typeof(x).manual_axis_type.varying == union
                 else jax.lax.pcast(x, tuple(sorted(union - jax.typeof(x).manual_axis_type.varying)), to="varying")
                 for x in xs)


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` result ``shape`` / ``dtype`` typed like ``like`` inside ``shard_map``
    (the same varying manual axes; replicated over the automatic ones)."""
    aval = jax.typeof(like)
    mat = aval.manual_axis_type
    if mat.empty:
        return jax.ShapeDtypeStruct(shape, dtype)
    sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=mat)


def fori_loop(lower, upper, body, init):
    """``jax.lax.fori_loop`` that always lowers to a while loop (traced bounds). With static
    bounds it becomes a ``scan``, whose ref-discharged carry loses its varying manual axes in
    Pallas interpret mode inside ``shard_map(check_vma=True)`` (JAX 0.10's HLO interpreter:
    "Scan carry input and output got mismatched varying manual axes"); the while form
    type-checks, and Triton lowers both to a loop."""
    zero = pl.program_id(0) * 0  # a traced 0: makes the bounds dynamic
    return jax.lax.fori_loop(zero + lower, zero + upper, body, init)
