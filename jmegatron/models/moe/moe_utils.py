"""The router's pure functions of the mixture of experts (its settings:
:class:`jmegatron.config.model.MoEConfig`).

Follows megatron/core/transformer/moe/moe_utils.py (megatron-core 0.16): the Switch
load-balancing loss (Fedus et al. 2021, arXiv:2101.03961), the router z-loss (ST-MoE,
Zoph et al. 2022, arXiv:2202.08906), Sinkhorn routing (BASE layers), the top-k routing
with a score function (softmax or sigmoid, DeepSeek-V3's expert bias), expert capacity
with token dropping, and the aux-loss-free expert-bias update (Wang et al. 2024,
arXiv:2408.15664). tests/test_moe.py runs megatron-core's own functions on the same
inputs.

Token order: Megatron's hidden states are ``[s, b, h]``, so its flattened tokens run
sequence-major (token ``t = s_i * b + b_i``). The functions here take ``[T, E]`` in any
order; :class:`jmegatron.models.moe.router.TopKRouter` feeds them Megatron's order, so
the "position" drop policy (earlier tokens kept) drops the tokens Megatron drops.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jmegatron.config import SCORE_FUNCTIONS, TOKEN_DROP_POLICIES, MoEConfig

Array = jax.Array


def router_dtype(moe: MoEConfig, input_dtype: Any) -> Any:
    """The routing computation's dtype: ``moe.moe_router_dtype`` (fp32 / fp64), else the
    input's (Megatron's None)."""
    return {None: input_dtype, "fp32": jnp.float32, "fp64": jnp.float64}[moe.moe_router_dtype]


# --------------------------------------------------------------------------- losses
def switch_load_balancing_loss_func(probs: Array, tokens_per_expert: Array, total_num_tokens: Any, topk: int,
                                    num_experts: int, moe_aux_loss_coeff: float) -> Array:
    """Switch Transformer's load-balancing loss, ``E * sum_i f_i * P_i * coeff`` with
    ``f_i`` the fraction of the ``T * topk`` assignments to expert i and ``P_i`` the mean
    router probability of expert i (Megatron's ``switch_load_balancing_loss_func``).

    probs ``[T, E]`` float (the full score distribution, not the top-k), tokens_per_expert
    ``[E]``, total_num_tokens T. Returns a scalar in probs' dtype.
    """
    aggregated = jnp.sum(probs, axis=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return jnp.sum(aggregated * tokens_per_expert.astype(probs.dtype)) * scale


def z_loss_func(logits: Array, z_loss_coeff: float) -> Array:
    """Router z-loss, ``coeff * mean_t logsumexp(logits_t)^2`` (ST-MoE; Megatron's
    ``z_loss_func``). logits ``[T, E]``; returns a scalar in logits' dtype."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))) * z_loss_coeff


def sinkhorn(cost: Array, tol: float = 1e-4, max_iters: int = 1000) -> Array:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` ``[T, E]`` into a doubly stochastic
    assignment (Megatron's ``sinkhorn``: the same updates and stopping rule, mean absolute
    change of the expert scaling below ``tol``), as a ``lax.while_loop``; ``max_iters``
    bounds it (Megatron's loop has no bound)."""
    cost = jnp.exp(cost)
    t, e = cost.shape
    eps = 1e-8

    def body(carry):
        _, d1, _, i = carry
        d0 = (1.0 / t) / (jnp.sum(d1[None, :] * cost, axis=1) + eps)
        new_d1 = (1.0 / e) / (jnp.sum(d0[:, None] * cost, axis=0) + eps)
        return d0, new_d1, jnp.mean(jnp.abs(d1 - new_d1)), i + 1

    def cond(carry):
        return (carry[2] > tol) & (carry[3] < max_iters)

    ones0, ones1 = jnp.ones((t,), cost.dtype), jnp.ones((e,), cost.dtype)
    d0, d1, _, _ = jax.lax.while_loop(cond, body, (ones0, ones1, jnp.asarray(1e9, cost.dtype), 0))
    return d1[None, :] * cost * d0[:, None]


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float,
                 min_capacity: Optional[int] = None) -> int:
    """Tokens each expert takes, ``ceil(num_tokens / num_experts * capacity_factor)``
    (at least ``min_capacity``): Megatron's ``get_capacity``. Python ints (static shapes)."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


# --------------------------------------------------------------------------- routing
def _topk(scores: Array, k: int) -> tuple[Array, Array]:
    """``lax.top_k`` over the last axis: values and int32 indices ``[T, k]``, ties to the
    lower expert index (torch.topk's CPU order for distinct values)."""
    return jax.lax.top_k(scores, k)


def _dense(num_experts: int, top_indices: Array, values: Array) -> Array:
    """Scatter ``values [T, k]`` into ``[T, E]`` at ``top_indices`` (zeros elsewhere)."""
    onehot = jax.nn.one_hot(top_indices, num_experts, dtype=values.dtype)  # [T, k, E]
    return jnp.einsum("tk,tke->te", values, onehot)


def group_limited_topk(scores: Array, topk: int, num_groups: int, group_topk: int) -> tuple[Array, Array]:
    """Megatron's ``group_limited_topk`` (DeepSeek-V2/V3 device-limited routing): the ``E``
    experts of ``scores [T, E]`` in ``num_groups`` contiguous groups, each scored by the sum
    of its top ``topk // group_topk`` scores; the top ``group_topk`` groups are kept and the
    top-k taken among their experts. Returns (values, int32 indices) ``[T, topk]``."""
    t, e = scores.shape
    per_group = topk // group_topk
    grouped = scores.reshape(t, num_groups, e // num_groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, per_group)[0], axis=-1)  # [T, groups]
    _, top_groups = jax.lax.top_k(group_scores, group_topk)
    keep = jnp.any(jax.nn.one_hot(top_groups, num_groups, dtype=jnp.bool_), axis=1)  # [T, groups]
    masked = jnp.where(jnp.repeat(keep, e // num_groups, axis=1), scores, -jnp.inf)
    return _topk(masked, topk)


def topk_routing_with_score_function(logits: Array, topk: int, use_pre_softmax: bool = False,
                                     scaling_factor: Optional[float] = None, score_function: str = "softmax",
                                     expert_bias: Optional[Array] = None, num_groups: Optional[int] = None,
                                     group_topk: Optional[int] = None) -> tuple[Array, Array, Array]:
    """Top-k routing (Megatron's ``topk_routing_with_score_function``,
    megatron/core/transformer/moe/moe_utils.py).

    logits ``[T, E]`` (the router dtype). softmax: top-k of the logits then softmax over the
    k (``use_pre_softmax``: softmax over all E, then top-k); sigmoid: top-k of
    ``sigmoid(logits) (+ expert_bias [E] for the choice only)``, weights normalised over the
    k when k > 1. ``scaling_factor`` multiplies the weights. ``num_groups`` /
    ``group_topk``: the top-k is group-limited (:func:`group_limited_topk`).

    Returns (routing_probs ``[T, E]`` logits' dtype, zero outside the top-k; routing_map
    ``[T, E]`` bool; top_indices ``[T, k]`` int32).
    """
    num_experts = logits.shape[-1]

    def top(scores):
        if num_groups is None:
            return _topk(scores, topk)
        return group_limited_topk(scores, topk, num_groups, group_topk)

    if score_function == "softmax":
        if use_pre_softmax:
            scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)
            probs, top_indices = top(scores)
        else:
            scores, top_indices = top(logits)
            probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(logits.dtype)
    elif score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits.astype(jnp.float32)).astype(logits.dtype)
        if expert_bias is not None:
            _, top_indices = top(scores + expert_bias.astype(scores.dtype))
            scores = jnp.take_along_axis(scores, top_indices, axis=1)
        else:
            scores, top_indices = top(scores)
        probs = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"moe_router_score_function={score_function!r} must be one of {SCORE_FUNCTIONS}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = _dense(num_experts, top_indices, probs)
    routing_map = _dense(num_experts, top_indices, jnp.ones_like(probs, jnp.int32)) > 0
    return routing_probs, routing_map, top_indices


def compute_routing_scores_for_aux_loss(logits: Array, topk: int, score_function: str) -> tuple[Array, Array]:
    """(routing_map ``[T, E]`` bool, scores ``[T, E]``) for the load-balancing losses: the
    full score distribution (softmax in float32, or sigmoid normalised over E) and its
    top-k, independent of expert bias and dropping (Megatron's
    ``compute_routing_scores_for_aux_loss``)."""
    if score_function == "softmax":
        scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    elif score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        scores = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
    else:
        raise ValueError(f"moe_router_score_function={score_function!r} must be one of {SCORE_FUNCTIONS}")
    _, top_indices = _topk(scores, topk)
    routing_map = _dense(logits.shape[-1], top_indices, jnp.ones(top_indices.shape, jnp.int32)) > 0
    return routing_map, scores


def capacity_mask(routing_probs: Array, routing_map: Array, capacity: int, drop_policy: str) -> Array:
    """``[T, E]`` bool: the (at most) ``capacity`` tokens each expert keeps, chosen among
    all T tokens by the highest routing probability ("probs") or by routing-map then
    earliest position ("position"); ties go to the earlier token. With ``capacity >= T``
    every entry is True. This is Megatron's ``topk(dim=0)`` selection in
    ``apply_router_token_dropping``, made deterministic."""
    num_tokens = routing_probs.shape[0]
    if capacity > num_tokens:
        return jnp.ones(routing_probs.shape, bool)
    if drop_policy == "probs":
        key = routing_probs
    elif drop_policy == "position":
        key = routing_map.astype(jnp.int32)
    else:
        raise ValueError(f"moe_token_drop_policy={drop_policy!r} must be one of {TOKEN_DROP_POLICIES}")
    _, indices = jax.lax.top_k(key.T, capacity)  # [E, C]; lax.top_k keeps the lower index first on ties
    experts = jnp.broadcast_to(jnp.arange(key.shape[1])[:, None], indices.shape)
    return jnp.zeros(key.T.shape, bool).at[experts, indices].set(True).T


def apply_router_token_dropping(routing_probs: Array, routing_map: Array, router_topk: int,
                                capacity_factor: float, drop_policy: str = "probs",
                                pad_to_capacity: bool = False) -> tuple[Array, Array]:
    """Expert capacity ``get_capacity(T * topk, E, capacity_factor)`` enforced on
    (routing_probs, routing_map) ``[T, E]`` (Megatron's ``apply_router_token_dropping``).
    Returns (probs with dropped entries zeroed, map): the map is the routed-and-kept
    entries, or with ``pad_to_capacity`` every kept slot (exactly ``min(capacity, T)``
    tokens per expert, zero-probability ones included, as Megatron)."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    keep = capacity_mask(routing_probs, routing_map, capacity, drop_policy)
    final_map = keep if pad_to_capacity else routing_map & keep
    return routing_probs * final_map.astype(routing_probs.dtype), final_map


def get_updated_expert_bias(tokens_per_expert: Array, expert_bias: Array, expert_bias_update_rate: float) -> Array:
    """DeepSeek-V3's aux-loss-free balancing step (Megatron's ``get_updated_expert_bias``):
    ``bias + sign(mean(tokens) - tokens) * rate``, raising the bias of under-loaded experts.
    ``tokens_per_expert`` ``[..., E]``: the tokens each expert received over the whole
    global batch (every micro-batch and data-parallel rank summed); float32 in and out."""
    tokens = tokens_per_expert.astype(jnp.float32)
    average = jnp.sum(tokens, axis=-1, keepdims=True) / tokens.shape[-1]
    return expert_bias + jnp.sign(average - tokens) * expert_bias_update_rate
