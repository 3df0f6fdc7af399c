"""Distil a gpt_tiny student from a larger jmegatron teacher on Shakespeare.

    python -m jmegatron.train --config configs/distill_gpt_tiny.py \
        --config.kd_teacher_load=TEACHER_DIR --config.kd_cfg=configs/distill.yaml \
        --config.data_path=runs/demo/shakespeare_text_document \
        --config.tokenizer_model=runs/demo/tokenizer.json --config.save=runs/distill/student
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = get_config_of(os.path.join(HERE, "gpt_tiny.py"))
    c.kd_cfg = os.path.join(HERE, "distill.yaml")
    return c
