"""The routed experts (megatron/core/transformer/moe/experts.py ``GroupedMLP`` /
``TEGroupedMLP``): ``num_moe_experts`` MLPs of ``moe_ffn_hidden_size``, their weights
stacked on a leading expert axis (logical name ``exp``).

Parameters: ``linear_fc1/kernel`` ``[E, h, ffn]`` (SwiGLU: ``[E, h, 2, ffn]``, gate then
up, as the dense MLP's fused fc1) and ``linear_fc2/kernel`` ``[E, ffn, h]``, float32
master weights, no biases. As Megatron (``moe_apply_probs_on_input`` off), each
assignment's routing weight multiplies the activation before linear_fc2, in float32.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.models.mlp import activation

Array = jax.Array


class GroupedMLP(nn.Module):
    """The experts of one MoE layer, applied to dispatched tokens in one of two layouts:

    * ``x [N, h]`` sorted by expert with ``group_sizes [E]`` (int32, summing to at most N):
      dropless, one ``jax.lax.ragged_dot`` per linear (grouped GEMM);
    * ``x [E, C, h]`` with ``group_sizes=None``: the capacity buffer, one batched matmul
      per linear.

    ``probs`` (``[N]`` or ``[E, C]``, float32) weights each row. Returns ``x``'s shape,
    in ``dtype``. ``init_std`` / ``output_init_std``: normal initialisation of fc1 / fc2
    (Megatron's init_method / output_layer_init_method). ``grouped_matmul``: the dropless
    path's grouped GEMM (``jax.lax.ragged_dot`` or the CPU kernel, ModelConfig.grouped_matmul).
    """

    num_experts: int
    hidden_size: int
    ffn_hidden_size: int
    swiglu: bool
    init_std: float = 0.02
    openai_gelu: bool = False  # the tanh GELU (jmegatron.models.mlp.activation)
    output_init_std: float = 0.02
    dtype: Any = jnp.float32
    grouped_matmul: Callable = jax.lax.ragged_dot

    @nn.compact
    def __call__(self, x: Array, probs: Array, group_sizes: Optional[Array] = None) -> Array:
        e, h, f = self.num_experts, self.hidden_size, self.ffn_hidden_size
        fc1_shape, fc1_names = ((e, h, 2, f), ("exp", "embed", None, "mlp")) if self.swiglu else \
            ((e, h, f), ("exp", "embed", "mlp"))
        fc1 = _ExpertKernel(fc1_shape, fc1_names, self.init_std, name="linear_fc1")()
        fc2 = _ExpertKernel((e, f, h), ("exp", "mlp", "embed"), self.output_init_std, name="linear_fc2")()
        fc1 = fc1.astype(self.dtype).reshape(e, h, -1)
        fc2 = fc2.astype(self.dtype)
        x = x.astype(self.dtype)
        if group_sizes is not None:
            hidden = self.grouped_matmul(x, fc1, group_sizes)  # [N, (2)f]
            hidden = nn.with_logical_constraint(hidden, (None, "activation_mlp"))
        else:
            hidden = jnp.einsum("ech,ehf->ecf", x, fc1)
            hidden = nn.with_logical_constraint(hidden, ("activation_exp", None, "activation_mlp"))
        if self.swiglu:
            hidden = hidden.reshape(hidden.shape[:-1] + (2, f))
        hidden = activation(hidden, self.swiglu, self.openai_gelu)
        hidden = (hidden.astype(jnp.float32) * probs[..., None].astype(jnp.float32)).astype(self.dtype)
        if group_sizes is not None:
            return self.grouped_matmul(hidden, fc2, group_sizes)
        return jnp.einsum("ecf,efh->ech", hidden, fc2)


class _ExpertKernel(nn.Module):
    """Holds one stacked expert weight as ``<name>/kernel`` (float32), the dense layers' layout."""

    shape: tuple
    names: tuple
    std: float

    @nn.compact
    def __call__(self) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(self.std), self.names)
        return self.param("kernel", init, self.shape, jnp.float32)


def output_init_std(init_method_std: float, num_layers: int) -> float:
    """Megatron's scaled init for output layers: ``std / sqrt(2 * num_layers)``."""
    return init_method_std / math.sqrt(2.0 * num_layers)
