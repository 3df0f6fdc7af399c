"""GPT-2-style tiny model for this CPU: 4 layers x 256 hidden, seq 256, trains on Shakespeare.

    python -m jmegatron.train --config configs/gpt_tiny.py \
        --config.data_path=runs/demo/shakespeare_text_document \
        --config.tokenizer_model=runs/demo/tokenizer.json --config.save=runs/demo/ckpt
"""

from jmegatron.config import base_config


def get_config():
    c = base_config("gpt2")
    c.num_layers = 4
    c.hidden_size = 256
    c.ffn_hidden_size = 1024
    c.num_attention_heads = 4
    c.seq_length = 256
    c.max_position_embeddings = 256
    c.micro_batch_size = 8
    c.global_batch_size = 8
    c.lr = 1e-3
    c.min_lr = 1e-4
    c.lr_warmup_iters = 50
    c.lr_decay_style = "cosine"
    c.weight_decay = 0.1
    c.adam_beta2 = 0.95
    c.clip_grad = 1.0
    c.train_iters = 500
    c.log_interval = 10
    c.eval_interval = 100
    c.eval_iters = 10
    c.save_interval = 250
    c.split = "90,5,5"  # 42 plays, one document each: 38 train, 2 valid, 2 test
    return c
