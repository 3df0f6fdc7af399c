"""Qwen3-style tiny model: llama_tiny's sizes and training recipe with the Qwen3 architecture
(QK-norm before RoPE, no biases, RoPE base 1e6, RMSNorm eps 1e-6) and a head dimension of 64
decoupled from hidden / heads (256 / 8 = 32), as Qwen3's 128 is."""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_tiny.py")), "qwen3")
    c.kv_channels = 64
    return c
