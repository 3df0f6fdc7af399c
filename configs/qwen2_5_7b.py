"""Qwen2.5-7B (Qwen Team 2024, arXiv:2412.15115), a reference config for FLOPs and memory
reports (``python -m jmegatron.tools.model_report``); it is not trained here (mock_data=True so
it validates without data).

Architecture from the Hugging Face config.json of Qwen/Qwen2.5-7B (family preset "qwen2":
Q/K/V biases and no other bias, RoPE base 1e6, RMSNorm eps 1e-6): 28 layers, hidden 3584, ffn
18944, 28 heads of 128, 4 KV groups, untied output, vocabulary 152064 (a multiple of 128),
32768 positions, sequences of 4096. The optimizer and schedule are not published;
configs/llama2_7b.py's recipe (AdamW 0.9 / 0.95, cosine, 4M-token batches) stands in.
"""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama2_7b.py")),
                   "qwen2")
    c.num_layers = 28
    c.hidden_size = 3584
    c.ffn_hidden_size = 18944
    c.num_attention_heads = 28
    c.num_query_groups = 4
    c.seq_length = 4096
    c.max_position_embeddings = 32768
    c.vocab_size = 152064
    return c
