"""Qwen3-30B-A3B (Qwen Team 2025, arXiv:2505.09388), a reference config for FLOPs and memory
reports (``python -m jmegatron.tools.model_report``); it is not trained here (mock_data=True so
it validates without data).

Architecture from the Hugging Face config.json of Qwen/Qwen3-30B-A3B (family preset
"qwen3_moe": Qwen3's QK-norm attention, 128 experts, top-8 routing renormalised over the chosen
experts, no shared expert): 48 layers, hidden 2048, 32 heads of 128 (kv_channels 128), 4 KV
groups, every MLP an MoE layer of experts with FFN 768, untied output, vocabulary 151936,
40960 positions, sequences of 4096. The optimizer and schedule are not published;
configs/llama2_7b.py's recipe (AdamW 0.9 / 0.95, cosine, 4M-token batches) stands in.
"""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama2_7b.py")),
                   "qwen3_moe")
    c.num_layers = 48
    c.hidden_size = 2048
    c.ffn_hidden_size = 6144  # config.json's dense width (unused: every layer is an MoE layer)
    c.moe_ffn_hidden_size = 768
    c.num_attention_heads = 32
    c.num_query_groups = 4
    c.kv_channels = 128
    c.seq_length = 4096
    c.max_position_embeddings = 40960
    c.vocab_size = 151936
    return c
