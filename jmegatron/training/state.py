"""The train state and its sharded initialisation.

The state is a pytree of arrays only (what Orbax saves): ``step`` (optimizer steps
taken, int32 scalar), float32 ``params``, the optax ``opt_state`` and the base
``rng`` (uint32 [2] raw PRNG key) from which every iteration's dropout key is derived.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from jmegatron.parallel import rules as rules_lib


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def _dummy_tokens(seq_length: int) -> jax.Array:
    return jnp.zeros((1, seq_length), jnp.int32)


def param_logical_specs(model: nn.Module, seq_length: int) -> tuple[Any, Any]:
    """(abstract float32 params, logical PartitionSpecs) without allocating anything."""
    boxed = jax.eval_shape(lambda k: model.init({"params": k}, _dummy_tokens(seq_length)),
                           jax.random.key(0))["params"]
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def state_logical_specs(model: nn.Module, tx: optax.GradientTransformation, seq_length: int):
    """(abstract TrainState, TrainState of logical PartitionSpecs). The optimizer's
    moments take their parameter's spec; its scalars are replicated."""
    abstract_params, param_specs = param_logical_specs(model, seq_length)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    opt_specs = optax.tree_map_params(
        tx, lambda _, spec: spec, abstract_opt, param_specs,
        transform_non_params=lambda _: PartitionSpec(), is_leaf=is_spec)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                          opt_state=abstract_opt, rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    specs = TrainState(step=PartitionSpec(), params=param_specs, opt_state=opt_specs, rng=PartitionSpec())
    return abstract, specs


def state_shardings(model, tx, seq_length: int, mesh: Mesh,
                    rules: Sequence = rules_lib.DEFAULT_RULES):
    """(abstract TrainState, TrainState of NamedShardings on ``mesh``)."""
    abstract, specs = state_logical_specs(model, tx, seq_length)
    return abstract, rules_lib.logical_to_sharding(specs, mesh, rules)


def init_train_state(model: nn.Module, tx: optax.GradientTransformation, seed: int,
                     seq_length: int, shardings: TrainState) -> TrainState:
    """Initialise params (Megatron's init: normal(init_method_std), output layers scaled
    by 1/sqrt(2 num_layers)) and optimizer state directly in their shardings."""

    def init(seed):
        key = jax.random.key(seed)
        params_key, rng = jax.random.split(key)
        params = nn.unbox(model.init({"params": params_key}, _dummy_tokens(seq_length))["params"])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          rng=jax.random.key_data(rng))

    return jax.jit(init, out_shardings=shardings)(seed)
