"""A larger GPT (6 layers x 384, 6 heads) trained first as the teacher of
configs/distill_gpt_tiny.py; same tokenizer, sequence length and data as gpt_tiny."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("gpt_tiny", os.path.join(os.path.dirname(__file__), "gpt_tiny.py"))
_gpt_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt_tiny)


def get_config():
    c = _gpt_tiny.get_config()
    c.num_layers = 6
    c.hidden_size = 384
    c.ffn_hidden_size = 1536
    c.num_attention_heads = 6
    return c
