"""Learning-rate schedules in samples (iteration- and sample-based, ramp-up, multi-step,
warm-up init/fraction) against megatron-core's OptimizerParamScheduler (with ByteMLPerf's
multi-step branch, transcribed) and its batch-size ramp-up calculator, driven as Megatron's
training loop drives them."""

import math
import types

import jax
import numpy as np
import pytest
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from jmegatron.config import ConfigError, base_config, from_configdict
from jmegatron import num_microbatches_calculator as nmc
from jmegatron.training.optimizer import lr_schedule


class MegatronScheduler(OptimizerParamScheduler):
    """megatron-core's OptimizerParamScheduler (num_steps counts samples), plus the
    'multi-step' style of ByteMLPerf's byte_train_perf/Megatron-LM copy, transcribed (only
    ByteMLPerf has it); ``get_lr()`` the rate it sets."""

    def __init__(self, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                 wsd_decay_steps=None, lr_wsd_decay_style=None, multi_step=(0.6, 0.3, 0.1)):
        self.multi_step = multi_step
        super().__init__(types.SimpleNamespace(param_groups=[{}]), init_lr, max_lr, min_lr, lr_warmup_steps,
                         lr_decay_steps, lr_decay_style, 0.0, 0.0, 1, "constant",
                         wsd_decay_steps=wsd_decay_steps if lr_decay_style == "WSD" else None,
                         lr_wsd_decay_style=lr_wsd_decay_style)

    def get_lr(self, param_group=None):
        if param_group is None:
            return self.optimizer.param_groups[0]["lr"]
        if self.lr_decay_style != "multi-step":
            return super().get_lr(param_group)
        max_lr, min_lr = self.max_lr, self.min_lr  # ByteMLPerf's get_lr, its multi-step path
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        decay_ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        first, second, _ = self.multi_step
        if decay_ratio <= first:
            return max_lr
        elif decay_ratio <= first + second:
            lr = max_lr * (1 / math.sqrt(10))
        else:
            lr = max_lr * 0.1
        return max(min_lr, lr)


def megatron_rampup_gbs(consumed, start, inc, ramp, gbs):
    """megatron-core's RampupBatchsizeNumMicroBatchesCalculator.update: the global batch size
    after ``consumed`` samples."""
    calc = RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, 0, start, inc, ramp)
    calc.update(consumed, consistency_check=False)
    return calc.get_current_global_batch_size()


def megatron_lrs(sched, iters, gbs_of_consumed):
    """The rate of each iteration as Megatron's train loop sets it: get_lr at the samples
    consumed so far, then step(increment=the iteration's global batch)."""
    out, consumed = [], 0
    for _ in range(iters):
        out.append(sched.get_lr())
        g = gbs_of_consumed(consumed)
        consumed += g
        sched.step(g)
    return out


