"""The Hugging Face ``transformers`` mapping of jmegatron parameters and configs, both ways.

Targets, chosen by the architecture fields of a :class:`jmegatron.config.JMegatronConfig`:

* ``GPT2LMHeadModel`` (transformers ``models/gpt2/modeling_gpt2.py``): learned absolute
  positions, LayerNorm, GELU MLP (exact "gelu", or GPT-2's tanh "gelu_new" with
  ``openai_gelu``), multi-head attention with biases.
* ``LlamaForCausalLM`` (``models/llama/modeling_llama.py``): rotary positions (rotate-half;
  default, "linear", Llama-3.x "llama3" or "yarn" scaling, :mod:`jmegatron.models.rope`),
  RMSNorm, SwiGLU MLP, grouped-query attention, any ``kv_channels``.
* ``Qwen2ForCausalLM``: Llama's blocks with Q/K/V biases and no other bias
  (``add_qkv_bias`` without ``add_bias_linear``).
* ``Qwen3ForCausalLM``: Llama's blocks with ``qk_layernorm`` (per-head ``q_norm`` /
  ``k_norm`` before RoPE).
* ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` for mixture-of-experts configs
  (``num_moe_experts`` set): Llama's attention with the MoE MLPs of
  :mod:`jmegatron.conversion.hf_moe` (Mixtral without a shared expert, Qwen2-MoE with one).

* ``GptOssForCausalLM`` (:mod:`jmegatron.conversion.hf_moe`): Llama's layout with biases on
  q/k/v/o, attention sinks (``softmax_type="learnable"``: ``self_attn.sinks`` =
  ``self_attention/softmax_offset [nq]``), sliding and full layers, and gpt-oss's experts.

* ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (``models/gemma2``, ``models/gemma3``):
  ``sandwich_norms`` (post-attention and post-MLP norms), Gemma's ``(1 + w)`` RMSNorm
  (``apply_layernorm_1p``), GeGLU with the tanh GELU (``gated_linear_unit`` +
  ``openai_gelu``), embeddings scaled by ``sqrt(hidden)``, ``softmax_scale``
  (``query_pre_attn_scalar``), sliding-window layers (``window_size``,
  ``window_attn_skip_freq``: HF ``sliding_window`` / ``layer_types``), soft-capping, a tied
  output; Gemma-3 adds ``qk_layernorm`` and a local RoPE base (``rotary_base_local``).
* ``Olmo2ForCausalLM`` / ``Olmo3ForCausalLM`` (``models/olmo2``, ``models/olmo3``): Llama's
  attention and SwiGLU MLP without biases, the QK-norm over all query heads and all key heads
  together (``qk_layernorm_across_heads``: ``q_norm`` ``[nq*d]``, ``k_norm`` ``[nkv*d]``) and
  post-norms only (``pre_norms=False`` with ``sandwich_norms``: ``post_attention_layernorm``,
  ``post_feedforward_layernorm``); OLMo-3 adds sliding-window layers (``layer_types``) and a
  RoPE per layer type (the sliding layers' unscaled ``rotary_base_local``).

* ``SmolLM3ForCausalLM``: Llama's blocks with NoPE layers (``no_rope_freq``; HF
  ``no_rope_layers``, 1 = RoPE) and sliding layers by ``layer_types``.
* ``GraniteForCausalLM``: Llama's blocks with ``embedding_multiplier``,
  ``residual_multiplier``, ``logits_scaling`` and ``attention_multiplier`` (``softmax_scale``).

* ``Phi3ForCausalLM`` (``models/phi3/modeling_phi3.py``): Llama's blocks without biases or
  QK-norm, with partial RoPE (``rotary_percent`` < 1: HF ``partial_rotary_factor``), the
  fused ``self_attn.qkv_proj`` (``[q; k; v]`` on the output axis) and ``mlp.gate_up_proj``
  (``[gate; up]``) tensors, and a sliding window over every layer when ``window_size`` is
  set. Export chooses it for a partial rotary factor, the one thing of Phi-3 that Llama
  cannot hold; a Phi-3 checkpoint with the whole head rotating imports to the same fields
  as Llama's and exports back as ``LlamaForCausalLM`` (``MistralForCausalLM`` with a
  window), the same model.

Import also reads ``MistralForCausalLM`` (model_type "mistral", Llama's layout, a sliding
window over every layer as ``window_size``), which exports back as ``MistralForCausalLM``
with a window and as ``LlamaForCausalLM`` without, and the text model of a multimodal
Gemma-3 checkpoint (model_type "gemma3": ``text_config``; the vision tower is dropped),
which exports back as ``Gemma3ForCausalLM``.

Anything else raises ``ValueError`` naming the config fields the target cannot represent
(see :func:`hf_architecture`).

Parameter trees are plain nested dicts of arrays (numpy or jax), i.e. the ``params``
collection of :class:`jmegatron.models.gpt.GPTModel` after ``flax.linen.meta.unbox``
(a ``{"params": ...}`` wrapper and still-boxed ``LogicallyPartitioned`` leaves are
accepted too). jmegatron layout (``h`` hidden, ``nq`` heads, ``nkv`` query groups,
``d`` kv_channels, ``ffn`` ffn_hidden_size, ``V`` padded vocab)::

    word_embeddings/embedding                     [V, h]
    position_embeddings/embedding                 [max_pos, h]   (learned_absolute only)
    decoder_layers_{i}/input_layernorm/{scale,bias}             [h]  (bias: LayerNorm only; none
                  without pre_norms, as pre_mlp_layernorm)
    decoder_layers_{i}/self_attention/linear_qkv/kernel         [h, nkv, nq/nkv + 2, d]
                  (+ bias [nkv, nq/nkv + 2, d]); Megatron's fused layout: for each query
                  group g, its query heads g*nq/nkv .. (g+1)*nq/nkv - 1, then K_g, then V_g
    decoder_layers_{i}/self_attention/linear_proj/kernel        [nq, d, h]   (+ bias [h])
    decoder_layers_{i}/self_attention/{q,k}_layernorm/scale     [d]  (qk_layernorm only;
                  [nq, d] / [nkv, d] with qk_layernorm_across_heads)
    decoder_layers_{i}/post_self_attn_layernorm/scale           [h]  (sandwich_norms only)
    decoder_layers_{i}/pre_mlp_layernorm/{scale,bias}           [h]
    decoder_layers_{i}/post_mlp_layernorm/scale                 [h]  (sandwich_norms only)
    decoder_layers_{i}/mlp/linear_fc1/kernel      [h, ffn] or [h, 2, ffn] with swiglu
                                                  (index 0 gate, 1 up)  (+ bias [ffn] / [2, ffn])
    decoder_layers_{i}/mlp/linear_fc2/kernel      [ffn, h]   (+ bias [h])
    final_layernorm/{scale,bias}                  [h]
    output_layer/kernel                           [h, V]     (untied only)

With ``scan_layers`` the per-layer subtrees are one ``decoder_layers`` subtree whose
leaves carry a leading ``[num_layers]`` axis (:func:`jmegatron.conversion.tree.stack_layers` /
:func:`jmegatron.conversion.tree.unstack_layers`).

Hugging Face layouts: ``nn.Linear`` weights are ``[out, in]``; GPT-2's ``Conv1D`` weights
are ``[in, out]`` and ``c_attn`` concatenates q|k|v on the output axis; heads are the major
factor of every ``heads * head_dim`` axis, as in jmegatron's reshapes.

This module imports numpy, the layer patterns of :mod:`jmegatron.config` and YaRN's factor
(:mod:`jmegatron.models.rope`); torch tensors handed to :func:`from_hf_state_dict` are read
without importing torch. Reading a folder's safetensors is :mod:`jmegatron.checkpoint.hf`;
the ``transformers`` model of a parameter tree is :mod:`jmegatron.export.hf_model`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from jmegatron.config import (ConfigError, JMegatronConfig, TransformerConfig, no_rope_layer_pattern, window_layer_pattern,
                              yarn_concentration_factor)
from jmegatron.conversion import hf_moe
from jmegatron.conversion.hf_moe import MOE_ARCHITECTURES
from jmegatron.conversion.tree import (check_shape, get, map_leaves, numpy_tree, plain, stack_layers, to_numpy,
                                       unstack_layers)

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
MINISTRAL = "MinistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
PHI3 = "Phi3ForCausalLM"
# Llama's layout (model.layers.{i}.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, RMSNorm):
# model_type -> class. Qwen2 adds Q/K/V biases without an o_proj bias; Qwen3 per-head
# q_norm / k_norm and a head_dim decoupled from hidden / heads; Phi-3 partial RoPE and the
# fused qkv_proj / gate_up_proj tensors (_PHI3_FUSED).
LLAMA_LIKE = {"llama": LLAMA, "mistral": MISTRAL, "ministral": MINISTRAL, "qwen2": QWEN2, "qwen3": QWEN3,
              "phi3": PHI3}
_MODEL_TYPE = {arch: model_type for model_type, arch in LLAMA_LIKE.items()}
GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
# Gemma's layout: Llama's names plus the sandwich norms; "gemma3" is the multimodal
# Gemma3ForConditionalGeneration, whose text model imports as gemma3_text
GEMMA_TYPES = {"gemma2": GEMMA2, "gemma3_text": GEMMA3, "gemma3": GEMMA3}
_MODEL_TYPE.update({GEMMA2: "gemma2", GEMMA3: "gemma3_text"})
OLMO2 = "Olmo2ForCausalLM"
OLMO3 = "Olmo3ForCausalLM"
# OLMo's layout: Llama's attention and MLP names, the QK-norm over all heads together
# (q_norm [nq*d], k_norm [nkv*d]: qk_layernorm_across_heads) and post-norms only
# (post_attention_layernorm, post_feedforward_layernorm: pre_norms=False); OLMo-3 adds
# sliding-window layers (layer_types) with a RoPE per layer type
OLMO_TYPES = {"olmo2": OLMO2, "olmo3": OLMO3}
_MODEL_TYPE.update({OLMO2: "olmo2", OLMO3: "olmo3"})
# every class :func:`hf_architecture` exports to (`export hf --help` and the README list these)
ARCHITECTURES = (GPT2, LLAMA, MISTRAL, MINISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3) + MOE_ARCHITECTURES + (OLMO2, OLMO3)
# Llama's layout with new parts: SmolLM3's NoPE layers (no_rope_layers: 1 = RoPE; no_rope_freq
# is its complement) and sliding windows by layer_types; Granite's embedding / residual /
# attention multipliers and logits_scaling
SMOLLM3 = "SmolLM3ForCausalLM"
GRANITE = "GraniteForCausalLM"
LLAMA_LIKE.update(smollm3=SMOLLM3, granite=GRANITE)
_MODEL_TYPE.update({SMOLLM3: "smollm3", GRANITE: "granite"})
ARCHITECTURES = ARCHITECTURES + (SMOLLM3, GRANITE)
# the Llama-layout model types whose attention_bias biases q/k/v/o_proj and mlp_bias the MLP
_ATTENTION_AND_MLP_BIAS = ("llama", "smollm3", "granite")
# jmegatron's per-layer norm -> the HF norm of the Llama layout and of Gemma's
_LLAMA_NORMS = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm"}
_GEMMA_NORMS = {"input_layernorm": "input_layernorm", "post_self_attn_layernorm": "post_attention_layernorm",
                "pre_mlp_layernorm": "pre_feedforward_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm"}
_OLMO_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm"}
# Phi-3's fused tensors (per layer, under model.layers.{i}.) -> the Llama-layout tensors they
# concatenate on the output axis, in order
_PHI3_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# GPT-2's activation_function values that are the tanh GELU (Megatron's openai_gelu)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

# Gemma3ForConditionalGeneration's text model keys (transformers 5 module names, then the
# Hub checkpoints' language_model.model.*) -> Gemma3ForCausalLM's; its vision tower is dropped
_GEMMA3_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."))
_GEMMA3_VISION = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")

# Buffers some GPT-2 checkpoints carry (old causal-mask buffers): not parameters.
_GPT2_IGNORED = re.compile(r"\.attn\.(bias|masked_bias)$")


# ----------------------------------------------------------------------------- config
def _gemma_block_problems(cfg, arch: str) -> list[str]:
    """Gemma's fields that ``arch`` (a target other than Gemma) cannot represent."""
    name = arch.replace("ForCausalLM", "").replace("LMHeadModel", "")
    problems = [f"config.{n}=True ({name} has no such block; Gemma-2/3 have)"
                for n in ("apply_layernorm_1p", "sandwich_norms", "scale_embeddings") if getattr(cfg, n)]
    if cfg.gated_linear_unit and not cfg.swiglu:
        problems.append(f"config.gated_linear_unit=True with swiglu=False (GeGLU: {name} has no such MLP)")
    for n in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping", "rotary_base_local"):
        if getattr(cfg, n) is not None:
            problems.append(f"config.{n}={getattr(cfg, n)} ({name} has no such field)")
    problems += gpt_oss_block_problems(cfg, name)
    if cfg.window_size is not None and not (arch in (MISTRAL, PHI3) and all(_window_pattern(cfg)) or arch in (MINISTRAL, SMOLLM3)
                                            or arch in (QWEN2, QWEN3) and _qwen_window_layers(cfg) is not None):
        problems.append(f"config.window_size={cfg.window_size} ({name} has no sliding window; Mistral windows "
                        f"every layer, Ministral and Gemma-2/3 mix sliding and full layers)")
    return problems


