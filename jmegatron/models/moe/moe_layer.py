"""The MoE layer (megatron/core/transformer/moe/moe_layer.py ``MoELayer``): router ->
token dispatcher -> experts -> combine, plus the shared expert; it takes the dense MLP's
place (``mlp``) in the decoder layers that ``moe_layer_freq`` selects.

Parameters under ``mlp``: ``router/kernel`` ``[h, E]``, ``experts/linear_fc1/kernel``
``[E, h, (2,) moe_ffn]``, ``experts/linear_fc2/kernel`` ``[E, moe_ffn, h]``, and
``shared_experts/linear_fc1|linear_fc2`` with a shared expert; with ``add_bias_linear``
``router/bias [E]`` and the experts' biases (:class:`jmegatron.models.moe.experts.GroupedMLP`).

Losses: Megatron attaches the router's losses to the activations with
``MoEAuxLossAutoScaler`` (forward unchanged, backward adds ``d(aux) * scale``, the scale
being ``1 / num_microbatches`` like the LM loss's). Here the router sows each loss with
its coefficient into the ``moe_losses`` collection and :func:`moe_loss_terms` gives the
sum the loss function adds to the micro-batch's loss; the train step averages
micro-batches, so the gradient is Megatron's, and the LM loss is reported unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.config import MoEConfig
from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.models.moe import moe_utils, token_dispatcher
from jmegatron.models.moe.experts import GroupedMLP, output_init_std
from jmegatron.models.moe.router import EXPERT_BIAS, MOE_LOSSES, MOE_STATS, TopKRouter
from jmegatron.models.moe.shared_experts import SharedExpertGate, SharedExpertMLP
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.parallel.rules import EXPERT_AXIS

Array = jax.Array


class MoELayer(nn.Module):
    """``[b, s, h]`` -> ``[b, s, h]`` in the compute dtype. ``cfg``: the model's
    :class:`jmegatron.models.transformer_config.ModelConfig` (``cfg.moe`` set). ``training``: the router
    computes and sows its losses (the train step's forward; eval and generation pass
    False).

    Dropless (``moe_expert_capacity_factor`` None): every token reaches its k experts, one
    ragged grouped GEMM per linear. With a capacity factor: each expert computes
    ``min(capacity, b * s)`` slots (``capacity = get_capacity(b*s*k, E, factor)``, over this
    device's micro-batch, as Megatron's per-rank capacity) and tokens past it are dropped
    by ``moe_token_drop_policy``.

    Expert parallelism (inside the train step's shard_map over the ``expert`` mesh axis,
    ``expert_model_parallel_size`` ranks): this rank holds ``E / ep`` experts' weights
    and its own tokens; ``moe_token_dispatcher_type`` "allgather" (dropless) or "alltoall"
    (the capacity buffer through ``all_to_all``; dropless buffers of ``T`` slots without a
    capacity factor), see :mod:`jmegatron.models.moe.token_dispatcher`.
    """

    cfg: ModelConfig
    training: bool = False
    dot_general: Callable = dense_dot_general_fn

    @nn.compact
    def __call__(self, x: Array) -> Array:
        c, moe = self.cfg, self.cfg.moe
        b, s, h = x.shape
        num_tokens = b * s
        routing = TopKRouter(moe, init_std=c.init_method_std, use_bias=c.add_bias_linear, name="router")(
            x, training=self.training)
        ep = token_dispatcher.expert_parallel_size(EXPERT_AXIS)
        experts = GroupedMLP(moe.num_moe_experts // ep, h, moe.moe_ffn_hidden_size, c.swiglu,
                             init_std=c.init_method_std, openai_gelu=c.openai_gelu,
                             output_init_std=output_init_std(c.init_method_std, c.num_layers), dtype=c.dtype,
                             grouped_matmul=c.grouped_matmul(), use_bias=c.add_bias_linear,
                             quick_geglu=c.quick_geglu, glu_linear_offset=c.glu_linear_offset,
                             clamp_value=c.activation_func_clamp_value, name="experts")
        flat = x.reshape(num_tokens, h)
        if ep > 1 and moe.moe_token_dispatcher_type == "allgather":
            d = token_dispatcher.dispatch_allgather(flat, routing.top_indices, routing.probs, EXPERT_AXIS, ep)
            y = experts(d.tokens, d.probs, d.group_sizes)
            out = token_dispatcher.combine_allgather(y, d, EXPERT_AXIS)
        elif ep > 1:  # alltoall: the capacity buffer to the experts' ranks and back
            capacity = num_tokens if moe.moe_expert_capacity_factor is None else min(num_tokens, moe_utils.get_capacity(
                num_tokens * moe.moe_router_topk, moe.num_moe_experts, moe.moe_expert_capacity_factor))
            d = token_dispatcher.dispatch_capacity(flat, routing.routing_map, routing.probs, capacity)
            y = experts(token_dispatcher.alltoall_to_experts(d.tokens, EXPERT_AXIS),
                        token_dispatcher.alltoall_to_experts(d.probs, EXPERT_AXIS))
            out = token_dispatcher.combine_capacity(token_dispatcher.alltoall_to_tokens(y, EXPERT_AXIS), d, num_tokens)
        elif moe.moe_expert_capacity_factor is None:
            d = token_dispatcher.dispatch_dropless(flat, routing.top_indices, routing.probs)
            y = experts(d.tokens, d.probs, d.group_sizes)
            out = token_dispatcher.combine_dropless(y, d, num_tokens)
        else:
            capacity = moe_utils.get_capacity(num_tokens * moe.moe_router_topk, moe.num_moe_experts,
                                              moe.moe_expert_capacity_factor)
            d = token_dispatcher.dispatch_capacity(flat, routing.routing_map, routing.probs,
                                                   min(capacity, num_tokens))
            y = experts(d.tokens, d.probs)
            out = token_dispatcher.combine_capacity(y, d, num_tokens)
        out = out.reshape(b, s, h).astype(c.dtype)
        if moe.moe_shared_expert_intermediate_size is not None:
            shared = SharedExpertMLP(c, self.dot_general)(x)
            if moe.moe_shared_expert_gate:
                shared = (shared.astype(jnp.float32) * SharedExpertGate(c, name="shared_expert_gate")(x)).astype(c.dtype)
            out = out + shared
        return nn.with_logical_constraint(out, ("batch", "length", "activation_embed"))


# The collections the loss function makes mutable to collect the MoE layers' sown values.
MOE_COLLECTIONS = (MOE_LOSSES, MOE_STATS)

# Report names of the sown losses (Megatron's tracker names) -> their coefficient's field.
LOSS_COEFFS = {"load_balancing_loss": "moe_aux_loss_coeff", "seq_load_balancing_loss": "moe_aux_loss_coeff",
               "z_loss": "moe_z_loss_coeff"}


def _collect(tree: Any, name: str) -> list[Array]:
    """Every leaf sown under ``name`` anywhere in ``tree`` (per layer; stacked ``[L]``
    under scan_layers)."""
    found = []

    def visit(node):
        if isinstance(node, dict) or hasattr(node, "items"):
            for k, v in node.items():
                if k == name:
                    found.extend(jax.tree.leaves(v))
                else:
                    visit(v)

    visit(tree)
    return found


def moe_loss_terms(variables: Any, moe: Optional[MoEConfig], num_moe_layers: int,
                   ) -> tuple[Array, dict[str, Array]]:
    """(the sum to add to the micro-batch's loss, report) from the ``moe_losses`` and
    ``moe_stats`` collections of one forward pass (``variables``: the mutable collections
    ``model.apply`` returned).

    The sum is every MoE layer's sown losses (coefficients applied), float32. The report
    has Megatron's tracker values, each the mean over MoE layers of the loss divided by
    its coefficient (``track_moe_metrics``): ``load_balancing_loss`` (aux_loss),
    ``seq_load_balancing_loss``, ``z_loss``, only those that are on; plus
    ``moe_dropped_token_fraction`` (routed (token, expert) assignments dropped by the
    capacity, over all MoE layers) and ``moe_tokens_per_expert`` ``[num_moe_layers, E]``.
    """
    total = jnp.float32(0.0)
    report: dict[str, Array] = {}
    if moe is None:
        return total, report
    losses = variables.get(MOE_LOSSES, {})
    for name, field in LOSS_COEFFS.items():
        values = _collect(losses, name)
        if not values:
            continue
        summed = sum(jnp.sum(v) for v in values)
        total = total + summed
        report[name] = summed / getattr(moe, field) / num_moe_layers
    stats = variables.get(MOE_STATS, {})
    tokens = _collect(stats, "tokens_per_expert")
    dropped = _collect(stats, "dropped_tokens")
    routed = _collect(stats, "routed_tokens")
    if tokens:
        report["moe_tokens_per_expert"] = jnp.concatenate([t.reshape(-1, moe.num_moe_experts) for t in tokens])
        report["moe_dropped_token_fraction"] = (sum(jnp.sum(d) for d in dropped)
                                                / jnp.maximum(sum(jnp.sum(r) for r in routed), 1.0))
    return total, report


def add_moe_losses(cfg: ModelConfig, loss: Array, report: dict, sown: Any, micro: dict, data_sum: Callable
                   ) -> tuple[Array, dict]:
    """(loss + the router losses, report + the MoE entries) for one micro-batch of an MoE
    model, inside the train step's loss function (:func:`jmegatron.training.forward_step.lm_loss_fn`).

    ``cfg``: the model's ModelConfig; ``sown``: the :data:`MOE_COLLECTIONS` of the forward
    pass; ``micro``: the micro-batch (its ``loss_mask`` ``[b, s]`` gives this rank's token
    count); ``data_sum``: the psum over data-parallel ranks. Each rank's router losses are
    its own tokens' (Megatron computes them per rank and its DDP averages gradients over
    data ranks), so they enter as the mean over ranks weighted by local tokens (equal on
    every rank); ``report["lm_loss"]`` is left as it is. ``moe_tokens_per_expert`` is
    summed over ranks, the other entries averaged (see :func:`moe_loss_terms`). Under
    context parallelism ``data_sum`` adds over the context ranks too, and each rank's sown
    losses are its estimate of its sequences' whole loss (the router's module doc), so the
    mean over data x context ranks is Megatron's sum of per-rank shares over context.
    """
    aux, moe_report = moe_loss_terms(sown, cfg.moe, sum(cfg.moe_layers()) + sum(cfg.mtp_moe_layers()))
    local = jnp.sum(jnp.ones_like(micro["loss_mask"], jnp.float32))
    tokens = data_sum(local)

    def mean(x):
        return data_sum(x * local) / tokens

    report = dict(report)
    for name, value in moe_report.items():
        report[name] = data_sum(value) if name == "moe_tokens_per_expert" else mean(value)
    return loss + mean(aux), report


def update_expert_bias(params: Any, tokens_per_expert: Array, update_rate: float, moe_pattern: Any,
                       layer_index: Optional[Any] = None) -> Any:
    """``params`` with every router's ``expert_bias`` advanced one step of DeepSeek-V3's
    aux-loss-free balancing (:func:`moe_utils.get_updated_expert_bias`: ``bias +
    sign(mean_e(t) - t_e) * update_rate``), as Megatron's ``_update_router_expert_bias``
    (megatron/core/distributed/finalize_model_grads.py) does once per global batch.

    ``tokens_per_expert`` float32 ``[num_moe_layers, E]``: the tokens each expert received
    in the step, over every micro-batch and rank (the train step's ``moe_tokens_per_expert``
    report, in MoE-layer order, the multi-token prediction layers' ``mtp_layers_<k>`` rows
    after the decoder's; any positive scale, the update takes its sign).
    ``moe_pattern``: one 0/1 per model layer (``ModelConfig.moe_layers()``). Per-layer
    parameters (``decoder_layers_{i}``) take the row of their MoE layer; stacked ones
    (``decoder_layers``, leaves ``[slots, E]``) the row of the model layer at each slot,
    ``layer_index`` (int ``[slots]``, :func:`jmegatron.training.run.stored_layer_index`;
    None: model order), slots marked PAD (-1, uneven pipeline stages) left as they are.
    Other parameters are returned unchanged. Raises ValueError for an ``expert_bias`` under
    any other top-level name.
    """
    pattern = np.asarray(moe_pattern, np.int64)
    moe_row = np.cumsum(pattern) - 1  # model layer -> its row among the MoE layers

    def update(path, leaf):
        if getattr(path[-1], "key", None) != EXPERT_BIAS:
            return leaf
        top = str(getattr(path[0], "key", ""))
        if top == "decoder_layers":
            slots = leaf.shape[0]
            index = np.arange(slots) if layer_index is None else np.asarray(layer_index)
            rows = tokens_per_expert[moe_row[np.maximum(index, 0)]]
            new = moe_utils.get_updated_expert_bias(rows, leaf, update_rate)
            return jnp.where(jnp.asarray(index >= 0)[:, None], new, leaf)
        if top.startswith("decoder_layers_"):
            return moe_utils.get_updated_expert_bias(tokens_per_expert[moe_row[int(top.rsplit("_", 1)[1])]],
                                                     leaf, update_rate)
        if top.startswith("mtp_layers_"):  # the MoE rows after the decoder's
            return moe_utils.get_updated_expert_bias(tokens_per_expert[int(pattern.sum()) + int(top.rsplit("_", 1)[1])],
                                                     leaf, update_rate)
        raise ValueError(f"update_expert_bias: an expert_bias under {top!r}: expected decoder_layers, "
                         f"decoder_layers_<i> or mtp_layers_<k>")

    return jax.tree_util.tree_map_with_path(update, params)


def sown_loss_names(moe: MoEConfig) -> tuple[str, ...]:
    """The report names of the losses :class:`TopKRouter` sows in training for ``moe`` (its
    rule: the aux / seq-aux loss with a nonzero ``moe_aux_loss_coeff``, the z-loss with a
    nonzero ``moe_z_loss_coeff``), in :data:`LOSS_COEFFS` order."""
    balancing = moe.moe_router_load_balancing_type
    on = {"load_balancing_loss": bool(moe.moe_aux_loss_coeff) and balancing == "aux_loss",
          "seq_load_balancing_loss": bool(moe.moe_aux_loss_coeff) and balancing == "seq_aux_loss",
          "z_loss": bool(moe.moe_z_loss_coeff)}
    return tuple(name for name in LOSS_COEFFS if on[name])


def chunk_report_zeros(cfg: ModelConfig) -> dict[str, Array]:
    """The MoE entries of a pipelined report (:func:`chunk_moe_losses`), zeros: float32
    scalars for :func:`sown_loss_names` and ``moe_dropped_token_fraction``,
    ``moe_tokens_per_expert`` ``[num_moe_layers, E]``. ``cfg``: the model's ModelConfig."""
    zeros = {name: jnp.float32(0.0) for name in sown_loss_names(cfg.moe)}
    zeros["moe_tokens_per_expert"] = jnp.zeros((sum(cfg.moe_layers()), cfg.moe.num_moe_experts), jnp.float32)
    zeros["moe_dropped_token_fraction"] = jnp.float32(0.0)
    return zeros


def chunk_moe_losses(cfg: ModelConfig, sown: Any, first_layer: Any, num_valid: Any, share: float
                     ) -> tuple[Array, dict[str, Array]]:
    """(loss, report) of one pipeline model chunk's MoE layers for one micro-batch on one
    data-parallel rank, such that summing over the chunks of every stage and over data
    ranks (the train step's psums) gives :func:`add_moe_losses`' unpipelined values.

    ``cfg``: the model's ModelConfig, every decoder layer an MoE layer (a pipeline stacks
    identical layers; validation refuses mixed ``moe_layer_freq`` under pp). ``sown``: the
    chunk's :data:`MOE_COLLECTIONS`, leaves stacked ``[K, ...]`` over its slots
    (:func:`jmegatron.models.gpt.apply_layers` with ``moe_sown``). ``first_layer`` (int32,
    may be traced): the model layer of slot 0; ``num_valid`` (traced int32 or None: all K):
    the chunk's real layers, the rest padding slots whose values are left out. ``share``:
    this rank's weight in the mean over data-parallel ranks (1 / data-parallel size, every
    rank holding as many tokens).

    loss (float32): ``share`` x the chunk's sown losses (coefficients applied). report, with
    :func:`chunk_report_zeros`' structure: each loss of :func:`sown_loss_names` divided by its
    coefficient and by the number of MoE layers (Megatron's ``track_moe_metrics`` mean over
    layers, summed over pipeline ranks) times ``share``; ``moe_tokens_per_expert``
    ``[num_moe_layers, E]`` with this chunk's layers in their rows and zeros elsewhere (the
    data/pipeline psum assembles the table); ``moe_dropped_token_fraction``: the chunk's
    dropped assignments over all layers' routed ones times ``share``, exact because every
    layer routes the same number (each token to ``moe_router_topk`` experts).

    Raises ValueError when not every layer is an MoE layer, or when ``sown`` lacks a value
    the router sows in training (the layers were applied without ``moe_sown``).
    """
    moe = cfg.moe
    num_layers = sum(cfg.moe_layers())
    if num_layers != cfg.num_layers:
        raise ValueError(f"chunk_moe_losses: {num_layers} of {cfg.num_layers} layers are MoE layers; pipeline "
                         f"stages stack identical layers (moe_layer_freq=1)")

    def found(name, collection):
        values = _collect(sown.get(collection, {}), name)
        if not values:
            raise ValueError(f"chunk_moe_losses: no {name!r} sown in {collection!r}: apply the layers in training "
                             f"with moe_sown=True")
        return values

    tokens = found("tokens_per_expert", MOE_STATS)[0].reshape(-1, moe.num_moe_experts)
    slots = tokens.shape[0]
    valid = jnp.ones((slots,), bool) if num_valid is None else jnp.arange(slots) < num_valid

    def chunk_sum(name, collection):  # over the chunk's real layers
        return sum(jnp.sum(jnp.where(valid, v.reshape(slots), 0.0)) for v in found(name, collection))

    total = jnp.float32(0.0)
    report = chunk_report_zeros(cfg)
    for name in sown_loss_names(moe):
        summed = chunk_sum(name, MOE_LOSSES)
        total = total + summed
        report[name] = summed / getattr(moe, LOSS_COEFFS[name]) / num_layers * share
    rows = jnp.where(valid, first_layer + jnp.arange(slots), num_layers)  # padding: out of range, dropped
    report["moe_tokens_per_expert"] = report["moe_tokens_per_expert"].at[rows].add(
        jnp.where(valid[:, None], tokens, 0.0), mode="drop")
    routed_per_layer = jnp.max(jnp.where(valid, found("routed_tokens", MOE_STATS)[0].reshape(slots), 0.0))
    report["moe_dropped_token_fraction"] = (chunk_sum("dropped_tokens", MOE_STATS)
                                            / jnp.maximum(routed_per_layer * num_layers, 1.0) * share)
    return total * share, report
