"""Hugging Face mapping of jmegatron's mixture-of-experts models (the MoE half of
:mod:`jmegatron.conversion.hf`, which calls into this module; numpy only).

Three targets, all with Llama's attention, RMSNorm and RoPE (:mod:`jmegatron.conversion.hf`'s
Llama mapping is reused for everything but the MLP):

* ``MixtralForCausalLM`` (transformers ``models/mixtral/modeling_mixtral.py``): every layer
  an MoE layer, SwiGLU experts, softmax over the top-k router logits (Megatron's default
  ``moe_router_pre_softmax=False``: softmax over all experts then renormalising the top-k,
  as Mixtral, is the same number), no shared expert.
* ``Qwen2MoeForCausalLM`` (``models/qwen2_moe/modeling_qwen2_moe.py``): for models with a
  shared expert; dense layers (``mlp_only_layers``) allowed; ``norm_topk_prob`` is ``not
  moe_router_pre_softmax``; ``qkv_bias`` is ``add_qkv_bias``. Qwen2-MoE multiplies the
  shared expert's output by a learned gate ``sigmoid(x W_g)``, ``W_g [1, h]``: jmegatron's
  ``moe_shared_expert_gate`` (Megatron-Core's), which import always sets. A model without
  the gate exports with ``W_g = 0`` and the shared ``down_proj`` times 2 (``sigmoid(0) * 2 = 1``
  exactly), so the HF model computes jmegatron's sum; such a checkpoint imports back into a
  gate-less config only when its gate is zero (ValueError naming the tensor otherwise).
* ``Qwen3MoeForCausalLM`` (``models/qwen3_moe/modeling_qwen3_moe.py``): Qwen3's attention
  (``qk_layernorm``) with Qwen2-MoE's experts and router, no shared expert.
* ``DeepseekV3ForCausalLM`` (``models/deepseek_v3/modeling_deepseek_v3.py``): multi-latent
  attention (its mapping is :mod:`jmegatron.conversion.hf`'s), first-k dense layers
  (``moe_layer_freq`` a dense prefix), sigmoid routing with the expert bias for the choice
  (``e_score_correction_bias`` = ``router/expert_bias``), weights normalised over the top-k
  and scaled (``routed_scaling_factor``), group-limited routing (``n_group`` /
  ``topk_group``: transformers scores a group by its top 2, Megatron by its top ``topk //
  group_topk``, so that quotient must be 2), ungated shared experts of ``n_shared_experts *
  moe_intermediate_size``.

* ``GptOssForCausalLM`` (``models/gpt_oss/modeling_gpt_oss.py``): Llama's attention with
  biases on q/k/v/o (``add_bias_linear``) and a learned sink logit per query head
  (``softmax_type="learnable"``), sliding and full layers (``layer_types``), every layer an
  MoE layer whose router has a bias and takes the softmax of the top-k logits, experts
  with biases and the quick-GELU GLU (``quick_geglu``, ``glu_linear_offset`` 1,
  ``activation_func_clamp_value`` 7: transformers' ``GptOssExperts`` fixes ``alpha = 1.702``
  and ``limit = 7``), no shared expert.

Checkpoint keys (what ``save_pretrained`` writes and the Hub holds; ``o`` =
``model.layers.{i}``, ``W^T`` = the jmegatron kernel transposed to ``nn.Linear``'s
``[out, in]``)::

    Mixtral   o.block_sparse_moe.gate.weight            [E, h]   router/kernel^T
              o.block_sparse_moe.experts.{e}.w1.weight  [F, h]   experts/linear_fc1/kernel[e, :, 0]^T (gate)
              o.block_sparse_moe.experts.{e}.w3.weight  [F, h]   experts/linear_fc1/kernel[e, :, 1]^T (up)
              o.block_sparse_moe.experts.{e}.w2.weight  [h, F]   experts/linear_fc2/kernel[e]^T
    Qwen2MoE  o.mlp.gate.weight                         [E, h]
              o.mlp.experts.{e}.{gate,up,down}_proj.weight       (as w1, w3, w2)
              o.mlp.shared_expert.{gate,up}_proj.weight [Fs, h]  shared_experts/linear_fc1/kernel[:, 0|1]^T
              o.mlp.shared_expert.down_proj.weight      [h, Fs]  shared_experts/linear_fc2/kernel^T (x 2 without a gate)
              o.mlp.shared_expert_gate.weight           [1, h]   shared_expert_gate/gate/kernel^T (zeros without a gate)
    Qwen3MoE  as Qwen2MoE without the shared expert and its gate
    DeepSeek  o.mlp.gate.weight [E, h], o.mlp.gate.e_score_correction_bias [E] (router/expert_bias)
              o.mlp.experts.{e}.{gate,up,down}_proj.weight (as Qwen2MoE)
              o.mlp.shared_experts.{gate,up,down}_proj.weight (no gate)
              (dense layers: o.mlp.{gate,up,down}_proj.weight as Llama)
    GptOss    o.mlp.router.weight [E, h], o.mlp.router.bias [E]     router/kernel^T, router/bias
              o.mlp.experts.gate_up_proj [E, h, 2F]  experts/linear_fc1/kernel, gate and up interleaved
                                                     (gate = [..., ::2], up = [..., 1::2])
              o.mlp.experts.gate_up_proj_bias [E, 2F]  experts/linear_fc1/bias, interleaved
              o.mlp.experts.down_proj [E, F, h], o.mlp.experts.down_proj_bias [E, h]   experts/linear_fc2/*
              o.self_attn.sinks [nq]                 self_attention/softmax_offset
              (the same keys in the module and in the checkpoint: the experts are stored fused)

transformers 5 keeps experts fused in memory (``o.mlp.experts.gate_up_proj [E, 2F, h]``,
gate rows first, ``o.mlp.experts.down_proj [E, h, F]``, and Mixtral's router as
``o.mlp.gate.weight``) and converts at load / save; :func:`to_module_layout` and
:func:`from_module_layout` convert between the two so both layouts load.

The capacity factor (``moe_expert_capacity_factor``) is a training-time dropping rule: the
HF models are dropless, so their logits equal jmegatron's when no token drops (as
Megatron's own HF converters export such models).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import numpy as np

from jmegatron.config import moe_layer_pattern, window_layer_pattern

MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
GPT_OSS = "GptOssForCausalLM"
# OLMoE: Qwen3-MoE's layout and router with OLMo's QK-norm over all heads
OLMOE = "OlmoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V3, GPT_OSS, OLMOE)
MODEL_TYPES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3,
               "gpt_oss": GPT_OSS, "olmoe": OLMOE}
# transformers' GptOssExperts: quick_gelu(gate) * (up + 1), gate <= 7 and up in [-7, 7] (fixed, not config fields)
GPT_OSS_GLU_LINEAR_OFFSET = 1.0
GPT_OSS_CLAMP_VALUE = 7.0
# HF's DeepSeek-V3 router scores a group by the sum of its top 2 experts (Megatron: topk // group_topk)
DEEPSEEK_GROUP_TOP = 2

_FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def moe_layers(cfg) -> tuple[int, ...]:
    """1 for each MoE decoder layer of ``cfg`` (``moe_layer_freq``,
    :func:`jmegatron.config.moe_layer_pattern`), all 0 for a dense model."""
    if cfg.num_moe_experts is None:
        return (0,) * cfg.num_layers
    return moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)


# ----------------------------------------------------------------------------- config
def moe_architecture(cfg, llama_problems: list[str]) -> tuple[str, list[str]]:
    """(the HF class for an MoE ``cfg``, the config fields it cannot represent).
    ``llama_problems``: the attention/norm problems of the Llama mapping."""
    if cfg.multi_latent_attention:
        return DEEPSEEK_V3, _deepseek_problems(cfg, llama_problems)
    if is_gpt_oss(cfg):
        return GPT_OSS, gpt_oss_problems(cfg)
    shared = cfg.moe_shared_expert_intermediate_size is not None
    arch = QWEN2_MOE if shared else (OLMOE if cfg.qk_layernorm_across_heads else QWEN3_MOE) if cfg.qk_layernorm \
        else MIXTRAL
    problems = [p for p in llama_problems if not (arch == OLMOE and "qk_layernorm_across_heads" in p)]
    if arch == OLMOE and not all(moe_layers(cfg)):
        problems.append(f"config.moe_layer_freq={cfg.moe_layer_freq!r} has dense layers (every OLMoE layer is an "
                        f"MoE layer)")
    if cfg.moe_router_num_groups is not None:
        problems.append(f"config.moe_router_num_groups={cfg.moe_router_num_groups} ({arch} has no group-limited "
                        f"routing)")
    if arch == QWEN2_MOE and cfg.qk_layernorm:
        problems.append("config.qk_layernorm=True with a shared expert (Qwen2-MoE has no QK-norm; Qwen3-MoE, "
                        "which has, no shared expert)")
    if arch in (QWEN3_MOE, OLMOE) and cfg.add_qkv_bias:
        problems.append(f"config.add_qkv_bias=True ({arch}'s attention has no Q/K/V-only bias)")
    if cfg.position_embedding_type != "rope":
        problems.append(f"config.position_embedding_type={cfg.position_embedding_type!r} ({arch} uses rope)")
    if cfg.moe_router_score_function != "softmax":
        problems.append(f"config.moe_router_score_function={cfg.moe_router_score_function!r} ({arch} routes "
                        f"with a softmax)")
    if cfg.moe_router_topk_scaling_factor is not None:
        problems.append(f"config.moe_router_topk_scaling_factor={cfg.moe_router_topk_scaling_factor} "
                        f"({arch} has no scaling of the top-k weights)")
    if cfg.moe_router_load_balancing_type == "sinkhorn":
        problems.append("config.moe_router_load_balancing_type='sinkhorn' (Sinkhorn routing is not a "
                        f"top-k softmax; {arch} has no such router)")
    if cfg.moe_router_enable_expert_bias:
        problems.append(f"config.moe_router_enable_expert_bias=True ({arch} has no expert bias)")
    if cfg.add_bias_linear:
        problems.append(f"config.add_bias_linear=True ({arch}'s router and experts have no biases; {GPT_OSS}'s have)")
    if arch == MIXTRAL:
        if not all(moe_layers(cfg)):
            problems.append(f"config.moe_layer_freq={cfg.moe_layer_freq!r} has dense layers (every Mixtral "
                            f"layer is an MoE layer; a shared expert would select {QWEN2_MOE}, which has "
                            f"mlp_only_layers)")
        if cfg.moe_router_pre_softmax:
            problems.append("config.moe_router_pre_softmax=True (Mixtral renormalises the top-k "
                            "probabilities; pre-softmax without renormalising is norm_topk_prob=False of "
                            "Qwen2-MoE (a shared expert) or Qwen3-MoE (qk_layernorm))")
        if cfg.add_qkv_bias:
            problems.append("config.add_qkv_bias=True (Mixtral's attention has no biases)")
    return arch, problems


def is_gpt_oss(cfg) -> bool:
    """Whether an MoE ``cfg`` has a gpt-oss block (attention sinks or the quick-GELU GLU), so
    that :data:`GPT_OSS` is its Hugging Face class."""
    return cfg.softmax_type != "vanilla" or cfg.quick_geglu


def gpt_oss_problems(cfg) -> list[str]:
    """The fields of an MoE ``cfg`` that ``GptOssForCausalLM`` cannot represent."""
    problems = []
    wanted = dict(normalization="RMSNorm", quick_geglu=True, glu_linear_offset=GPT_OSS_GLU_LINEAR_OFFSET,
                  activation_func_clamp_value=GPT_OSS_CLAMP_VALUE, softmax_type="learnable", add_bias_linear=True,
                  moe_router_score_function="softmax", moe_router_pre_softmax=False)
    for name, value in wanted.items():
        if getattr(cfg, name) != value:
            problems.append(f"config.{name}={getattr(cfg, name)!r} (gpt-oss has {value!r})")
    for name in ("qk_layernorm", "multi_latent_attention", "apply_layernorm_1p", "sandwich_norms",
                 "scale_embeddings", "moe_router_enable_expert_bias", "moe_shared_expert_gate"):
        if getattr(cfg, name):
            problems.append(f"config.{name}=True (gpt-oss has no such block)")
    for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping", "rotary_base_local",
                 "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_shared_expert_intermediate_size",
                 "mtp_num_layers"):
        if getattr(cfg, name) is not None:
            problems.append(f"config.{name}={getattr(cfg, name)!r} (gpt-oss has no such field)")
    if cfg.moe_router_load_balancing_type == "sinkhorn":
        problems.append("config.moe_router_load_balancing_type='sinkhorn' (gpt-oss's router is a top-k softmax)")
    if cfg.position_embedding_type not in ("rope", "yarn"):
        problems.append(f"config.position_embedding_type={cfg.position_embedding_type!r} (gpt-oss uses rope)")
    if cfg.rotary_seq_len_interpolation_factor is not None and (cfg.rope_scaling
                                                                or cfg.position_embedding_type == "yarn"):
        problems.append(f"config.rotary_seq_len_interpolation_factor={cfg.rotary_seq_len_interpolation_factor} with "
                        f"{'rope_scaling' if cfg.rope_scaling else 'yarn'} (rope_parameters hold one rope_type)")
    if not all(moe_layers(cfg)):
        problems.append(f"config.moe_layer_freq={cfg.moe_layer_freq!r} has dense layers (every gpt-oss layer is an "
                        f"MoE layer)")
    return problems


def _deepseek_problems(cfg, llama_problems: list[str]) -> list[str]:
    """The fields of an MLA + MoE ``cfg`` that ``DeepseekV3ForCausalLM`` cannot represent."""
    problems = [p for p in llama_problems if "hidden_size" not in p]
    k, pattern = cfg.moe_router_topk, moe_layers(cfg)
    first = pattern.index(1) if 1 in pattern else len(pattern)
    if any(pattern[first:]) and not all(pattern[first:]):
        problems.append(f"config.moe_layer_freq={cfg.moe_layer_freq!r} (DeepSeek-V3's dense layers are a prefix: "
                        f"first_k_dense_replace)")
    if cfg.moe_router_score_function != "sigmoid":
        problems.append(f"config.moe_router_score_function={cfg.moe_router_score_function!r} (DeepSeek-V3 routes "
                        f"with sigmoid scores)")
    if k == 1:
        problems.append("config.moe_router_topk=1 (transformers' DeepSeek-V3 weights the one expert by the "
                        "scaling factor alone; Megatron by its score)")
    if cfg.moe_router_num_groups is not None and k // cfg.moe_router_group_topk != DEEPSEEK_GROUP_TOP:
        problems.append(f"config.moe_router_topk={k} // moe_router_group_topk={cfg.moe_router_group_topk} != "
                        f"{DEEPSEEK_GROUP_TOP} (transformers scores each expert group by its top "
                        f"{DEEPSEEK_GROUP_TOP})")
    shared, f = cfg.moe_shared_expert_intermediate_size, cfg.moe_ffn_hidden_size
    if not shared or shared % f:
        problems.append(f"config.moe_shared_expert_intermediate_size={shared} (DeepSeek-V3 has n_shared_experts "
                        f"of moe_ffn_hidden_size={f}: a positive multiple)")
    if cfg.moe_shared_expert_gate:
        problems.append("config.moe_shared_expert_gate=True (DeepSeek-V3's shared experts are ungated)")
    if not cfg.qk_layernorm:
        problems.append("config.qk_layernorm=False (DeepSeek-V3 always norms the q and kv latents)")
    if cfg.norm_epsilon != 1e-6:
        problems.append(f"config.norm_epsilon={cfg.norm_epsilon} (transformers fixes the latent norms' at 1e-6 and "
                        f"jmegatron's norms share one epsilon)")
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        problems.append("config.add_qkv_bias / add_bias_linear (DeepSeek-V3's attention_bias biases other "
                        "projections)")
    return problems


def moe_config_dict(cfg, arch: str, llama: dict[str, Any]) -> dict[str, Any]:
    """The transformers ``config.json`` of an MoE ``cfg``, built on the Llama dict
    ``llama`` (:func:`jmegatron.conversion.hf.hf_config_dict`'s, which has the attention, RoPE,
    norm and vocabulary entries)."""
    keep = ("architectures", "vocab_size", "initializer_range", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id", "use_cache", "dtype", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
            "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "attention_dropout")
    conf = {k: llama[k] for k in keep}
    conf["architectures"] = [arch]
    if arch == DEEPSEEK_V3:
        pattern = moe_layers(cfg)
        return {"model_type": "deepseek_v3", **{k: v for k, v in conf.items() if k not in ("rope_theta", "rope_scaling")},
                "head_dim": int(cfg.qk_pos_emb_head_dim), "intermediate_size": int(cfg.ffn_hidden_size),
                "moe_intermediate_size": int(cfg.moe_ffn_hidden_size), "num_experts_per_tok": int(cfg.moe_router_topk),
                "n_routed_experts": int(cfg.num_moe_experts),
                "n_shared_experts": int(cfg.moe_shared_expert_intermediate_size // cfg.moe_ffn_hidden_size),
                "routed_scaling_factor": float(cfg.moe_router_topk_scaling_factor or 1.0),
                "n_group": int(cfg.moe_router_num_groups or 1), "topk_group": int(cfg.moe_router_group_topk or 1),
                "first_k_dense_replace": pattern.index(1) if 1 in pattern else len(pattern), "norm_topk_prob": True,
                "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": int(cfg.kv_lora_rank),
                "qk_nope_head_dim": int(cfg.qk_head_dim), "qk_rope_head_dim": int(cfg.qk_pos_emb_head_dim),
                "v_head_dim": int(cfg.v_head_dim), "rope_interleave": True, "attention_bias": False,
                "num_nextn_predict_layers": int(cfg.mtp_num_layers or 0), "pretraining_tp": 1}
    conf.update(num_experts_per_tok=int(cfg.moe_router_topk), router_aux_loss_coef=float(cfg.moe_aux_loss_coeff),
                output_router_logits=False)
    if arch == GPT_OSS:
        pattern = window_layer_pattern(cfg.window_size, cfg.window_attn_skip_freq, cfg.num_layers)
        windowed = cfg.window_size is not None
        return {"model_type": "gpt_oss", **conf, "intermediate_size": int(cfg.moe_ffn_hidden_size),
                "num_local_experts": int(cfg.num_moe_experts), "attention_bias": True,
                "sliding_window": cfg.window_size[0] + 1 if windowed else None,
                "layer_types": ["sliding_attention" if windowed and w else "full_attention" for w in pattern]}
    if arch == MIXTRAL:
        return {"model_type": "mixtral", **conf, "intermediate_size": int(cfg.moe_ffn_hidden_size),
                "num_local_experts": int(cfg.num_moe_experts), "router_jitter_noise": 0.0,
                "sliding_window": None}
    dense = [i for i, moe in enumerate(moe_layers(cfg)) if not moe]
    qwen = {**conf, "intermediate_size": int(cfg.ffn_hidden_size), "moe_intermediate_size": int(cfg.moe_ffn_hidden_size),
            "num_experts": int(cfg.num_moe_experts), "norm_topk_prob": not cfg.moe_router_pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": dense, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": int(cfg.num_layers), "layer_types": ["full_attention"] * int(cfg.num_layers)}
    if arch == QWEN3_MOE:
        return {"model_type": "qwen3_moe", **qwen, "attention_bias": False}
    if arch == OLMOE:
        return {"model_type": "olmoe", **conf, "intermediate_size": int(cfg.moe_ffn_hidden_size),
                "num_experts": int(cfg.num_moe_experts), "norm_topk_prob": not cfg.moe_router_pre_softmax,
                "attention_bias": False, "clip_qkv": None}
    return {"model_type": "qwen2_moe", **qwen,
            "shared_expert_intermediate_size": int(cfg.moe_shared_expert_intermediate_size),
            "qkv_bias": bool(cfg.add_qkv_bias)}


def moe_config_fields(conf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """jmegatron fields of a ``mixtral`` / ``qwen2_moe`` / ``qwen3_moe`` ``config.json`` (the
    attention, RoPE and norm fields are the caller's, read as Llama's / Qwen3's); appends what
    jmegatron cannot represent to ``problems``."""
    model_type = conf["model_type"]
    layers = int(conf["num_hidden_layers"])
    if model_type == "deepseek_v3":
        return _deepseek_fields(conf, problems)
    if model_type == "gpt_oss":
        return _gpt_oss_fields(conf, problems)
    if model_type == "olmoe":  # the attention's QK-norm over all heads is the caller's
        if conf.get("clip_qkv") is not None:
            problems.append(f"clip_qkv={conf['clip_qkv']} (OLMoE's clamp of q, k and v: not built)")
        if conf.get("attention_bias"):
            problems.append("attention_bias=True (OLMoE's biases on q/k/v and o_proj: not built)")
        ffn = int(conf["intermediate_size"])
        return dict(num_moe_experts=int(conf["num_experts"]), moe_router_topk=int(conf["num_experts_per_tok"]),
                    ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, moe_layer_freq=1,
                    moe_router_pre_softmax=not bool(conf.get("norm_topk_prob", False)),
                    moe_router_load_balancing_type="aux_loss",
                    moe_aux_loss_coeff=float(conf.get("router_aux_loss_coef", 0.0)),
                    moe_router_score_function="softmax", add_bias_linear=False, add_qkv_bias=False)
    fields: dict[str, Any] = dict(moe_router_topk=int(conf["num_experts_per_tok"]),
                                  moe_router_load_balancing_type="aux_loss",
                                  moe_aux_loss_coeff=float(conf.get("router_aux_loss_coef", 0.0)),
                                  moe_router_score_function="softmax", add_bias_linear=False)
    if model_type == "mixtral":
        if conf.get("router_jitter_noise"):
            problems.append(f"router_jitter_noise={conf['router_jitter_noise']} (Mixtral's training-time input "
                            f"jitter: not built)")
        ffn = int(conf["intermediate_size"])
        fields.update(num_moe_experts=int(conf["num_local_experts"]), ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
                      moe_layer_freq=1, moe_router_pre_softmax=False, add_qkv_bias=False)
        return fields
    experts = int(conf.get("num_experts") or conf.get("num_local_experts") or 0)  # (transformers 5: the latter)
    if experts <= 0:
        problems.append(f"num_experts={experts} (a dense {MODEL_TYPES[model_type]}; import it as a Llama-style "
                        f"model instead)")
    step, dense = int(conf.get("decoder_sparse_step", 1)), set(conf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    fields.update(num_moe_experts=experts, ffn_hidden_size=int(conf["intermediate_size"]),
                  moe_ffn_hidden_size=int(conf["moe_intermediate_size"]),
                  moe_layer_freq=1 if all(pattern) else tuple(pattern),
                  moe_router_pre_softmax=not bool(conf.get("norm_topk_prob", False)))
    if model_type == "qwen3_moe":
        if conf.get("attention_bias"):
            problems.append("attention_bias=True (Qwen3-MoE's biases on q/k/v and o_proj: not built)")
        fields.update(add_qkv_bias=False)
        return fields
    shared = int(conf.get("shared_expert_intermediate_size") or 0)
    if shared <= 0:
        problems.append(f"shared_expert_intermediate_size={shared} (a Qwen2-MoE layer always adds its shared "
                        f"expert; without one it is Qwen3-MoE's or Mixtral's layout)")
    fields.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True,
                  add_qkv_bias=bool(conf.get("qkv_bias", True)))
    return fields


def _gpt_oss_fields(conf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """jmegatron's MoE, MLP-activation and attention-sink fields of a ``gpt_oss``
    ``config.json`` (see :func:`moe_config_fields`; the attention, RoPE, windows and norm
    fields are the caller's)."""
    if not conf.get("attention_bias", True):
        problems.append("attention_bias=False (jmegatron's add_bias_linear biases q/k/v/o together with the "
                        "experts and the router, which gpt-oss always biases)")
    # OpenAI's own config.json names beside transformers': the same values or refused
    limit = conf.get("swiglu_limit", GPT_OSS_CLAMP_VALUE)
    if float(limit) != GPT_OSS_CLAMP_VALUE:
        problems.append(f"swiglu_limit={limit} (transformers' GptOssExperts clamps at {GPT_OSS_CLAMP_VALUE} whatever "
                        f"the config says; jmegatron follows it)")
    if conf.get("experts_per_token", conf["num_experts_per_tok"]) != conf["num_experts_per_tok"]:
        problems.append(f"experts_per_token={conf['experts_per_token']} != num_experts_per_tok="
                        f"{conf['num_experts_per_tok']} (transformers routes by num_experts_per_tok)")
    rope = {**(conf.get("rope_parameters") or {}), **(conf.get("rope_scaling") or {})}
    initial = conf.get("initial_context_length")
    if initial is not None and rope.get("original_max_position_embeddings", initial) != initial:
        problems.append(f"initial_context_length={initial} != the RoPE's original_max_position_embeddings="
                        f"{rope['original_max_position_embeddings']} (YaRN scales from the latter)")
    ffn = int(conf["intermediate_size"])
    return dict(num_moe_experts=int(conf["num_local_experts"]), moe_router_topk=int(conf["num_experts_per_tok"]),
                ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, moe_layer_freq=1, moe_router_pre_softmax=False,
                moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=float(conf.get("router_aux_loss_coef", 0.0)), add_bias_linear=True,
                add_qkv_bias=False, swiglu=False, quick_geglu=True, glu_linear_offset=GPT_OSS_GLU_LINEAR_OFFSET,
                activation_func_clamp_value=GPT_OSS_CLAMP_VALUE, softmax_type="learnable")


def _deepseek_fields(conf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """jmegatron's MLA and MoE fields of a ``deepseek_v3`` ``config.json`` (see
    :func:`moe_config_fields`); the import refusals name the HF field."""
    layers, heads = int(conf["num_hidden_layers"]), int(conf["num_attention_heads"])
    k, groups, group_topk = int(conf["num_experts_per_tok"]), int(conf.get("n_group") or 1), \
        int(conf.get("topk_group") or 1)
    if conf.get("num_key_value_heads") not in (None, heads):
        problems.append(f"num_key_value_heads={conf['num_key_value_heads']} != num_attention_heads={heads} "
                        f"(MLA has one key/value head per query head)")
    if conf.get("attention_bias"):
        problems.append("attention_bias=True (biases on q_a_proj / kv_a_proj_with_mqa / o_proj: not built)")
    if not conf.get("rope_interleave", True):
        problems.append("rope_interleave=False (jmegatron's MLA RoPE is Megatron's interleaved layout)")
    if not conf.get("norm_topk_prob", True) and k > 1:
        problems.append("norm_topk_prob=False (Megatron normalises the top-k sigmoid weights)")
    if k == 1:
        problems.append("num_experts_per_tok=1 (transformers weights the one expert by the scaling factor alone)")
    if float(conf.get("rms_norm_eps", 1e-6)) != 1e-6:
        problems.append(f"rms_norm_eps={conf.get('rms_norm_eps')} (the latent norms' epsilon is 1e-6 in "
                        f"transformers; jmegatron's norms share one)")
    if groups > 1 and k // group_topk != DEEPSEEK_GROUP_TOP and group_topk < groups:
        problems.append(f"num_experts_per_tok={k} // topk_group={group_topk} != {DEEPSEEK_GROUP_TOP} (transformers "
                        f"scores a group by its top {DEEPSEEK_GROUP_TOP} experts, Megatron by its top topk // "
                        f"group_topk)")
    shared = int(conf.get("n_shared_experts") or 0)
    if shared <= 0:
        problems.append(f"n_shared_experts={shared} (not built without a shared expert)")
    conf.get("num_nextn_predict_layers")  # the MTP depth: the folder's tensors decide (checkpoint.hf)
    nope, rope = int(conf["qk_nope_head_dim"]), int(conf["qk_rope_head_dim"])
    if conf.get("qk_head_dim") not in (None, nope + rope):
        problems.append(f"qk_head_dim={conf['qk_head_dim']} != qk_nope_head_dim + qk_rope_head_dim = {nope + rope}")
    first = int(conf.get("first_k_dense_replace") or 0)
    pattern = (0,) * min(first, layers) + (1,) * max(layers - first, 0)
    f = int(conf["moe_intermediate_size"])
    return dict(num_moe_experts=int(conf["n_routed_experts"]), moe_router_topk=k, ffn_hidden_size=int(
        conf["intermediate_size"]), moe_ffn_hidden_size=f, moe_layer_freq=1 if all(pattern) else pattern,
        moe_shared_expert_intermediate_size=shared * f, moe_shared_expert_gate=False,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=float(conf.get("routed_scaling_factor") or 1.0),
        moe_router_num_groups=groups if group_topk < groups else None,
        moe_router_group_topk=group_topk if group_topk < groups else None,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, add_bias_linear=False,
        add_qkv_bias=False, multi_latent_attention=True, q_lora_rank=conf.get("q_lora_rank"),
        kv_lora_rank=int(conf["kv_lora_rank"]), qk_head_dim=int(conf["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(conf["qk_rope_head_dim"]), v_head_dim=int(conf["v_head_dim"]), qk_layernorm=True)


# ------------------------------------------------------------------------ state dicts
def _moe_prefix(arch: str, i: int) -> str:
    return f"model.layers.{i}." + ("block_sparse_moe" if arch == MIXTRAL else "mlp")


def _shared_prefix(arch: str) -> str:
    return "shared_experts" if arch == DEEPSEEK_V3 else "shared_expert"


def _expert_names(arch: str) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if arch == MIXTRAL else ("gate_proj", "up_proj", "down_proj")


def mlp_to_hf(mlp: Mapping, cfg, arch: str, i: int, check: Callable) -> dict[str, np.ndarray]:
    """HF tensors of layer ``i``'s MoE MLP (``mlp``: the layer's ``mlp`` params subtree);
    ``check(name, array, shape)`` raises ValueError for a wrong shape."""
    h, f, e = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
    L, o = f"decoder_layers_{i}/mlp", _moe_prefix(arch, i)
    if arch == GPT_OSS:
        return _gpt_oss_mlp_to_hf(mlp, cfg, i, check)
    try:
        router = check(f"{L}/router/kernel", mlp["router"]["kernel"], (h, e))
        fc1 = check(f"{L}/experts/linear_fc1/kernel", mlp["experts"]["linear_fc1"]["kernel"], (e, h, 2, f))
        fc2 = check(f"{L}/experts/linear_fc2/kernel", mlp["experts"]["linear_fc2"]["kernel"], (e, f, h))
    except KeyError as err:
        raise ValueError(f"params have no {L}/{err.args[0]}...: layer {i} is not an MoE layer of this config "
                         f"(num_moe_experts={e}, moe_layer_freq={cfg.moe_layer_freq!r})") from None
    gate, up, down = _expert_names(arch)
    sd = {f"{o}.gate.weight": router.T}
    if arch == DEEPSEEK_V3:  # zeros for a model trained without the bias
        sd[f"{o}.gate.e_score_correction_bias"] = np.asarray(
            mlp["router"].get("expert_bias", np.zeros((e,), np.float32)), np.float32)
    for x in range(e):
        sd[f"{o}.experts.{x}.{gate}.weight"] = fc1[x, :, 0, :].T
        sd[f"{o}.experts.{x}.{up}.weight"] = fc1[x, :, 1, :].T
        sd[f"{o}.experts.{x}.{down}.weight"] = fc2[x].T
    if arch in (QWEN2_MOE, DEEPSEEK_V3):
        fs, shared = cfg.moe_shared_expert_intermediate_size, f"{o}.{_shared_prefix(arch)}"
        s1 = check(f"{L}/shared_experts/linear_fc1/kernel", mlp["shared_experts"]["linear_fc1"]["kernel"], (h, 2, fs))
        s2 = check(f"{L}/shared_experts/linear_fc2/kernel", mlp["shared_experts"]["linear_fc2"]["kernel"], (fs, h))
        sd[f"{shared}.gate_proj.weight"] = s1[:, 0, :].T
        sd[f"{shared}.up_proj.weight"] = s1[:, 1, :].T
        if arch == DEEPSEEK_V3:  # ungated
            sd[f"{shared}.down_proj.weight"] = s2.T
    if arch == QWEN2_MOE:
        if cfg.moe_shared_expert_gate:
            sd[f"{o}.shared_expert.down_proj.weight"] = s2.T
            sd[f"{o}.shared_expert_gate.weight"] = check(
                f"{L}/shared_expert_gate/gate/kernel", mlp["shared_expert_gate"]["gate"]["kernel"], (h, 1)).T
        else:  # no gate here: a zero gate and down_proj x 2, since sigmoid(0) = 1/2
            sd[f"{o}.shared_expert.down_proj.weight"] = 2 * s2.T
            sd[f"{o}.shared_expert_gate.weight"] = np.zeros((1, h), s2.dtype)
    return {k: np.array(v, order="C", copy=True) for k, v in sd.items()}


def _gpt_oss_mlp_to_hf(mlp: Mapping, cfg, i: int, check: Callable) -> dict[str, np.ndarray]:
    """gpt-oss's router and fused experts of layer ``i`` (the module doc's table)."""
    h, f, e = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
    L, o = f"decoder_layers_{i}/mlp", f"model.layers.{i}.mlp"
    try:
        router, fc1, fc2 = mlp["router"], mlp["experts"]["linear_fc1"], mlp["experts"]["linear_fc2"]
        sd = {f"{o}.router.weight": check(f"{L}/router/kernel", router["kernel"], (h, e)).T,
              f"{o}.router.bias": check(f"{L}/router/bias", router["bias"], (e,)),
              f"{o}.experts.gate_up_proj": np.swapaxes(
                  check(f"{L}/experts/linear_fc1/kernel", fc1["kernel"], (e, h, 2, f)), 2, 3).reshape(e, h, 2 * f),
              f"{o}.experts.gate_up_proj_bias": np.swapaxes(
                  check(f"{L}/experts/linear_fc1/bias", fc1["bias"], (e, 2, f)), 1, 2).reshape(e, 2 * f),
              f"{o}.experts.down_proj": check(f"{L}/experts/linear_fc2/kernel", fc2["kernel"], (e, f, h)),
              f"{o}.experts.down_proj_bias": check(f"{L}/experts/linear_fc2/bias", fc2["bias"], (e, h))}
    except KeyError as err:
        raise ValueError(f"params have no {L}/.../{err.args[0]}: layer {i} is not a gpt-oss MoE layer of this config "
                         f"(num_moe_experts={e}, add_bias_linear={cfg.add_bias_linear})") from None
    return {k: np.array(v, order="C", copy=True) for k, v in sd.items()}


def _gpt_oss_mlp_from_hf(t: Callable, cfg, i: int) -> dict:
    """The inverse of :func:`_gpt_oss_mlp_to_hf`."""
    h, f, e = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
    o = f"model.layers.{i}.mlp"
    fc1 = np.swapaxes(t(f"{o}.experts.gate_up_proj", (e, h, 2 * f)).reshape(e, h, f, 2), 2, 3)
    fc1_bias = np.swapaxes(t(f"{o}.experts.gate_up_proj_bias", (e, 2 * f)).reshape(e, f, 2), 1, 2)
    return {"router": {"kernel": t(f"{o}.router.weight", (e, h)).T, "bias": t(f"{o}.router.bias", (e,))},
            "experts": {"linear_fc1": {"kernel": fc1, "bias": fc1_bias},
                        "linear_fc2": {"kernel": t(f"{o}.experts.down_proj", (e, f, h)),
                                       "bias": t(f"{o}.experts.down_proj_bias", (e, h))}}}


def mlp_from_hf(t: Callable, cfg, arch: str, i: int) -> dict:
    """jmegatron ``mlp`` subtree of MoE layer ``i`` from HF tensors; ``t(key, shape)``
    returns the float32 tensor (raising ValueError if missing or misshapen). Raises
    ValueError for a non-zero Qwen2-MoE ``shared_expert_gate``."""
    if arch == GPT_OSS:
        return _gpt_oss_mlp_from_hf(t, cfg, i)
    h, f, e = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
    o = _moe_prefix(arch, i)
    gate, up, down = _expert_names(arch)
    fc1 = np.stack([np.stack([t(f"{o}.experts.{x}.{gate}.weight", (f, h)).T,
                              t(f"{o}.experts.{x}.{up}.weight", (f, h)).T], axis=1) for x in range(e)])
    fc2 = np.stack([t(f"{o}.experts.{x}.{down}.weight", (h, f)).T for x in range(e)])
    mlp = {"router": {"kernel": t(f"{o}.gate.weight", (e, h)).T},
           "experts": {"linear_fc1": {"kernel": fc1}, "linear_fc2": {"kernel": fc2}}}
    if arch == DEEPSEEK_V3:
        mlp["router"]["expert_bias"] = t(f"{o}.gate.e_score_correction_bias", (e,))
        mlp["shared_experts"] = _shared_from_hf(t, cfg, f"{o}.shared_experts")
    if arch == QWEN2_MOE:
        g = t(f"{o}.shared_expert_gate.weight", (1, h))
        if cfg.moe_shared_expert_gate:
            mlp["shared_expert_gate"] = {"gate": {"kernel": np.ascontiguousarray(g.T)}}
        elif np.any(g):
            raise ValueError(
                f"{o}.shared_expert_gate.weight is not zero but config.moe_shared_expert_gate=False: Qwen2-MoE "
                f"scales the shared expert by sigmoid(x W_g); set moe_shared_expert_gate=True (the import "
                f"from a config.json does)")
        # without the gate, the export doubled down_proj (sigmoid(0) = 1/2)
        mlp["shared_experts"] = _shared_from_hf(t, cfg, f"{o}.shared_expert",
                                                down_scale=1.0 if cfg.moe_shared_expert_gate else 0.5)
    return mlp


def _shared_from_hf(t: Callable, cfg, prefix: str, down_scale: float = 1.0) -> dict:
    """The ``shared_experts`` subtree from the SwiGLU ``{gate,up,down}_proj`` under ``prefix``
    (``t(key, shape)``: a float32 HF tensor); ``down_proj`` times ``down_scale``."""
    h, fs = cfg.hidden_size, cfg.moe_shared_expert_intermediate_size
    return {"linear_fc1": {"kernel": np.stack([t(f"{prefix}.gate_proj.weight", (fs, h)).T,
                                               t(f"{prefix}.up_proj.weight", (fs, h)).T], axis=1)},
            "linear_fc2": {"kernel": t(f"{prefix}.down_proj.weight", (h, fs)).T * np.float32(down_scale)}}


def from_module_layout(sd: Mapping[str, Any], arch: str, to_numpy: Callable) -> dict:
    """A transformers-5 in-memory state dict (fused ``experts.gate_up_proj`` /
    ``experts.down_proj``, Mixtral's router under ``mlp.gate``) -> checkpoint keys; other
    keys pass through. Checkpoint-layout input comes back unchanged, and so does gpt-oss's
    (its checkpoint keeps the experts fused)."""
    if arch == GPT_OSS:
        return dict(sd)
    out: dict[str, Any] = {}
    gate, up, down = _expert_names(arch)
    for key, value in sd.items():
        m = _FUSED.match(key)
        if m is None:
            if arch == MIXTRAL and re.match(r"^model\.layers\.\d+\.mlp\.gate\.weight$", key):
                key = key.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[key] = value
            continue
        layer, name = m.groups()
        o = layer + (".block_sparse_moe" if arch == MIXTRAL else ".mlp")
        a = to_numpy(value)
        for x in range(a.shape[0]):
            if name == "gate_up_proj":
                f = a.shape[1] // 2
                out[f"{o}.experts.{x}.{gate}.weight"] = a[x, :f]
                out[f"{o}.experts.{x}.{up}.weight"] = a[x, f:]
            else:
                out[f"{o}.experts.{x}.{down}.weight"] = a[x]
    return out


def to_module_layout(sd: Mapping[str, np.ndarray], arch: str, module_keys: set) -> dict:
    """Checkpoint keys -> the keys of a transformers model whose ``state_dict()`` has
    ``module_keys`` (transformers 5 fuses the experts; 4.x keeps them per expert, in which
    case ``sd`` is returned unchanged, as for gpt-oss, whose checkpoint is fused too)."""
    if arch == GPT_OSS or not any(_FUSED.match(k) for k in module_keys):
        return dict(sd)
    gate, up, down = _expert_names(arch)
    out, experts = {}, {}
    pat = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
    for key, value in sd.items():
        m = pat.match(key)
        if m is None:
            out[key.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = value
            continue
        layer, x, name = m.group(1), int(m.group(2)), m.group(3)
        experts.setdefault(layer, {}).setdefault(x, {})[name] = value
    for layer, by_expert in experts.items():
        order = sorted(by_expert)
        out[f"{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([by_expert[x][gate], by_expert[x][up]], axis=0) for x in order])
        out[f"{layer}.mlp.experts.down_proj"] = np.stack([by_expert[x][down] for x in order])
    return out
