"""The kernels a model runs, resolved once per platform: :class:`Backend`.

``config.attention_impl``, ``matmul_impl``, ``cross_entropy_impl`` and ``transformer_impl``
may say ``"auto"``; :func:`resolve_impls` picks for the platform (Megatron's
``--transformer-impl`` choice between its local and its Transformer Engine layers, and
Levanter's one attention backend decided once) and :meth:`Backend.from_config` holds the
result, which :class:`jmegatron.models.transformer_config.ModelConfig` carries: the layers,
the losses and distillation read it from the model config instead of resolving again.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from jmegatron.config import JMegatronConfig
from jmegatron.kernels import cpu as cpu_kernels
from jmegatron.kernels import gpu_target
from jmegatron.models import te
from jmegatron.models.core_attention import CORE_ATTENTION_FEATURES, attention_features


def detect_backend() -> str:
    """JAX's default backend as :func:`resolve_impls` names it: ``"cpu"``, ``"gpu"`` (NVIDIA,
    CUDA), ``"rocm"`` (an AMD GPU: no cuDNN) or ``"tpu"``; ``"gpu"`` inside
    :func:`jmegatron.kernels.gpu_target.lowering_for` (traced for a named GPU)."""
    if gpu_target.current() is not None:
        return "gpu"
    backend = jax.default_backend()
    if backend == "gpu" and "rocm" in getattr(jax.devices()[0].client, "platform_version", "").lower():
        return "rocm"
    return backend


def cudnn_max_head_dim(compute_capability: Optional[tuple[int, int]] = None) -> int:
    """The largest head dimension cuDNN's flash attention takes on a GPU of
    ``compute_capability`` (None: :func:`jmegatron.kernels.gpu_target.compute_capability`):
    256 from Hopper (9.0) on, 128 before it or when unknown, as JAX's
    ``check_is_flash_attention`` (jax/_src/cudnn/fused_attention_stablehlo.py) states
    cuDNN's limits."""
    cc = compute_capability or gpu_target.compute_capability()
    return 256 if cc is not None and tuple(cc) >= (9, 0) else 128


def cudnn_attention_supported(cfg: JMegatronConfig, compute_capability: Optional[tuple[int, int]] = None
                              ) -> tuple[bool, str]:
    """Whether ``jax.nn.dot_product_attention(implementation="cudnn")`` can run ``cfg``'s
    attention on a GPU of ``compute_capability`` (None: the local or named GPU's; its checks
    in jax/_src/cudnn/fused_attention_stablehlo.py): bfloat16 / float16 compute,
    ``kv_channels`` a multiple of 8 and at most :func:`cudnn_max_head_dim` (128 before
    Hopper, 256 from it), no attention dropout (jax.nn exposes none), an even
    ``seq_length`` under document masking (the mask becomes a bias). Returns ``(ok,
    reason)``; reason "" when ok."""
    limit = cudnn_max_head_dim(compute_capability)
    if not (cfg.bf16 or cfg.fp16):
        return False, "cuDNN attention runs bfloat16 / float16 only (config.bf16 / fp16 unset)"
    if cfg.kv_channels % 8 or cfg.kv_channels > limit:
        return False, f"kv_channels={cfg.kv_channels} (cuDNN: a multiple of 8, <= {limit} on this GPU)"
    if cfg.attention_dropout > 0.0:
        return False, f"attention_dropout={cfg.attention_dropout} (jax.nn's cuDNN attention has no dropout)"
    if cfg.reset_attention_mask and cfg.seq_length % 2:
        return False, f"seq_length={cfg.seq_length} is odd (cuDNN's masked attention needs it even)"
    return True, ""


