"""Llama-3.x-style tiny model: llama_tiny's sizes and training recipe with the Llama-3.1
RoPE (base 500000, the "llama3" frequency scaling; the original context is set to 64 tokens
so that the scaled band falls inside the 256-token sequences trained here)."""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_tiny.py")), "llama3")
    c.rope_scaling_original_max_position_embeddings = 64
    return c
