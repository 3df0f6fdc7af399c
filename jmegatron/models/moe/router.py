"""The MoE router (megatron/core/transformer/moe/router.py ``TopKRouter``).

Gating linear (``kernel [h, E]``, with ``use_bias`` a ``bias [E]``) in ``moe_router_dtype``, z-loss, top-k routing
with the score function (or Sinkhorn), expert capacity with token dropping, and the
load-balancing losses. The losses are not attached to the activations as Megatron's
``MoEAuxLossAutoScaler`` does: the router ``sow``\\ s them into the ``moe_losses``
collection and the language model's loss function adds them
(:func:`jmegatron.models.moe.moe_layer.moe_loss_terms`), which gives the same gradients.

Context parallelism (inside the train step's shard_map, ``context`` manual, each rank
routing its ``s / cp`` tokens of every sequence): Megatron's router reduces the token
statistics of the aux losses over the tensor x context group
(``get_tokens_per_expert_and_token_count(reduce_group=tp_cp_group)`` in
megatron/core/transformer/moe/router.py ``_apply_aux_loss`` / ``_apply_seq_aux_loss``,
``total_num_tokens = local * |tp_cp|``), so a rank's loss is its tokens' share of the whole
sequences' loss, and ``MoEAuxLossAutoScaler.set_loss_scale(cp / num_microbatches)``
(megatron/core/pipeline_parallel/schedules.py) with DDP's ``1 / (dp * cp)`` averaging makes
the gradient that of the sum over context ranks. The z-loss is a per-token mean divided by
``|tp_cp|`` there. Here the tokens per expert (per sequence for ``seq_aux_loss``) are summed
over ``context`` the same way, and each rank sows ``cp`` times Megatron's share (the
z-loss: its own tokens' mean): the loss function averages the sown values over the ranks
that split the batch (:func:`jmegatron.models.moe.moe_layer.add_moe_losses`), which gives
Megatron's sum over context ranks. So the aux, seq-aux and z losses, their gradients, the
sown ``tokens_per_expert`` (local; the report sums it) and the expert-bias counts equal the
unsplit sequence's (tested against one device). Per-rank by Megatron's definition, hence
not equal to one device: the capacity (``get_capacity`` over the rank's tokens) and the
Sinkhorn balancing (over the rank's tokens).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.config import MoEConfig
from jmegatron.models.moe import moe_utils
from jmegatron.parallel.rules import CONTEXT_AXIS

Array = jax.Array

MOE_LOSSES = "moe_losses"  # sown: load_balancing_loss / seq_load_balancing_loss / z_loss (coefficients applied)
MOE_STATS = "moe_stats"  # sown: tokens_per_expert [E], routed_tokens / dropped_tokens (assignments)
EXPERT_BIAS = "expert_bias"  # the router's parameter [E] float32 (moe_router_enable_expert_bias), no gradient


@dataclasses.dataclass(frozen=True)
class Routing:
    """A router's decision for ``T = b * s`` tokens in ``[b, s]`` order.

    ``probs`` ``[T, E]`` (router dtype): each token's weight per expert, zero where not
    routed or dropped; ``routing_map`` ``[T, E]`` bool: the (token, expert) pairs the
    experts compute (after dropping; with ``moe_pad_expert_input_to_capacity`` every kept
    slot); ``top_indices`` ``[T, k]`` int32: the chosen experts before any dropping."""

    probs: Array
    routing_map: Array
    top_indices: Array


jax.tree_util.register_dataclass(Routing, data_fields=["probs", "routing_map", "top_indices"], meta_fields=[])


def _context_parallel_size() -> int:
    """The context mesh axis's size when it is manual here (the train step's shard_map),
    else 1 (evaluation and generation route whole sequences)."""
    try:
        return jax.lax.axis_size(CONTEXT_AXIS)
    except NameError:
        return 1


class TopKRouter(nn.Module):
    """Routes ``x [b, s, h]`` to ``moe_router_topk`` of ``num_moe_experts`` experts.

    ``training``: compute and sow the z-loss and the load-balancing loss (Megatron computes
    them only in training with gradients enabled). With ``moe_router_enable_expert_bias``
    the top-k choice adds ``expert_bias [E]`` (float32, DeepSeek-V3's aux-loss-free
    balancing). Megatron keeps it as a buffer; here it is a parameter under the router
    (so every layout, checkpoint, evaluation and export carries it with the layer) behind
    ``stop_gradient``: its gradient is exactly zero and the train step overwrites it after
    each optimizer step (:func:`jmegatron.models.moe.moe_layer.update_expert_bias`).
    Tokens are routed in Megatron's sequence-major order (see
    :mod:`jmegatron.models.moe.moe_utils`); the result is in ``[b, s]`` order.
    """

    cfg: MoEConfig
    init_std: float = 0.02
    use_bias: bool = False  # a bias [E] on the logits (Megatron's router under add_bias_linear; gpt-oss)

    @nn.compact
    def __call__(self, x: Array, training: bool = False) -> Routing:
        c = self.cfg
        b, s, h = x.shape
        num_experts, k = c.num_moe_experts, c.moe_router_topk
        router_dtype = moe_utils.router_dtype(c, x.dtype)
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(self.init_std),
                                                                   ("embed", None)), (h, num_experts), jnp.float32)
        logits = jnp.einsum("bsh,he->sbe", x.astype(router_dtype), kernel.astype(router_dtype))
        if self.use_bias:  # Megatron's router_gating_linear(input, weight, bias)
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (num_experts,),
                              jnp.float32)
            logits = logits + bias.astype(router_dtype)
        logits = logits.reshape(s * b, num_experts)  # Megatron's [s, b] token order

        if training and c.moe_z_loss_coeff:
            self.sow(MOE_LOSSES, "z_loss", moe_utils.z_loss_func(logits, c.moe_z_loss_coeff).astype(jnp.float32))

        expert_bias = None
        if c.moe_router_enable_expert_bias:
            # A parameter the gradient never reaches: the train step replaces it after each
            # optimizer step (moe_layer.update_expert_bias), as MaxText keeps its routed bias.
            expert_bias = jax.lax.stop_gradient(self.param(
                EXPERT_BIAS, nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (num_experts,),
                jnp.float32))

        if c.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map, top_indices = self._sinkhorn(logits, training)
        else:
            probs, routing_map, top_indices = moe_utils.topk_routing_with_score_function(
                logits, k, use_pre_softmax=c.moe_router_pre_softmax,
                scaling_factor=c.moe_router_topk_scaling_factor, score_function=c.moe_router_score_function,
                expert_bias=expert_bias, num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk)
        routed = routing_map
        if c.moe_expert_capacity_factor is not None:
            probs, routing_map = moe_utils.apply_router_token_dropping(
                probs, routing_map, k, c.moe_expert_capacity_factor, c.moe_token_drop_policy,
                c.moe_pad_expert_input_to_capacity)

        if training and c.moe_aux_loss_coeff and c.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss"):
            aux_map, aux_scores = moe_utils.compute_routing_scores_for_aux_loss(
                logits, k, c.moe_router_score_function)
            # context parallelism: the token counts over the whole sequences (module doc)
            cp = _context_parallel_size()
            over_context = (lambda x: jax.lax.psum(x, CONTEXT_AXIS)) if cp > 1 else (lambda x: x)
            if c.moe_router_load_balancing_type == "aux_loss":
                loss = cp * moe_utils.switch_load_balancing_loss_func(
                    aux_scores, over_context(jnp.sum(aux_map, axis=0)), s * b * cp, k, num_experts,
                    c.moe_aux_loss_coeff)
                self.sow(MOE_LOSSES, "load_balancing_loss", loss.astype(jnp.float32))
            else:  # one Switch loss per sequence, averaged over the batch (Megatron's _apply_seq_aux_loss)
                per_seq_scores = jnp.sum(aux_scores.reshape(s, b, num_experts), axis=0)  # [b, E]
                per_seq_tokens = over_context(jnp.sum(aux_map.reshape(s, b, num_experts), axis=0))
                full = s * cp  # the sequence's length
                loss = cp * (jnp.sum(per_seq_scores * per_seq_tokens.astype(per_seq_scores.dtype))
                             * (num_experts * c.moe_aux_loss_coeff / (k * full * full)) / b)
                self.sow(MOE_LOSSES, "seq_load_balancing_loss", loss.astype(jnp.float32))

        kept = routing_map & routed  # padded slots (pad_to_capacity) are not tokens
        self.sow(MOE_STATS, "tokens_per_expert", jnp.sum(routing_map, axis=0).astype(jnp.float32))
        self.sow(MOE_STATS, "routed_tokens", jnp.sum(routed).astype(jnp.float32))
        self.sow(MOE_STATS, "dropped_tokens", (jnp.sum(routed) - jnp.sum(kept)).astype(jnp.float32))

        def to_bs(a):  # [s*b, ...] -> [b*s, ...]
            return jnp.swapaxes(a.reshape((s, b) + a.shape[1:]), 0, 1).reshape((b * s,) + a.shape[1:])

        return Routing(probs=to_bs(probs), routing_map=to_bs(routing_map), top_indices=to_bs(top_indices))

    def _sinkhorn(self, logits: Array, training: bool) -> tuple[Array, Array, Array]:
        """Megatron's ``sinkhorn_load_balancing``: in training the experts are the top-k of
        the Sinkhorn-balanced float32 logits (no gradient); the weights are sigmoid (k = 1)
        or softmax over all experts of the logits, at the chosen experts."""
        k = self.cfg.moe_router_topk
        if k == 1:
            act = jax.nn.sigmoid(logits)
        else:
            act = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)
        if training:
            balanced = jax.lax.stop_gradient(moe_utils.sinkhorn(logits.astype(jnp.float32)))
            _, top_indices = jax.lax.top_k(balanced, k)
        else:
            _, top_indices = jax.lax.top_k(act, k)
        onehot = jax.nn.one_hot(top_indices, logits.shape[-1], dtype=jnp.int32)
        routing_map = jnp.sum(onehot, axis=1) > 0
        return act * routing_map.astype(act.dtype), routing_map, top_indices
