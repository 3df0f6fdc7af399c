"""Basic Flax layers whose parameters carry logical axis names.

Parameters are created in ``param_dtype`` (float32 master weights) and cast to the
compute ``dtype`` at use, the mixed-precision scheme of Megatron's Float16Module with
fp32 master weights. Logical axis names (``embed``, ``mlp``, ``heads``, ``kv``,
``kv_heads``, ``vocab``, ``norm``) are mapped to mesh axes only by
:mod:`jmegatron.parallel.rules`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.parallel import tensor_parallel

Array = jax.Array
DType = Any
DotGeneral = Callable[..., Array]


def _normalize_axes(axes: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(a % ndim for a in axes)


class Linear(nn.Module):
    """A dense layer contracting trailing input axes with a named kernel.

    ``x``: ``[..., *in_shape]`` (the axes in ``axis``) -> ``[..., *features]``.
    The kernel has shape ``in_shape + features`` and logical names ``kernel_axes``.
    ``dot_general`` is pluggable (``jax.lax.dot_general`` by default; an FP8 or
    quantized implementation with the same signature can be passed in). One that holds
    per-layer parameters (FP8's meta, :class:`jmegatron.models.fp8.Fp8DotGeneral`) has a
    ``for_layer(module)`` method, called in this layer's scope, that returns the function.
    """

    features: Sequence[int]
    kernel_axes: Sequence[str | None]
    axis: int | Sequence[int] = -1
    use_bias: bool = False
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    kernel_init: Callable = nn.initializers.normal(0.02)
    bias_init: Callable = nn.initializers.zeros
    dot_general: DotGeneral = dense_dot_general_fn
    # Megatron's tensor-parallel role: "column" (kernel output dim ``tp_dim`` split) or
    # "row" (kernel input dim ``tp_dim`` split); with sequence parallelism the layer then
    # runs with Megatron's explicit collectives (jmegatron.parallel.tensor_parallel).
    tp_mode: Optional[str] = None
    tp_dim: int = 0

    @nn.compact
    def __call__(self, x: Array) -> Array:
        features = tuple(self.features)
        axis = _normalize_axes(self.axis, x.ndim)
        in_shape = tuple(x.shape[a] for a in axis)
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(self.kernel_init, tuple(self.kernel_axes)),
            in_shape + features,
            self.param_dtype,
        )
        kernel = jnp.asarray(kernel, self.dtype)
        x = jnp.asarray(x, self.dtype)
        dims = ((axis, tuple(range(len(axis)))), ((), ()))
        dot_general = self.dot_general
        if hasattr(dot_general, "for_layer"):  # creates its parameters in this layer (FP8 meta)
            dot_general = dot_general.for_layer(self)
        y = None
        if self.tp_mode == "column":
            out_shard = x.ndim - len(axis) + self.tp_dim - len(axis)
            y = tensor_parallel.column_parallel(x, kernel, dims, self.tp_dim, out_shard, dot_general)
        elif self.tp_mode == "row":
            y = tensor_parallel.row_parallel(x, kernel, dims, axis[self.tp_dim], self.tp_dim, dot_general)
        if y is None:
            y = dot_general(x, kernel, dims)
        if self.use_bias:
            bias_axes = tuple(self.kernel_axes[len(axis):])
            bias = self.param(
                "bias", nn.with_logical_partitioning(self.bias_init, bias_axes), features,
                self.param_dtype)
            y = y + jnp.asarray(bias, self.dtype)
        return y


class _Norm(nn.Module):
    """The fields and the ``scale`` param that :class:`LayerNorm` and :class:`RMSNorm` share."""

    epsilon: float = 1e-5
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    zero_centered: bool = False

    def _scale(self, h: int) -> Array:
        """The norm's float32 multiplier from its ``scale`` param ``[h]``: ``scale``, or with
        ``zero_centered`` ``1 + scale`` (the param initialised to 0; Megatron's
        ``--apply-layernorm-1p``, Gemma's RMSNorm ``x * (1 + w)``)."""
        init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
        scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)), (h,),
                           self.param_dtype).astype(jnp.float32)
        return 1.0 + scale if self.zero_centered else scale


