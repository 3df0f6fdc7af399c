"""gpt-oss-120b (OpenAI 2025), a reference config for FLOPs and memory reports
(``python -m jmegatron.tools.model_report --config configs/gpt_oss_120b.py``); it is not trained
here (mock_data=True so it validates without data).

The architecture is the Hub's ``config.json`` of openai/gpt-oss-120b (:data:`CONFIG_JSON`, its
model fields as published) read by jmegatron's Hugging Face import
(:func:`jmegatron.conversion.hf.config_fields_from_hf`), so this file and ``import-hf`` agree:
36 layers alternating a 128-key sliding window and full attention, hidden 2880, 64 query heads
of 64 over 8 KV groups, attention sinks, biased q/k/v/o, YaRN x32 from 4096 positions (theta
150000), 128 experts of FFN 2880 with biases, top-4 routing (top-k then softmax, a router bias),
the clamped quick-GELU GLU, untied output, vocabulary 201088. Sequences of 4096 (the original
context). configs/llama2_7b.py's optimizer and schedule stand in (OpenAI published none).
"""

import os

from jmegatron.config import get_config_of
from jmegatron.conversion.hf import config_fields_from_hf

CONFIG_JSON = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "num_local_experts": 128, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}

# 8 GPUs of 80 GB: the experts over 8 expert ranks, the rest over 8 data ranks (ZeRO-1: see
# model_report's --zero1)
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
              expert_model_parallel_size=8)


def get_config():
    c = get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama2_7b.py"))
    for name, value in config_fields_from_hf(CONFIG_JSON).items():
        setattr(c, name, list(value) if isinstance(value, tuple) else value)
    c.seq_length = 4096
    return c
