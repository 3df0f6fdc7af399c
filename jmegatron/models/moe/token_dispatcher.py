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

Under expert parallelism (inside the train step's ``shard_map`` with the ``expert`` mesh
axis manual) Megatron's two dispatchers put their collectives between these steps:

* **allgather** (dropless, any backend): every rank all-gathers the tokens and routing of
  the expert ranks, computes its own experts' assignments (one grouped GEMM, the other
  ranks' assignments sorted last and left out of the groups) and reduce-scatters the
  partial outputs back (:func:`dispatch_allgather` / :func:`combine_allgather`);
* **alltoall** (static shapes): the capacity buffer ``[E, C, h]`` goes through one
  ``all_to_all`` to the ranks owning the experts and back (:func:`alltoall_to_experts` /
  :func:`alltoall_to_tokens`); without a capacity factor C = T, every token fits, so it
  is dropless at the cost of an ``[E, T, h]`` buffer (``ragged_all_to_all``, which would
  send only the routed tokens, is UNIMPLEMENTED on XLA:CPU).
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


# ------------------------------------------------------------------ expert parallelism
# Inside the train step's shard_map with the "expert" mesh axis manual: each of the ``ep``
# expert ranks holds ``E / ep`` consecutive experts (rank r: experts [r E/ep, (r+1) E/ep))
# and its own tokens.

def expert_parallel_size(axis: str) -> int:
    """The size of mesh axis ``axis`` when it is manual here (inside a ``shard_map`` over
    it), else 1: the MoE layer runs its expert-parallel dispatch only inside the train
    step; evaluation and generation (GSPMD, no manual axis) take the one-device path."""
    try:
        return jax.lax.axis_size(axis)
    except NameError:
        return 1


@dataclasses.dataclass(frozen=True)
class AllGatherDispatch:
    """Megatron's allgather dispatcher, dropless: ``tokens`` ``[ep*T*k, h]`` every rank's
    assignments, this rank's experts' first (sorted by local expert), ``probs`` ``[ep*T*k]``
    (zero for other ranks' experts), ``group_sizes`` ``[E/ep]``, ``order`` as in
    :class:`DroplessDispatch`, ``num_gathered`` = ``ep * T``."""

    tokens: Array
    probs: Array
    group_sizes: Array
    order: Array
    num_gathered: int


def dispatch_allgather(x: Array, top_indices: Array, probs: Array, axis: str, ep: int) -> AllGatherDispatch:
    """All-gather ``x [T, h]``, ``top_indices [T, k]`` and ``probs [T, E]`` over the
    expert ranks and sort the assignments to this rank's experts to the front, by expert
    (megatron/core/transformer/moe/token_dispatcher.py ``MoEAllGatherTokenDispatcher``)."""
    num_experts = probs.shape[1]
    local = num_experts // ep
    x_all = jax.lax.all_gather(x, axis, tiled=True)
    idx_all = jax.lax.all_gather(top_indices, axis, tiled=True)
    probs_all = jax.lax.all_gather(probs, axis, tiled=True)
    k = idx_all.shape[1]
    experts = idx_all.reshape(-1)
    local_expert = experts - jax.lax.axis_index(axis) * local
    mine = (local_expert >= 0) & (local_expert < local)
    key = jnp.where(mine, local_expert, local)  # other ranks' assignments sort last
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    token = order // k
    group_sizes = jnp.zeros((local + 1,), jnp.int32).at[key].add(1)[:local]
    weights = jnp.where(mine[order], probs_all[token, experts[order]], 0).astype(jnp.float32)
    return AllGatherDispatch(tokens=x_all[token], probs=weights, group_sizes=group_sizes, order=order,
                             num_gathered=x_all.shape[0])


def combine_allgather(y: Array, dispatch: AllGatherDispatch, axis: str) -> Array:
    """``[ep*T*k, h]`` this rank's expert outputs (other ranks' rows zero) -> ``[T, h]``:
    summed per token, then reduce-scattered over the expert ranks (each token's k experts
    may live on different ranks)."""
    inverse = jnp.argsort(dispatch.order)
    n = dispatch.num_gathered
    partial = jnp.sum(y[inverse].reshape(n, -1, y.shape[-1]), axis=1)
    return jax.lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)


def alltoall_to_experts(a: Array, axis: str) -> Array:
    """``[E, C, ...]`` per-expert slots of this rank's tokens -> ``[E/ep, ep*C, ...]`` the
    slots of this rank's experts from every rank (Megatron's ``MoEAlltoAllTokenDispatcher``
    with a static capacity: one ``all_to_all``)."""
    return jax.lax.all_to_all(a, axis, split_axis=0, concat_axis=1, tiled=True)


def alltoall_to_tokens(a: Array, axis: str) -> Array:
    """The inverse of :func:`alltoall_to_experts`: ``[E/ep, ep*C, ...]`` -> ``[E, C, ...]``."""
    return jax.lax.all_to_all(a, axis, split_axis=1, concat_axis=0, tiled=True)
