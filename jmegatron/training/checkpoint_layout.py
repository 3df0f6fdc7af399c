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
layouts; :func:`restore` restores a checkpoint saved in one layout into a run using
another, bit-exactly. The roles follow Megatron-LM's
megatron/core/dist_checkpointing (checkpoints restorable into another parallel layout),
where the layer index in a sharded tensor's key is global; here the layer order is
recorded through the saved config's (scan_layers, p, v).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jmegatron.parallel.pipeline_layout import PAD, PipelineLayout, take_slots
from jmegatron.training.checkpointing import CheckpointError

__all__ = ["LayerLayout", "convert_layers", "restore", "PARAMS_SOURCES", "state_item_dir", "saved_state_metadata",
           "saved_params_path", "restore_params"]

STACKED_KEY = "decoder_layers"
_LAYER_RE = re.compile(r"^decoder_layers_(\d+)$")


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
    return isinstance(x, Mapping) and any(k == STACKED_KEY or _LAYER_RE.match(str(k)) for k in x)


def _rebuild(node: Mapping, items: dict):
    try:
        return type(node)(items)
    except TypeError:
        return items


def _convert_container(node: Mapping, where: str, source: LayerLayout, target: LayerLayout,
                       num_layers: int):
    per_layer = sorted((k for k in node if _LAYER_RE.match(str(k))), key=lambda k: int(_LAYER_RE.match(k)[1]))
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


# ---------------------------------------------------------------------------- restore
def restore(ckpt, target: Any, cfg: Any, iteration: Optional[int] = None) -> tuple[Any, dict]:
    """(state, meta): checkpoint ``ckpt`` (a :class:`jmegatron.training.checkpointing.
    Checkpointer`) restored into ``target`` (ShapeDtypeStructs with shardings, in the
    layout of the run's config ``cfg``).

    When the checkpoint's saved config stores its layers as ``cfg`` does, this is
    ``ckpt.restore(target, iteration)``. Otherwise the checkpoint is restored in its saved
    layout (``target`` converted there, same shardings with an unsharded layers axis),
    converted to ``cfg``'s layout inside one jitted program, and placed in ``target``'s
    shardings: bit-equal arrays. Raises CheckpointError (from ``ckpt``) for a missing or
    corrupt checkpoint, ValueError when ``target`` is not a layer tree.
    """
    meta = ckpt.read_meta(iteration)
    num_layers = int(meta["config"]["num_layers"])
    saved, run = LayerLayout.of_config(meta["config"]), LayerLayout.of_config(cfg)
    if saved.same_storage(run, num_layers):
        return ckpt.restore(target, iteration)
    state, meta = ckpt.restore(convert_layers(target, run, saved, num_layers), iteration)
    shardings = jax.tree.map(lambda s: s.sharding, target)
    state = jax.jit(lambda s: convert_layers(s, saved, run, num_layers), out_shardings=shardings)(state)
    print(f"[jmegatron] converted checkpoint layers from {saved.describe()} to {run.describe()}", flush=True)
    return state, meta


# ------------------------------------------------------------------ parameters only
# Where a checkpoint's parameters live in its ``state`` item: "model" = the model's params
# (float32, or the bf16 / fp16 copy under bf16 / fp16); "main" = the float32 main params
# (Float16OptimizerState.main_params under bf16 / fp16; the model's params of a float32 run).
PARAMS_SOURCES = ("model", "main")
MAIN_PARAMS_PATH = ("opt_state", "main_params")


def state_item_dir(ckpt, iteration: Optional[int] = None) -> tuple[str, int]:
    """(directory of the ``state`` item, step) of checkpoint ``ckpt`` (a
    :class:`jmegatron.training.checkpointing.Checkpointer`) at ``iteration`` (default: the
    latest). Orbax's default step naming (``<directory>/<step>/state``). Raises
    CheckpointError for a missing step or item."""
    import os

    meta = ckpt.read_meta(iteration)  # CheckpointError for a step it does not hold
    # the step whose meta was read (Checkpointer's choice of the latest usable one)
    step = int(iteration if iteration is not None else meta.get("iteration", ckpt.latest_step()))
    path = os.path.join(ckpt.directory, str(step), "state")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory} has no state item at {path}")
    return path, step


