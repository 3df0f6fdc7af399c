"""Megatron's distributed optimizer (ZeRO-1) as shardings.

Megatron (megatron/core/optimizer/distrib_optimizer.py) shards the fp32 optimizer state
and master weights over the data-parallel group: gradients are reduce-scattered, each
rank updates its shard, and the updated parameters are all-gathered. Here each
optimizer-state leaf takes its parameter's sharding plus the data axis on one more
dimension (the largest one that the data-parallel size divides and that no other mesh
axis uses); the gradients are reduce-scattered to that same layout inside the step and
the parameters gathered back by the step's output sharding.

Under expert parallelism the data-parallel group of a dense parameter is ``data`` x
``expert`` (Megatron's data-parallel group), that of an expert's weight ``data`` alone
(its expert-data-parallel group): the state is sharded over the group, as Megatron's
DistributedOptimizer with its expert-data-parallel buffers.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jmegatron.parallel.rules import CONTEXT_AXIS, EXPERT_AXIS, entry_axes

DATA = "data"


def zero1_group(mesh_shape: Any, expert_leaf: bool) -> tuple[str, ...]:
    """The mesh axes a leaf's optimizer state is sharded over (its data-parallel group, in
    mesh order): ``data``; ``expert`` too for a dense leaf (``expert_leaf`` False) under expert
    parallelism; ``context`` too under context parallelism. ``mesh_shape``: axis name ->
    size (``Mesh.shape``); axes of size 1 other than ``data`` are left out."""
    group = (DATA,)
    if not expert_leaf and mesh_shape.get(EXPERT_AXIS, 1) > 1:
        group += (EXPERT_AXIS,)
    if mesh_shape.get(CONTEXT_AXIS, 1) > 1:
        group += (CONTEXT_AXIS,)
    return group


def add_data_axis(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """``sharding`` with the leaf's ZeRO-1 group (:func:`zero1_group`: data, and expert /
    context where they split the batch) added on the largest free dimension divisible by
    the data-parallel size, else on an already-sharded dimension that stays divisible
    (e.g. ``("tensor", "data")``); unchanged if already data-sharded or nothing divides
    (that leaf's gradient is then all-reduced and its state replicated)."""
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {a for e in spec for a in entry_axes(e)}
    group = zero1_group(mesh.shape, expert_leaf=EXPERT_AXIS in used)
    dp = math.prod(mesh.shape[a] for a in group)
    if dp == 1 or DATA in used:
        return sharding
    entry = group[0] if len(group) == 1 else group
    candidates = [d for d in range(len(shape)) if spec[d] is None and shape[d] % dp == 0]
    if candidates:
        d = max(candidates, key=lambda i: shape[i])
        spec[d] = entry
        return NamedSharding(mesh, PartitionSpec(*spec))
    # No free dimension: split an already-sharded one further (data minor), if it divides.
    for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
        axes = entry_axes(spec[d])
        if axes and shape[d] % (math.prod(mesh.shape[a] for a in axes) * dp) == 0:
            spec[d] = axes + group
            return NamedSharding(mesh, PartitionSpec(*spec))
    return sharding


def zero1_shardings(param_shardings: Any, abstract_params: Any,
                    keep: Optional[Callable[[tuple], bool]] = None) -> Any:
    """Per-parameter shardings of gradients and optimizer state under ZeRO-1
    (:func:`add_data_axis` per leaf). ``keep(path)`` (a ``jax.tree_util`` key path; None:
    no leaf) marks leaves that keep their parameter's sharding: FP8's meta
    (:func:`jmegatron.parallel.rules.is_fp8_meta`), whose "gradients" are amaxes combined with a
    max over the data ranks, not reduce-scattered."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s, a: s if keep is not None and keep(path) else add_data_axis(s, a.shape),
        param_shardings, abstract_params)


def data_dim(sharding: NamedSharding) -> int | None:
    """The dimension a sharding splits over the data axis (alone or with others), or None."""
    for d, entry in enumerate(sharding.spec):
        if DATA in entry_axes(entry):
            return d
    return None


def is_expert_sharding(sharding: NamedSharding) -> bool:
    """True for a leaf split over the ``expert`` mesh axis (an expert's weight: its
    data-parallel group is the expert-data-parallel one, :func:`zero1_group`)."""
    return EXPERT_AXIS in {a for e in sharding.spec for a in entry_axes(e)}


def zero1_axes(sharding: NamedSharding, expert_leaf: bool) -> tuple[str, ...]:
    """The mesh axes of size > 1 that a leaf laid out by ``sharding`` is split over on its
    data dimension (:func:`data_dim`): its :func:`zero1_group` (the ZeRO-1 state's group;
    FSDP's parameters, whose ``embed`` rule gives the same data x context group), or ()
    when it is not split over data. The axes a ZeRO-1 gradient is reduce-scattered over
    and an FSDP parameter all-gathered over. ``expert_leaf``: the *parameter* is an
    expert's (:func:`is_expert_sharding` of the parameter's sharding, not of the gradient's,
    to which ZeRO-1 may have added ``expert``)."""
    if data_dim(sharding) is None:
        return ()
    mesh_shape = sharding.mesh.shape
    return tuple(a for a in zero1_group(mesh_shape, expert_leaf) if mesh_shape.get(a, 1) > 1)
