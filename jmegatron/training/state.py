"""The train state and its sharded initialisation.

The state is a pytree of arrays only (what Orbax saves): ``step`` (iterations taken,
int32 scalar), the model's ``params`` (float32; bfloat16 / float16 under ``bf16`` / ``fp16``),
the optimizer's ``opt_state`` (optax's; under bf16 / fp16 a
:class:`~jmegatron.training.float16_optimizer.Float16OptimizerState` holding the float32 main
parameters) and the base ``rng`` (uint32 [2] raw PRNG key) from which every iteration's
dropout key is derived.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jmegatron.models.fp8 import is_fp8_meta
from jmegatron.parallel import pipeline_layout, rules as rules_lib
from jmegatron.parallel.distributed_optimizer import zero1_shardings
from jmegatron.training.float16_optimizer import Float16Optimizer, Float16OptimizerState


@flax.struct.dataclass
class TrainState:
    """``step`` int32 scalar (iterations taken); ``params`` the model's parameters (float32,
    or the bf16 / fp16 model copy); ``opt_state`` optax AdamW state (float32 moments; under
    bf16 / fp16 wrapped with the float32 main parameters); ``rng`` uint32 [2] raw base key."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def _dummy_tokens(seq_length: int) -> jax.Array:
    return jnp.zeros((1, seq_length), jnp.int32)


AuxModules = Optional[Mapping[str, tuple[nn.Module, tuple[int, ...]]]]


def _init_params(model: nn.Module, key: jax.Array, seq_length: int, aux: AuxModules) -> dict:
    """The model's boxed params, plus one top-level entry per auxiliary trainable module
    (``name -> (module, example input shape)``), each initialised with its own key folded
    from ``key`` so the model's own initialisation does not depend on ``aux``."""
    params = dict(model.init({"params": key}, _dummy_tokens(seq_length))["params"])
    for i, (name, (module, shape)) in enumerate(sorted((aux or {}).items())):
        if name in params:
            raise ValueError(f"auxiliary module name {name!r} collides with a model parameter")
        params[name] = module.init({"params": jax.random.fold_in(key, 1_000_003 + i)},
                                   jnp.zeros(shape, jnp.float32))["params"]
    return params


def stored_layer_index(cfg: Any) -> Optional[np.ndarray]:
    """int ``[num_slots]``: the model layer at each stored slot of the stacked decoder layers
    of a :class:`jmegatron.config.JMegatronConfig`'s pipeline layout
    (:data:`jmegatron.parallel.pipeline_layout.PAD` for uneven stages' padding), or None
    when they are stored in model order (no pipeline, or one even chunk per stage)."""
    if cfg.pipeline_model_parallel_size == 1:
        return None
    index = pipeline_layout.gather_index(pipeline_layout.PipelineLayout(cfg.num_layers), cfg.pipeline_layout())
    return None if np.array_equal(index, np.arange(cfg.num_layers)) else index


def store_layers(params: dict, layer_index: Optional[np.ndarray]) -> dict:
    """``params`` with the stacked ``decoder_layers`` (leading ``[num_layers]``) moved to
    their stored slots: slot ``j`` holds model layer ``layer_index[j]``, zeros where it is
    :data:`jmegatron.parallel.pipeline_layout.PAD` (uneven pipeline stages). Leaves may be
    arrays or ShapeDtypeStructs; ``layer_index`` None: unchanged."""
    if layer_index is None or "decoder_layers" not in params:
        return params
    index = np.asarray(layer_index)

    def take(a):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((len(index),) + tuple(a.shape[1:]), a.dtype)
        return pipeline_layout.take_slots(a, index)

    return dict(params, decoder_layers=jax.tree.map(take, params["decoder_layers"]))


def param_logical_specs(model: nn.Module, seq_length: int, aux: AuxModules = None,
                        layer_index: Optional[np.ndarray] = None) -> tuple[Any, Any]:
    """(abstract float32 params, logical PartitionSpecs) without allocating anything.
    ``aux``: extra trainable modules stored beside the model's params (e.g. distillation's
    ``kd_projection``), see :func:`_init_params`; ``layer_index``: the stored slots of the
    stacked layers (:func:`store_layers`)."""
    boxed = jax.eval_shape(lambda k: _init_params(model, k, seq_length, aux), jax.random.key(0))
    return store_layers(nn.unbox(boxed), layer_index), nn.get_partition_spec(boxed)


