"""The jitted train and eval steps: pure functions of (state, batch).

A batch is a dict of arrays ``[num_microbatches, micro_batch_size * dp, seq_length]``
(``tokens``, ``labels``, ``position_ids`` int32; ``loss_mask`` float32), the batch
axis sharded over the data axis. Gradients accumulate over micro-batches in a
``lax.scan`` inside the jit (Megatron's forward_backward_no_pipelining); nothing in the
step synchronises with the host.

Loss: per micro-batch, the token mean of the masked cross-entropy over the whole
micro-batch (all data-parallel ranks together, which makes the loss independent of
the device layout); the step's loss and gradient are the mean over micro-batches
(megatron/training/training.py, ``loss_func`` in pretrain_gpt.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jmegatron.parallel import rules as rules_lib
from jmegatron.training.state import TrainState

Batch = dict[str, jax.Array]


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, loss_mask: jax.Array):
    """(sum of masked token losses, number of unmasked tokens), both float32 scalars.

    logits ``[b, s, V]`` float32, labels ``[b, s]`` int32, loss_mask ``[b, s]``.
    """
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def _mean(total, count):
    return total / jnp.maximum(count, 1.0)


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, schedule: Callable,
                    rules: Sequence = rules_lib.DEFAULT_RULES) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The un-jitted train step ``(state, batch) -> (state, metrics)``.

    metrics (float32 scalars): ``lm_loss``, ``grad_norm`` (before clipping), ``lr``
    (the rate this step applied), ``num_tokens``.
    """

    def micro_loss(params, micro, rng):
        with nn.logical_axis_rules(list(rules)):
            logits = model.apply({"params": params}, micro["tokens"], micro["position_ids"],
                                 deterministic=False, rngs={"dropout": rng})
        total, count = masked_cross_entropy(logits, micro["labels"], micro["loss_mask"])
        return _mean(total, count), count

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: Batch):
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        num_micro = batch["tokens"].shape[0]

        def accumulate(carry, xs):
            grads_acc, loss_acc, tokens_acc = carry
            i, micro = xs
            (loss, count), grads = grad_fn(state.params, micro, jax.random.fold_in(step_rng, i))
            grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
            return (grads_acc, loss_acc + loss, tokens_acc + count), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        init = (zeros, jnp.float32(0.0), jnp.float32(0.0))
        (grads, loss, tokens), _ = jax.lax.scan(accumulate, init, (jnp.arange(num_micro), batch))
        grads = jax.tree.map(lambda g: g / num_micro, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"lm_loss": loss / num_micro, "grad_norm": optax.tree.norm(grads),
                   "lr": jnp.asarray(schedule(state.step), jnp.float32), "num_tokens": tokens}
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return step


def make_eval_step(model: nn.Module, rules: Sequence = rules_lib.DEFAULT_RULES):
    """The un-jitted eval step ``(params, batch) -> (loss_sum, token_count)`` (float32)."""

    def step(params, batch: Batch):
        def body(carry, micro):
            with nn.logical_axis_rules(list(rules)):
                logits = model.apply({"params": params}, micro["tokens"], micro["position_ids"],
                                     deterministic=True)
            total, count = masked_cross_entropy(logits, micro["labels"], micro["loss_mask"])
            return (carry[0] + total, carry[1] + count), None

        (total, count), _ = jax.lax.scan(body, (jnp.float32(0.0), jnp.float32(0.0)), batch)
        return total, count

    return step


def batch_shardings(mesh: Mesh) -> Batch:
    """NamedShardings for a batch: ``[num_micro, batch, seq]`` with batch over data."""
    spec = PartitionSpec(None, dict(rules_lib.DEFAULT_RULES)["batch"], None)
    s = NamedSharding(mesh, spec)
    return {"tokens": s, "labels": s, "loss_mask": s, "position_ids": s}


def jit_train_step(step_fn, mesh: Mesh, state_shardings: TrainState):
    """jit with the state donated and laid out by ``state_shardings``."""
    return jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings(mesh)),
                   out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
                   donate_argnums=(0,))


def jit_eval_step(step_fn, mesh: Mesh, param_shardings: Any):
    return jax.jit(step_fn, in_shardings=(param_shardings, batch_shardings(mesh)),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))
