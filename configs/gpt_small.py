"""GPT-2-style small model for CPU speed work: 8 layers x 512 hidden, 8 heads,
FFN 2048, vocab 16384, seq 512, micro-batch 4.

    python benchmarks/compare_torch.py --config configs/gpt_small.py
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = get_config_of(os.path.join(HERE, "gpt_tiny.py"))
    c.num_layers = 8
    c.hidden_size = 512
    c.ffn_hidden_size = 2048
    c.num_attention_heads = 8
    c.seq_length = 512
    c.max_position_embeddings = 512
    c.vocab_size = 16384
    c.micro_batch_size = 4
    c.global_batch_size = 4
    return c
