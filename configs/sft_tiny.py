"""Supervised fine-tuning of the gpt_tiny sizes on packed chat conversations (jmegatron.data.sft_dataset).

    python -m jmegatron.tools.preprocess_data --input chats.jsonl --json-keys messages --apply-chat-template \
        --tokenizer-model TOKENIZER_DIR --output-prefix runs/sft/chats
    python -m jmegatron.train --config configs/sft_tiny.py --config.data_path=runs/sft/chats_messages_document \
        --config.tokenizer_model=TOKENIZER_DIR --config.save=runs/sft/ckpt [--config.load=PRETRAINED --config.finetune=True]
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
    c.sft = True
    c.reset_attention_mask = True  # the packed conversations never attend to each other
    return c
