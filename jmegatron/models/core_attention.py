"""The core attentions (``config.attention_impl``), one registry: :data:`CORE_ATTENTIONS`.

Megatron-Core's ``core_attention`` submodule of a layer spec
(megatron/core/models/gpt/gpt_layer_specs.py: ``DotProductAttention`` or
``TEDotProductAttention``): every core here takes ``(q [b, s, nq, d], k [b, s, nkv, d], v
[b, s, nkv, d], *, dropout_rate, dropout_rng, deterministic, dropout_impl, sample_offset[,
segment_ids])`` and returns the causal attention ``[b, s, nq, d]``. Which one a model runs
is resolved once (:class:`jmegatron.models.backend.Backend`).

* ``"xla"`` -- :func:`jmegatron.kernels.xla.attention.xla_attention`, the reference.
* ``"dot_product"`` -- ``jax.nn.dot_product_attention`` (XLA implementation).
* ``"cudnn"`` -- cuDNN's flash attention through ``jax.nn.dot_product_attention``.
* ``"cpu"`` -- the CPU kernel (:mod:`jmegatron.kernels.cpu`).
* ``"pallas"`` -- the Pallas FlashAttention-2 kernels (:mod:`jmegatron.kernels.pallas`).
* ``"transformer_engine"`` -- Transformer Engine's fused attention (:mod:`jmegatron.models.te`).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jmegatron.config import ConfigError
from jmegatron.kernels import gpu_target
from jmegatron.kernels.cpu import ops as cpu_ops
from jmegatron.kernels.pallas import flash_attention
from jmegatron.kernels.xla.attention import xla_attention
from jmegatron.models import te

Array = jax.Array

# A core attention: (q [b, s, nq, d], k [b, s, nkv, d], v [b, s, nkv, d], *,
#   dropout_rate, dropout_rng, deterministic, dropout_impl, sample_offset[, segment_ids])
#   -> [b, s, nq, d]; causal. sample_offset: the global sample number of row 0
#   (jmegatron.kernels.xla.dropout); segment_ids int [b, s] (document masking), passed only when given.
CoreAttention = Callable[..., Array]


def dot_product_attention(q: Array, k: Array, v: Array, *, dropout_rate: float = 0.0,
                          dropout_rng: Optional[Array] = None, deterministic: bool = True,
                          dropout_impl: str = "hash", sample_offset=0,
                          segment_ids: Optional[Array] = None) -> Array:
    """``jax.nn.dot_product_attention`` (XLA implementation, causal; ``segment_ids`` int
    ``[b, s]`` as :func:`jmegatron.kernels.xla.attention.xla_attention`, given to it as a
    boolean ``mask [b, 1, s, s]``). No attention dropout: raises ValueError when dropout is requested in training."""
    if not deterministic and dropout_rate > 0.0:
        raise ValueError("attention_impl='dot_product' has no attention dropout; "
                         "set config.attention_dropout=0.0 or attention_impl='xla'.")
    return _jax_nn_attention(q, k, v, segment_ids, "xla")


def _jax_nn_attention(q: Array, k: Array, v: Array, segment_ids: Optional[Array], implementation: str) -> Array:
    """Causal ``jax.nn.dot_product_attention`` (GQA native: ``nq % nkv == 0``); document
    masking as a boolean ``mask [b, 1, s, s]`` (same segment), which the cuDNN path turns
    into an additive bias (``[b, 1, s, s]`` in q's dtype: O(s^2) memory per sequence)."""
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_attention(q: Array, k: Array, v: Array, *, dropout_rate: float = 0.0,
                    dropout_rng: Optional[Array] = None, deterministic: bool = True,
                    dropout_impl: str = "hash", sample_offset=0,
                    segment_ids: Optional[Array] = None) -> Array:
    """cuDNN's fused flash attention through ``jax.nn.dot_product_attention(...,
    implementation="cudnn")`` (the counterpart of Megatron's TEDotProductAttention with the
    cuDNN backend): causal (cuDNN skips the masked tiles), GQA native, ``segment_ids`` (int
    ``[b, s]``) as a same-document mask. q ``[b, s, nq, d]``, k/v ``[b, s, nkv, d]`` in
    bfloat16 or float16 -> ``[b, s, nq, d]``.

    Raises :class:`jmegatron.config.ConfigError` naming ``attention_impl`` and the fix when
    attention dropout is requested (``jax.nn.dot_product_attention`` exposes none, and
    jmegatron's dropout masks are its own hash: use ``attention_dropout=0`` or
    ``attention_impl="pallas"`` / ``"xla"``), when JAX's backend is not a GPU, when the
    dtype is float32, or when cuDNN refuses the shape (head dim > 128 before Hopper, or
    not a multiple of 8; cuDNN missing); a named GPU
    (:func:`jmegatron.kernels.gpu_target.lowering_for`) counts as one."""
    if not deterministic and dropout_rate > 0.0:
        raise ConfigError(f"attention_impl='cudnn' has no attention dropout (attention_dropout={dropout_rate}): "
                          "set config.attention_dropout=0.0, or attention_impl='pallas' or 'xla'.")
    if not gpu_target.is_gpu():
        raise ConfigError(f"attention_impl='cudnn' needs an NVIDIA GPU; JAX's backend is {jax.default_backend()!r}: "
                          "set config.attention_impl='auto' (or 'xla').")
    if q.dtype not in CUDNN_DTYPES:
        raise ConfigError(f"attention_impl='cudnn' runs bfloat16 / float16 only, got {q.dtype}: set config.bf16=True "
                          "(or fp16=True), or attention_impl='auto'.")
    try:
        return _jax_nn_attention(q, k, v, segment_ids, "cudnn")
    except (NotImplementedError, RuntimeError) as e:  # cuDNN's shape checks, or no cuDNN
        raise ConfigError(f"attention_impl='cudnn': cuDNN cannot run this attention (q {q.shape} {q.dtype}): {e}; "
                          "set config.attention_impl='auto' (Pallas or XLA).") from e


def cpu_attention(q: Array, k: Array, v: Array, segment_ids: Optional[Array] = None, **kwargs) -> Array:
    """The CPU attention kernel (:func:`jmegatron.kernels.cpu.ops.cpu_attention`), same
    signature, dropout masks and document mask as :func:`jmegatron.kernels.xla.attention.xla_attention`."""
    return cpu_ops.cpu_attention(q, k, v, segment_ids=segment_ids, **kwargs)


def te_attention(q: Array, k: Array, v: Array, segment_ids: Optional[Array] = None, **kwargs) -> Array:
    """Transformer Engine's fused attention (:func:`jmegatron.models.te.te_fused_attention`);
    the core ``transformer_impl="transformer_engine"`` resolves ``attention_impl="auto"`` to.
    ``segment_ids`` (document masking) go to :func:`cudnn_attention`: TE's BSHD layout masks
    padding, not several documents per row."""
    if segment_ids is not None:
        return cudnn_attention(q, k, v, dropout_rate=kwargs.get("dropout_rate", 0.0),
                               deterministic=kwargs.get("deterministic", True), segment_ids=segment_ids)
    return te.te_fused_attention(q, k, v, **kwargs)


def pallas_attention(q: Array, k: Array, v: Array, segment_ids: Optional[Array] = None, **kwargs) -> Array:
    """The Pallas FlashAttention-2 kernels
    (:func:`jmegatron.kernels.pallas.flash_attention.pallas_attention`; Pallas interpret mode
    off a GPU), same signature, dropout masks (``dropout_impl="hash"``) and document mask as
    :func:`jmegatron.kernels.xla.attention.xla_attention`."""
    return flash_attention.pallas_attention(q, k, v, segment_ids=segment_ids, **kwargs)


CORE_ATTENTIONS: dict[str, CoreAttention] = {
    "xla": xla_attention,
    "dot_product": dot_product_attention,
    "cpu": cpu_attention,
    "cudnn": cudnn_attention,
    "transformer_engine": te_attention,
    "pallas": pallas_attention,
}


# The attention fields beyond causal softmax(q k^T / sqrt(d)) that each core takes
# (the field names of jmegatron.config.JMegatronConfig); a core absent here takes none.
CORE_ATTENTION_FEATURES: dict[str, tuple[str, ...]] = {
    "xla": ("softmax_scale", "attn_logit_softcapping", "window_size", "multi_latent_attention", "softmax_type"),
}


def attention_features(cfg) -> tuple[str, ...]:
    """The fields of ``cfg`` (a run's or model's config) that a core attention must take
    (:data:`CORE_ATTENTION_FEATURES`): those of ``softmax_scale``, ``attn_logit_softcapping``,
    ``window_size`` and ``multi_latent_attention`` (a value head dimension unlike the
    key's) that are set, and ``softmax_type`` when it is not "vanilla" (attention sinks)."""
    return tuple(n for n in ("softmax_scale", "attn_logit_softcapping", "window_size", "multi_latent_attention")
                 if getattr(cfg, n, None) not in (None, False)) + \
        (("softmax_type",) if getattr(cfg, "softmax_type", "vanilla") != "vanilla" else ())