class LayerNorm(_Norm):
    """LayerNorm over the last axis, statistics in float32 (Megatron's FusedLayerNorm).

    ``x``: ``[..., hidden]`` -> same shape, in ``dtype``. Params ``scale``/``bias``: ``[hidden]``;
    ``zero_centered``: the output multiplied by ``1 + scale``. Fields: ``epsilon``, ``dtype``,
    ``param_dtype``, ``zero_centered``.
    """

    @nn.compact
    def __call__(self, x: Array) -> Array:
        h = x.shape[-1]
        scale = self._scale(h)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
                          (h,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        return (y * scale + bias.astype(jnp.float32)).astype(self.dtype)


class RMSNorm(_Norm):
    """RMSNorm (Zhang & Sennrich 2019) over the last axis in float32, as Llama and Megatron.

    ``x``: ``[..., hidden]`` -> same shape, in ``dtype``. Param ``scale``: ``[hidden]``;
    ``zero_centered``: the output multiplied by ``1 + scale``. Fields as :class:`LayerNorm`.
    """

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self._scale(x.shape[-1])
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return (y * scale).astype(self.dtype)


class HeadsNorm(nn.Module):
    """LayerNorm or RMSNorm of each position's heads together: the statistics over the last
    two axes of ``x [..., heads, d]`` in float32, ``scale`` (and LayerNorm's ``bias``)
    ``[heads, d]`` with logical names ``axes`` (the heads' own, so the params shard with the
    heads). Under tensor parallelism the heads axis is split and the mean over it is a
    cross-shard reduction that GSPMD inserts. OLMo-2/3's ``q_norm`` / ``k_norm``
    (transformers ``Olmo2RMSNorm`` over ``q_proj``'s ``heads * d`` output).

    ``x`` -> same shape, in ``dtype``. Fields: ``normalization`` ("LayerNorm" | "RMSNorm"),
    ``epsilon``, ``dtype``, ``param_dtype``, ``zero_centered`` (multiply by ``1 + scale``,
    the scale initialised to 0).
    """

    normalization: str = "RMSNorm"
    axes: tuple[str, str] = ("heads", "kv")
    epsilon: float = 1e-5
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    zero_centered: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shape = x.shape[-2:]
        init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
        scale = self.param("scale", nn.with_logical_partitioning(init, self.axes), shape,
                           self.param_dtype).astype(jnp.float32)
        scale = 1.0 + scale if self.zero_centered else scale
        x32 = x.astype(jnp.float32)
        if self.normalization == "LayerNorm":
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes), shape,
                              self.param_dtype).astype(jnp.float32)
            x32 = x32 - jnp.mean(x32, axis=(-2, -1), keepdims=True)
            y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=(-2, -1), keepdims=True) + self.epsilon)
            return (y * scale + bias).astype(self.dtype)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=(-2, -1), keepdims=True) + self.epsilon)
        return (y * scale).astype(self.dtype)


def make_norm(normalization: str, epsilon: float, dtype: DType, name: str, zero_centered: bool = False) -> nn.Module:
    """``LayerNorm`` or ``RMSNorm`` by Megatron's ``--normalization`` name; ``zero_centered``:
    Megatron's ``--apply-layernorm-1p``."""
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[normalization]
    return cls(epsilon=epsilon, dtype=dtype, zero_centered=zero_centered, name=name)


class Embed(nn.Module):
    """A lookup table ``[num_embeddings, features]`` with logical names ``axes``.

    ``__call__``: int ``[...]`` -> ``[..., features]`` in ``dtype``.
    ``attend``: ``[..., features]`` -> ``[..., num_embeddings]`` (tied output layer).
    """

    num_embeddings: int
    features: int
    axes: tuple[str, str] = ("vocab", "embed")
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    embedding_init: Callable = nn.initializers.normal(0.02)

    def setup(self):
        self.embedding = self.param(
            "embedding", nn.with_logical_partitioning(self.embedding_init, self.axes),
            (self.num_embeddings, self.features), self.param_dtype)

    def __call__(self, ids: Array) -> Array:
        table = jnp.asarray(self.embedding, self.dtype)
        # Under sequence parallelism: VocabParallelEmbedding + scatter to the sequence-
        # parallel region, or a replicated table looked up per sequence shard.
        if self.axes[0] == "vocab":
            out = tensor_parallel.vocab_parallel_embed(ids, table)
        else:
            out = tensor_parallel.sequence_local_embed(ids, table)
        return jnp.take(table, ids, axis=0) if out is None else out

    def attend(self, x: Array, dot_general: Optional[DotGeneral] = None) -> Array:
        """Logits ``x @ embedding^T`` by ``dot_general`` (default
        :func:`jmegatron.kernels.xla.dense.dense_dot_general`)."""
        table = jnp.asarray(self.embedding, self.dtype)
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        out = tensor_parallel.column_parallel(x, table, dims, 0, x.ndim - 1, jax.lax.dot_general)
        if out is not None:
            return out
        return (dot_general or dense_dot_general_fn)(x, table, dims)
