"""Distil a gpt_tiny student from a larger jmegatron teacher on Shakespeare.

    python -m jmegatron.train --config configs/distill_gpt_tiny.py \
        --config.kd_teacher_load=TEACHER_DIR --config.kd_cfg=configs/distill.yaml \
        --config.data_path=runs/demo/shakespeare_text_document \
        --config.tokenizer_model=runs/demo/tokenizer.json --config.save=runs/distill/student
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("gpt_tiny", os.path.join(os.path.dirname(__file__), "gpt_tiny.py"))
_gpt_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt_tiny)


def get_config():
    c = _gpt_tiny.get_config()
    c.kd_cfg = os.path.join(os.path.dirname(__file__), "distill.yaml")
    return c
