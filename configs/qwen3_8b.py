"""Qwen3-8B (Qwen Team 2025, arXiv:2505.09388), a reference config for FLOPs and memory
reports (``python -m jmegatron.tools.model_report``); it is not trained here (mock_data=True so
it validates without data).

Architecture from the Hugging Face config.json of Qwen/Qwen3-8B (family preset "qwen3":
QK-norm, no biases, RoPE base 1e6, RMSNorm eps 1e-6): 36 layers, hidden 4096, ffn 12288, 32
heads of 128 (kv_channels 128, decoupled from hidden / heads), 8 KV groups, untied output,
vocabulary 151936 (a multiple of 128), 40960 positions, trained on
4096-token sequences before long-context extension. The optimizer and schedule are not
published; configs/llama2_7b.py's recipe (AdamW 0.9 / 0.95, cosine, 4M-token batches) stands in.
"""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama2_7b.py")),
                   "qwen3")
    c.num_layers = 36
    c.hidden_size = 4096
    c.ffn_hidden_size = 12288
    c.num_attention_heads = 32
    c.num_query_groups = 8
    c.kv_channels = 128
    c.seq_length = 4096
    c.max_position_embeddings = 40960
    c.vocab_size = 151936  # Qwen's byte-level BPE (151643 tokens + special tokens)
    return c
