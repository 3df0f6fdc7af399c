"""The transformer's MLP block (megatron/core/transformer/mlp.py ``MLP``): linear_fc1 ->
GELU, SwiGLU, GeGLU or the quick-GELU GLU -> linear_fc2, the dense layer's MLP and the MoE shared expert's.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.fusions import fused_gelu
from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.models.layers import Linear
from jmegatron.models.transformer_config import ModelConfig

Array = jax.Array


QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu: x * sigmoid(1.702 x)


def quick_geglu(h: Array, linear_offset: float = 0.0, clamp_value: Optional[float] = None) -> Array:
    """Megatron-core's quick-GELU GLU on ``h [..., 2, ffn]`` (index 0 the gate, 1 the linear
    half): ``quick_gelu(gate) * (up + linear_offset)``, ``quick_gelu(x) = x * sigmoid(1.702 x)``;
    with ``clamp_value`` c the gate is first clamped to ``<= c`` and the linear half to
    ``[-c, c]`` (megatron/core/transformer/moe/experts.py ``glu``,
    ``activation_func_clamp_value`` / ``glu_linear_offset``; gpt-oss's experts, transformers'
    ``GptOssExperts._apply_gate`` with ``alpha = 1.702``, ``limit = c``, offset 1).
    Returns ``[..., ffn]`` in ``h``'s dtype."""
    gate, up = h[..., 0, :], h[..., 1, :]
    if clamp_value is not None:
        gate = jnp.minimum(gate, clamp_value)
        up = jnp.clip(up, -clamp_value, clamp_value)
    return gate * jax.nn.sigmoid(QUICK_GELU_ALPHA * gate) * (up + linear_offset)


def activation(h: Array, swiglu: bool, openai_gelu: bool, gated_linear_unit: bool = False,
               quick_geglu_: bool = False, glu_linear_offset: float = 0.0,
               clamp_value: Optional[float] = None) -> Array:
    """The MLP's activation on linear_fc1's output: SwiGLU ``silu(h[..., 0, :]) * h[..., 1, :]``
    for ``[..., 2, ffn]`` (``swiglu``), else GELU, the tanh approximation with ``openai_gelu``
    (:func:`jmegatron.fusions.fused_gelu.gelu_tanh`) and the exact erf form otherwise
    (:func:`jmegatron.fusions.fused_gelu.gelu`), on ``[..., ffn]`` or, with
    ``gated_linear_unit``, gating ``[..., 2, ffn]`` as ``gelu(h[..., 0, :]) * h[..., 1, :]``
    (GeGLU, Shazeer 2020; Gemma). Megatron-Core's ``activation_func`` /
    ``gated_linear_unit`` of megatron/core/transformer/mlp.py. ``quick_geglu_``: :func:`quick_geglu`
    with ``glu_linear_offset`` and ``clamp_value`` (the config's ``quick_geglu``)."""
    if quick_geglu_:
        return quick_geglu(h, glu_linear_offset, clamp_value)
    if swiglu:
        return nn.silu(h[..., 0, :]) * h[..., 1, :]
    gelu = fused_gelu.gelu_tanh if openai_gelu else fused_gelu.gelu
    return gelu(h[..., 0, :]) * h[..., 1, :] if gated_linear_unit else gelu(h)


class MLP(nn.Module):
    """``[b, s, h]`` -> ``[b, s, h]``: linear_fc1 (column-parallel) -> GELU, SwiGLU or GeGLU
    -> linear_fc2 (row-parallel). Gated (SwiGLU, ``gated_linear_unit``), linear_fc1 is
    ``[h, 2, ffn]`` (index 0 the gate, 1 the up projection), one matmul as Megatron's fused fc1."""

    cfg: ModelConfig
    dot_general: Callable = dense_dot_general_fn

    @nn.compact
    def __call__(self, x: Array) -> Array:
        c = self.cfg
        init = nn.initializers.normal(c.init_method_std)
        out_init = nn.initializers.normal(c.init_method_std / math.sqrt(2.0 * c.num_layers))
        dense = functools.partial(Linear, use_bias=c.add_bias_linear, dtype=c.dtype,
                                  dot_general=self.dot_general)
        if c.gated_mlp:
            h = dense((2, c.ffn_hidden_size), ("embed", None, "mlp"), kernel_init=init, tp_mode="column",
                      tp_dim=2, name="linear_fc1")(x)
        else:
            h = dense((c.ffn_hidden_size,), ("embed", "mlp"), kernel_init=init, tp_mode="column", tp_dim=1,
                      name="linear_fc1")(x)
        h = activation(h, c.swiglu, c.openai_gelu, c.gated_linear_unit, c.quick_geglu, c.glu_linear_offset,
                       c.activation_func_clamp_value)
        h = nn.with_logical_constraint(h, ("batch", "length", "activation_mlp"))
        return dense((c.hidden_size,), ("mlp", "embed"), kernel_init=out_init, tp_mode="row", tp_dim=0,
                     name="linear_fc2")(h)
