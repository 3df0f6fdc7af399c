"""Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2), as megatron-core's
megatron/core/transformer/multi_token_prediction.py builds it.

Depth ``k`` (1-based, ``k <= mtp_num_layers``) predicts the token ``k + 1`` places ahead:
its :class:`MultiTokenPredictionLayer` takes the previous depth's hidden states (depth 1:
the decoder's output after the final norm) and the embeddings of the tokens rolled ``k``
places left, and its logits come from the model's own output layer. The losses
(:func:`mtp_losses`) are reported apart from ``lm_loss`` as Megatron's ``mtp_{k} loss`` and
added to the optimised loss times ``mtp_loss_scaling_factor / mtp_num_layers``.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.models.layers import Linear, make_norm
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.models.transformer_layer import TransformerLayer

Array = jax.Array

# The collection GPTModel sows each depth's logits into (``logits``: a tuple, depth 1 first);
# the model computes them only when the collection is mutable (training), never when
# evaluating or generating.
MTP_COLLECTION = "mtp"


def roll_left(x: Array, shift: int = 1) -> Array:
    """``x [b, s, ...]`` moved ``shift`` places left along the sequence, the last ``shift``
    positions zero (megatron-core's ``roll_tensor(x, shifts=-shift)`` with its zero fill)."""
    if shift == 0:
        return x
    pad = jnp.zeros((x.shape[0], shift) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, shift:], pad], axis=1)


class MultiTokenPredictionLayer(nn.Module):
    """One MTP depth (megatron-core's ``MultiTokenPredictionLayer``), ``[b, s, h]`` hidden
    states and ``[b, s, h]`` embeddings of the rolled tokens -> ``[b, s, h]``:
    ``final_layernorm(transformer_layer(eh_proj([enorm(embeddings) | hnorm(hidden)])))``,
    the embeddings first. ``eh_proj/kernel [2h, h]`` has no bias; the transformer layer has
    the last decoder layer's kind (``moe_layer``: an MoE layer, as DeepSeek-V3's) and layer
    number (its attention window, if any)."""

    cfg: ModelConfig
    dot_general: Callable = dense_dot_general_fn
    moe_layer: bool = False

    @nn.compact
    def __call__(self, hidden: Array, embedded: Array, position_ids: Array, deterministic: bool,
                 sample_offset: Any = 0, segment_ids: Any = None, positions: Any = None) -> Array:
        c = self.cfg

        def norm(name):
            return make_norm(c.normalization, c.norm_epsilon, c.dtype, name, c.apply_layernorm_1p)

        x = jnp.concatenate([norm("enorm")(embedded), norm("hnorm")(hidden)], axis=-1)
        x = Linear((c.hidden_size,), (None, "embed"), dtype=c.dtype, dot_general=c.linear_dot_general(self.dot_general),
                   kernel_init=nn.initializers.normal(c.init_method_std), name="eh_proj")(x)
        x = nn.with_logical_constraint(x, ("batch", "activation_length", "activation_embed"))
        layer = TransformerLayer(c, deterministic, self.dot_general, self.moe_layer, name="transformer_layer")
        x, _ = layer(x, position_ids, jnp.asarray(sample_offset, jnp.uint32), None, segment_ids, c.num_layers - 1,
                     positions)
        return norm("final_layernorm")(x)


def mtp_losses(logits: tuple, labels: Array, loss_mask: Array, data_sum: Callable, cross_entropy: Callable,
               scaling_factor: float, share_sum: Callable = None) -> tuple[Array, dict]:
    """(the loss to add, report) of the MTP depths' ``logits`` (float32 ``[b, s, V]`` each,
    depth 1 first) for one micro-batch (Megatron's ``GPTModel._postprocess`` with
    ``MTPLossAutoScaler``).

    Depth ``k`` is scored against ``labels [b, s]`` rolled ``k`` places left, under
    ``loss_mask [b, s]`` rolled alike (the last ``k`` positions masked): ``mtp_{k}_loss`` is
    its masked token mean over every data-parallel rank (``data_sum`` of the local sums,
    float32), and the returned loss is ``scaling_factor / D * sum_k mtp_{k}_loss``.
    ``cross_entropy(logits, labels, mask) -> (masked sum, count)``. ``share_sum`` (default
    ``data_sum``) sums the masked losses instead: the identity gives this rank's share of
    each mean (its sum over the global count), which a pipeline schedule sums over ranks."""
    total = jnp.float32(0.0)
    report = {}
    for k, depth_logits in enumerate(logits, 1):
        ce, count = cross_entropy(depth_logits, roll_left(labels, k), roll_left(loss_mask, k))
        loss_k = (share_sum or data_sum)(ce) / jnp.maximum(data_sum(count), 1.0)
        report[f"mtp_{k}_loss"] = loss_k
        total = total + loss_k
    return total * (scaling_factor / max(len(logits), 1)), report
