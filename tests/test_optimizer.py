"""LR schedules against megatron-core's own OptimizerParamScheduler."""

import types

import numpy as np
import pytest
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from jmegatron.config import base_config, from_configdict
from jmegatron.training.optimizer import lr_schedule, weight_decay_mask


def megatron_lrs(steps, max_lr, min_lr, warmup, decay, style, wsd_iters=None, wsd_style=None):
    """megatron-core's OptimizerParamScheduler (init_lr 0, constant weight decay) stepped one
    iteration at a time: the rate it sets for iterations 0..steps-1."""
    optimizer = types.SimpleNamespace(param_groups=[{}])
    sched = OptimizerParamScheduler(optimizer, 0.0, max_lr, min_lr, warmup, decay, style, 0.0, 0.0, 1, "constant",
                                    wsd_decay_steps=wsd_iters, lr_wsd_decay_style=wsd_style)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        sched.step(1)
    return out


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
    want = megatron_lrs(121, 3e-3, 3e-4, 10, 100, style, 30 if wsd_style else None, wsd_style)
    for step in range(0, 121):
        np.testing.assert_allclose(float(sched(step)), want[step], rtol=1e-5, atol=1e-9, err_msg=f"step {step}")


def test_no_weight_decay_on_biases_and_norms():
    params = {"layer": {"kernel": np.ones((2, 2)), "bias": np.ones(2)}, "norm": {"scale": np.ones(2)},
              "word_embeddings": {"embedding": np.ones((4, 2))}}
    mask = weight_decay_mask(params)
    assert mask == {"layer": {"kernel": True, "bias": False}, "norm": {"scale": False},
                    "word_embeddings": {"embedding": True}}