def resolve_impls(cfg: JMegatronConfig, backend: Optional[str] = None) -> dict[str, str]:
    """``attention_impl``, ``matmul_impl``, ``cross_entropy_impl`` and ``transformer_impl``
    with ``"auto"`` resolved for ``backend`` (``"cpu"`` | ``"gpu"`` | ``"rocm"`` | ``"tpu"``;
    None: :func:`detect_backend`). Explicit choices are kept.

    * CPU: the CPU kernels ("cpu" / "hybrid", :mod:`jmegatron.kernels.cpu`) when the compute
      dtype is float32, tensor_model_parallel_size 1 and the kernels build; else "xla".
      Cross-entropy "xla".
    * NVIDIA GPU: attention "cudnn" where :func:`cudnn_attention_supported`, else "pallas"
      (:mod:`jmegatron.kernels.pallas`: dropout, float32); matmul "xla" (cuBLAS);
      cross-entropy "pallas".
    * ROCm / TPU: attention, matmul and cross-entropy "xla".
    * Attention falls back to "xla" where the pick lacks a field the model sets
      (:data:`jmegatron.models.core_attention.CORE_ATTENTION_FEATURES`: sliding windows,
      soft-capping, ``softmax_scale``).
    * ``transformer_impl``: :func:`jmegatron.models.te.resolve_transformer_impl` ("auto" is
      Transformer Engine only on an NVIDIA GPU where ``transformer_engine.jax`` imports; an
      explicit "transformer_engine" without it prints why and resolves to "local"). Under
      Transformer Engine, attention and matmul "auto" are TE's fused attention and GEMMs
      ("transformer_engine": :mod:`jmegatron.models.te`).
    """
    backend = backend or detect_backend()
    out = {"attention_impl": cfg.attention_impl, "matmul_impl": cfg.matmul_impl,
           "cross_entropy_impl": cfg.cross_entropy_impl,
           # (FP8 delayed scaling is jmegatron's own: "auto" keeps it on the local layers)
           "transformer_impl": te.resolve_transformer_impl(
               "local" if cfg.transformer_impl == "auto" and cfg.fp8 is not None and cfg.fp8_recipe == "delayed"
               else cfg.transformer_impl, backend)}
    attention = matmul = "xla"
    cross_entropy = resolve_cross_entropy_impl("auto", backend)
    if backend == "cpu" and "auto" in (cfg.attention_impl, cfg.matmul_impl):
        kernels = cpu_kernels.use_by_default(cfg.tensor_model_parallel_size, float32=not (cfg.bf16 or cfg.fp16))
        attention, matmul = ("cpu", "hybrid") if kernels else ("xla", "xla")
    elif backend == "gpu":
        attention = "cudnn" if cudnn_attention_supported(cfg)[0] else "pallas"
        if out["transformer_impl"] == "transformer_engine":  # Megatron's TE layers: TE's GEMMs and fused attention
            attention = matmul = "transformer_engine"
    if [n for n in attention_features(cfg) if n not in CORE_ATTENTION_FEATURES.get(attention, ())]:
        attention = "xla"  # the reference takes every attention field
    for name, choice in (("attention_impl", attention), ("matmul_impl", matmul),
                         ("cross_entropy_impl", cross_entropy)):
        if out[name] == "auto":
            out[name] = choice
    return out


def resolve_cross_entropy_impl(impl: str, backend: Optional[str] = None) -> str:
    """``config.cross_entropy_impl`` with ``"auto"`` resolved for ``backend`` (None:
    :func:`detect_backend`): "pallas" on an NVIDIA GPU, else "xla" (the Pallas kernels would
    run in interpret mode). Other values are returned unchanged."""
    if impl != "auto":
        return impl
    return "pallas" if (backend or detect_backend()) == "gpu" else "xla"


@dataclasses.dataclass(frozen=True)
class Backend:
    """The resolved kernels of one model on one platform.

    ``platform``: ``"cpu"`` | ``"gpu"`` | ``"rocm"`` | ``"tpu"`` (:func:`detect_backend`).
    ``attention``: the core attention (a key of
    :data:`jmegatron.models.core_attention.CORE_ATTENTIONS`); ``matmul``: the dense layers'
    matmul (``"xla"``, the CPU kernels' ``"blas"`` / ``"hybrid"``, ``"transformer_engine"``);
    ``cross_entropy``: the LM loss's cross-entropy (``"xla"`` | ``"pallas"``);
    ``transformer``: ``"local"`` | ``"transformer_engine"``. None is ``"auto"``. The
    defaults are XLA's everywhere (a model config built without a run's config).
    """

    platform: str = "cpu"
    attention: str = "xla"
    matmul: str = "xla"
    cross_entropy: str = "xla"
    transformer: str = "local"

    @classmethod
    def from_config(cls, cfg: JMegatronConfig, platform: Optional[str] = None) -> "Backend":
        """``cfg``'s choices with ``"auto"`` resolved by :func:`resolve_impls` for ``platform``
        (None: JAX's default backend, :func:`detect_backend`)."""
        platform = platform or detect_backend()
        impls = resolve_impls(cfg, platform)
        return cls(platform=platform, attention=impls["attention_impl"], matmul=impls["matmul_impl"],
                   cross_entropy=impls["cross_entropy_impl"], transformer=impls["transformer_impl"])
