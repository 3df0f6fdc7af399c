"""Llama-style tiny model: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output."""

from jmegatron.config import base_config


def get_config():
    c = base_config()
    c.num_layers = 4
    c.hidden_size = 256
    c.ffn_hidden_size = 688  # ~ 8/3 * hidden, as Llama
    c.num_attention_heads = 8
    c.num_query_groups = 2
    c.seq_length = 256
    c.max_position_embeddings = 256
    c.position_embedding_type = "rope"
    c.rotary_base = 10000
    c.normalization = "RMSNorm"
    c.norm_epsilon = 1e-5
    c.swiglu = True
    c.untie_embeddings_and_output_weights = True
    c.add_bias_linear = False
    c.hidden_dropout = 0.0
    c.attention_dropout = 0.0
    c.micro_batch_size = 8
    c.global_batch_size = 8
    c.lr = 1e-3
    c.min_lr = 1e-4
    c.lr_warmup_iters = 50
    c.lr_decay_style = "cosine"
    c.weight_decay = 0.1
    c.adam_beta2 = 0.95
    c.train_iters = 500
    c.eval_interval = 100
    c.save_interval = 250
    c.split = "90,5,5"  # 42 plays, one document each: 38 train, 2 valid, 2 test
    return c
