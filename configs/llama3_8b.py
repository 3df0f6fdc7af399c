"""Llama-3.1-8B (Grattafiori et al. 2024, arXiv:2407.21783), a reference config for FLOPs and
memory reports (``python -m jmegatron.tools.model_report``); it is not trained here
(mock_data=True so it validates without data).

Architecture from the Hugging Face config.json of meta-llama/Llama-3.1-8B (family preset
"llama3": RoPE base 500000 with the Llama-3.1 scaling, factor 8 over an 8192-token original
context): 32 layers, hidden 4096, ffn 14336, 32 heads, 8 KV groups (head dim 128), RMSNorm eps
1e-5, untied output, vocabulary 128256 (a multiple of 128: unpadded), 131072 positions, trained
on 8192-token sequences. The 8B model's optimizer settings are not published in full;
configs/llama2_7b.py's recipe stands in, with 512 x 8192 = 4M-token batches as there.
"""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama2_7b.py")),
                   "llama3")
    c.num_layers = 32
    c.hidden_size = 4096
    c.ffn_hidden_size = 14336
    c.num_attention_heads = 32
    c.num_query_groups = 8
    c.seq_length = 8192
    c.max_position_embeddings = 131072
    c.vocab_size = 128256  # the Llama 3 tiktoken-based tokenizer
    c.global_batch_size = 512
    return c
