"""The model's architecture configuration, resolved from a run's config: :class:`ModelConfig`,
the run's :class:`jmegatron.config.model.TransformerConfig` (Megatron-Core's
megatron/core/transformer/transformer_config.py) with what the model resolves from it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jmegatron.config import (ConfigError, JMegatronConfig, MoEConfig, RotaryConfig, TransformerConfig,
                              moe_layer_pattern, no_rope_layer_pattern, window_layer_pattern)
from jmegatron.kernels.cpu.ops import blas_dot_general, grouped_matmul
from jmegatron.kernels.xla.dense import dense_dot_general_fn
from jmegatron.models.backend import Backend
from jmegatron.models.core_attention import CORE_ATTENTION_FEATURES, attention_features
from jmegatron.models.fp8 import Fp8DotGeneral
from jmegatron.models.rope import RotaryEmbedding
from jmegatron.models.te import te_dot_general


@dataclasses.dataclass(frozen=True)
class ModelConfig(TransformerConfig):
    """The model group of a run's config (:class:`jmegatron.config.model.TransformerConfig`:
    its fields, with its rotary, MoE and parallel parts) as the model runs it: ``vocab_size``
    padded, ``scan_layers`` forced under pipeline parallelism, and what the run's config
    resolves for the model: the compute ``dtype``, the kernels (``backend``,
    :class:`jmegatron.models.backend.Backend`, chosen once in :meth:`from_config`) and the
    rotary embedding ``rope``."""

    dtype: Any = jnp.float32
    backend: Backend = Backend()  # the resolved attention / matmul / cross-entropy kernels
    # the rotary embedding with its scalings (from_config builds it from the run's fields);
    # None: RotaryEmbedding.from_config of the fields above
    rope: Optional[RotaryEmbedding] = None

    @classmethod
    def from_config(cls, cfg: JMegatronConfig, padded_vocab_size: int) -> "ModelConfig":
        """The model fields of ``cfg``; compute dtype bfloat16 / float16 with ``cfg.bf16`` / ``fp16``;
        ``backend`` resolved for JAX's default backend
        (:meth:`jmegatron.models.backend.Backend.from_config`).

        Raises ConfigError for ``fp8`` with an ``fp8_recipe`` other than "delayed" unless
        Transformer Engine runs it, or with ``sequence_parallel`` (not built in pure JAX)."""
        backend = Backend.from_config(cfg)
        _check_fp8(cfg, backend)
        _check_attention_features(cfg, backend)
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TransformerConfig)}
        if cfg.pipeline_model_parallel_size > 1:  # stages hold slices of the stacked layers
            fields["scan_layers"] = True
        fields["vocab_size"] = padded_vocab_size
        dtype = jnp.bfloat16 if cfg.bf16 else jnp.float16 if cfg.fp16 else jnp.float32
        return cls(dtype=dtype, backend=backend, rope=RotaryEmbedding.from_config(cfg), **fields)

    @property
    def moe(self) -> Optional[MoEConfig]:
        """The mixture-of-experts group (this config: it is a :class:`MoEConfig`); None for a
        dense model (``num_moe_experts`` None)."""
        return None if self.num_moe_experts is None else self

    def rotary_embedding(self) -> Optional[RotaryEmbedding]:
        """The attention's rotary embedding: ``rope``, else the unscaled one of
        ``position_embedding_type`` / ``rotary_base`` / ``kv_channels``; None without rotary
        positions."""
        return self.rope if self.rope is not None else RotaryEmbedding.from_config(self)

    def local_rotary_embedding(self) -> Optional[RotaryEmbedding]:
        """The rotary embedding of the sliding-window layers: the unscaled RoPE at
        ``rotary_base_local`` (Gemma-3's local base; Hugging Face scales the global layers
        only) over the same channels and layout (``rotary_percent``, ``rotary_interleaved``),
        or None when the windowed layers share :meth:`rotary_embedding`."""
        if self.rotary_base_local is None:
            return None
        return RotaryEmbedding(self.kv_channels, RotaryConfig(position_embedding_type="rope",
                                                             rotary_base=self.rotary_base_local,
                                                             rotary_percent=self.rotary_percent,
                                                             rotary_interleaved=self.rotary_interleaved))

    def window_layers(self) -> tuple[int, ...]:
        """1 for each decoder layer whose attention slides (``window_size``,
        ``window_attn_skip_freq``: :func:`jmegatron.config.window_layer_pattern`), else 0."""
        return window_layer_pattern(self.window_size, self.window_attn_skip_freq, self.num_layers)

    def no_rope_layers(self) -> tuple[int, ...]:
        """1 for each decoder layer that applies no position embedding (``no_rope_freq``:
        :func:`jmegatron.config.no_rope_layer_pattern`), else 0."""
        return no_rope_layer_pattern(self.no_rope_freq, self.num_layers)

    @property
    def attention_window(self) -> Optional[int]:
        """The sliding window's width W in keys, the query's own included (``window_size[0] +
        1``, Hugging Face's ``sliding_window``); None without ``window_size``."""
        return None if self.window_size is None else self.window_size[0] + 1

    @property
    def attention_impl(self) -> str:
        """The core attention, ``backend.attention``."""
        return self.backend.attention

    @property
    def matmul_impl(self) -> str:
        """The dense layers' matmul, ``backend.matmul``."""
        return self.backend.matmul

    def linear_dot_general(self, default: Callable) -> Any:
        """The ``dot_general`` of the layers' QKV, attention output, fc1 and fc2 Linears:
        :class:`jmegatron.models.fp8.Fp8DotGeneral` when ``fp8`` is set, else ``default``."""
        if self.fp8 is None:
            return default
        return Fp8DotGeneral(self.fp8, self.fp8_amax_history_len)

    def moe_layers(self) -> tuple[int, ...]:
        """1 for each decoder layer whose MLP is an MoE layer (``moe_layer_freq``), else 0."""
        if self.moe is None:
            return (0,) * self.num_layers
        return moe_layer_pattern(self.moe.moe_layer_freq, self.num_layers)

    def mtp_moe_layers(self) -> tuple[int, ...]:
        """1 for each multi-token prediction depth whose layer is an MoE layer (each takes the
        last decoder layer's kind, as megatron-core's), else 0; empty without ``mtp_num_layers``."""
        return (self.moe_layers()[-1],) * (self.mtp_num_layers or 0)

    def dense_dot_general(self) -> Callable:
        """The dense layers' ``dot_general`` for ``backend.matmul``."""
        if self.matmul_impl in ("blas", "hybrid"):
            return functools.partial(blas_dot_general, weight_grad_only=self.matmul_impl == "hybrid")
        if self.matmul_impl == "transformer_engine":  # resolved under transformer_impl="transformer_engine"
            return te_dot_general(self)
        return dense_dot_general_fn

    def grouped_matmul(self) -> Callable:
        """The MoE experts' grouped GEMM ``(x [N, K], w [E, K, P], group_sizes [E]) -> [N, P]``
        for ``backend.matmul``: the CPU kernel (:func:`jmegatron.kernels.cpu.ops.grouped_matmul`)
        with the CPU matmul kernels, else ``jax.lax.ragged_dot``."""
        if self.matmul_impl in ("blas", "hybrid"):
            return grouped_matmul
        return jax.lax.ragged_dot


def _check_fp8(cfg: JMegatronConfig, backend: Backend) -> None:
    if cfg.fp8 is None:
        return
    if cfg.fp8_recipe != "delayed" and backend.transformer != "transformer_engine":
        raise ConfigError(f"config.fp8_recipe={cfg.fp8_recipe!r} needs transformer_impl='transformer_engine' "
                          f"(Transformer Engine); the pure-JAX FP8 path (jmegatron.models.fp8) builds "
                          f"fp8_recipe='delayed' only.")
    if cfg.sequence_parallel:
        raise ConfigError("config.fp8 with sequence_parallel=True is not built on the pure-JAX FP8 path "
                          "(jmegatron.models.fp8); set sequence_parallel=False.")




def _check_attention_features(cfg: JMegatronConfig, backend: Backend) -> None:
    missing = [n for n in attention_features(cfg) if n not in CORE_ATTENTION_FEATURES.get(backend.attention, ())]
    if missing:
        raise ConfigError(f"config.attention_impl={backend.attention!r} does not build {', '.join(missing)}; "
                          f"set config.attention_impl='auto' (or one of "
                          f"{sorted(k for k, v in CORE_ATTENTION_FEATURES.items() if set(missing) <= set(v))}).")
