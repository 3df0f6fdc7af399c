"""Supervised fine-tuning of gpt_tiny on packed chat conversations (jmegatron.data.sft_dataset).

    python -m jmegatron.tools.preprocess_data --input chats.jsonl --json-keys messages --apply-chat-template \
        --tokenizer-model TOKENIZER_DIR --output-prefix runs/sft/chats
    python -m jmegatron.train --config configs/sft_tiny.py --config.data_path=runs/sft/chats_messages_document \
        --config.tokenizer_model=TOKENIZER_DIR --config.save=runs/sft/ckpt [--config.load=PRETRAINED --config.finetune=True]
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = get_config_of(os.path.join(HERE, "gpt_tiny.py"))
    c.sft = True
    c.reset_attention_mask = True  # the packed conversations never attend to each other
    return c
