"""Token dispatch and combine on one device (megatron/core/transformer/moe/token_dispatcher.py).

Two layouts of the routed tokens, for the two expert computations of
:mod:`jmegatron.models.moe.experts`:

* **dropless** (no capacity factor): the ``T * k`` (token, expert) assignments sorted by
  expert (stable, so by token within an expert: Megatron's ``permute``), with the group
  size of each expert, for one grouped GEMM (``jax.lax.ragged_dot``); combine un-sorts
  and sums each token's k expert outputs (Megatron's ``unpermute``).
* **capacity** (``moe_expert_capacity_factor``): a static ``[E, C, h]`` buffer, expert e's
  kept tokens in token order in its first slots, the rest masked (zero input, zero
  weight); combine scatter-adds each slot's output into its token.

Under expert parallelism the allgather / alltoall dispatchers put their collectives
between these steps (a later phase); on one device both are these functions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DroplessDispatch:
    """``tokens`` ``[T*k, h]`` sorted by expert, ``probs`` ``[T*k]`` float32 (each
    assignment's routing weight), ``group_sizes`` ``[E]`` int32 (sums to T*k), ``order``
    ``[T*k]`` int32 (sorted position -> flat assignment index ``t*k + j``)."""

    tokens: Array
    probs: Array
    group_sizes: Array
    order: Array


@dataclasses.dataclass(frozen=True)
class CapacityDispatch:
    """``tokens`` ``[E, C, h]``, ``probs`` ``[E, C]`` float32 (zero in empty slots),
    ``token_index`` ``[E, C]`` int32 (the token in each slot), ``valid`` ``[E, C]`` bool."""

    tokens: Array
    probs: Array
    token_index: Array
    valid: Array


def dispatch_dropless(x: Array, top_indices: Array, probs: Array) -> DroplessDispatch:
    """Sort the assignments of ``x [T, h]`` to ``top_indices [T, k]`` by expert.
    ``probs`` ``[T, E]``: the routing weights (read at each assignment)."""
    num_tokens, k = top_indices.shape
    num_experts = probs.shape[1]
    experts = top_indices.reshape(-1)
    order = jnp.argsort(experts, stable=True).astype(jnp.int32)
    token = order // k
    sorted_experts = experts[order]
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[experts].add(1)
    return DroplessDispatch(tokens=x[token], probs=probs[token, sorted_experts].astype(jnp.float32),
                            group_sizes=group_sizes, order=order)


def combine_dropless(y: Array, dispatch: DroplessDispatch, num_tokens: int) -> Array:
    """``[T*k, h]`` expert outputs (sorted, already weighted) -> ``[T, h]``: each token's
    k outputs summed in expert-choice order."""
    inverse = jnp.argsort(dispatch.order)  # flat assignment index -> sorted position
    k = y.shape[0] // num_tokens
    return jnp.sum(y[inverse].reshape(num_tokens, k, y.shape[-1]), axis=1)


def dispatch_capacity(x: Array, routing_map: Array, probs: Array, capacity: int) -> CapacityDispatch:
    """Fill ``[E, capacity, h]`` from ``x [T, h]`` by ``routing_map [T, E]`` (at most
    ``capacity`` True per expert, as :func:`apply_router_token_dropping` leaves it) and
    ``probs [T, E]``."""
    column = routing_map.T.astype(jnp.int32)  # [E, T]
    # lax.top_k keeps the lower index first among equal values: the routed tokens, in token order.
    _, token_index = jax.lax.top_k(column, capacity)
    valid = jnp.take_along_axis(column, token_index, axis=1) > 0
    experts = jnp.arange(routing_map.shape[1])[:, None]
    slot_probs = jnp.where(valid, probs.T[experts, token_index], 0).astype(jnp.float32)
    tokens = jnp.where(valid[..., None], x[token_index], jnp.zeros((), x.dtype))
    return CapacityDispatch(tokens=tokens, probs=slot_probs, token_index=token_index.astype(jnp.int32),
                            valid=valid)


def combine_capacity(y: Array, dispatch: CapacityDispatch, num_tokens: int) -> Array:
    """``[E, C, h]`` expert outputs (already weighted) -> ``[T, h]``: each slot added into
    its token (empty slots add zero)."""
    y = jnp.where(dispatch.valid[..., None], y, jnp.zeros((), y.dtype))
    out = jnp.zeros((num_tokens, y.shape[-1]), y.dtype)
    return out.at[dispatch.token_index.reshape(-1)].add(y.reshape(-1, y.shape[-1]))
