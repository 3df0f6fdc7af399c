"""The one table mapping logical axis names to mesh axes.

Layers name only logical axes (``embed``, ``heads``, ``batch`` ...); this module alone
knows the mesh. The idea is MaxText's ``logical_axis_rules`` (configs/base.yml); the
table here is typed and checked: every logical name the model uses must appear in it
(a silently unmapped axis is replicated, the failure mode of MaxText issue #4005), and
every mesh axis it names must exist.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = Optional[str | tuple[str, ...]]
DATA_AXIS = "data"
EXPERT_AXIS = "expert"
CONTEXT_AXIS = "context"
# The parameter collection of FP8's scaling meta (jmegatron.models.fp8): its leaves keep their
# parameter's sharding under ZeRO-1, and their "gradients" (observed amaxes) combine by max.
FP8_META = "fp8_meta"


def is_fp8_meta(path: tuple) -> bool:
    """True for a ``jax.tree_util`` key path inside an ``fp8_meta`` subtree."""
    return any(getattr(k, "key", None) == FP8_META for k in path)

PIPELINE_AXIS = "pipeline"

# Megatron-Core tensor parallelism: attention heads, FFN and vocabulary split over
# "tensor" (column-parallel in, row-parallel out); the batch over "data".
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", "data"),
    ("length", None),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("norm", None),
    ("layers", None),
    # mixture of experts: the stacked experts' axis of weights and of the capacity buffer
    # (expert parallelism shards it; the expert mesh axis has size 1 until that is built)
    ("exp", "expert"),
    ("activation_exp", "expert"),
)


def check_rules(rules: Sequence[tuple[str, MeshAxes]], mesh: Mesh,
                used_names: Iterable[str] = ()) -> None:
    """Raise ValueError if a rule names a mesh axis the mesh lacks, a logical name is
    mapped twice, or a name in ``used_names`` has no rule."""
    seen = set()
    for name, axes in rules:
        if name in seen:
            raise ValueError(f"logical axis {name!r} appears twice in the axis rules")
        seen.add(name)
        for ax in (axes,) if isinstance(axes, str) else (axes or ()):
            if ax not in mesh.axis_names:
                raise ValueError(f"axis rule {name!r} -> {ax!r}: mesh has no axis {ax!r} "
                                 f"(mesh axes: {mesh.axis_names})")
    missing = sorted(set(used_names) - seen - {None})
    if missing:
        raise ValueError(f"logical axes {missing} have no entry in the axis rules; add them "
                         f"(mapped to a mesh axis or None) to jmegatron.parallel.rules.DEFAULT_RULES")


def logical_names(specs: Any) -> set[str]:
    """All logical axis names in a pytree of logical PartitionSpecs."""
    names: set[str] = set()
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
        for entry in spec:
            for n in (entry,) if isinstance(entry, str) or entry is None else entry:
                if n is not None:
                    names.add(n)
    return names


def logical_to_sharding(specs: Any, mesh: Mesh,
                        rules: Sequence[tuple[str, MeshAxes]] = DEFAULT_RULES) -> Any:
    """Map a pytree of logical PartitionSpecs to NamedShardings on ``mesh`` (checked)."""
    check_rules(rules, mesh, logical_names(specs))
    return nn.logical_to_mesh_sharding(specs, mesh, list(rules))


def entry_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def spec_only(spec: PartitionSpec, axis: str | tuple[str, ...]) -> PartitionSpec:
    """``spec`` keeping only ``axis`` (a name or several: the in/out specs of a shard_map
    over those axes)."""
    keep = (axis,) if isinstance(axis, str) else tuple(axis)
    out = []
    for e in spec:
        kept = tuple(a for a in entry_axes(e) if a in keep)
        out.append(None if not kept else (kept[0] if len(kept) == 1 else kept))
    return PartitionSpec(*out)


def spec_without(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """``spec`` with ``axis`` removed from every entry."""
    return PartitionSpec(*(tuple(a for a in entry_axes(e) if a != axis) or None for e in spec))


def rules_without(rules: Sequence[tuple[str, MeshAxes]], axis: str) -> list[tuple[str, MeshAxes]]:
    """The rules with ``axis`` removed (inside a shard_map that makes it manual)."""
    out = []
    for name, axes in rules:
        rest = tuple(a for a in entry_axes(axes) if a != axis)
        out.append((name, rest[0] if len(rest) == 1 else (rest or None)))
    return out


def make_rules(cfg) -> tuple[tuple[str, MeshAxes], ...]:
    """The axis rules of a config: :data:`DEFAULT_RULES` plus

    * ``sequence_parallel``: the residual stream's ``activation_length`` split over
      "tensor" (Megatron-Core sequence parallelism, Korthikanti et al. 2022);
    * ``use_megatron_fsdp``: every parameter's ``embed`` axis split over "data", and over
      "context" too under context parallelism (parameters, gradients and optimizer state
      sharded, ZeRO-3, over Megatron-FSDP's data x context group);
    * ``pipeline_model_parallel_size > 1``: the stacked decoder layers' ``layers`` axis split
      over "pipeline" (jmegatron.parallel.pipeline_layout);
    * ``expert_model_parallel_size > 1``: the batch split over "data" and "expert" together
      (Megatron carves expert parallelism out of data parallelism: the expert ranks are data
      ranks for everything but the experts, whose ``exp`` axis is split over "expert").
    """
    table = dict(DEFAULT_RULES)
    table["activation_length"] = "tensor" if cfg.sequence_parallel else None
    if cfg.pipeline_model_parallel_size > 1:  # the stacked decoder layers, in stage order
        table["layers"] = "pipeline"
    if cfg.use_megatron_fsdp:  # over data x context under context parallelism (Megatron-FSDP's dp-cp group)
        table["embed"] = (DATA_AXIS, CONTEXT_AXIS) if cfg.context_parallel_size > 1 else DATA_AXIS
    if cfg.expert_model_parallel_size > 1:
        table["batch"] = batch_axes(cfg.expert_model_parallel_size)
    return tuple(table.items())


def batch_axes(expert_model_parallel_size: int) -> str | tuple[str, str]:
    """The mesh axes the batch is split over: "data", and "expert" too under expert
    parallelism (data-major: rank ``d * ep + e``)."""
    return (DATA_AXIS, EXPERT_AXIS) if expert_model_parallel_size > 1 else DATA_AXIS


def data_parallel_size(mesh: Mesh) -> int:
    """Megatron's data-parallel size: the ranks that split the batch ("data" x "expert")."""
    return mesh.shape[DATA_AXIS] * mesh.shape.get(EXPERT_AXIS, 1)


def batch_shardings(mesh: Mesh, segment_ids: bool = False, extra_keys: tuple = ()) -> dict[str, NamedSharding]:
    """NamedShardings of a batch's arrays ``[num_micro, batch, seq]``: the batch over
    :func:`batch_axes` (data, and expert under expert parallelism), the sequence over
    "context" under context parallelism, micro-batches unsplit. Keys ``tokens``, ``labels``,
    ``loss_mask``, ``position_ids``, ``positions`` under context parallelism (each slot's
    sequence position, :func:`jmegatron.parallel.context_parallel.load_balance_index`), and
    ``segment_ids`` when ``segment_ids`` (``reset_attention_mask``); each of
    ``extra_keys`` (a forward step's ``batch_keys``: ``[num_micro, batch, seq, ...]``) the
    same, its trailing axis whole."""
    cp = mesh.shape.get(CONTEXT_AXIS, 1)
    spec = PartitionSpec(None, batch_axes(mesh.shape.get(EXPERT_AXIS, 1)), CONTEXT_AXIS if cp > 1 else None)
    s = NamedSharding(mesh, spec)
    out = {"tokens": s, "labels": s, "loss_mask": s, "position_ids": s}
    if cp > 1:
        out["positions"] = s
    out.update({k: NamedSharding(mesh, PartitionSpec(*spec, None)) for k in extra_keys})
    return dict(out, segment_ids=s) if segment_ids else out


def stop_flag_sharding(mesh: Mesh) -> NamedSharding:
    """The layout of the train step's ``stop`` input: float32 ``[mesh size]``, one entry per
    device, split over every mesh axis (each process fills its own devices' entries)."""
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
