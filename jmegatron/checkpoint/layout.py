"""Checkpoints across decoder-layer layouts: per-layer, stacked, and stacked in stage order.

A TrainState stores the decoder layers' parameters (and the optimizer moments that mirror
them) in one of three ways:

* **per-layer** (``scan_layers=False``, no pipeline): ``decoder_layers_0 ..
  decoder_layers_{L-1}``, each a subtree of one layer's arrays;
* **stacked** (``scan_layers=True``): one ``decoder_layers`` subtree whose leaves carry a
  leading ``[L]`` axis (``nn.scan``'s layout, logical axis ``layers``), in model order;
* **stacked in stage order** (``pipeline_model_parallel_size`` p > 1, always stacked): the
  stack is split over the ``pipeline`` mesh axis in contiguous blocks and, with v > 1
  interleaved chunks per stage, stored in the stage order of
  :class:`jmegatron.parallel.pipeline_layout.PipelineLayout` (the identity for v = 1);
  uneven stages (``decoder_first/last_pipeline_num_layers``) add zero padding slots.

:func:`convert_layers` moves any pytree holding such parameter trees (params, optax's
``mu``/``nu`` inside chained or masked states, abstract ShapeDtypeStruct trees) between
layouts; :mod:`jmegatron.checkpoint.restore` restores a checkpoint saved in one layout into a run
using another, bit-exactly. :func:`step_dir` / :func:`item_dir` name a step's folders. The roles follow Megatron-LM's
megatron/core/dist_checkpointing (checkpoints restorable into another parallel layout),
where the layer index in a sharded tensor's key is global; here the layer order is
recorded through the saved config's (scan_layers, p, v).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jmegatron.parallel.pipeline_layout import PAD, PipelineLayout, take_slots

__all__ = ["ITEMS", "LAYER_RE", "STACKED_KEY", "LayerLayout", "convert_layers", "item_dir", "step_dir"]

# The stacked layers' key, and a per-layer key (group 1: the model layer number).
STACKED_KEY = "decoder_layers"
LAYER_RE = re.compile(r"^decoder_layers_(\d+)$")
# The items of every step (Orbax CheckpointManager item names): the TrainState arrays and the JSON meta.
ITEMS = ("state", "meta")


def step_dir(directory: str, step: int) -> str:
    """``<directory>/<step>``: Orbax's default step naming (a finished step; a killed save
    leaves ``<step>.orbax-checkpoint-tmp*`` instead), absolute."""
    return os.path.join(os.path.abspath(directory), str(int(step)))


def item_dir(directory: str, step: int, item: str = "state") -> str:
    """``<directory>/<step>/<item>``: the folder of one item (:data:`ITEMS`) of a step."""
    return os.path.join(step_dir(directory, step), item)


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """How a state stores its decoder layers. ``stacked``: one ``decoder_layers`` subtree
    with a leading slots axis (else ``decoder_layers_{i}``); ``pipeline_size`` (p),
    ``virtual_size`` (v) and the uneven first/last stage sizes give the stage order of
    the stack (only meaningful when stacked)."""

    stacked: bool
    pipeline_size: int = 1
    virtual_size: int = 1
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    @classmethod
    def of_config(cls, cfg: Any) -> "LayerLayout":
        """The layout a run of ``cfg`` (a :class:`jmegatron.config.JMegatronConfig` or a
        checkpoint meta's saved ``config`` dict) stores: stacked iff ``scan_layers`` or
        ``pipeline_model_parallel_size > 1``, in the stage order of (p, v). Saved configs
        older than the pipeline fields read as p = v = 1."""
        get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
        p = int(get("pipeline_model_parallel_size", 1) or 1)
        if hasattr(cfg, "virtual_pipeline_size"):
            v = cfg.virtual_pipeline_size()
        else:
            v = _virtual_size(int(get("num_layers")), p, get("virtual_pipeline_model_parallel_size", None),
                              get("num_layers_per_virtual_pipeline_stage", None))
        stacked = bool(get("scan_layers", False)) or p > 1
        first, last = get("decoder_first_pipeline_num_layers", None), get("decoder_last_pipeline_num_layers", None)
        return cls(stacked, p, v, first, last) if stacked else cls(False)

    def pipeline(self, num_layers: int) -> PipelineLayout:
        return PipelineLayout(num_layers, self.pipeline_size, self.virtual_size, self.first_stage_layers,
                              self.last_stage_layers)

    def order(self, num_layers: int) -> Optional[np.ndarray]:
        """int64 ``[slots]``: the model layer at each stored slot of the stack
        (:data:`~jmegatron.parallel.pipeline_layout.PAD` for padding), or None for the
        per-layer layout."""
        if not self.stacked:
            return None
        return self.pipeline(num_layers).order()

    def same_storage(self, other: "LayerLayout", num_layers: int) -> bool:
        """True when both layouts store identical trees (e.g. stacked with v = 1 for any p)."""
        a, b = self.order(num_layers), other.order(num_layers)
        return (a is None) == (b is None) and (a is None or bool(np.array_equal(a, b)))

    def describe(self) -> str:
        if not self.stacked:
            return "per-layer (decoder_layers_{i})"
        uneven = (f", first/last stage {self.first_stage_layers}/{self.last_stage_layers} layers"
                  if self.first_stage_layers is not None or self.last_stage_layers is not None else "")
        return (f"stacked (decoder_layers [L]) in the stage order of pp={self.pipeline_size}, "
                f"v={self.virtual_size}{uneven}")


def _virtual_size(num_layers: int, p: int, v: Optional[int], per_stage: Optional[int]) -> int:
    # JMegatronConfig.virtual_pipeline_size's rule, for saved config dicts too
    if per_stage:
        return num_layers // (p * per_stage)
    return int(v or 1)


# ----------------------------------------------------------------------------- leaf ops
# Each works on numpy arrays (host), jax arrays / tracers, and ShapeDtypeStructs (restore
# targets: the sharding gains or loses the leading layers axis, unsharded).

def _is_abstract(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _is_host(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


def _leading(x) -> Optional[int]:
    shape = np.shape(x) if not _is_abstract(x) else x.shape
    return shape[0] if len(shape) else None


def _stack_sharding(sharding, add: bool):
    if not isinstance(sharding, NamedSharding):
        return sharding  # None, single-device or fully replicated: valid at any rank
    spec = tuple(sharding.spec)
    spec = (None,) + spec if add else spec[1:]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _stack(leaves: Sequence):
    first = leaves[0]
    if _is_abstract(first):
        return jax.ShapeDtypeStruct((len(leaves),) + tuple(first.shape), first.dtype,
                                    sharding=_stack_sharding(first.sharding, add=True))
    if all(_is_host(x) for x in leaves):
        return np.stack(leaves, axis=0)
    return jnp.stack(leaves, axis=0)


def _take(stack, index: np.ndarray):
    """``stack[index]`` along the leading axis, zeros where ``index`` is PAD."""
    if _is_abstract(stack):
        if len(index) == stack.shape[0]:
            return stack
        # another slot count: the leading axis loses its sharding (it may not divide)
        sharding = _stack_sharding(_stack_sharding(stack.sharding, add=False), add=True)
        return jax.ShapeDtypeStruct((len(index),) + tuple(stack.shape[1:]), stack.dtype, sharding=sharding)
    return take_slots(stack, index)


def _layer(stack, i: int):
    if _is_abstract(stack):
        return jax.ShapeDtypeStruct(tuple(stack.shape[1:]), stack.dtype,
                                    sharding=_stack_sharding(stack.sharding, add=False))
    return stack[i]


# ------------------------------------------------------------------------- conversion
def _is_container(x) -> bool:
    return isinstance(x, Mapping) and any(k == STACKED_KEY or LAYER_RE.match(str(k)) for k in x)


def _rebuild(node: Mapping, items: dict):
    try:
        return type(node)(items)
    except TypeError:
        return items


def _convert_container(node: Mapping, where: str, source: LayerLayout, target: LayerLayout,
                       num_layers: int):
    per_layer = sorted((k for k in node if LAYER_RE.match(str(k))), key=lambda k: int(LAYER_RE.match(k)[1]))
    has_stack = STACKED_KEY in node
    if has_stack and per_layer:
        raise ValueError(f"{where} holds both a stacked {STACKED_KEY!r} and per-layer {per_layer[0]!r}...: "
                         f"neither layout")
    if source.stacked and not has_stack:
        raise ValueError(f"{where} holds per-layer decoder_layers_{{i}} but the source layout is "
                         f"{source.describe()}")
    if not source.stacked:
        if has_stack:
            raise ValueError(f"{where} holds a stacked {STACKED_KEY!r} but the source layout is "
                             f"{source.describe()}")
        expected = [f"decoder_layers_{i}" for i in range(num_layers)]
        if per_layer != expected:
            raise ValueError(f"{where} holds layers {per_layer}, expected decoder_layers_0.."
                             f"decoder_layers_{num_layers - 1} (num_layers={num_layers})")
    rest = {k: v for k, v in node.items() if k != STACKED_KEY and k not in per_layer}
    src_order, tgt_order = source.order(num_layers), target.order(num_layers)

    if source.stacked:
        stack = node[STACKED_KEY]
        for path, leaf in jax.tree_util.tree_leaves_with_path(stack):
            if _leading(leaf) != len(src_order):
                raise ValueError(f"{where}[{STACKED_KEY!r}]{jax.tree_util.keystr(path)} has shape "
                                 f"{tuple(np.shape(leaf) if not _is_abstract(leaf) else leaf.shape)}, "
                                 f"expected a leading axis of {len(src_order)} slots (num_layers={num_layers})")
        real = src_order != PAD
        position_of = np.empty(num_layers, np.int64)
        position_of[src_order[real]] = np.nonzero(real)[0]
        if tgt_order is not None:
            if np.array_equal(src_order, tgt_order):
                return node
            index = np.where(tgt_order != PAD, position_of[np.maximum(tgt_order, 0)], PAD)
            rest[STACKED_KEY] = jax.tree.map(lambda a: _take(a, index), stack)
        else:
            for i in range(num_layers):
                rest[f"decoder_layers_{i}"] = jax.tree.map(lambda a, j=int(position_of[i]): _layer(a, j), stack)
        return _rebuild(node, rest)

    if tgt_order is None:
        return node
    layers = [node[f"decoder_layers_{int(max(i, 0))}"] for i in tgt_order]
    try:
        stacked = jax.tree.map(lambda *ls: _stack(ls), *layers)
    except ValueError as e:
        raise ValueError(f"{where}: the per-layer subtrees differ in structure, cannot stack them: {e}") from e
    if (tgt_order == PAD).any():  # padding slots (uneven stages) hold zeros
        identity = np.where(tgt_order == PAD, PAD, np.arange(len(tgt_order)))
        stacked = jax.tree.map(lambda a: _take(a, identity), stacked)
    rest[STACKED_KEY] = stacked
    return _rebuild(node, rest)


def convert_layers(tree: Any, source: LayerLayout, target: LayerLayout, num_layers: int) -> Any:
    """``tree`` with every decoder-layer container moved from ``source`` to ``target``.

    A container is any mapping holding ``decoder_layers`` or ``decoder_layers_{i}`` keys:
    the params, and each params-shaped tree inside the optimizer state (optax's ``mu`` /
    ``nu``, masked states' MaskedNode leaves included); everything else (embeddings, final
    norm, scalars, the rng, auxiliary modules) passes through untouched. Stacked leaves
    are ``[num_layers, ...]``, per-layer leaves ``[...]``; values are moved, never computed
    (gathers and stacks), so the result is bit-equal and keeps every dtype. Leaves may be
    numpy arrays (result numpy), jax arrays or tracers (result jax), or ShapeDtypeStructs
    (a restore target: a NamedSharding gains/loses an unsharded leading axis).

    Raises ValueError naming the path of a container that matches neither ``source``'s
    form nor ``num_layers`` (missing or extra layers, wrong leading axis), or when the
    tree holds no decoder layers at all.
    """
    found = []

    def convert(path, node):
        if not _is_container(node):
            return node
        where = "<root>" if not path else jax.tree_util.keystr(path)
        found.append(where)
        return _convert_container(node, where, source, target, num_layers)

    out = jax.tree_util.tree_map_with_path(convert, tree, is_leaf=_is_container)
    if not found:
        raise ValueError("the tree holds no decoder layers (neither 'decoder_layers' nor 'decoder_layers_{i}' "
                         "keys): not a GPT TrainState / params tree")
    return out
