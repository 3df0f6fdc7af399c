"""Gemma-3-4B (Gemma Team 2025, arXiv:2503.19786), the text model, a reference config for
FLOPs and memory reports (``python -m jmegatron.tools.model_report``); it is not trained here
(mock_data=True so it validates without data).

Architecture (family preset "gemma3"), from Megatron-Bridge's Gemma-3 provider and
transformers' Gemma3TextConfig defaults (the Hub's config.json is not read here): 34 layers,
hidden 2560, GeGLU ffn 10240, 8 heads of 256 (kv_channels 256, decoupled from hidden / heads),
4 KV groups, query_pre_attn_scalar 256 (= kv_channels: the default softmax_scale), five local
layers with a 1024-key sliding window per global layer, the global RoPE (base 1e6) scaled
linearly by 8 for its 131072-token context, vocabulary 262208 (262144 SentencePiece pieces
plus image tokens; a multiple of 64 but not of 128, so the embedding pads to 262272), tied
output. The optimizer and schedule are not published; configs/llama2_7b.py's recipe stands in.
"""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama2_7b.py")),
                   "gemma3")
    c.num_layers = 34
    c.hidden_size = 2560
    c.ffn_hidden_size = 10240
    c.num_attention_heads = 8
    c.num_query_groups = 4
    c.kv_channels = 256
    c.window_size = (1023, 0)
    c.rotary_seq_len_interpolation_factor = 8.0
    c.seq_length = 4096
    c.max_position_embeddings = 131072
    c.vocab_size = 262208
    return c