def gpt_oss_block_problems(cfg, name: str) -> list[str]:
    """gpt-oss's fields (attention sinks, the quick-GELU GLU with its offset and clamp) set in
    ``cfg``, as problems of a target ``name`` other than gpt-oss."""
    problems = []
    if cfg.softmax_type != "vanilla":
        problems.append(f"config.softmax_type={cfg.softmax_type!r} ({name} has no attention sinks; "
                        f"{hf_moe.GPT_OSS} has)")
    if cfg.quick_geglu:
        problems.append(f"config.quick_geglu=True ({name} has no quick-GELU GLU; {hf_moe.GPT_OSS}'s experts have)")
    for n, off in (("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)):
        if getattr(cfg, n) != off:
            problems.append(f"config.{n}={getattr(cfg, n)} ({name} has no such field)")
    return problems


def _qwen_window_layers(cfg) -> Optional[int]:
    """Qwen2's ``max_window_layers`` for ``cfg``'s sliding layers when they are Qwen's rule
    (full layers, then sliding ones to the top), else None."""
    pattern = _window_pattern(cfg)
    first = pattern.index(1) if 1 in pattern else len(pattern)
    return first if all(pattern[first:]) else None


def _window_pattern(cfg) -> tuple[int, ...]:
    return window_layer_pattern(cfg.window_size, cfg.window_attn_skip_freq, cfg.num_layers)


def _no_rope_pattern(cfg) -> tuple[int, ...]:
    return no_rope_layer_pattern(cfg.no_rope_freq, cfg.num_layers)


def _granite_scalars(cfg) -> list[str]:
    """Granite's scalars of ``cfg`` that are not 1.0 (``embedding_multiplier``,
    ``residual_multiplier``, ``logits_scaling``)."""
    return [n for n in ("embedding_multiplier", "residual_multiplier", "logits_scaling") if getattr(cfg, n) != 1.0]


def _new_part_problems(cfg, arch: str) -> list[str]:
    """NoPE layers and Granite's scalars where ``arch`` cannot hold them (SmolLM3 holds the
    first, Granite the others)."""
    name = arch.replace("ForCausalLM", "").replace("LMHeadModel", "")
    problems = []
    if arch != SMOLLM3 and any(_no_rope_pattern(cfg)):
        problems.append(f"config.no_rope_freq={cfg.no_rope_freq!r} ({name} rotates every layer; SmolLM3's "
                        f"no_rope_layers skip RoPE on some)")
    if arch != GRANITE:
        problems += [f"config.{n}={getattr(cfg, n)} ({name} has no such field; Granite has)" for n in _granite_scalars(cfg)]
    return problems


def _gemma_problems(cfg, arch: str) -> list[str]:
    """The fields of ``cfg`` that Hugging Face Gemma-2 / Gemma-3 cannot represent."""
    name = arch.replace("ForCausalLM", "")
    problems = []
    if cfg.normalization != "RMSNorm":
        problems.append(f"config.normalization={cfg.normalization!r} ({name} uses RMSNorm)")
    for n in ("apply_layernorm_1p", "sandwich_norms", "scale_embeddings", "gated_linear_unit", "openai_gelu"):
        if not getattr(cfg, n):
            problems.append(f"config.{n}=False ({name} always has it)")
    if cfg.swiglu:
        problems.append(f"config.swiglu=True ({name}'s MLP is GeGLU with the tanh GELU)")
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        problems.append(f"config.add_bias_linear / add_qkv_bias ({name} has no biases)")
    if arch == GEMMA3 and cfg.attn_logit_softcapping is not None:
        problems.append(f"config.attn_logit_softcapping={cfg.attn_logit_softcapping} (transformers' Gemma-3 "
                        f"attention does not apply it)")
    if arch == GEMMA2 and cfg.rotary_base_local is not None:
        problems.append(f"config.rotary_base_local={cfg.rotary_base_local} (Gemma-2 has one RoPE; Gemma-3 two)")
    return problems + _rope_problems(cfg, arch) + _olmo_block_problems(cfg, arch) + gpt_oss_block_problems(cfg, name)


def _olmo_block_problems(cfg, arch: str) -> list[str]:
    """OLMo-2/3's blocks that ``arch`` (a target other than OLMo) cannot represent."""
    name = arch.replace("ForCausalLM", "").replace("LMHeadModel", "")
    problems = []
    if cfg.qk_layernorm_across_heads:
        problems.append(f"config.qk_layernorm_across_heads=True ({name} has no QK-norm over all heads together; "
                        f"OLMo-2/3 have)")
    if not cfg.pre_norms:
        problems.append(f"config.pre_norms=False ({name}'s layers have pre-norms; OLMo-2/3's post-norms only)")
    return problems


def _olmo_problems(cfg, arch: str) -> list[str]:
    """The fields of ``cfg`` that Hugging Face OLMo-2 / OLMo-3 cannot represent."""
    name = arch.replace("ForCausalLM", "")
    problems = []
    if cfg.normalization != "RMSNorm":
        problems.append(f"config.normalization={cfg.normalization!r} ({name} uses RMSNorm)")
    if not cfg.swiglu:
        problems.append(f"config.swiglu=False ({name}'s MLP is SwiGLU: gate_proj/up_proj/down_proj)")
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        problems.append(f"config.add_bias_linear / add_qkv_bias ({name}'s attention_bias biases q/k/v and o_proj, "
                        f"its MLP has none)")
    if not (cfg.qk_layernorm and cfg.qk_layernorm_across_heads):
        problems.append(f"config.qk_layernorm={cfg.qk_layernorm}, qk_layernorm_across_heads="
                        f"{cfg.qk_layernorm_across_heads} ({name} norms all query heads and all key heads together: "
                        f"q_norm, k_norm)")
    for n in ("apply_layernorm_1p", "scale_embeddings"):
        if getattr(cfg, n):
            problems.append(f"config.{n}=True ({name} has no such block; Gemma-2/3 have)")
    for n in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, n) is not None:
            problems.append(f"config.{n}={getattr(cfg, n)} ({name} has no such field)")
    return problems + _rope_problems(cfg, arch) + gpt_oss_block_problems(cfg, name)


def _gpt2_problems(cfg) -> list[str]:
    problems = []
    if cfg.normalization != "LayerNorm":
        problems.append(f"config.normalization={cfg.normalization!r} (GPT-2 uses LayerNorm)")
    if cfg.swiglu:
        problems.append("config.swiglu=True (GPT-2's MLP is c_fc -> gelu -> c_proj)")
    if not cfg.add_bias_linear:
        problems.append("config.add_bias_linear=False (GPT-2's linear layers always have biases)")
    if cfg.num_query_groups != cfg.num_attention_heads:
        problems.append(f"config.num_query_groups={cfg.num_query_groups} != num_attention_heads="
                        f"{cfg.num_attention_heads} (GPT-2 has no grouped-query attention)")
    if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        problems.append(f"config.kv_channels={cfg.kv_channels} (GPT-2 needs kv_channels * "
                        f"num_attention_heads == hidden_size={cfg.hidden_size})")
    return problems + _gemma_block_problems(cfg, GPT2) + _olmo_block_problems(cfg, GPT2)


def _llama_problems(cfg, arch: str = LLAMA) -> list[str]:
    """The fields of ``cfg`` that Hugging Face ``arch`` (a Llama-layout class) cannot represent."""
    name = arch.replace("ForCausalLM", "")
    problems = []
    if cfg.normalization != "RMSNorm":
        problems.append(f"config.normalization={cfg.normalization!r} ({name} uses RMSNorm)")
    if not cfg.swiglu:
        problems.append(f"config.swiglu=False ({name}'s MLP is SwiGLU: gate_proj/up_proj/down_proj)")
    if arch == LLAMA and not cfg.add_bias_linear and cfg.add_qkv_bias:
        problems.append("config.add_qkv_bias=True with add_bias_linear=False (Llama's attention_bias "
                        "also biases o_proj; a QKV-only bias is Qwen2's layout)")
    if arch in (QWEN2, QWEN3) and cfg.add_bias_linear:
        problems.append(f"config.add_bias_linear=True ({name}'s MLP and o_proj have no biases)")
    if arch == QWEN3 and cfg.add_qkv_bias:
        problems.append("config.add_qkv_bias=True with qk_layernorm=True (Qwen3's attention_bias also biases "
                        "o_proj; a QKV-only bias with QK-norm has no Hugging Face class)")
    if arch == LLAMA and cfg.hidden_size % cfg.num_attention_heads:
        problems.append(f"config.hidden_size={cfg.hidden_size} is not divisible by num_attention_heads="
                        f"{cfg.num_attention_heads} (LlamaConfig rejects it)")
    if arch == PHI3:
        problems += _phi3_problems(cfg)
    problems += _rope_problems(cfg, arch) + _gemma_block_problems(cfg, arch) + _olmo_block_problems(cfg, arch)
    return problems


def _phi3_problems(cfg) -> list[str]:
    """The fields of ``cfg`` that Hugging Face Phi-3 (besides Llama's checks) cannot represent."""
    problems = []
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        problems.append("config.add_bias_linear / add_qkv_bias (Phi3 has no biases)")
    if cfg.qk_layernorm:
        problems.append("config.qk_layernorm=True (Phi3 has no QK-norm)")
    if cfg.rope_scaling or cfg.position_embedding_type == "yarn" or cfg.rotary_seq_len_interpolation_factor:
        problems.append("rope_scaling / yarn / rotary_seq_len_interpolation_factor (Phi3Config takes rope_type "
                        "'default' or 'longrope' only)")
    return problems


def _rope_problems(cfg, arch: str = LLAMA) -> list[str]:
    """The rotary fields of ``cfg`` that Hugging Face ``arch``'s RoPE cannot represent."""
    problems = []
    if cfg.rotary_interleaved:
        problems.append("config.rotary_interleaved=True (interleaved RoPE: no export target; the Llama layout "
                        "rotates halves)")
    if cfg.rotary_percent != 1.0 and arch != PHI3:
        problems.append(f"config.rotary_percent={cfg.rotary_percent} (partial RoPE: {PHI3} holds it, with "
                        f"rope_type 'default', no biases and no QK-norm)")
    if problems:
        return problems
    if cfg.rotary_seq_len_interpolation_factor is not None and (cfg.rope_scaling
                                                                 or cfg.position_embedding_type == "yarn"):
        return [f"config.rotary_seq_len_interpolation_factor={cfg.rotary_seq_len_interpolation_factor} with "
                f"{'rope_scaling' if cfg.rope_scaling else 'yarn'} (Hugging Face's rope_parameters hold one "
                f"rope_type)"]
    return []


def rope_parameters(cfg) -> dict[str, Any]:
    """Hugging Face's ``rope_parameters`` for ``cfg``'s rotary embedding
    (:class:`jmegatron.models.rope.RotaryEmbedding`): rope_type "default", "linear"
    (``rotary_seq_len_interpolation_factor``), "llama3" (``rope_scaling``) or "yarn"."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    if cfg.position_embedding_type == "yarn":
        out.update(rope_type="yarn", factor=float(cfg.yarn_rotary_scaling_factor),
                   original_max_position_embeddings=int(cfg.yarn_original_max_position_embeddings),
                   beta_fast=float(cfg.yarn_beta_fast), beta_slow=float(cfg.yarn_beta_slow),
                   mscale=float(cfg.yarn_mscale), mscale_all_dim=float(cfg.yarn_mscale_all_dim),
                   truncate=bool(cfg.yarn_correction_range_round_to_int))
    elif cfg.rope_scaling:
        out.update(rope_type="llama3", factor=float(cfg.rope_scaling_factor),
                   low_freq_factor=float(cfg.rope_scaling_low_freq_factor),
                   high_freq_factor=float(cfg.rope_scaling_high_freq_factor),
                   original_max_position_embeddings=int(cfg.rope_scaling_original_max_position_embeddings))
    elif cfg.rotary_seq_len_interpolation_factor is not None:
        out.update(rope_type="linear", factor=float(cfg.rotary_seq_len_interpolation_factor))
    return out


def rope_fields_from_hf(conf: Mapping[str, Any], problems: list[str], partial_rotary: bool = False) -> dict[str, Any]:
    """jmegatron's rotary fields of a Hugging Face ``config.json`` (``rope_parameters``, or the
    legacy ``rope_scaling`` + ``rope_theta`` of transformers 4.x); appends what jmegatron cannot
    represent to ``problems`` (rope types other than default / linear / llama3 / yarn, a YaRN
    ``attention_factor`` other than the one its mscales give, and a partial rotary factor
    unless ``partial_rotary``: the family's attention rotates ``q[..., :int(head_dim *
    factor)]`` and passes the rest, as Phi-3's, read as ``rotary_percent``)."""
    rope = dict(conf.get("rope_parameters") or {})
    rope.update(conf.get("rope_scaling") or {})  # transformers: rope_scaling wins when both are given
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", conf.get("rope_theta", 10000.0)))
    if theta != int(theta):
        problems.append(f"rope_theta={theta} (jmegatron's rotary_base is an integer)")
    fields: dict[str, Any] = dict(position_embedding_type="rope", rotary_base=int(theta))
    partial = rope.get("partial_rotary_factor", conf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0) and partial_rotary:
        fields["rotary_percent"] = float(partial)
    elif partial not in (None, 1.0):
        problems.append(f"partial_rotary_factor={partial} (this family's transformers attention rotates the whole "
                        f"head)")
    original = rope.get("original_max_position_embeddings", conf.get("max_position_embeddings"))
    if rope_type == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(rope["factor"])
    elif rope_type == "llama3":
        fields.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                      rope_scaling_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                      rope_scaling_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                      rope_scaling_original_max_position_embeddings=int(original))
    elif rope_type == "yarn":
        factor = rope.get("factor") or float(conf["max_position_embeddings"]) / float(original)
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if not (mscale and mscale_all_dim):  # transformers: both or neither (then 0.1 ln(factor) + 1)
            mscale, mscale_all_dim = 1.0, 0.0
        fields.update(position_embedding_type="yarn", yarn_rotary_scaling_factor=float(factor),
                      yarn_original_max_position_embeddings=int(original),
                      yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
                      yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
                      yarn_mscale=float(mscale), yarn_mscale_all_dim=float(mscale_all_dim),
                      yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))
        given = rope.get("attention_factor")
        if given is not None:
            implied = yarn_concentration_factor(float(factor), float(mscale), float(mscale_all_dim))
            if abs(float(given) - implied) > 1e-12:
                problems.append(f"rope_parameters.attention_factor={given} (jmegatron derives YaRN's attention "
                                f"factor from factor / mscale / mscale_all_dim: {implied})")
    elif rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (RoPE scalings built: 'default', 'linear', 'llama3', 'yarn')")
    return fields


