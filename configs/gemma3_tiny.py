"""Gemma-3-style tiny model: llama_tiny's sizes and training recipe with the Gemma-3
architecture (sandwich norms with Gemma's 1 + w RMSNorm, GeGLU, embeddings scaled by
sqrt(hidden), QK-norm, a tied output) and its attention pattern scaled down: five local layers
per global one over 6 layers, a 64-key sliding window on the 256-token sequences trained here,
RoPE base 1e6 for the global layers and 10000 for the local ones, and a score scale
(query_pre_attn_scalar 128) that is not 1 / sqrt(kv_channels)."""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_tiny.py")), "gemma3")
    c.num_layers = 6
    c.kv_channels = 64
    c.window_size = (63, 0)
    c.softmax_scale = 128 ** -0.5  # query_pre_attn_scalar 128 on 64-wide heads
    return c
