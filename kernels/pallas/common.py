"""What the Pallas kernels share: interpret-mode choice and ``shard_map`` typing."""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl


def default_interpret() -> bool:
    """True (Pallas interpret mode: the kernel code evaluated by XLA) unless JAX's default
    backend is a GPU, where the kernels compile through Triton."""
    return jax.default_backend() != "gpu"


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