def hf_architecture(cfg) -> str:
    """The transformers class name that represents ``cfg`` exactly.

    ``"GPT2LMHeadModel"`` for learned_absolute positions + LayerNorm + GELU + multi-head
    attention with ``kv_channels * heads == hidden`` + biases; for rope / yarn + RMSNorm +
    SwiGLU (grouped-query attention, any ``kv_channels``): ``"Qwen3ForCausalLM"`` with
    ``qk_layernorm``, ``"Qwen2ForCausalLM"`` with ``add_qkv_bias`` and no other bias,
    ``"MistralForCausalLM"`` with a sliding window on every layer, else
    ``"LlamaForCausalLM"`` (biases map to ``attention_bias``/``mlp_bias``);
    ``"Phi3ForCausalLM"`` with a partial rotary factor (``rotary_percent`` < 1), which no
    other target holds. Tied and untied
    output layers are both representable (``tie_word_embeddings``). With ``sandwich_norms``:
    ``"Gemma3ForCausalLM"`` with ``qk_layernorm``, else ``"Gemma2ForCausalLM"``. Without
    ``pre_norms``: ``"Olmo3ForCausalLM"`` with a sliding window, else ``"Olmo2ForCausalLM"``
    (both need ``qk_layernorm_across_heads``). With NoPE
    layers (``no_rope_freq``): ``"SmolLM3ForCausalLM"`` (any sliding layers too); with
    Granite's scalars (``embedding_multiplier``, ``residual_multiplier``, ``logits_scaling``
    not 1) or a ``softmax_scale`` (its ``attention_multiplier``): ``"GraniteForCausalLM"``.

    MoE configs (``num_moe_experts`` set): ``"Qwen2MoeForCausalLM"`` with a shared expert,
    ``"Qwen3MoeForCausalLM"`` with ``qk_layernorm``, else ``"MixtralForCausalLM"``
    (:func:`jmegatron.conversion.hf_moe.moe_architecture`).

    Raises ValueError naming every config field the target cannot represent
    (``position_embedding_type="none"`` has no target).
    """
    if cfg.num_moe_experts is not None:
        arch, problems = hf_moe.moe_architecture(cfg, [p for p in _llama_problems(cfg) if "add_qkv_bias" not in p])
        problems += _new_part_problems(cfg, arch)
        if cfg.mtp_num_layers and arch != hf_moe.DEEPSEEK_V3:
            problems.append(f"config.mtp_num_layers={cfg.mtp_num_layers} (only {hf_moe.DEEPSEEK_V3} holds "
                            f"multi-token prediction layers)")
        if problems:
            raise ValueError(f"this MoE config cannot be exported as Hugging Face {arch}: " + "; ".join(problems) + ".")
        return arch
    if cfg.position_embedding_type == "learned_absolute":
        arch, problems = GPT2, _gpt2_problems(cfg)
    elif cfg.multi_latent_attention:
        raise ValueError(f"config.multi_latent_attention=True without num_moe_experts has no Hugging Face export "
                         f"target (DeepSeek-V3, {hf_moe.DEEPSEEK_V3}, is a mixture of experts).")
    elif cfg.position_embedding_type in ("rope", "yarn") and not cfg.pre_norms:
        arch = OLMO3 if cfg.window_size is not None else OLMO2
        problems = _olmo_problems(cfg, arch)
    elif cfg.position_embedding_type in ("rope", "yarn") and cfg.sandwich_norms:
        arch = GEMMA3 if cfg.qk_layernorm else GEMMA2
        problems = _gemma_problems(cfg, arch)
    elif cfg.position_embedding_type in ("rope", "yarn") and any(_no_rope_pattern(cfg)):
        arch, problems = SMOLLM3, _llama_problems(cfg, SMOLLM3)
        if cfg.qk_layernorm:
            problems.append("config.qk_layernorm=True (SmolLM3 has no q/k norms)")
    elif cfg.position_embedding_type in ("rope", "yarn") and (_granite_scalars(cfg) or cfg.softmax_scale is not None):
        arch = GRANITE  # attention_multiplier holds softmax_scale
        problems = [p for p in _llama_problems(cfg, GRANITE) if not p.startswith("config.softmax_scale=")]
        if cfg.qk_layernorm:
            problems.append("config.qk_layernorm=True (Granite has no q/k norms)")
    elif cfg.position_embedding_type in ("rope", "yarn"):
        arch = QWEN3 if cfg.qk_layernorm else QWEN2 if cfg.add_qkv_bias and not cfg.add_bias_linear else \
            (MISTRAL if all(_window_pattern(cfg)) else MINISTRAL) if cfg.window_size is not None else LLAMA
        if cfg.rotary_percent != 1.0:  # partial RoPE: Phi-3 holds it
            arch = PHI3
        problems = _llama_problems(cfg, arch)
    else:
        raise ValueError(
            f"config.position_embedding_type={cfg.position_embedding_type!r} has no Hugging Face "
            f"export target: {GPT2} needs 'learned_absolute', {LLAMA} needs 'rope' or 'yarn'.")
    if cfg.mtp_num_layers:
        problems.append(f"config.mtp_num_layers={cfg.mtp_num_layers} (only {hf_moe.DEEPSEEK_V3} holds multi-token "
                        f"prediction layers)")
    problems += _new_part_problems(cfg, arch)
    if problems:
        raise ValueError(f"this config cannot be exported as Hugging Face {arch} "
                         f"(chosen by position_embedding_type={cfg.position_embedding_type!r}"
                         f"{', qk_layernorm' if cfg.qk_layernorm else ''}"
                         f"{f', rotary_percent={cfg.rotary_percent}' if arch == PHI3 else ''}): "
                         + "; ".join(problems) + ".")
    return arch


