"""The shared expert (megatron/core/transformer/moe/shared_experts.py ``SharedExpertMLP``):
a dense MLP of ``moe_shared_expert_intermediate_size`` that every token passes through,
its output added to the routed experts' (DeepSeek-MoE, Qwen-MoE), optionally scaled per
token by Megatron's sigmoid gate (``moe_shared_expert_gate``, Qwen2-MoE's ``shared_expert_gate``).

Parameters as the dense MLP's, under ``shared_experts``: ``linear_fc1/kernel`` ``[h, ffn]``
(SwiGLU ``[h, 2, ffn]``), ``linear_fc2/kernel`` ``[ffn, h]``; the gate's ``kernel [h, 1]``
under ``shared_expert_gate`` (Megatron-Core keeps it as ``shared_experts.gate_weight [1, h]``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.models.layers import Linear
from jmegatron.models.mlp import MLP
from jmegatron.models.transformer_config import ModelConfig


def SharedExpertMLP(cfg: ModelConfig, dot_general: Callable, name: str = "shared_experts") -> nn.Module:
    """The shared expert as a :class:`jmegatron.models.mlp.MLP` module (``[b, s, h]`` ->
    ``[b, s, h]``) with ``ffn_hidden_size = moe_shared_expert_intermediate_size``.
    ``cfg``: the model's :class:`jmegatron.models.transformer_config.ModelConfig` (with ``moe`` set)."""
    shared = dataclasses.replace(cfg, ffn_hidden_size=cfg.moe.moe_shared_expert_intermediate_size)
    return MLP(shared, dot_general=dot_general, name=name)


class SharedExpertGate(nn.Module):
    """The shared expert's gate ``sigmoid(x W_g)``: ``x [b, s, h]`` -> float32 ``[b, s, 1]``
    (megatron/core/transformer/moe/shared_experts.py, ``use_shared_expert_gate``)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        logits = Linear((1,), ("embed", None), dtype=self.cfg.dtype,
                        kernel_init=nn.initializers.normal(self.cfg.init_method_std), name="gate")(x)
        return jax.nn.sigmoid(logits.astype(jnp.float32))
