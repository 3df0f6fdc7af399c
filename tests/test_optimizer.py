"""LR schedules against a direct transcription of Megatron's OptimizerParamScheduler.get_lr."""

import math

import numpy as np
import pytest

from jmegatron.config import base_config, from_configdict
from jmegatron.training.optimizer import lr_schedule, weight_decay_mask


def megatron_get_lr(step, max_lr, min_lr, warmup, decay, style, wsd_iters=None, wsd_style=None):
    """megatron/core/optimizer_param_scheduler.py, get_lr (init_lr = 0), in iterations."""
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    if style == "inverse-square-root":
        warmup = max(warmup, 1)
        return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
    ratio = (step - warmup) / (decay - warmup)
    delta = max_lr - min_lr
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif style == "WSD":
        anneal_start = decay - wsd_iters
        if step <= anneal_start:
            coeff = 1.0
        else:
            r = (step - anneal_start) / wsd_iters
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": 2.0 * 0.5 ** r - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[wsd_style]
    return min_lr + coeff * delta


@pytest.mark.parametrize("style, wsd_style", [("constant", None), ("linear", None), ("cosine", None),
                                              ("inverse-square-root", None), ("WSD", "linear"),
                                              ("WSD", "cosine"), ("WSD", "exponential"),
                                              ("WSD", "minus_sqrt")])
def test_schedule_matches_megatron(style, wsd_style):
    c = base_config()
    c.mock_data, c.vocab_size = True, 100
    c.lr, c.min_lr, c.lr_warmup_iters, c.train_iters, c.lr_decay_iters = 3e-3, 3e-4, 10, 120, 100
    c.lr_decay_style = style
    if wsd_style:
        c.lr_wsd_decay_style, c.lr_wsd_decay_iters = wsd_style, 30
    sched = lr_schedule(from_configdict(c))
    for step in range(0, 121):
        want = megatron_get_lr(step, 3e-3, 3e-4, 10, 100, style, 30, wsd_style)
        np.testing.assert_allclose(float(sched(step)), want, rtol=1e-5, atol=1e-9, err_msg=f"step {step}")


def test_no_weight_decay_on_biases_and_norms():
    params = {"layer": {"kernel": np.ones((2, 2)), "bias": np.ones(2)}, "norm": {"scale": np.ones(2)},
              "word_embeddings": {"embedding": np.ones((4, 2))}}
    mask = weight_decay_mask(params)
    assert mask == {"layer": {"kernel": True, "bias": False}, "norm": {"scale": False},
                    "word_embeddings": {"embedding": True}}