def state_shardings(model: nn.Module, tx: optax.GradientTransformation, seq_length: int, mesh: Mesh,
                    rules: Sequence = rules_lib.DEFAULT_RULES, distributed_optimizer: bool = False,
                    aux: AuxModules = None, layer_index: Optional[np.ndarray] = None):
    """(abstract TrainState, TrainState of NamedShardings, gradient shardings).

    Parameters are laid out by the logical-axis ``rules``. The optimizer's moments take
    their parameter's sharding, plus the data axis under ``distributed_optimizer``
    (ZeRO-1, :mod:`jmegatron.parallel.distributed_optimizer`); gradients are produced in
    the optimizer's layout. Scalars are replicated.
    """
    abstract_params, param_specs = param_logical_specs(model, seq_length, aux, layer_index)
    param_sh = rules_lib.logical_to_sharding(param_specs, mesh, rules)
    grad_sh = zero1_shardings(param_sh, abstract_params, keep=is_fp8_meta) if distributed_optimizer else param_sh
    replicated = NamedSharding(mesh, PartitionSpec())
    inner = tx.tx if isinstance(tx, Float16Optimizer) else tx
    abstract_opt = jax.eval_shape(inner.init, abstract_params)
    masked = optax.transforms.MaskedNode  # a leaf a masked transform keeps no state for (FP8 meta)
    opt_sh = optax.tree_map_params(
        inner, lambda leaf, sharding: leaf if isinstance(leaf, masked) else sharding, abstract_opt, grad_sh,
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, (NamedSharding, masked)))
    if isinstance(tx, Float16Optimizer):  # main params laid out as the gradients (ZeRO-1: sharded)
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
        opt_sh = Float16OptimizerState(main_params=grad_sh, inner=opt_sh, grad_scaler=None if tx.grad_scaler is None
                                       else jax.tree.map(lambda _: replicated, abstract_opt.grad_scaler))
        abstract_params = tx.model_params(abstract_params)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                          opt_state=abstract_opt, rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    shardings = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated)
    return abstract, shardings, grad_sh


def init_train_state(model: nn.Module, tx: optax.GradientTransformation, seed: int,
                     seq_length: int, shardings: TrainState, aux: AuxModules = None,
                     layer_index: Optional[np.ndarray] = None) -> TrainState:
    """Initialise params (Megatron's init: normal(init_method_std), output layers scaled
    by 1/sqrt(2 num_layers)) and optimizer state directly in their shardings; ``aux`` and
    ``layer_index`` as in :func:`param_logical_specs` (the same model for every layout:
    the layers are initialised in model order, then moved to their slots)."""

    def init(seed):
        key = jax.random.key(seed)
        params_key, rng = jax.random.split(key)
        params = store_layers(nn.unbox(_init_params(model, params_key, seq_length, aux)), layer_index)
        opt_state = tx.init(params)  # float32: the main parameters under bf16 / fp16
        if isinstance(tx, Float16Optimizer):
            params = tx.model_params(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                          rng=jax.random.key_data(rng))

    return jax.jit(init, out_shardings=shardings)(seed)


def prune_to(tree: Any, target: Any, fill: Any = None) -> Any:
    """``target``'s structure with the leaves of ``tree`` at the same paths: drops what
    ``target`` lacks (e.g. a distillation run's auxiliary params and their optimizer
    moments when a plain student is restored). A path ``tree`` lacks takes ``fill``'s leaf
    (a tree of ``target``'s structure), or raises KeyError naming it without ``fill``."""
    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    fill_leaves = jax.tree_util.tree_leaves(fill) if fill is not None else None
    out = []
    for i, (path, _) in enumerate(paths):
        key = jax.tree_util.keystr(path)
        if key in leaves:
            out.append(leaves[key])
        elif fill_leaves is not None:
            out.append(fill_leaves[i])
        else:
            raise KeyError(f"the restored state has no {key}")
    return jax.tree_util.tree_unflatten(treedef, out)


def convert_precision(state: TrainState, src: Any, dst: Any) -> TrainState:
    """``state``, saved with optimizer ``src``, as optimizer ``dst`` holds it: float32 <->
    bf16 / fp16 (:class:`~jmegatron.training.float16_optimizer.Float16Optimizer`). The
    float32 parameters (the main copy, or the float32 model's) carry over with the
    optimizer's moments; a run switching to fp16 starts its loss scaler afresh. The result
    keeps the input's shardings: place it with ``jax.device_put``."""
    if src is dst:
        return state
    if isinstance(src, Float16Optimizer):
        main, inner = state.opt_state.main_params, state.opt_state.inner
    else:
        main, inner = state.params, state.opt_state
    if isinstance(dst, Float16Optimizer):
        opt_state = Float16OptimizerState(main_params=main, inner=inner,
                                          grad_scaler=None if dst.grad_scaler is None else dst.grad_scaler.init())
        return state.replace(params=dst.model_params(main), opt_state=opt_state)
    return state.replace(params=main, opt_state=inner)
