"""The routed experts (megatron/core/transformer/moe/experts.py ``GroupedMLP`` /
``TEGroupedMLP``): ``num_moe_experts`` MLPs of ``moe_ffn_hidden_size``, their weights
stacked on a leading expert axis (logical name ``exp``).

Parameters: ``linear_fc1/kernel`` ``[E, h, ffn]`` (SwiGLU or the quick-GELU GLU:
``[E, h, 2, ffn]``, gate then up, as the dense MLP's fused fc1) and ``linear_fc2/kernel``
``[E, ffn, h]``, float32 master weights; with ``use_bias`` (Megatron's ``add_bias_linear``)
``linear_fc1/bias`` ``[E, (2,) ffn]`` and ``linear_fc2/bias`` ``[E, h]``. As Megatron
(``moe_apply_probs_on_input`` off), each assignment's routing weight multiplies the
activation before linear_fc2, in float32, and linear_fc2's bias (TEGroupedMLP's
``_apply_bias``: ``out + bias * prob``), so an assignment gives ``prob * (fc2(act) + bias)``.
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
    use_bias: bool = False  # per-expert fc1 / fc2 biases (Megatron's add_bias_linear)
    # the quick-GELU GLU (jmegatron.models.mlp.quick_geglu) with its linear offset and clamp
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    clamp_value: Optional[float] = None

    @nn.compact
    def __call__(self, x: Array, probs: Array, group_sizes: Optional[Array] = None) -> Array:
        e, h, f = self.num_experts, self.hidden_size, self.ffn_hidden_size
        gated = self.swiglu or self.quick_geglu
        fc1_shape, fc1_names = ((e, h, 2, f), ("exp", "embed", None, "mlp")) if gated else \
            ((e, h, f), ("exp", "embed", "mlp"))
        fc1_module = _ExpertKernel(fc1_shape, fc1_names, self.init_std, self.use_bias, name="linear_fc1")
        fc2_module = _ExpertKernel((e, f, h), ("exp", "mlp", "embed"), self.output_init_std, self.use_bias,
                                   name="linear_fc2")
        fc1, fc1_bias = fc1_module()
        fc2, fc2_bias = fc2_module()
        fc1 = fc1.astype(self.dtype).reshape(e, h, -1)
        fc2 = fc2.astype(self.dtype)
        x = x.astype(self.dtype)
        rows = None
        if group_sizes is not None:
            hidden = self.grouped_matmul(x, fc1, group_sizes)  # [N, (2)f]
            hidden = nn.with_logical_constraint(hidden, (None, "activation_mlp"))
            rows = _row_expert(group_sizes, x.shape[0]) if self.use_bias else None
        else:
            hidden = jnp.einsum("ech,ehf->ecf", x, fc1)
            hidden = nn.with_logical_constraint(hidden, ("activation_exp", None, "activation_mlp"))
        if self.use_bias:
            hidden = hidden + _per_row(fc1_bias.reshape(e, -1), rows, group_sizes).astype(self.dtype)
        if gated:
            hidden = hidden.reshape(hidden.shape[:-1] + (2, f))
        hidden = activation(hidden, self.swiglu, self.openai_gelu, quick_geglu_=self.quick_geglu,
                            glu_linear_offset=self.glu_linear_offset, clamp_value=self.clamp_value)
        hidden = (hidden.astype(jnp.float32) * probs[..., None].astype(jnp.float32)).astype(self.dtype)
        if group_sizes is not None:
            out = self.grouped_matmul(hidden, fc2, group_sizes)
        else:
            out = jnp.einsum("ecf,efh->ech", hidden, fc2)
        if self.use_bias:  # TEGroupedMLP._apply_bias: the bias times the assignment's weight
            out = out + (_per_row(fc2_bias, rows, group_sizes) * probs[..., None].astype(jnp.float32)
                         ).astype(self.dtype)
        return out


def _row_expert(group_sizes: Array, num_rows: int) -> Array:
    """int32 ``[N]``: the expert of each row of the dropless layout (rows sorted by expert,
    ``group_sizes [E]``); rows past ``sum(group_sizes)`` get ``E`` (no expert)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right").astype(jnp.int32)


def _per_row(bias: Array, rows: Optional[Array], group_sizes: Optional[Array]) -> Array:
    """``bias [E, n]`` (float32) laid out as the experts' rows: ``[N, n]`` for the dropless
    layout (``rows`` from :func:`_row_expert`; zeros for a row of no expert), else ``[E, 1, n]``
    against the capacity buffer ``[E, C, n]``."""
    if group_sizes is None:
        return bias[:, None, :].astype(jnp.float32)
    padded = jnp.concatenate([bias.astype(jnp.float32), jnp.zeros((1, bias.shape[-1]), jnp.float32)])
    return padded[rows]


class _ExpertKernel(nn.Module):
    """Holds one stacked expert weight as ``<name>/kernel`` (float32), the dense layers' layout,
    and with ``use_bias`` its per-expert ``<name>/bias`` (``shape[:1] + shape[2:]``, zeros at
    init). Returns (kernel, bias or None)."""

    shape: tuple
    names: tuple
    std: float
    use_bias: bool = False

    @nn.compact
    def __call__(self) -> tuple[Array, Optional[Array]]:
        init = nn.with_logical_partitioning(nn.initializers.normal(self.std), self.names)
        kernel = self.param("kernel", init, self.shape, jnp.float32)
        if not self.use_bias:
            return kernel, None
        bias_names = self.names[:1] + self.names[2:]
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, bias_names),
                          self.shape[:1] + self.shape[2:], jnp.float32)
        return kernel, bias


def output_init_std(init_method_std: float, num_layers: int) -> float:
    """Megatron's scaled init for output layers: ``std / sqrt(2 * num_layers)``."""
    return init_method_std / math.sqrt(2.0 * num_layers)
