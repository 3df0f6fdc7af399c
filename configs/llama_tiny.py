"""Llama-style tiny model: gpt_tiny's sizes and training recipe with the Llama architecture
(RoPE, RMSNorm, SwiGLU, no biases, untied output, no dropout) and grouped-query attention."""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_tiny.py")), "llama")
    c.ffn_hidden_size = 688  # ~ 8/3 * hidden, as Llama
    c.num_attention_heads = 8
    c.num_query_groups = 2
    return c