def _cfg(**kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 100
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


def _ours(cfg, iters, gbs=None):
    sched = lr_schedule(cfg, gbs)
    return np.array([float(sched(k)) for k in range(iters)])


STYLES = [("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None),
          ("multi-step", None), ("WSD", "linear"), ("WSD", "cosine"), ("WSD", "exponential")]


@pytest.mark.parametrize("style, wsd_style", STYLES)
def test_iteration_based_counts_samples_like_megatron(style, wsd_style):
    # get_optimizer_param_scheduler: lengths are iterations x global_batch_size, increments the batch
    gbs = 4
    kw = dict(lr=3e-3, min_lr=2e-4, lr_warmup_init=1e-4, lr_warmup_iters=10, train_iters=120, lr_decay_iters=100,
              lr_decay_style=style, global_batch_size=gbs, micro_batch_size=4)
    if wsd_style:
        kw.update(lr_wsd_decay_style=wsd_style, lr_wsd_decay_iters=30)
    ref = MegatronScheduler(1e-4, 3e-3, 2e-4, 10 * gbs, 100 * gbs, style, 30 * gbs, wsd_style)
    want = megatron_lrs(ref, 121, lambda c: gbs)
    np.testing.assert_allclose(_ours(_cfg(**kw), 121), want, rtol=2e-6, atol=1e-10)


def test_inverse_square_root_without_warmup_counts_one_sample():
    # Megatron's max(num_steps, 1) is one *sample*: lr(iteration k) = lr / sqrt(k * gbs)
    gbs = 8
    cfg = _cfg(lr=1e-3, lr_decay_style="inverse-square-root", train_iters=50, global_batch_size=gbs, micro_batch_size=8)
    ref = MegatronScheduler(0.0, 1e-3, 0.0, 0, 50 * gbs, "inverse-square-root")
    np.testing.assert_allclose(_ours(cfg, 50), megatron_lrs(ref, 50, lambda c: gbs), rtol=2e-6)


@pytest.mark.parametrize("style, wsd_style", STYLES)
def test_sample_based_with_rampup_matches_megatron(style, wsd_style):
    start, inc, ramp, gbs = 4, 4, 200, 16
    kw = dict(lr=2e-3, min_lr=1e-4, lr_warmup_init=5e-4, lr_warmup_samples=90, train_samples=1500,
              lr_decay_samples=1300, lr_decay_style=style, global_batch_size=gbs, micro_batch_size=4,
              rampup_batch_size=(start, inc, ramp))
    if wsd_style:
        kw.update(lr_wsd_decay_style=wsd_style, lr_wsd_decay_samples=333)
    cfg = _cfg(**kw)
    ref = MegatronScheduler(5e-4, 2e-3, 1e-4, 90, 1300, style, 333, wsd_style)
    gbs_of = lambda c: megatron_rampup_gbs(c, start, inc, ramp, gbs)  # noqa: E731
    iters = cfg.train_iters + 5
    np.testing.assert_allclose(_ours(cfg, iters), megatron_lrs(ref, iters, gbs_of), rtol=2e-6, atol=1e-10)


def test_sample_based_constant_batch_fractional_lengths():
    # lengths that are not whole iterations: warm-up 50 samples with a batch of 16 = 3.125 iterations
    cfg = _cfg(lr=1e-3, min_lr=1e-5, lr_warmup_samples=50, train_samples=800, lr_decay_style="cosine",
               global_batch_size=16, micro_batch_size=4)
    assert cfg.train_iters == 50 and cfg.lr_decay_samples == 800 and cfg.lr_decay_iters is None
    ref = MegatronScheduler(0.0, 1e-3, 1e-5, 50, 800, "cosine")
    np.testing.assert_allclose(_ours(cfg, 55), megatron_lrs(ref, 55, lambda c: 16), rtol=2e-6, atol=1e-10)


def test_multi_step_switches_at_megatrons_float64_boundaries():
    # 0.6 + 0.3 == 0.8999999999999999 in float64, so ByteMLPerf's code is in the third stage at a
    # decay ratio of exactly 0.9 (iteration 90 of 100); a float32 comparison would say second.
    cfg = _cfg(lr=1e-3, min_lr=0.0, lr_decay_style="multi-step", train_iters=100)
    lrs = _ours(cfg, 101)
    assert lrs[60] == np.float32(1e-3) and lrs[61] == np.float32(1e-3 / math.sqrt(10))
    assert lrs[89] == np.float32(1e-3 / math.sqrt(10))
    assert lrs[90] == np.float32(1e-3 * 0.1)
    ref = MegatronScheduler(0.0, 1e-3, 0.0, 0, 100, "multi-step")
    np.testing.assert_allclose(lrs, megatron_lrs(ref, 101, lambda c: 1), rtol=1e-7)
    # never below min_lr; custom shares
    cfg = _cfg(lr=1e-3, min_lr=2e-4, lr_decay_style="multi-step", train_iters=20, lr_warmup_iters=5,
               lr_decay_multi_step=(0.5, 0.25, 0.25))
    ref = MegatronScheduler(0.0, 1e-3, 2e-4, 5, 20, "multi-step", multi_step=(0.5, 0.25, 0.25))
    lrs = _ours(cfg, 25)
    np.testing.assert_allclose(lrs, megatron_lrs(ref, 25, lambda c: 1), rtol=1e-6)
    assert lrs[5:].min() == np.float32(2e-4) and lrs[19] == np.float32(2e-4)  # lr/10 < min_lr: clamped


def test_warmup_fraction_is_a_share_of_the_decay():
    cfg = _cfg(lr=1e-3, lr_warmup_fraction=0.1, train_iters=40, lr_decay_iters=30, lr_decay_style="linear",
               global_batch_size=2, micro_batch_size=2)
    ref = MegatronScheduler(0.0, 1e-3, 0.0, 0.1 * 60, 60, "linear")
    np.testing.assert_allclose(_ours(cfg, 40), megatron_lrs(ref, 40, lambda c: 2), rtol=2e-6, atol=1e-10)


def test_train_iters_from_train_samples_like_update_train_iters():
    def megatron_update_train_iters(train_samples, start, inc, ramp, gbs):
        iterations, consumed = 0, 0
        while consumed <= ramp and consumed <= train_samples:
            consumed += megatron_rampup_gbs(consumed, start, inc, ramp, gbs)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // gbs
        return iterations

    for train_samples, ramp in ((1500, 200), (100, 200), (150, 37), (10_000, 9_999)):
        cfg = _cfg(train_samples=train_samples, global_batch_size=16, micro_batch_size=4, rampup_batch_size=(4, 4, ramp))
        assert cfg.train_iters == megatron_update_train_iters(train_samples, 4, 4, ramp, 16)
    assert _cfg(train_samples=1000, global_batch_size=16, micro_batch_size=4).train_iters == 62
    # a saved config (train_iters resolved) reloads
    cfg = _cfg(train_samples=1000, global_batch_size=16, micro_batch_size=4)
    from jmegatron.config import from_json
    assert from_json(cfg.to_json()) == cfg


def test_rampup_calculator_matches_megatron():
    calc = nmc.build_num_microbatches_calculator(48, 2, 2, (8, 8, 1000))
    for consumed in list(range(0, 1200, 7)) + [1000, 1001]:
        calc.update(consumed)
        want = megatron_rampup_gbs(consumed, 8, 8, 1000, 48)
        assert calc.get_current_global_batch_size() == want and calc.get() == want // 4
    stages = calc.stages()
    consumed, it = 0, 0
    while consumed < 1500:  # the stage table reproduces the loop's consumed samples
        assert nmc.consumed_samples_at(stages, it) == consumed
        consumed += megatron_rampup_gbs(consumed, 8, 8, 1000, 48)
        it += 1


@pytest.mark.parametrize("kw, match", [
    (dict(lr_decay_style="multi-step", lr_decay_multi_step=(0.6, 0.3, 0.2)), "sum to 1"),
    (dict(lr_decay_multi_step=(0.6, 0.4)), "three shares"),
    (dict(train_samples=100, train_iters=50, global_batch_size=4), "train_iters=50 and config.train_samples"),
    (dict(train_samples=100), "needs config.global_batch_size"),
    (dict(rampup_batch_size=(4, 4, 100), global_batch_size=16), "rampup_batch_size.*needs config.train_samples"),
    (dict(lr_warmup_samples=10), "lr_warmup_samples=10 needs config.train_samples"),
    (dict(train_samples=100, global_batch_size=4, lr_warmup_iters=5), "lr_warmup_iters=5 is iteration-based"),
    (dict(lr_warmup_fraction=0.1, lr_warmup_iters=3), "lr_warmup_fraction"),
    (dict(lr_warmup_init=1.0), "lr_warmup_init"),
    (dict(train_samples=100, global_batch_size=16, micro_batch_size=4, rampup_batch_size=(16, 4, 50)), "nothing to ramp"),
    (dict(train_samples=100, global_batch_size=16, micro_batch_size=4, rampup_batch_size=(4, 5, 50)), "not divisible"),
    (dict(variable_data=True), "seq_length_step"),
    (dict(variable_data=True, seq_length=64, seq_length_step=8), "seq_length - 9"),
])
def test_bad_schedule_settings_fail_with_field_named(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**kw)


def test_rampup_batches_must_split_into_microbatches():
    with pytest.raises(nmc.NumMicroBatchesCalculatorError, match="multiples of config.micro_batch_size"):
        nmc.build_num_microbatches_calculator(32, 4, 2, (4, 4, 100))


def test_schedule_is_one_jitted_function_of_the_step():
    cfg = _cfg(lr=2e-3, min_lr=1e-4, lr_warmup_samples=30, train_samples=600, lr_decay_style="multi-step",
               global_batch_size=16, micro_batch_size=4, rampup_batch_size=(4, 4, 100))
    sched = lr_schedule(cfg)
    jitted = jax.jit(sched)
    steps = np.arange(cfg.train_iters + 3, dtype=np.int32)
    got = np.array([float(jitted(s)) for s in steps])
    assert jitted._cache_size() == 1  # the step is traced, never baked in
    # XLA may fuse a division differently from op-by-op execution: 1 ulp
    np.testing.assert_allclose(got, _ours(cfg, len(steps)), rtol=3e-7)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(sched))(steps)), got, rtol=3e-7)
