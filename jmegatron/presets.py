"""Model-family presets: the architecture fields a family fixes, under Megatron's names.

A config names its family and sets only its sizes (layers, hidden, heads, FFN, vocabulary,
sequence) and training fields::

    from jmegatron.config import base_config

    def get_config():
        c = base_config("llama")
        c.num_layers = 32
        ...

The idea is MaxText's ``configs/models/*.yml`` (a model names its ``decoder_block`` and gives
its dimensions) and the per-model argument sets of Megatron-LM's examples and
``docs/llama_mistral.md``. A preset only sets existing :class:`jmegatron.config.JMegatronConfig`
fields, so a resolved config (a checkpoint's config.json) has the same fields whichever
way it was written; the family's name is not stored.

Adding a family: one entry in :data:`FAMILIES` (built from another family's dict where it
extends one, as ``mixtral`` extends ``llama``); a field the family needs that the config
lacks is added to ``JMegatronConfig`` first. tests/test_config.py checks that every preset
validates and names only config fields.

This module imports nothing from jmegatron (``jmegatron.config`` imports it).
"""

from typing import Any

# GPT-2 / GPT-3 (Radford et al. 2019; Megatron-LM's defaults and its examples/gpt3 scripts):
# learned absolute positions, pre-LayerNorm (eps 1e-5), GELU MLP, biases on every linear
# layer, output layer tied to the word embeddings, dropout 0.1.
GPT2: dict[str, Any] = dict(
    position_embedding_type="learned_absolute",
    normalization="LayerNorm",
    norm_epsilon=1e-5,
    swiglu=False,
    untie_embeddings_and_output_weights=False,
    add_bias_linear=True,
    add_qkv_bias=False,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)

# Llama 2 (Touvron et al. 2023; Megatron-LM docs/llama_mistral.md: --use-rotary-position-embeddings
# --no-position-embedding --normalization RMSNorm --swiglu --disable-bias-linear
# --untie-embeddings-and-output-weights): RoPE (base 10000), RMSNorm (eps 1e-5), SwiGLU MLP,
# no biases, an untied output layer, no dropout (GPT-2's fields with those flags). Grouped-query
# attention is a size (num_query_groups), set by each config.
LLAMA: dict[str, Any] = dict(
    GPT2,
    position_embedding_type="rope", rotary_base=10000,
    normalization="RMSNorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
    hidden_dropout=0.0, attention_dropout=0.0,
)

# Mixtral (Jiang et al. 2024, arXiv:2401.04088; Megatron-LM megatron/core/transformer/moe/README.md
# "Mixtral 8x7B": --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
# --moe-aux-loss-coeff 1e-2): Llama's blocks with every MLP a mixture of 8 SwiGLU experts,
# top-2 softmax routing and the Switch load-balancing loss. The experts' FFN
# (moe_ffn_hidden_size), RoPE base and the dispatcher are per model.
MIXTRAL: dict[str, Any] = dict(LLAMA, num_moe_experts=8, moe_router_topk=2,
                               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)

# Llama 3.x (Grattafiori et al. 2024, arXiv:2407.21783; Hugging Face Llama-3.1 config.json):
# Llama's blocks with RoPE base 500000 and the Llama-3.1 frequency scaling (megatron-core's
# rope_scaling, factor 8 over an 8192-token original context; Llama-3.2 uses factor 32).
LLAMA3: dict[str, Any] = dict(
    LLAMA,
    rotary_base=500000,
    rope_scaling=True,
    rope_scaling_factor=8.0,
    rope_scaling_low_freq_factor=1.0,
    rope_scaling_high_freq_factor=4.0,
    rope_scaling_original_max_position_embeddings=8192,
)

# Mistral 7B v0.3 (Jiang et al. 2023, arXiv:2310.06825; v0.2+ drop the sliding window):
# Llama's blocks with RoPE base 1e6.
MISTRAL: dict[str, Any] = dict(LLAMA, rotary_base=1000000)