def saved_state_metadata(state_dir: str) -> dict:
    """The ``state`` item's tree of Orbax ``ArrayMetadata`` (shape, dtype, saved sharding),
    nested dicts keyed like the saved TrainState (``step``, ``params``, ``opt_state``,
    ``rng``); reads no array. Raises CheckpointError for an unreadable item."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        tree = ocp.StandardCheckpointHandler().metadata(epath.Path(state_dir))
    except Exception as e:  # orbax raises several types for unreadable metadata
        raise CheckpointError(f"cannot read the array metadata of {state_dir}: {type(e).__name__}: {e}") from e
    return dict(getattr(tree, "tree", tree))


def saved_params_path(saved_tree: Mapping, source: str = "model") -> tuple[str, ...]:
    """The path of the parameters ``source`` (:data:`PARAMS_SOURCES`) asks for in a saved
    state tree (:func:`saved_state_metadata`): ``("params",)`` for "model", and for "main"
    ``("opt_state", "main_params")`` when the checkpoint holds float32 main parameters
    (a bf16 / fp16 run), else ``("params",)`` (a float32 run's model params are its main
    params). Raises ValueError for another ``source``."""
    if source not in PARAMS_SOURCES:
        raise ValueError(f"params source {source!r} is not one of {PARAMS_SOURCES}: 'model' = the model's params "
                         f"(bf16 under bf16), 'main' = the float32 main params")
    opt = saved_tree.get("opt_state")
    if source == "main" and isinstance(opt, Mapping) and isinstance(opt.get("main_params"), Mapping):
        return MAIN_PARAMS_PATH
    return ("params",)


def _nest(path: Sequence[str], value):
    for k in reversed(tuple(path)):
        value = {k: value}
    return value


def _dig(tree, path: Sequence[str]):
    for k in path:
        tree = tree[k]
    return tree


def restore_params(ckpt, target: Any, cfg: Any, iteration: Optional[int] = None,
                   source: str = "model") -> tuple[Any, dict]:
    """(params, meta): only the parameters of checkpoint ``ckpt`` (a
    :class:`jmegatron.training.checkpointing.Checkpointer`), restored straight into
    ``target`` (a params tree of ShapeDtypeStructs carrying NamedShardings, in the layer
    layout of the run's config ``cfg``).

    Orbax's partial restore of one subtree of the ``state`` item: ``params`` (``source=
    "model"``) or, for ``source="main"``, the float32 main parameters
    (``opt_state/main_params``) of a bf16 / fp16 checkpoint (:func:`saved_params_path`).
    No optimizer moment, step or rng is read, and each device reads only its own shard of
    each array (no gather onto one device). Leaves are cast to ``target``'s dtypes.
    Checkpoint entries ``target`` lacks (a distillation run's ``kd_projection``) are not
    read. A checkpoint stored in another decoder-layer layout (scan_layers, pipeline stage
    order) is restored in its own layout, same shardings with an unsharded layers axis,
    and converted inside one jitted program into ``target``'s shardings
    (:func:`convert_layers`, as :func:`restore`).

    Raises CheckpointError naming the step directory when a parameter ``target`` asks for
    is missing from the checkpoint or has another shape (a different model), or the
    checkpoint is unreadable; ValueError for an unknown ``source``.
    """
    import orbax.checkpoint as ocp

    meta = ckpt.read_meta(iteration)
    state_dir, step = state_item_dir(ckpt, iteration)
    saved_tree = saved_state_metadata(state_dir)
    path = saved_params_path(saved_tree, source)
    num_layers = int(meta["config"]["num_layers"])
    saved, run = LayerLayout.of_config(meta["config"]), LayerLayout.of_config(cfg)
    same = saved.same_storage(run, num_layers)
    read_target = target if same else convert_layers(target, run, saved, num_layers)
    _check_against_saved(read_target, _dig(saved_tree, path), "/".join(path), state_dir)
    restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, dtype=t.dtype,
                                                               global_shape=t.shape), read_target)
    try:
        restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
            item=_nest(path, read_target), restore_args=_nest(path, restore_args), partial_restore=True))
    except Exception as e:  # orbax / tensorstore raise several types for unreadable arrays
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory}: cannot read its parameters "
                              f"({'/'.join(path)}): {type(e).__name__}: {e}") from e
    params = _dig(restored, path)
    if not same:
        shardings = jax.tree.map(lambda t: t.sharding, target)
        params = jax.jit(lambda p: convert_layers(p, saved, run, num_layers), out_shardings=shardings)(params)
        print(f"[jmegatron] converted checkpoint layers from {saved.describe()} to {run.describe()}", flush=True)
    return params, meta


def _check_against_saved(target: Any, saved: Any, where: str, state_dir: str) -> None:
    """Raise CheckpointError naming each target leaf the saved tree lacks or holds with
    another shape (before any array is read)."""
    problems = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        node = saved
        for k in keys:
            node = node.get(k) if isinstance(node, Mapping) else None
        name = "/".join([where] + keys)
        if node is None or isinstance(node, Mapping):
            problems.append(f"{name} is missing")
        elif tuple(node.shape) != tuple(leaf.shape):
            problems.append(f"{name} has shape {tuple(node.shape)}, the model expects {tuple(leaf.shape)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {state_dir} does not hold this model's parameters: {shown}. "
                              f"Restore it with its own config (the meta's) or check --load.")
