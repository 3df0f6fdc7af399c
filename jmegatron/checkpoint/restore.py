"""Every way a checkpoint is read back, from one :class:`~jmegatron.checkpoint.metadata.SavedStep`.

* :func:`restore`: the whole TrainState into target shardings (resume), any saved
  decoder-layer layout converted (:func:`jmegatron.checkpoint.layout.convert_layers`);
* :func:`restore_params`: the parameters only (the model's, or the float32 main
  parameters), each device reading its own shards (evaluation, generation, a teacher);
* :func:`read_saved_params`: the parameters as float32 NumPy on the host, per-layer
  layout, no model built (export);
* :class:`CheckpointParamsReader`: the same, one decoder layer at a time through
  TensorStore (the streaming Hugging Face export).

No optimizer moment, step or rng is read by the last three. The roles follow Megatron-LM's
megatron/training/checkpointing.py ``load_checkpoint`` and megatron/core/dist_checkpointing
(a checkpoint restorable into another parallel layout).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from jmegatron.checkpoint.checkpointing import Checkpointer, CheckpointError
from jmegatron.checkpoint.layout import LAYER_RE, STACKED_KEY, LayerLayout, convert_layers
from jmegatron.checkpoint.metadata import SavedStep

__all__ = ["MAIN_PARAMS_PATH", "PARAMS_SOURCES", "CheckpointParamsReader", "map_tree", "read_saved_params", "restore",
           "restore_params", "saved_params_path", "storage_flags", "tree_paths"]


def _convert_on_mesh(tree: Any, target: Any, saved: LayerLayout, run: LayerLayout, num_layers: int) -> Any:
    """``tree`` (restored in the ``saved`` layout) moved to ``run``'s inside one jitted
    program, placed in ``target``'s shardings."""
    shardings = jax.tree.map(lambda t: t.sharding, target)
    out = jax.jit(lambda s: convert_layers(s, saved, run, num_layers), out_shardings=shardings)(tree)
    print(f"[jmegatron] converted checkpoint layers from {saved.describe()} to {run.describe()}", flush=True)
    return out


def restore(ckpt: Checkpointer, target: Any, cfg: Any, iteration: Optional[int] = None) -> tuple[Any, dict]:
    """(state, meta): checkpoint ``ckpt`` restored into ``target`` (ShapeDtypeStructs with
    shardings, in the layout of the run's config ``cfg``).

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
    return _convert_on_mesh(state, target, saved, run, num_layers), meta


# ------------------------------------------------------------------ parameters only
# Where a checkpoint's parameters live in its ``state`` item: "model" = the model's params
# (float32, or the bf16 / fp16 copy under bf16 / fp16); "main" = the float32 main params
# (Float16OptimizerState.main_params under bf16 / fp16; the model's params of a float32 run).
PARAMS_SOURCES = ("model", "main")
MAIN_PARAMS_PATH = ("opt_state", "main_params")


def saved_params_path(saved_tree: Mapping, source: str = "model") -> tuple[str, ...]:
    """The path of the parameters ``source`` (:data:`PARAMS_SOURCES`) asks for in a saved
    state tree (:attr:`SavedStep.tree`): ``("params",)`` for "model", and for "main"
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


def _partial_restore(saved: SavedStep, path: Sequence[str], target: Any, restore_args: Any) -> Any:
    """Orbax's partial restore of the subtree at ``path`` of ``saved``'s ``state`` item:
    nothing else is read. Raises CheckpointError naming the step."""
    try:
        restored = ocp.PyTreeCheckpointer().restore(saved.state_dir, args=ocp.args.PyTreeRestore(
            item=_nest(path, target), restore_args=_nest(path, restore_args), partial_restore=True))
    except Exception as e:  # orbax / tensorstore raise several types for unreadable arrays
        raise CheckpointError(f"checkpoint step {saved.step} in {saved.directory}: cannot read its parameters "
                              f"({'/'.join(path)}): {type(e).__name__}: {e}") from e
    return _dig(restored, path)


def restore_params(ckpt: Checkpointer, target: Any, cfg: Any, iteration: Optional[int] = None,
                   source: str = "model") -> tuple[Any, dict]:
    """(params, meta): only the parameters of checkpoint ``ckpt``, restored straight into
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
    step = SavedStep.of(ckpt, iteration)
    path = saved_params_path(step.tree, source)
    num_layers = step.num_layers
    saved, run = step.layout, LayerLayout.of_config(cfg)
    same = saved.same_storage(run, num_layers)
    read_target = target if same else convert_layers(target, run, saved, num_layers)
    _check_against_saved(read_target, _dig(step.tree, path), "/".join(path), step.state_dir)
    restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, dtype=t.dtype,
                                                               global_shape=t.shape), read_target)
    params = _partial_restore(step, path, read_target, restore_args)
    if not same:
        params = _convert_on_mesh(params, target, saved, run, num_layers)
    return params, step.meta


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


# ------------------------------------------------------------------ host numpy
def tree_paths(tree, prefix=()):
    """(path tuple of str keys, leaf) of every leaf of a nested mapping, depth first."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from tree_paths(v, prefix + (str(k),))
    else:
        yield prefix, tree


def map_tree(fn, tree):
    """``tree`` (nested mappings) with ``fn`` applied to every leaf, as plain dicts."""
    if isinstance(tree, Mapping):
        return {k: map_tree(fn, v) for k, v in tree.items()}
    return fn(tree)