# Qwen2 / Qwen2.5 (arXiv:2407.10671, 2412.15115; Megatron-Bridge's Qwen2 provider:
# add_qkv_bias, no other bias): Llama's blocks with Q/K/V biases, RoPE base 1e6, RMSNorm eps 1e-6.
QWEN2: dict[str, Any] = dict(LLAMA, add_qkv_bias=True, rotary_base=1000000, norm_epsilon=1e-6)

# Qwen3 (arXiv:2505.09388; Megatron-Bridge's Qwen3 provider: qk_layernorm, kv_channels 128):
# Llama's blocks with per-head RMSNorm on queries and keys before RoPE, no biases, RoPE base
# 1e6, eps 1e-6; the head dimension (kv_channels) is set per model, decoupled from hidden / heads.
QWEN3: dict[str, Any] = dict(LLAMA, qk_layernorm=True, rotary_base=1000000, norm_epsilon=1e-6)

# Qwen3-MoE (arXiv:2505.09388; Qwen3-30B-A3B and -235B-A22B): Qwen3's attention with every MLP
# a mixture of 128 SwiGLU experts, top-8 softmax routing renormalised over the chosen experts
# (norm_topk_prob), no shared expert, the load-balancing loss at 1e-3.
QWEN3_MOE: dict[str, Any] = dict(QWEN3, num_moe_experts=128, moe_router_topk=8,
                                 moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3)

# Gemma 2 (Gemma Team 2024, arXiv:2408.00118; transformers' Gemma2Config): Llama's fields
# with RoPE base 10000, RMSNorm (eps 1e-6) multiplying by 1 + w, the pre- and post-norms
# around attention and MLP, GeGLU with the tanh GELU, embeddings scaled by sqrt(hidden), a
# tied output layer, no biases or dropout, local (sliding 4096-key window) and global layers
# alternating from a local first layer, attention scores soft-capped at 50 and the logits
# at 30. The score scale (query_pre_attn_scalar) is per model.
GEMMA2: dict[str, Any] = dict(
    LLAMA,
    norm_epsilon=1e-6, apply_layernorm_1p=True, sandwich_norms=True,
    swiglu=False, gated_linear_unit=True, openai_gelu=True,
    scale_embeddings=True, untie_embeddings_and_output_weights=False,
    window_size=(4095, 0), window_attn_skip_freq=2,
    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
)

# Gemma 3 (Gemma Team 2025, arXiv:2503.19786; transformers' Gemma3TextConfig): Gemma 2's blocks
# with QK-norm instead of the attention soft-cap, no logit soft-cap, five local layers per
# global one, and two RoPE bases: 1e6 for the global layers (which carry any long-context
# scaling) and 10000 for the local ones. The window (512 for 1B, 1024 from 4B) is per model.
GEMMA3: dict[str, Any] = dict(
    GEMMA2,
    qk_layernorm=True,
    rotary_base=1000000,
    rotary_base_local=10000,
    window_size=(1023, 0),
    window_attn_skip_freq=6,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
)

# DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437; Megatron-LM's DeepSeek-V3 recipe and
# transformers' DeepseekV3Config): Llama's RMSNorm (eps 1e-6), SwiGLU, no biases or dropout and
# untied output, with multi-latent attention (latent norms: qk_layernorm; YaRN RoPE on the
# 64-dim rotary part), mixture-of-experts layers with one shared expert, sigmoid routing with
# the aux-loss-free expert bias, top-8 weights scaled by 2.5, group-limited to 4 of 8 groups,
# and the sequence-level balancing loss at 1e-4. The dense prefix (first_k_dense_replace),
# the ranks and the expert sizes are per model.
DEEPSEEK_V3: dict[str, Any] = dict(
    LLAMA,
    norm_epsilon=1e-6,
    position_embedding_type="yarn",
    multi_latent_attention=True,
    qk_layernorm=True,
    moe_router_topk=8,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.5,
    moe_router_num_groups=8,
    moe_router_group_topk=4,
    moe_router_dtype="fp32",
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "mixtral": MIXTRAL,
    "qwen3_moe": QWEN3_MOE,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "deepseek_v3": DEEPSEEK_V3,
}
