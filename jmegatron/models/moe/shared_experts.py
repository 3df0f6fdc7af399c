"""The shared expert (megatron/core/transformer/moe/shared_experts.py ``SharedExpertMLP``):
a dense MLP of ``moe_shared_expert_intermediate_size`` that every token passes through,
its output added to the routed experts' (DeepSeek-MoE, Qwen-MoE). Megatron's optional
sigmoid gate (``moe_shared_expert_gate``) is not built.

Parameters as the dense MLP's, under ``shared_experts``: ``linear_fc1/kernel`` ``[h, ffn]``
(SwiGLU ``[h, 2, ffn]``), ``linear_fc2/kernel`` ``[ffn, h]``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn

from jmegatron.models.mlp import MLP
from jmegatron.models.transformer_config import ModelConfig


def SharedExpertMLP(cfg: ModelConfig, dot_general: Callable, name: str = "shared_experts") -> nn.Module:
    """The shared expert as a :class:`jmegatron.models.mlp.MLP` module (``[b, s, h]`` ->
    ``[b, s, h]``) with ``ffn_hidden_size = moe_shared_expert_intermediate_size``.
    ``cfg``: the model's :class:`jmegatron.models.transformer_config.ModelConfig` (with ``moe`` set)."""
    shared = dataclasses.replace(cfg, ffn_hidden_size=cfg.moe.moe_shared_expert_intermediate_size)
    return MLP(shared, dot_general=dot_general, name=name)