def read_saved_params(step: SavedStep) -> dict:
    """The checkpoint step's model ``params`` (:meth:`SavedStep.model_params`: auxiliary
    modules are not read) as float32 numpy in the per-layer layout (``decoder_layers_{i}``),
    restored from the on-disk tree itself (host numpy, no model built, no sharding;
    Orbax's partial restore of the ``params`` subtree, no optimizer state), so leaves the
    installed model does not declare (``fp8_meta`` of an FP8 run) come back too. Stacked
    layouts (``scan_layers``, pipeline stage order, uneven stages) are converted by
    :func:`convert_layers`. Raises CheckpointError for unreadable arrays."""
    params_md = step.model_params()
    target = map_tree(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), params_md)
    restore_args = map_tree(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), params_md)
    params = map_tree(lambda a: np.asarray(a, dtype=np.float32),
                      dict(_partial_restore(step, ("params",), target, restore_args)))
    per_layer = LayerLayout(False)
    if not step.layout.same_storage(per_layer, step.num_layers):
        params = convert_layers(params, step.layout, per_layer, step.num_layers)
    return params


# ------------------------------------------------------------------ streaming
def storage_flags(state_dir: str) -> tuple[bool, bool]:
    """(use_ocdbt, use_zarr3) of an Orbax PyTree item, from its ``_METADATA`` (Orbax's
    defaults, OCDBT and zarr v2, when the file does not say)."""
    try:
        with open(os.path.join(state_dir, "_METADATA")) as f:
            md = json.load(f)
    except (OSError, ValueError):
        return True, False
    return bool(md.get("use_ocdbt", True)), bool(md.get("use_zarr3", False))


class CheckpointParamsReader:
    """The parameters of a checkpoint step read piece by piece, as float32 NumPy.

    ``read_common()``: everything under ``params`` except the decoder layers and
    auxiliary modules (a distillation run's ``kd_projection``); ``read_layer(i)``: model
    layer ``i``'s per-layer subtree (the names of ``decoder_layers_{i}``, whatever layout
    the checkpoint stores). Both read single arrays through TensorStore (the store Orbax
    writes): a per-layer checkpoint's ``decoder_layers_{i}`` arrays whole, a stacked one's
    (``scan_layers``, pipeline stage order) slot of layer ``i`` only (``array[slot]``:
    TensorStore reads the chunks that hold it; Orbax writes one chunk per saved shard, so
    the transient read buffer of a stack whose layers axis was not sharded spans all its
    layers for that shard). No optimizer moment, main parameter copy, step or rng is read.

    Attributes: ``saved`` (the :class:`SavedStep`), ``num_layers``, ``bytes_read`` (array
    bytes read so far, in the stored dtype).

    Raises CheckpointError for a stored layer tree that does not match the saved config
    (names the path), an unreadable array, or a layer outside ``[0, num_layers)``.
    """

    def __init__(self, saved: SavedStep):
        self.saved = saved
        self.bytes_read = 0
        self._params = saved.model_params()
        self.num_layers = saved.num_layers
        layout = saved.layout
        self._slot = None
        if layout.stacked:
            order = layout.order(self.num_layers)
            self._slot = {int(layer): slot for slot, layer in enumerate(order) if layer >= 0}
            if STACKED_KEY not in self._params:
                raise CheckpointError(f"{saved.directory}: the saved config stores the layers {layout.describe()} "
                                      f"but params hold no 'decoder_layers'")
        else:
            missing = [i for i in range(self.num_layers) if f"decoder_layers_{i}" not in self._params]
            if missing:
                raise CheckpointError(f"{saved.directory}: params lack decoder_layers_{missing[0]} "
                                      f"(num_layers={self.num_layers})")
        self._use_ocdbt, self._use_zarr3 = storage_flags(saved.state_dir)
        # one context: the OCDBT manifest and B-tree nodes are opened once; no data cache
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                                    "cache_pool#ocdbt": {"total_bytes_limit": 0}})

    # the stored array of one metadata leaf, all of it or one slot of its leading axis
    def _read(self, leaf, slot: Optional[int] = None) -> np.ndarray:
        info = ocp.type_handlers.ParamInfo(name=leaf.name, parent_dir=epath.Path(self.saved.state_dir),
                                           is_ocdbt_checkpoint=self._use_ocdbt, use_zarr3=self._use_zarr3,
                                           ts_context=self._context)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._use_ocdbt)
        try:
            store = ts.open(spec, context=self._context, open=True, read=True).result()
            data = (store if slot is None else store[slot]).read().result()
        except Exception as e:  # tensorstore raises ValueError / RuntimeError variants
            raise CheckpointError(f"{self.saved.directory}: cannot read {leaf.name} of step {self.saved.step}: "
                                  f"{type(e).__name__}: {e}") from e
        self.bytes_read += int(data.nbytes)
        return data if data.dtype == np.float32 else data.astype(np.float32)

    def read_common(self) -> dict:
        """Float32 numpy tree of the parameters outside the decoder layers."""
        rest = {k: v for k, v in self._params.items() if k != STACKED_KEY and not LAYER_RE.match(str(k))}
        return map_tree(self._read, rest)

    def read_layer(self, i: int) -> dict:
        """Float32 numpy tree of model decoder layer ``i`` (the per-layer names). Raises
        CheckpointError for ``i`` outside ``[0, num_layers)``."""
        if not 0 <= i < self.num_layers:
            raise CheckpointError(f"decoder layer {i} is outside [0, {self.num_layers}) (num_layers)")
        if self._slot is None:
            return map_tree(self._read, self._params[f"decoder_layers_{i}"])
        slot = self._slot[i]
        return map_tree(lambda leaf: self._read(leaf, slot), self._params[STACKED_KEY])
