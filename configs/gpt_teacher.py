"""A larger GPT (6 layers x 384, 6 heads) trained first as the teacher of
configs/distill_gpt_tiny.py; same tokenizer, sequence length and data as gpt_tiny."""

import os

from jmegatron.config import get_config_of


def get_config():
    c = get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_tiny.py"))
    c.num_layers = 6
    c.hidden_size = 384
    c.ffn_hidden_size = 1536
    c.num_attention_heads = 6
    return c