def hf_config_dict(cfg, vocab_size: int, *, bos_token_id: Optional[int | list[int]] = None,
                   eos_token_id: Optional[int | list[int]] = None) -> dict[str, Any]:
    """The transformers ``config.json`` content for ``cfg`` with ``vocab_size`` rows of the
    embedding (the padded size of the params, or a smaller true vocabulary when the export
    drops the padding rows, see :func:`to_hf_state_dict`).

    GPT-2 (``GPT2Config``): ``activation_function`` "gelu" (the exact erf GELU) or, with
    ``openai_gelu``, GPT-2's own "gelu_new" (tanh). Llama / Qwen2 / Qwen3: RoPE is written as
    transformers 5.x ``rope_parameters`` (:func:`rope_parameters`), and also as the legacy
    top-level ``rope_theta`` and ``rope_scaling`` (non-default types) read by transformers 4.x.
    ``bos_token_id``/``eos_token_id`` (an id, or a list of ids as Llama-3-Instruct's eos) default
    to None (jmegatron does not know the tokenizer's).
    Raises ValueError as :func:`hf_architecture`.
    """
    arch = hf_architecture(cfg)
    vocab_size = int(vocab_size)
    common = {
        "architectures": [arch],
        "vocab_size": vocab_size,
        "initializer_range": float(cfg.init_method_std),
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "float32",
    }
    if arch == GPT2:
        return {
            "model_type": "gpt2",
            **common,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_hidden_size,
            "n_positions": cfg.max_position_embeddings,
            "layer_norm_epsilon": float(cfg.norm_epsilon),
            "activation_function": "gelu_new" if cfg.openai_gelu else "gelu",
            "resid_pdrop": float(cfg.hidden_dropout),
            "embd_pdrop": float(cfg.hidden_dropout),
            "attn_pdrop": float(cfg.attention_dropout),
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    rope = rope_parameters(cfg)
    llama = {
        "model_type": "llama",
        **common,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": float(cfg.norm_epsilon),
        "rope_parameters": rope,
        "rope_theta": float(cfg.rotary_base),
        "rope_scaling": None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "attention_bias": bool(cfg.add_bias_linear),
        "attention_dropout": float(cfg.attention_dropout),
        "mlp_bias": bool(cfg.add_bias_linear),
        "pretraining_tp": 1,
    }
    if arch in MOE_ARCHITECTURES:
        return hf_moe.moe_config_dict(cfg, arch, llama)
    if arch in (GEMMA2, GEMMA3):
        return _gemma_config_dict(cfg, arch, llama, rope)
    if arch in (OLMO2, OLMO3):
        return _olmo_config_dict(cfg, arch, llama, rope)
    if arch == MISTRAL:
        conf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp", "attention_bias")}
        return dict(conf, model_type="mistral", sliding_window=cfg.window_size[0] + 1)
    if arch == PHI3:
        return _phi3_config_dict(cfg, llama, rope)
    if arch == MINISTRAL:
        conf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp", "attention_bias")}
        return dict(conf, model_type="ministral", sliding_window=cfg.window_size[0] + 1,
                    layer_types=["sliding_attention" if w else "full_attention" for w in _window_pattern(cfg)])
    if arch == SMOLLM3:
        return _smollm3_config_dict(cfg, llama)
    if arch == GRANITE:
        return _granite_config_dict(cfg, llama)
    if arch in (QWEN2, QWEN3):  # Qwen2: Q/K/V biases always; Qwen3: attention_bias (none here)
        conf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp")}
        windowed = cfg.window_size is not None
        conf.update(model_type=_MODEL_TYPE[arch], use_sliding_window=windowed,
                    sliding_window=cfg.window_size[0] + 1 if windowed else None,
                    max_window_layers=_qwen_window_layers(cfg) if windowed else cfg.num_layers,
                    layer_types=["sliding_attention" if w else "full_attention" for w in _window_pattern(cfg)])
        if arch == QWEN2:
            conf.pop("attention_bias")
        return conf
    return llama


def _smollm3_config_dict(cfg, llama: dict) -> dict[str, Any]:
    """SmolLM3Config content: Llama's, ``no_rope_layers`` (1 = RoPE: the complement of
    ``no_rope_freq``'s pattern; ``no_rope_layer_interval`` its int N, else transformers'
    default 4, unread when the list is given), and the sliding layers as ``layer_types`` with
    ``use_sliding_window`` (any pattern)."""
    conf = {k: v for k, v in llama.items() if k != "pretraining_tp"}
    windowed = cfg.window_size is not None
    freq = cfg.no_rope_freq
    conf.update(model_type="smollm3", no_rope_layers=[1 - v for v in _no_rope_pattern(cfg)],
                no_rope_layer_interval=freq if isinstance(freq, int) and not isinstance(freq, bool) and freq else 4,
                use_sliding_window=windowed, sliding_window=cfg.window_size[0] + 1 if windowed else None,
                layer_types=["sliding_attention" if w else "full_attention" for w in _window_pattern(cfg)])
    return conf


def _granite_config_dict(cfg, llama: dict) -> dict[str, Any]:
    """GraniteConfig content: Llama's, the three scalars, and ``attention_multiplier`` =
    ``softmax_scale`` (``1 / sqrt(kv_channels)`` without one)."""
    conf = {k: v for k, v in llama.items() if k != "pretraining_tp"}
    scale = cfg.kv_channels ** -0.5 if cfg.softmax_scale is None else cfg.softmax_scale
    conf.update(model_type="granite", embedding_multiplier=float(cfg.embedding_multiplier),
                residual_multiplier=float(cfg.residual_multiplier), logits_scaling=float(cfg.logits_scaling),
                attention_multiplier=float(scale))
    return conf


def _gemma_config_dict(cfg, arch: str, llama: dict, rope: dict) -> dict[str, Any]:
    """Gemma2Config / Gemma3TextConfig content: Llama's sizes, ``query_pre_attn_scalar`` =
    ``softmax_scale ** -2`` (``kv_channels`` without one), ``sliding_window`` and the
    ``layer_types`` of ``window_attn_skip_freq``, the soft-caps, and for Gemma-3 the
    per-layer-type ``rope_parameters`` (the local base unscaled)."""
    keep = ("architectures", "vocab_size", "initializer_range", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id", "use_cache", "dtype", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "attention_bias", "attention_dropout")
    conf = {k: llama[k] for k in keep}
    scalar = float(cfg.kv_channels) if cfg.softmax_scale is None else float(cfg.softmax_scale) ** -2
    pattern = _window_pattern(cfg)
    conf.update(model_type=_MODEL_TYPE[arch], hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=int(round(scalar)) if abs(scalar - round(scalar)) < 1e-6 else scalar,
                sliding_window=None if cfg.window_size is None else cfg.window_size[0] + 1,
                layer_types=["sliding_attention" if w else "full_attention" for w in pattern],
                final_logit_softcapping=cfg.final_logit_softcapping, use_bidirectional_attention=False)
    if arch == GEMMA2:
        conf.update(attn_logit_softcapping=cfg.attn_logit_softcapping, rope_parameters=rope,
                    rope_theta=rope["rope_theta"])
    else:
        local = rope if cfg.rotary_base_local is None else {"rope_type": "default",
                                                            "rope_theta": float(cfg.rotary_base_local)}
        conf.update(attn_logit_softcapping=None,
                    rope_parameters={"full_attention": rope, "sliding_attention": local})
    return conf


def _olmo_config_dict(cfg, arch: str, llama: dict, rope: dict) -> dict[str, Any]:
    """Olmo2Config / Olmo3Config content: Llama's sizes without biases (``attention_bias``
    False, no ``mlp_bias``); OLMo-2 keeps the legacy ``rope_theta`` / ``rope_scaling`` beside
    ``rope_parameters``; OLMo-3 gives ``sliding_window``, the ``layer_types`` of
    ``window_attn_skip_freq`` and a ``rope_parameters`` entry per layer type (the sliding
    layers': the unscaled ``rotary_base_local``, or the full layers' RoPE without one)."""
    conf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp")}
    conf.update(model_type=_MODEL_TYPE[arch], attention_bias=False)
    if arch == OLMO3:
        local = rope if cfg.rotary_base_local is None else {"rope_type": "default",
                                                            "rope_theta": float(cfg.rotary_base_local)}
        for legacy in ("rope_theta", "rope_scaling"):
            conf.pop(legacy)
        conf.update(rope_parameters={"full_attention": rope, "sliding_attention": local},
                    sliding_window=cfg.window_size[0] + 1,
                    layer_types=["sliding_attention" if w else "full_attention" for w in _window_pattern(cfg)])
    return conf


def _phi3_config_dict(cfg, llama: dict, rope: dict) -> dict[str, Any]:
    """Phi3Config content: Llama's sizes (``head_dim`` kept: Phi-3's attention reads it when
    given), ``rope_parameters`` with ``partial_rotary_factor`` = ``rotary_percent`` (also the
    transformers 4.x top-level ``partial_rotary_factor`` / ``rope_theta``), ``resid_pdrop`` =
    ``embd_pdrop`` = ``hidden_dropout`` (jmegatron's hidden dropout also drops the embeddings,
    as Megatron's; transformers' Phi-3 applies ``resid_pdrop`` only),
    ``original_max_position_embeddings`` = ``max_position_embeddings`` (LongRoPE's, unused
    by the default RoPE), and the window of every layer as ``sliding_window``."""
    conf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp", "attention_bias", "rope_scaling")}
    conf.update(model_type="phi3", rope_parameters=dict(rope, partial_rotary_factor=float(cfg.rotary_percent)),
                partial_rotary_factor=float(cfg.rotary_percent), resid_pdrop=float(cfg.hidden_dropout),
                embd_pdrop=float(cfg.hidden_dropout), original_max_position_embeddings=cfg.max_position_embeddings,
                sliding_window=None if cfg.window_size is None else cfg.window_size[0] + 1)
    return conf


def _phi3_fields_from_hf(conf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """Phi-3's fields beyond the Llama layout's (see :func:`config_fields_from_hf`):
    ``hidden_dropout`` = ``resid_pdrop`` (transformers' Phi-3 drops the attention and MLP
    outputs before their residual adds; ``embd_pdrop`` is read and unused there, and
    jmegatron's hidden dropout also drops the embeddings, as Megatron's);
    ``original_max_position_embeddings`` is read (LongRoPE's only). Appends to ``problems``
    a rope type other than "default" (Phi3Config reads "su" and "yarn" as "longrope":
    LongRoPE's short / long factors are not built) and ``layer_types`` (Phi-3 windows every
    layer by ``sliding_window``; transformers' Phi-3 does not read them)."""
    conf.get("embd_pdrop"), conf.get("original_max_position_embeddings")
    rope = dict(conf.get("rope_parameters") or {})
    rope.update(conf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (Phi-3's LongRoPE, short / long factors by sequence length: not "
                        f"built{'; Phi3Config reads it as longrope' if rope_type in ('su', 'yarn') else ''})")
    if conf.get("layer_types") is not None:
        problems.append("layer_types (transformers' Phi-3 windows every layer by sliding_window and does not read "
                        "them)")
    return dict(hidden_dropout=float(conf.get("resid_pdrop") or 0.0))


LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer_types jmegatron builds


def window_fields_from_hf(conf: Mapping[str, Any], model_type: str, problems: list[str]) -> dict[str, Any]:
    """``window_size`` and ``window_attn_skip_freq`` of a Hugging Face config's attention
    layers: transformers' ``layer_types`` (each "sliding_attention" layer attends to its
    ``sliding_window`` latest keys, itself included; "full_attention" to all), or, in a
    config without them, the family's own rule: Mistral / Mixtral / Ministral window every
    layer when ``sliding_window`` is set, Qwen2's family the layers from
    ``max_window_layers`` on when ``use_sliding_window``, Gemma-2 alternates and Gemma-3
    keeps every ``sliding_window_pattern``-th layer full.

    A ``model_type`` "mistral" config with ``layer_types`` is read as Ministral's layers
    (transformers' MistralForCausalLM would window every layer and warns that such a
    checkpoint is a Ministral one). Qwen2's family windows only with ``use_sliding_window``.
    Appends to ``problems`` a layer type other than :data:`LAYER_TYPES` (naming
    ``layer_types``) or a ``layer_types`` whose length is not ``num_hidden_layers``."""
    layers = int(conf["num_hidden_layers"])
    window = conf.get("sliding_window")
    types = conf.get("layer_types")
    qwen = "use_sliding_window" in conf or "max_window_layers" in conf
    if qwen:
        conf.get("max_window_layers")
        window = window if conf.get("use_sliding_window") else None
    if model_type in ("gemma3_text", "gemma2"):
        conf.get("sliding_window_pattern"), conf.get("_sliding_window_pattern")
    if model_type == "smollm3":  # transformers' masks follow layer_types whatever use_sliding_window says
        window = conf.get("sliding_window")
    if types is None:
        if model_type == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif model_type == "gemma3_text":
            n = int(conf.get("sliding_window_pattern") or conf.get("_sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
        elif model_type == "olmo3":  # transformers' Olmo3Config: every 4th layer full
            types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
        elif model_type == "smollm3":  # transformers' SmolLM3Config: the NoPE layers slide
            rope = _smollm3_rope_layers(conf, layers, [])
            types = ["sliding_attention" if conf.get("use_sliding_window") and window is not None and not r
                     else "full_attention" for r in rope]
        elif qwen:
            first = int(conf.get("max_window_layers", 28))  # transformers' Qwen2Config default
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            types = ["sliding_attention"] * layers
    types = list(types)
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        problems.append(f"layer_types with {', '.join(map(repr, unknown))} (built: {', '.join(map(repr, LAYER_TYPES))})")
        return {}
    if len(types) != layers:
        problems.append(f"layer_types has {len(types)} entries for num_hidden_layers={layers}")
        return {}
    pattern = tuple(int(t == "sliding_attention") for t in types)
    if window is None or not any(pattern):
        return dict(window_size=None, window_attn_skip_freq=None)
    window_size = (int(window) - 1, 0)
    if all(pattern):
        return dict(window_size=window_size, window_attn_skip_freq=None)
    freq = next((n for n in range(1, layers + 1) if window_layer_pattern(window_size, n, layers) == pattern),
                list(pattern))
    return dict(window_size=window_size, window_attn_skip_freq=freq)


def _gemma_fields_from_hf(conf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """jmegatron's fields of a Gemma2Config / Gemma3TextConfig mapping (see
    :func:`config_fields_from_hf`)."""
    model_type = conf["model_type"]
    h, heads, layers = int(conf["hidden_size"]), int(conf["num_attention_heads"]), int(conf["num_hidden_layers"])
    d = int(conf.get("head_dim") or h // heads)
    act = conf.get("hidden_activation") or conf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        problems.append(f"hidden_activation={act!r} (jmegatron's GeGLU is the tanh GELU, 'gelu_pytorch_tanh')")
    if conf.get("attention_bias"):
        problems.append("attention_bias=True (jmegatron's Gemma has no biases)")
    if conf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=True (jmegatron's attention is causal)")
    windows = window_fields_from_hf(conf, model_type, problems)
    window_size, freq = windows.get("window_size"), windows.get("window_attn_skip_freq")
    scalar = float(conf.get("query_pre_attn_scalar") or d)
    fields = dict(
        num_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=int(conf["intermediate_size"]),
        num_query_groups=int(conf.get("num_key_value_heads") or heads), kv_channels=d,
        max_position_embeddings=int(conf["max_position_embeddings"]), normalization="RMSNorm",
        norm_epsilon=float(conf.get("rms_norm_eps", 1e-6)), swiglu=False, gated_linear_unit=True, openai_gelu=True,
        apply_layernorm_1p=True, sandwich_norms=True, scale_embeddings=True, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=model_type != "gemma2",
        softmax_scale=None if scalar == d else scalar ** -0.5,
        # transformers' Gemma-3 attention does not apply attn_logit_softcapping (read, unused)
        attn_logit_softcapping=conf.get("attn_logit_softcapping") if model_type == "gemma2" else
        conf.get("attn_logit_softcapping") and None,
        final_logit_softcapping=conf.get("final_logit_softcapping"),
        window_size=window_size, window_attn_skip_freq=freq,
        hidden_dropout=0.0, attention_dropout=float(conf.get("attention_dropout") or 0.0))
    rope = dict(conf.get("rope_parameters") or {})
    if model_type == "gemma2" or "full_attention" not in rope:
        local_base = conf.get("rope_local_base_freq", 10000.0) if model_type != "gemma2" else None
        fields.update(rope_fields_from_hf(conf, problems))
    else:  # Gemma-3: one RoPE per layer type; the sliding layers' unscaled
        sliding = rope.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            problems.append(f"rope_parameters.sliding_attention.rope_type={sliding.get('rope_type')!r} "
                            f"(jmegatron's local RoPE is unscaled)")
        local_base = sliding.get("rope_theta", 10000.0)
        fields.update(rope_fields_from_hf({**conf, "rope_parameters": rope["full_attention"], "rope_scaling": None},
                                          problems))
    if local_base is not None and window_size is not None:
        if float(local_base) != int(local_base):
            problems.append(f"the local rope_theta={local_base} (jmegatron's rotary_base_local is an integer)")
        fields["rotary_base_local"] = int(local_base)
    return fields


# Olmo3Config's rope_theta when a config gives none (its default_theta)
_OLMO3_THETA = 500000.0


def _olmo_fields_from_hf(conf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """jmegatron's fields of an Olmo2Config / Olmo3Config mapping (see
    :func:`config_fields_from_hf`): Llama's sizes, SwiGLU, no biases, the QK-norm over all
    heads and post-norms only; OLMo-3's ``layer_types`` / ``sliding_window``
    (:func:`window_fields_from_hf`) and its RoPE per layer type: the full layers' as
    :func:`rope_fields_from_hf`, the sliding layers' the same RoPE (then no
    ``rotary_base_local``) or an unscaled one at ``rotary_base_local``. A legacy config
    (``rope_theta`` / ``rope_scaling`` without per-type ``rope_parameters``) is read as
    transformers' Olmo3Config reads it: the scaling and theta for the full layers, the
    sliding layers unscaled at Olmo3Config's default theta (500000)."""
    model_type = conf["model_type"]
    h, heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
    if conf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={conf.get('hidden_act')!r} (SwiGLU uses silu)")
    if conf.get("attention_bias"):
        problems.append(f"attention_bias=True ({OLMO_TYPES[model_type]}'s biases on q/k/v and o_proj but not the "
                        f"MLP: jmegatron's add_bias_linear biases every linear layer, add_qkv_bias only Q/K/V)")
    fields = dict(
        num_layers=int(conf["num_hidden_layers"]), hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=int(conf["intermediate_size"]), num_query_groups=int(conf.get("num_key_value_heads") or heads),
        kv_channels=int(conf.get("head_dim") or h // heads), max_position_embeddings=int(conf["max_position_embeddings"]),
        normalization="RMSNorm", norm_epsilon=float(conf.get("rms_norm_eps", 1e-5)), swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, qk_layernorm_across_heads=True,
        sandwich_norms=True, pre_norms=False, hidden_dropout=0.0,
        attention_dropout=float(conf.get("attention_dropout") or 0.0))
    if model_type == "olmo2":
        fields.update(rope_fields_from_hf(conf, problems))
        return fields
    windows = window_fields_from_hf(conf, model_type, problems)
    fields.update(windows)
    rope = dict(conf.get("rope_parameters") or {})
    if rope and not set(rope) & set(LAYER_TYPES):
        problems.append(f"rope_parameters={rope!r} without per-layer-type entries (OLMo-3 gives one per layer type: "
                        f"{', '.join(LAYER_TYPES)})")
        return fields
    full = {**(rope.get("full_attention") or {"rope_type": "default"}), **(conf.get("rope_scaling") or {})}
    full.setdefault("rope_theta", conf.get("rope_theta", _OLMO3_THETA))
    sliding = dict(rope.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", _OLMO3_THETA)
    plain_conf = {k: dict.__getitem__(conf, k) for k in dict.keys(conf)}
    fields.update(rope_fields_from_hf({**plain_conf, "rope_parameters": full, "rope_scaling": None}, problems))
    local = rope_fields_from_hf({**plain_conf, "rope_parameters": sliding, "rope_scaling": None}, [])
    same = local == rope_fields_from_hf({**plain_conf, "rope_parameters": full, "rope_scaling": None}, [])
    types = list(conf.get("layer_types") or [])
    if same:
        return fields
    if windows.get("window_size") is None:
        if "sliding_attention" in types:
            problems.append(f"sliding_window={conf.get('sliding_window')!r} with sliding_attention layers whose RoPE "
                            f"differs from the full layers' (jmegatron's local RoPE belongs to its windowed layers)")
        return fields
    if sliding.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.sliding_attention.rope_type={sliding.get('rope_type')!r} (jmegatron's local "
                        f"RoPE is unscaled, or the full layers')")
    elif float(sliding["rope_theta"]) != int(float(sliding["rope_theta"])):
        problems.append(f"the sliding layers' rope_theta={sliding['rope_theta']} (jmegatron's rotary_base_local is "
                        f"an integer)")
    else:
        fields["rotary_base_local"] = int(float(sliding["rope_theta"]))
    return fields


def _smollm3_rope_layers(conf: Mapping[str, Any], layers: int, problems: list[str]) -> list[int]:
    """SmolLM3's ``no_rope_layers`` (1 = RoPE) for ``layers`` layers: the list (its first
    ``layers`` entries, as transformers reads it), else every ``no_rope_layer_interval``-th
    layer NoPE (transformers' SmolLM3Config). Appends to ``problems`` a list shorter than
    the layers or with entries other than 0/1."""
    interval = conf.get("no_rope_layer_interval")
    given = conf.get("no_rope_layers")
    if given is None:
        n = int(interval or 4)
        return [int((i + 1) % n != 0) for i in range(layers)]
    given = list(given)
    if len(given) < layers or any(v not in (0, 1) or isinstance(v, float) for v in given[:layers]):
        problems.append(f"no_rope_layers={given} (one 0 (NoPE) or 1 (RoPE) per layer, {layers} layers)")
        return [1] * layers
    return [int(v) for v in given[:layers]]


def _smollm3_fields_from_hf(conf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """``no_rope_freq`` of a SmolLM3Config mapping (the complement of ``no_rope_layers``: an
    int N where the pattern is Megatron's every-N-th layer, else the 0/1 list; None without
    NoPE layers). Appends to ``problems`` a ``use_sliding_window=False`` with sliding
    ``layer_types`` and a ``sliding_window``: transformers' eager and SDPA masks follow
    ``layer_types`` then, its flash kernels do not (two models)."""
    layers = int(conf["num_hidden_layers"])
    pattern = tuple(1 - r for r in _smollm3_rope_layers(conf, layers, problems))
    types = conf.get("layer_types") or ()
    if not conf.get("use_sliding_window") and conf.get("sliding_window") is not None and "sliding_attention" in types:
        problems.append(f"use_sliding_window=False with sliding layers in layer_types and sliding_window="
                        f"{conf.get('sliding_window')} (transformers' masks slide, its flash attention does not; "
                        f"set use_sliding_window=True or make every layer 'full_attention')")
    if not any(pattern):
        return dict(no_rope_freq=None)
    freq = next((n for n in range(1, layers + 1) if not layers % n and no_rope_layer_pattern(n, layers) == pattern),
                pattern)
    return dict(no_rope_freq=freq)


def _granite_fields_from_hf(conf: Mapping[str, Any], kv_channels: int, problems: list[str]) -> dict[str, Any]:
    """Granite's scalars of a GraniteConfig mapping: ``embedding_multiplier``,
    ``residual_multiplier``, ``logits_scaling`` by name, ``attention_multiplier`` as
    ``softmax_scale`` (None when it is ``1 / sqrt(head_dim)``). Appends to ``problems`` a
    ``sliding_window`` (transformers' Granite has none)."""
    if conf.get("sliding_window") is not None:
        problems.append(f"sliding_window={conf.get('sliding_window')} (transformers' Granite attends to every "
                        f"key; jmegatron would slide)")
    fields = {n: float(conf.get(n, 1.0)) for n in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
    scale = float(conf.get("attention_multiplier", 1.0))
    fields["softmax_scale"] = None if math.isclose(scale, kv_channels ** -0.5, rel_tol=1e-12) else scale
    return fields


# Fields of a transformers config that are not the model: bookkeeping, token ids, and the
# generation and task-head settings PretrainedConfig carries. Every other field of a
# config.json is read by the family's import or refused by name (:func:`config_fields_from_hf`).
NOT_MODEL_FIELDS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "problem_type", "id2label",
    "label2id", "tokenizer_class", "prefix", "task_specific_params", "chunk_size_feed_forward",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "_attn_implementation_autoset", "use_return_dict", "tf_legacy_loss", "torchscript",
    # generation settings that old config.json files carry (transformers moved them to
    # generation_config.json)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
    # transformers 4.x Llama's split of each matmul into pretraining_tp slices (the same
    # product); a request to return the MoE router's logits
    "pretraining_tp", "output_router_logits",
    # the Hub's remote-code classes for trust_remote_code (Phi-3's checkpoints carry them); the
    # import follows transformers' own class of model_type, as transformers does without it
    "auto_map",
    # GPT-2's sequence-summary head (GPT2DoubleHeadsModel), not the language model's
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
})
# jmegatron's field -> the Hugging Face fields it is read from: a check of the imported
# config that fails names these (:func:`_check_imported`)
HF_SOURCES = {
    "num_layers": ("num_hidden_layers", "n_layer"), "hidden_size": ("hidden_size", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_head"), "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",), "ffn_hidden_size": ("intermediate_size", "n_inner"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "num_moe_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_router_topk": ("num_experts_per_tok",), "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_router_num_groups": ("n_group",), "moe_router_group_topk": ("topk_group",),
    "moe_router_pre_softmax": ("norm_topk_prob",), "moe_layer_freq": ("first_k_dense_replace", "mlp_only_layers",
                                                                    "decoder_sparse_step"),
    "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size", "n_shared_experts"),
    "moe_router_topk_scaling_factor": ("routed_scaling_factor",),
    "q_lora_rank": ("q_lora_rank",), "kv_lora_rank": ("kv_lora_rank",), "qk_head_dim": ("qk_nope_head_dim",),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim",), "v_head_dim": ("v_head_dim",),
    "rotary_seq_len_interpolation_factor": ("rope_parameters", "rope_scaling"),
    "rope_scaling_factor": ("rope_parameters", "rope_scaling"), "yarn_rotary_scaling_factor": ("rope_parameters",
                                                                                              "rope_scaling"),
    "window_size": ("sliding_window",), "window_attn_skip_freq": ("layer_types",),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings",), "norm_epsilon": ("rms_norm_eps",
                                                                                      "layer_norm_epsilon"),
    "softmax_scale": ("query_pre_attn_scalar",), "attn_logit_softcapping": ("attn_logit_softcapping",),
    "final_logit_softcapping": ("final_logit_softcapping",), "rotary_base": ("rope_parameters", "rope_theta"),
    "rotary_percent": ("partial_rotary_factor", "rope_parameters"), "hidden_dropout": ("resid_pdrop",),
}
HF_SOURCES.update(no_rope_freq=("no_rope_layers", "no_rope_layer_interval"),
                  embedding_multiplier=("embedding_multiplier",), residual_multiplier=("residual_multiplier",),
                  logits_scaling=("logits_scaling",))
HF_SOURCES["softmax_scale"] += ("attention_multiplier",)


class _ReadFields(dict):
    """A ``config.json`` mapping that records the fields read (``read``)."""

    def __init__(self, conf: Mapping[str, Any]):
        super().__init__(conf)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def _unread_problems(conf: _ReadFields, model_type: str) -> list[str]:
    """A problem for each field of ``conf`` that the import did not read and that is not
    bookkeeping (:data:`NOT_MODEL_FIELDS`)."""
    return [f"{key}={dict.__getitem__(conf, key)!r} (a field jmegatron's {model_type} import does not read: it may "
            f"change the model)" for key in dict.keys(conf) if key not in conf.read and key not in NOT_MODEL_FIELDS]


def _check_imported(fields: Mapping[str, Any], conf: Mapping[str, Any], model_type: str) -> None:
    """Raise ValueError naming the Hugging Face fields (:data:`HF_SOURCES`) when the
    imported model fields fail a run config's checks (:class:`jmegatron.config.JMegatronConfig`
    of the fields, mock data, ``seq_length`` = ``max_position_embeddings``)."""
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    model = {k: v for k, v in fields.items() if k in names}
    model.setdefault("seq_length", model.get("max_position_embeddings", 1))
    try:
        JMegatronConfig(mock_data=True, **model)
    except ConfigError as e:
        named = re.findall(r"(\w+)=", str(e))
        sources = [f"{key}={conf[key]!r}" for n in named for key in HF_SOURCES.get(n, ()) if key in conf]
        sources = list(dict.fromkeys(sources)) or ["model_type=" + repr(model_type)]
        raise ValueError(f"this Hugging Face {model_type} config cannot be imported: {', '.join(sources)} gives "
                         f"{e}") from None


def config_fields_from_hf(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The jmegatron architecture fields (:data:`jmegatron.config.MODEL_FIELDS` plus
    ``vocab_size``), dropout rates and ``init_method_std`` (``initializer_range``) of a
    transformers ``config.json`` mapping; the inverse
    of :func:`hf_config_dict`. Dropout: GPT-2's ``resid_pdrop`` (jmegatron's one
    ``hidden_dropout`` also drops the embeddings, as Megatron's) and ``attn_pdrop``; the
    Llama layout's ``attention_dropout`` and no hidden dropout (it has none).

    Accepts ``model_type`` "gpt2" (``activation_function`` "gelu", or the tanh "gelu_new" /
    "gelu_pytorch_tanh" / "gelu_fast" as ``openai_gelu``), the Llama layout "llama",
    "mistral", "qwen2" (Q/K/V biases), "qwen3" (``qk_layernorm``), "phi3" (partial RoPE as
    ``rotary_percent``, ``resid_pdrop`` as ``hidden_dropout``: :func:`_phi3_fields_from_hf`) with ``hidden_act "silu"``
    and the RoPE types of :func:`rope_fields_from_hf`, and the MoE types of
    :mod:`jmegatron.conversion.hf_moe`. Raises ValueError naming each HF field jmegatron cannot
    represent (e.g. sliding-window attention, ``attention_bias`` without ``mlp_bias``, RoPE
    type "longrope").
    """
    model_type = conf.get("model_type")
    problems: list[str] = []
    if model_type == "gemma3":  # the multimodal checkpoint: its text model
        conf = {**(conf.get("text_config") or {}), "model_type": "gemma3_text",
                "tie_word_embeddings": conf.get("tie_word_embeddings", True)}
        model_type = "gemma3_text"
    conf = _ReadFields(conf)
    if model_type in GEMMA_TYPES:
        fields = _gemma_fields_from_hf(conf, problems)
    elif model_type in OLMO_TYPES:
        fields = _olmo_fields_from_hf(conf, problems)
    elif model_type == "gpt2":
        h, heads = int(conf["n_embd"]), int(conf["n_head"])
        act = conf.get("activation_function", "gelu_new")
        if act not in ("gelu",) + _GELU_TANH:
            problems.append(f"activation_function={act!r} (built: the exact 'gelu' and the tanh "
                            f"{', '.join(map(repr, _GELU_TANH))})")
        conf.get("embd_pdrop")  # jmegatron's one hidden_dropout (resid_pdrop) also drops the embeddings
        if conf.get("add_cross_attention"):
            problems.append("add_cross_attention=True (cross-attention to an encoder: jmegatron's GPT is a decoder "
                            "only)")
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if conf.get(key):
                problems.append(f"{key}=True (not built)")
        if conf.get("scale_attn_weights", True) is False:
            problems.append("scale_attn_weights=False (jmegatron scales by 1/sqrt(head_dim))")
        fields = dict(
            num_layers=int(conf["n_layer"]), hidden_size=h, num_attention_heads=heads,
            ffn_hidden_size=int(conf.get("n_inner") or 4 * h), num_query_groups=heads, kv_channels=h // heads,
            max_position_embeddings=int(conf["n_positions"]), position_embedding_type="learned_absolute",
            normalization="LayerNorm", norm_epsilon=float(conf.get("layer_norm_epsilon", 1e-5)), swiglu=False,
            openai_gelu=act in _GELU_TANH, add_bias_linear=True, add_qkv_bias=False,
            hidden_dropout=float(conf.get("resid_pdrop", 0.1)), attention_dropout=float(conf.get("attn_pdrop", 0.1)))
    elif model_type in tuple(LLAMA_LIKE) + tuple(hf_moe.MODEL_TYPES):
        h, heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
        if conf.get("hidden_act", "silu") != "silu" and model_type != "gpt_oss":  # (gpt-oss's experts ignore it)
            problems.append(f"hidden_act={conf.get('hidden_act')!r} (SwiGLU uses silu)")
        attn_bias, mlp_bias = bool(conf.get("attention_bias", False)), bool(conf.get("mlp_bias", False))
        if model_type in _ATTENTION_AND_MLP_BIAS and attn_bias != mlp_bias:
            problems.append(f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (jmegatron's add_bias_linear "
                            f"biases every linear layer or none)")
        if model_type == "qwen3" and attn_bias:
            problems.append("attention_bias=True (Qwen3's biases on q/k/v and o_proj but not the MLP: jmegatron's "
                            "add_bias_linear biases every linear layer, add_qkv_bias only Q/K/V)")
        windows = window_fields_from_hf(conf, model_type, problems)
        if windows.get("window_size") is not None and model_type in hf_moe.MODEL_TYPES and model_type != "gpt_oss":
            problems.append(f"sliding_window={conf.get('sliding_window')} (a sliding window in "
                            f"{hf_moe.MODEL_TYPES[model_type]}: not built)")
        fields = dict(
            num_layers=int(conf["num_hidden_layers"]), hidden_size=h, num_attention_heads=heads,
            ffn_hidden_size=int(conf["intermediate_size"]),
            num_query_groups=int(conf.get("num_key_value_heads") or heads),
            kv_channels=int(conf.get("head_dim") or h // heads),
            max_position_embeddings=int(conf["max_position_embeddings"]),
            normalization="RMSNorm", norm_epsilon=float(conf.get("rms_norm_eps", 1e-6)), swiglu=True,
            add_bias_linear=model_type in _ATTENTION_AND_MLP_BIAS and attn_bias and mlp_bias,
            add_qkv_bias=model_type == "qwen2", qk_layernorm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            qk_layernorm_across_heads=model_type == "olmoe",
            hidden_dropout=0.0, attention_dropout=float(conf.get("attention_dropout") or 0.0))
        fields.update(rope_fields_from_hf(conf, problems, partial_rotary=model_type == "phi3"))
        fields.update(windows)
        if model_type == "phi3":
            fields.update(_phi3_fields_from_hf(conf, problems))
        if model_type in hf_moe.MODEL_TYPES:
            fields.update(hf_moe.moe_config_fields(conf, problems))
        if model_type == "smollm3":
            fields.update(_smollm3_fields_from_hf(conf, problems))
        if model_type == "granite":
            fields.update(_granite_fields_from_hf(conf, fields["kv_channels"], problems))
    else:
        raise ValueError(f"Hugging Face model_type={model_type!r} has no jmegatron import: supported are "
                         + ", ".join(f"{t!r} ({a})" for t, a in
                                     [("gpt2", GPT2), *LLAMA_LIKE.items(), *GEMMA_TYPES.items(),
                                      *hf_moe.MODEL_TYPES.items(), *OLMO_TYPES.items()]))
    fields["untie_embeddings_and_output_weights"] = not bool(conf.get("tie_word_embeddings", True))
    if conf.get("initializer_range") is not None:  # written back by hf_config_dict
        fields["init_method_std"] = float(conf["initializer_range"])
    fields["vocab_size"] = int(conf["vocab_size"])
    if conf.get("is_encoder_decoder"):
        problems.append("is_encoder_decoder=True (jmegatron's models are decoders)")
    problems += _unread_problems(conf, model_type)
    if problems:
        raise ValueError(f"this Hugging Face {model_type} config cannot be imported: " + "; ".join(problems))
    _check_imported(fields, conf, model_type)
    return fields


# ------------------------------------------------------------------------ jmegatron -> HF
def to_hf_state_dict(params: Mapping, cfg, vocab_size: Optional[int] = None) -> dict[str, np.ndarray]:
    """jmegatron params (per-layer or scanned) -> Hugging Face state dict of numpy arrays.

    Keys and layouts are those of ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (``transformer.*``
    / ``model.*``); arrays keep the params' dtype (owned, writable, C-contiguous copies).
    ``lm_head.weight`` is written only for an untied output layer (tied checkpoints omit it,
    as on the Hub).
    ``vocab_size`` (default: all rows of ``word_embeddings``) keeps only the first
    ``vocab_size`` rows of the embedding and output layer, dropping Megatron's padding.

    GPT-2: ``c_attn.weight [h, 3h]`` = q|k|v kernels reshaped ``[h, nq*d]`` and concatenated,
    ``c_attn.bias [3h]``; ``c_proj.weight [h, h]`` (Conv1D: ``[in, out]``); ``mlp.c_fc.weight
    [h, ffn]``, ``mlp.c_proj.weight [ffn, h]``; ``ln_1``/``ln_2``/``ln_f`` weight+bias.
    Llama: ``q_proj.weight [nq*d, h]``, ``k_proj``/``v_proj.weight [nkv*d, h]``,
    ``o_proj.weight [h, nq*d]``, ``gate_proj``/``up_proj.weight [ffn, h]`` (fc1 index 0/1),
    ``down_proj.weight [h, ffn]``, ``input_layernorm``/``post_attention_layernorm``/``norm``.
    Phi-3: Llama's keys with ``self_attn.qkv_proj.weight [(nq + 2 nkv) d, h]`` (q|k|v rows) and
    ``mlp.gate_up_proj.weight [2 ffn, h]`` (gate|up rows) in place of the separate projections.
    Mixtral / Qwen2-MoE: Llama's keys, the MoE layers' MLPs in the checkpoint (Hub) names of
    :mod:`jmegatron.conversion.hf_moe` (``block_sparse_moe.experts.{e}.w1`` ...), Q/K/V biases
    with ``add_qkv_bias``.

    Raises ValueError when ``cfg`` has no HF target (:func:`hf_architecture`) or the params
    do not match ``cfg`` (a missing entry or a wrong shape).
    """
    hf_architecture(cfg)
    p = plain(params)
    if "decoder_layers" in p:
        p = unstack_layers(p, cfg.num_layers)
    return dict(iter_hf_tensors(p, lambda i: get(p, f"decoder_layers_{i}", cfg), cfg, vocab_size))


def iter_hf_tensors(common: Mapping, layer: Callable[[int], Mapping], cfg,
                    vocab_size: Optional[int] = None) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of :func:`to_hf_state_dict` one at a time, in file order: the
    embeddings, then decoder layer 0, 1, ... (``layer(i)``: that layer's per-layer
    subtree, asked for once, when its tensors are due, so a caller can read it from disk
    then), then the final norm and ``lm_head``. ``common``: the parameters other than the
    decoder layers (``word_embeddings``, ``position_embeddings``, ``final_layernorm``,
    ``output_layer``; per-layer entries in it are ignored). Only the current layer's
    arrays are held: the streaming export's memory bound (:mod:`jmegatron.export.stream`).

    Raises ValueError as :func:`to_hf_state_dict`.
    """
    arch = hf_architecture(cfg)
    common = plain(common)
    h = cfg.hidden_size
    g = lambda path: get(common, path, cfg)  # noqa: E731

    wte = g("word_embeddings/embedding")
    rows = wte.shape[0]
    check_shape("word_embeddings/embedding", wte, (rows, h))
    v = rows if vocab_size is None else int(vocab_size)
    if not 0 < v <= rows:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {rows}] (the embedding's rows)")

    def layer_tree(i: int) -> dict:
        L = f"decoder_layers_{i}"
        if cfg.multi_latent_attention:
            return {L: numpy_tree(layer(i))}
        return _split_fused_qkv({L: numpy_tree(layer(i))}, cfg, layers=(i,))

    if arch == GPT2:
        yield "transformer.wte.weight", _owned(wte[:v])
        yield "transformer.wpe.weight", _owned(check_shape(
            "position_embeddings/embedding", g("position_embeddings/embedding"), (cfg.max_position_embeddings, h)))
        for i in range(cfg.num_layers):
            yield from _gpt2_layer_to_hf(i, layer_tree(i), cfg)
        yield "transformer.ln_f.weight", _owned(g("final_layernorm/scale"))
        yield "transformer.ln_f.bias", _owned(g("final_layernorm/bias"))
    else:
        yield "model.embed_tokens.weight", _owned(wte[:v])
        moe_layers = hf_moe.moe_layers(cfg)
        for i in range(cfg.num_layers):
            tensors = _llama_layer_to_hf(i, layer_tree(i), bool(moe_layers[i]), cfg, arch)
            yield from (_phi3_fuse(i, tensors) if arch == PHI3 else tensors)
        for k in range(cfg.mtp_num_layers or 0):  # DeepSeek-V3's Hub layout: depth k is layer L + k
            n, M = cfg.num_layers + k, f"mtp_layers_{k}"
            o = f"model.layers.{n}"
            for name, hf_name in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_layernorm", "shared_head.norm")):
                yield f"{o}.{hf_name}.weight", _owned(check_shape(f"{M}/{name}/scale", g(f"{M}/{name}/scale"), (h,)))
            yield f"{o}.eh_proj.weight", _owned(check_shape(f"{M}/eh_proj/kernel", g(f"{M}/eh_proj/kernel"),
                                                            (2 * h, h)).T)
            yield f"{o}.embed_tokens.weight", _owned(wte[:v])  # the Hub's copies of the shared embedding and head
            yield f"{o}.shared_head.head.weight", _owned((g("output_layer/kernel")
                                                          if cfg.untie_embeddings_and_output_weights
                                                          else wte.T)[:, :v].T)
            yield from _llama_layer_to_hf(n, {f"decoder_layers_{n}": numpy_tree(g(f"{M}/transformer_layer"))},
                                          bool(moe_layers[-1]), cfg, arch)
        yield "model.norm.weight", _owned(g("final_layernorm/scale"))
    if cfg.untie_embeddings_and_output_weights:
        out = check_shape("output_layer/kernel", g("output_layer/kernel"), (h, rows))
        yield "lm_head.weight", _owned(out[:, :v].T)


def _owned(a) -> np.ndarray:
    """An owned, writable, C-contiguous copy of ``a`` (jax arrays give read-only views)."""
    return np.array(a, order="C", copy=True)


def _gpt2_layer_to_hf(i: int, lp: Mapping, cfg) -> Iterator[tuple[str, np.ndarray]]:
    """GPT-2's tensors of ``transformer.h.{i}`` from ``lp`` = ``{"decoder_layers_{i}": subtree}``
    (Q/K/V split, :func:`_split_fused_qkv`)."""
    h, nq, d, ffn = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.ffn_hidden_size
    L, o = f"decoder_layers_{i}", f"transformer.h.{i}"
    gl = lambda path: get(lp, path, cfg)  # noqa: E731
    qkv = [check_shape(f"{L}/self_attention/linear_{n}/kernel",
                       gl(f"{L}/self_attention/linear_{n}/kernel"), (h, nq, d)).reshape(h, nq * d)
           for n in "qkv"]
    yield f"{o}.ln_1.weight", _owned(gl(f"{L}/input_layernorm/scale"))
    yield f"{o}.ln_1.bias", _owned(gl(f"{L}/input_layernorm/bias"))
    yield f"{o}.attn.c_attn.weight", _owned(np.concatenate(qkv, axis=1))
    yield f"{o}.attn.c_attn.bias", _owned(np.concatenate(
        [gl(f"{L}/self_attention/linear_{n}/bias").reshape(nq * d) for n in "qkv"]))
    yield f"{o}.attn.c_proj.weight", _owned(check_shape(
        f"{L}/self_attention/linear_proj/kernel", gl(f"{L}/self_attention/linear_proj/kernel"),
        (nq, d, h)).reshape(nq * d, h))
    yield f"{o}.attn.c_proj.bias", _owned(gl(f"{L}/self_attention/linear_proj/bias"))
    yield f"{o}.ln_2.weight", _owned(gl(f"{L}/pre_mlp_layernorm/scale"))
    yield f"{o}.ln_2.bias", _owned(gl(f"{L}/pre_mlp_layernorm/bias"))
    yield f"{o}.mlp.c_fc.weight", _owned(check_shape(
        f"{L}/mlp/linear_fc1/kernel", gl(f"{L}/mlp/linear_fc1/kernel"), (h, ffn)))
    yield f"{o}.mlp.c_fc.bias", _owned(gl(f"{L}/mlp/linear_fc1/bias"))
    yield f"{o}.mlp.c_proj.weight", _owned(check_shape(
        f"{L}/mlp/linear_fc2/kernel", gl(f"{L}/mlp/linear_fc2/kernel"), (ffn, h)))
    yield f"{o}.mlp.c_proj.bias", _owned(gl(f"{L}/mlp/linear_fc2/bias"))


def _llama_layer_to_hf(i: int, lp: Mapping, moe: bool, cfg, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """The Llama layout's tensors of ``model.layers.{i}`` (Gemma's norms for Gemma, the MoE
    MLP of :mod:`jmegatron.conversion.hf_moe` for an MoE layer) from ``lp`` =
    ``{"decoder_layers_{i}": subtree}``."""
    h, nq, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    ffn, bias = cfg.ffn_hidden_size, cfg.add_bias_linear
    norms = _GEMMA_NORMS if arch in (GEMMA2, GEMMA3) else _OLMO_NORMS if arch in (OLMO2, OLMO3) else _LLAMA_NORMS
    L, o = f"decoder_layers_{i}", f"model.layers.{i}"
    A = f"{L}/self_attention"
    gl = lambda path: get(lp, path, cfg)  # noqa: E731
    for name, hf_name in norms.items():
        yield f"{o}.{hf_name}.weight", _owned(check_shape(f"{L}/{name}/scale", gl(f"{L}/{name}/scale"), (h,)))
    if cfg.multi_latent_attention:
        for key, value in _mla_to_hf(gl, cfg, A, f"{o}.self_attn"):
            yield key, _owned(value)
    for n, heads in (() if cfg.multi_latent_attention else (("q", nq), ("k", nkv), ("v", nkv))):
        k = check_shape(f"{A}/linear_{n}/kernel", gl(f"{A}/linear_{n}/kernel"), (h, heads, d))
        yield f"{o}.self_attn.{n}_proj.weight", _owned(k.reshape(h, heads * d).T)
        if bias or cfg.add_qkv_bias:
            yield f"{o}.self_attn.{n}_proj.bias", _owned(gl(f"{A}/linear_{n}/bias").reshape(heads * d))
    if cfg.qk_layernorm and not cfg.multi_latent_attention:
        for n, heads in (("q", nq), ("k", nkv)):  # across heads: [heads, d] <-> [heads * d] (OLMo)
            shape = (heads, d) if cfg.qk_layernorm_across_heads else (d,)
            yield f"{o}.self_attn.{n}_norm.weight", _owned(check_shape(
                f"{A}/{n}_layernorm/scale", gl(f"{A}/{n}_layernorm/scale"), shape).reshape(-1))
    dv = cfg.v_head_dim if cfg.multi_latent_attention else d
    k = check_shape(f"{A}/linear_proj/kernel", gl(f"{A}/linear_proj/kernel"), (nq, dv, h))
    yield f"{o}.self_attn.o_proj.weight", _owned(k.reshape(nq * dv, h).T)
    if bias:
        yield f"{o}.self_attn.o_proj.bias", _owned(gl(f"{A}/linear_proj/bias"))
    if cfg.softmax_type == "learnable":  # gpt-oss's attention sinks
        yield f"{o}.self_attn.sinks", _owned(check_shape(f"{A}/softmax_offset", gl(f"{A}/softmax_offset"), (nq,)))
    if moe:
        yield from hf_moe.mlp_to_hf(gl(f"{L}/mlp"), cfg, arch, i, check_shape).items()
        return
    fc1 = check_shape(f"{L}/mlp/linear_fc1/kernel", gl(f"{L}/mlp/linear_fc1/kernel"), (h, 2, ffn))
    yield f"{o}.mlp.gate_proj.weight", _owned(fc1[:, 0, :].T)
    yield f"{o}.mlp.up_proj.weight", _owned(fc1[:, 1, :].T)
    fc2 = check_shape(f"{L}/mlp/linear_fc2/kernel", gl(f"{L}/mlp/linear_fc2/kernel"), (ffn, h))
    yield f"{o}.mlp.down_proj.weight", _owned(fc2.T)
    if bias:
        b1 = gl(f"{L}/mlp/linear_fc1/bias")
        yield f"{o}.mlp.gate_proj.bias", _owned(b1[0])
        yield f"{o}.mlp.up_proj.bias", _owned(b1[1])
        yield f"{o}.mlp.down_proj.bias", _owned(gl(f"{L}/mlp/linear_fc2/bias"))


def _phi3_fuse(i: int, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Phi-3's tensors of ``model.layers.{i}`` from the Llama layout's: ``self_attn.qkv_proj``
    ``[(nq + 2 nkv) d, h]`` = ``[q_proj; k_proj; v_proj]`` and ``mlp.gate_up_proj [2 ffn, h]`` =
    ``[gate_proj; up_proj]`` (transformers' Phi3Attention slices q, k, v in that order;
    Phi3MLP's ``chunk(2)`` gives gate, then up)."""
    o = f"model.layers.{i}."
    out = dict(tensors)
    for fused, parts in _PHI3_FUSED.items():
        out[f"{o}{fused}.weight"] = np.concatenate([out.pop(f"{o}{part}.weight") for part in parts], axis=0)
    yield from out.items()


def _phi3_split(sd: Mapping[str, Any], cfg) -> dict[str, Any]:
    """``sd`` with Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` weights split into the Llama
    layout's ``q_proj``, ``k_proj``, ``v_proj`` / ``gate_proj``, ``up_proj`` (the inverse of
    :func:`_phi3_fuse`). Raises ValueError for a fused tensor of the wrong shape."""
    d, ffn = cfg.kv_channels, cfg.ffn_hidden_size
    sizes = {"self_attn.qkv_proj": (cfg.num_attention_heads * d, cfg.num_query_groups * d, cfg.num_query_groups * d),
             "mlp.gate_up_proj": (ffn, ffn)}
    out: dict[str, Any] = {}
    for key, value in sd.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight", key)
        if m is None:
            out[key] = value
            continue
        rows = sizes[m[2]]
        a = check_shape(key, to_numpy(value), (sum(rows), cfg.hidden_size))
        for part, piece in zip(_PHI3_FUSED[m[2]], np.split(a, np.cumsum(rows)[:-1], axis=0)):
            out[f"{m[1]}{part}.weight"] = piece
    return out


# multi-latent attention: jmegatron param (under self_attention) -> HF module (under self_attn)
_MLA_NAMES = {"linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm", "linear_q_up_proj": "q_b_proj",
              "linear_q_proj": "q_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
              "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj"}


def _mla_shapes(cfg) -> dict[str, tuple]:
    """The MLA params' shapes (``o_proj`` aside), jmegatron layout."""
    h, n, rq, rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dqk, dr, dv = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    shapes = {"linear_kv_down_proj": (h, rkv + dr), "kv_layernorm": (rkv,), "linear_kv_up_proj": (rkv, n, cfg.qk_head_dim + dv)}
    if rq is None:
        shapes["linear_q_proj"] = (h, n, dqk)
    else:
        shapes.update(linear_q_down_proj=(h, rq), q_layernorm=(rq,), linear_q_up_proj=(rq, n, dqk))
    return shapes


def _mla_to_hf(get: Callable, cfg, prefix: str, o: str) -> Iterator[tuple[str, np.ndarray]]:
    """DeepSeek-V3's attention tensors (``o`` = ``model.layers.{i}.self_attn``) of the MLA
    params under ``prefix``; kernels ``[in, *out]`` become ``[prod(out), in]``."""
    for name, shape in _mla_shapes(cfg).items():
        leaf = "scale" if name.endswith("layernorm") else "kernel"
        a = check_shape(f"{prefix}/{name}/{leaf}", get(f"{prefix}/{name}/{leaf}"), shape)
        yield f"{o}.{_MLA_NAMES[name]}.weight", a if leaf == "scale" else a.reshape(shape[0], -1).T


def _mla_from_hf(t: Callable, cfg, o: str) -> dict:
    """The inverse of :func:`_mla_to_hf` (``t(key, shape)``: a float32 HF tensor)."""
    out = {}
    for name, shape in _mla_shapes(cfg).items():
        if name.endswith("layernorm"):
            out[name] = {"scale": t(f"{o}.{_MLA_NAMES[name]}.weight", shape)}
        else:
            flat = int(np.prod(shape[1:]))
            out[name] = {"kernel": np.ascontiguousarray(t(f"{o}.{_MLA_NAMES[name]}.weight", (flat, shape[0])).T
                                                        .reshape(shape))}
    return out


def _split_fused_qkv(p: dict, cfg, layers: Optional[Sequence[int]] = None) -> dict:
    """Per-layer params with ``linear_qkv`` replaced by ``linear_q`` ``[h, nq, d]`` and
    ``linear_k``/``linear_v`` ``[h, nkv, d]`` (biases ``[nq, d]``/``[nkv, d]``); ``layers``:
    the decoder layers ``p`` holds (default all ``cfg.num_layers``)."""
    nq, nkv, d, h = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.hidden_size
    per = nq // nkv
    out = dict(p)
    for i in (range(cfg.num_layers) if layers is None else layers):
        layer = f"decoder_layers_{i}"
        attn = dict(get(out, f"{layer}/self_attention", cfg))
        fused = attn.pop("linear_qkv", None)
        if fused is None:
            raise ValueError(f"params have no {layer}/self_attention/linear_qkv")
        kernel = check_shape(f"{layer}/self_attention/linear_qkv/kernel", to_numpy(fused["kernel"]),
                              (h, nkv, per + 2, d))
        attn["linear_q"] = {"kernel": kernel[:, :, :per].reshape(h, nq, d)}
        attn["linear_k"] = {"kernel": kernel[:, :, per]}
        attn["linear_v"] = {"kernel": kernel[:, :, per + 1]}
        if "bias" in fused:
            b = check_shape(f"{layer}/self_attention/linear_qkv/bias", to_numpy(fused["bias"]),
                             (nkv, per + 2, d))
            attn["linear_q"]["bias"] = b[:, :per].reshape(nq, d)
            attn["linear_k"]["bias"] = b[:, per]
            attn["linear_v"]["bias"] = b[:, per + 1]
        out[layer] = dict(out[layer], self_attention=attn)
    return out


def _fuse_qkv(p: dict, cfg) -> dict:
    """The inverse of :func:`_split_fused_qkv`."""
    nq, nkv, d, h = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.hidden_size
    per = nq // nkv
    for i in range(cfg.num_layers):
        attn = p[f"decoder_layers_{i}"]["self_attention"]
        q, k, v = (attn.pop(f"linear_{n}") for n in "qkv")
        fused = {"kernel": np.concatenate([q["kernel"].reshape(h, nkv, per, d), k["kernel"][:, :, None],
                                           v["kernel"][:, :, None]], axis=2)}
        if "bias" in q:
            fused["bias"] = np.concatenate([q["bias"].reshape(nkv, per, d), k["bias"][:, None],
                                            v["bias"][:, None]], axis=1)
        attn["linear_qkv"] = fused
    return p


# ------------------------------------------------------------------------ HF -> jmegatron
def from_hf_state_dict(state_dict: Mapping[str, Any], cfg,
                       padded_vocab_size: Optional[int] = None) -> dict:
    """Hugging Face state dict (numpy arrays or torch tensors) -> jmegatron params.

    The inverse of :func:`to_hf_state_dict`: returns a nested dict of float32 numpy arrays in
    the per-layer layout, or the stacked ``decoder_layers`` layout when ``cfg.scan_layers``.
    The embedding (and untied output layer) is zero-padded to ``padded_vocab_size`` rows
    (default ``cfg.padded_vocab_size(<HF vocab rows>)``, Megatron's padding rule).

    MoE models: checkpoint (Hub) keys, or a transformers-5 model's ``state_dict()`` with
    fused experts (:func:`jmegatron.conversion.hf_moe.from_module_layout`); a Qwen2-MoE
    ``shared_expert_gate`` must be zero (ValueError otherwise: jmegatron has no such gate).
    GPT-2 keys may lack the ``transformer.`` prefix (``GPT2Model`` checkpoints); the legacy
    ``attn.bias``/``attn.masked_bias`` mask buffers are ignored. ``lm_head.weight`` is
    ignored for a tied config and required for an untied one. Raises ValueError when
    ``cfg`` has no HF target, a tensor is missing, has the wrong shape, or is left unused.
    """
    arch = hf_architecture(cfg)
    sd = _hf_checkpoint_names(state_dict, arch)
    if arch == PHI3:
        sd = _phi3_split(sd, cfg)
    used: set[str] = set()

    def t(key: str, shape: tuple) -> np.ndarray:
        if key not in sd:
            raise ValueError(f"Hugging Face state dict has no {key!r} (needed for {arch} with this config)")
        used.add(key)
        return check_shape(key, to_numpy(sd[key]).astype(np.float32), shape)

    h = cfg.hidden_size
    emb_key = "transformer.wte.weight" if arch == GPT2 else "model.embed_tokens.weight"
    if emb_key not in sd:
        raise ValueError(f"Hugging Face state dict has no {emb_key!r} (is it a {arch} checkpoint?)")
    v = to_numpy(sd[emb_key]).shape[0]
    rows = int(padded_vocab_size) if padded_vocab_size is not None else cfg.padded_vocab_size(v)
    if rows < v:
        raise ValueError(f"padded_vocab_size={rows} is smaller than the checkpoint's vocabulary {v}")

    def pad_rows(a: np.ndarray) -> np.ndarray:
        return a if rows == v else np.concatenate([a, np.zeros((rows - v,) + a.shape[1:], a.dtype)])

    p: dict[str, Any] = {"word_embeddings": {"embedding": pad_rows(t(emb_key, (v, h)))}}
    if arch == GPT2:
        p.update(_gpt2_from_hf(t, cfg))
    else:
        p.update(_llama_from_hf(t, cfg, arch))
        for k in range(cfg.mtp_num_layers or 0):  # the Hub's copies of the shared embedding and head
            used.update({f"model.layers.{cfg.num_layers + k}.{name}.weight"
                         for name in ("embed_tokens", "shared_head.head")})
        # MTP depths the config leaves out (a teacher, a model without MTP): dropped, as
        # transformers' DeepseekV3ForCausalLM drops them
        first_extra = cfg.num_layers + (cfg.mtp_num_layers or 0)
        used.update(k for k in sd if _layer_index(k) is not None and _layer_index(k) >= first_extra
                    and arch == hf_moe.DEEPSEEK_V3)
    if cfg.untie_embeddings_and_output_weights:
        p["output_layer"] = {"kernel": np.ascontiguousarray(pad_rows(t("lm_head.weight", (v, h))).T)}
    else:
        used.add("lm_head.weight")
    unused = sorted(set(sd) - used)
    if unused:
        raise ValueError(f"Hugging Face state dict has tensors this config does not use: {unused[:8]}"
                         + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else ""))
    p = map_leaves(np.ascontiguousarray, p if cfg.multi_latent_attention else _fuse_qkv(p, cfg))
    if cfg.scan_layers:
        p = stack_layers(p, cfg.num_layers)
    return p


def _hf_checkpoint_names(state_dict: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """``state_dict`` under the checkpoint names :func:`from_hf_state_dict` reads: MoE experts
    unfused (:func:`jmegatron.conversion.hf_moe.from_module_layout`), a multimodal Gemma-3's
    text model in Gemma3ForCausalLM's names (its vision tower dropped), GPT-2 keys with the
    ``transformer.`` prefix and without the legacy mask buffers."""
    if arch in MOE_ARCHITECTURES:
        state_dict = hf_moe.from_module_layout(state_dict, arch, to_numpy)
    sd: dict[str, Any] = {}
    for key, value in state_dict.items():
        if arch == GEMMA3:  # a multimodal Gemma-3: its text model, in Gemma3ForCausalLM's names
            if key.startswith(_GEMMA3_VISION):
                continue
            for prefix, to in _GEMMA3_TEXT_PREFIXES:
                if key.startswith(prefix):
                    key = to + key[len(prefix):]
                    break
        if arch == GPT2:
            if _GPT2_IGNORED.search(key):
                continue
            if not key.startswith("transformer.") and key != "lm_head.weight":
                key = "transformer." + key
        sd[key] = value
    return sd


def _gpt2_from_hf(t: Callable, cfg) -> dict:
    """GPT-2's position embedding, decoder layers (Q/K/V split) and final norm as jmegatron
    params (``t(key, shape)``: a float32 HF tensor)."""
    h, nq, d, ffn = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.ffn_hidden_size
    p: dict[str, Any] = {"position_embeddings": {"embedding": t("transformer.wpe.weight",
                                                                (cfg.max_position_embeddings, h))}}
    for i in range(cfg.num_layers):
        o = f"transformer.h.{i}"
        w = t(f"{o}.attn.c_attn.weight", (h, 3 * nq * d))
        b = t(f"{o}.attn.c_attn.bias", (3 * nq * d,))
        attn = {f"linear_{n}": {"kernel": w[:, j * nq * d:(j + 1) * nq * d].reshape(h, nq, d),
                                "bias": b[j * nq * d:(j + 1) * nq * d].reshape(nq, d)}
                for j, n in enumerate("qkv")}
        attn["linear_proj"] = {"kernel": t(f"{o}.attn.c_proj.weight", (nq * d, h)).reshape(nq, d, h),
                               "bias": t(f"{o}.attn.c_proj.bias", (h,))}
        p[f"decoder_layers_{i}"] = {
            "input_layernorm": {"scale": t(f"{o}.ln_1.weight", (h,)), "bias": t(f"{o}.ln_1.bias", (h,))},
            "self_attention": attn,
            "pre_mlp_layernorm": {"scale": t(f"{o}.ln_2.weight", (h,)), "bias": t(f"{o}.ln_2.bias", (h,))},
            "mlp": {"linear_fc1": {"kernel": t(f"{o}.mlp.c_fc.weight", (h, ffn)),
                                   "bias": t(f"{o}.mlp.c_fc.bias", (ffn,))},
                    "linear_fc2": {"kernel": t(f"{o}.mlp.c_proj.weight", (ffn, h)),
                                   "bias": t(f"{o}.mlp.c_proj.bias", (h,))}},
        }
    p["final_layernorm"] = {"scale": t("transformer.ln_f.weight", (h,)), "bias": t("transformer.ln_f.bias", (h,))}
    return p


def _llama_from_hf(t: Callable, cfg, arch: str) -> dict:
    """The Llama layout's decoder layers (Q/K/V split), final norm and DeepSeek-V3's
    multi-token prediction depths as jmegatron params (``t(key, shape)``: a float32 HF
    tensor)."""
    h = cfg.hidden_size
    moe_layers = hf_moe.moe_layers(cfg)
    p: dict[str, Any] = {f"decoder_layers_{i}": _llama_layer_from_hf(t, cfg, arch, i, bool(moe_layers[i]))
                         for i in range(cfg.num_layers)}
    p["final_layernorm"] = {"scale": t("model.norm.weight", (h,))}
    for k in range(cfg.mtp_num_layers or 0):  # DeepSeek-V3's Hub layout: depth k is layer L + k
        n = cfg.num_layers + k
        o = f"model.layers.{n}"
        p[f"mtp_layers_{k}"] = {"enorm": {"scale": t(f"{o}.enorm.weight", (h,))},
                                "hnorm": {"scale": t(f"{o}.hnorm.weight", (h,))},
                                "final_layernorm": {"scale": t(f"{o}.shared_head.norm.weight", (h,))},
                                "eh_proj": {"kernel": np.ascontiguousarray(t(f"{o}.eh_proj.weight", (h, 2 * h)).T)},
                                "transformer_layer": _llama_layer_from_hf(t, cfg, arch, n, bool(moe_layers[-1]))}
    return p


def _llama_layer_from_hf(t: Callable, cfg, arch: str, i: int, moe: bool) -> dict:
    """The jmegatron layer subtree of ``model.layers.{i}`` (the inverse of
    :func:`_llama_layer_to_hf`, Q/K/V split)."""
    h, nq, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    ffn, bias = cfg.ffn_hidden_size, cfg.add_bias_linear
    norms = _GEMMA_NORMS if arch in (GEMMA2, GEMMA3) else _OLMO_NORMS if arch in (OLMO2, OLMO3) else _LLAMA_NORMS
    o = f"model.layers.{i}"
    attn = _mla_from_hf(t, cfg, f"{o}.self_attn") if cfg.multi_latent_attention else {}
    for n, heads in (() if cfg.multi_latent_attention else (("q", nq), ("k", nkv), ("v", nkv))):
        attn[f"linear_{n}"] = {"kernel": t(f"{o}.self_attn.{n}_proj.weight", (heads * d, h)).T.reshape(h, heads, d)}
        if bias or cfg.add_qkv_bias:
            attn[f"linear_{n}"]["bias"] = t(f"{o}.self_attn.{n}_proj.bias", (heads * d,)).reshape(heads, d)
    dv = cfg.v_head_dim if cfg.multi_latent_attention else d
    attn["linear_proj"] = {"kernel": t(f"{o}.self_attn.o_proj.weight", (h, nq * dv)).T.reshape(nq, dv, h)}
    if cfg.qk_layernorm and not cfg.multi_latent_attention:
        for n, heads in (("q", nq), ("k", nkv)):  # across heads: [heads * d] -> [heads, d] (OLMo)
            if cfg.qk_layernorm_across_heads:
                attn[f"{n}_layernorm"] = {"scale": t(f"{o}.self_attn.{n}_norm.weight", (heads * d,)).reshape(heads, d)}
            else:
                attn[f"{n}_layernorm"] = {"scale": t(f"{o}.self_attn.{n}_norm.weight", (d,))}
    if cfg.softmax_type == "learnable":  # gpt-oss's attention sinks
        attn["softmax_offset"] = t(f"{o}.self_attn.sinks", (nq,))
    if moe and bias:  # gpt-oss's o_proj bias (a dense layer reads its own below)
        attn["linear_proj"]["bias"] = t(f"{o}.self_attn.o_proj.bias", (h,))
    layer_norms = {name: {"scale": t(f"{o}.{hf_name}.weight", (h,))} for name, hf_name in norms.items()}
    if moe:
        return {**layer_norms, "self_attention": attn, "mlp": hf_moe.mlp_from_hf(t, cfg, arch, i)}
    fc1 = {"kernel": np.stack([t(f"{o}.mlp.gate_proj.weight", (ffn, h)).T,
                               t(f"{o}.mlp.up_proj.weight", (ffn, h)).T], axis=1)}
    fc2 = {"kernel": t(f"{o}.mlp.down_proj.weight", (h, ffn)).T}
    if bias:
        attn["linear_proj"]["bias"] = t(f"{o}.self_attn.o_proj.bias", (h,))
        fc1["bias"] = np.stack([t(f"{o}.mlp.gate_proj.bias", (ffn,)), t(f"{o}.mlp.up_proj.bias", (ffn,))])
        fc2["bias"] = t(f"{o}.mlp.down_proj.bias", (h,))
    return {**layer_norms, "self_attention": attn, "mlp": {"linear_fc1": fc1, "linear_fc2": fc2}}


def _layer_index(key: str) -> Optional[int]:
    """``i`` of a ``model.layers.{i}.*`` key, else None."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return int(m[1]) if m else None


def hf_mtp_depths(names, num_layers: int) -> int:
    """The multi-token prediction depths a DeepSeek-V3 checkpoint holds (tensor ``names``):
    depth ``k`` is ``model.layers.{num_layers + k}.eh_proj.weight``, present or not whatever
    ``num_nextn_predict_layers`` says (``save_pretrained`` writes 1 but no MTP tensors)."""
    names = set(names)
    k = 0
    while f"model.layers.{num_layers + k}.eh_proj.weight" in names:
        k += 1
    return k


