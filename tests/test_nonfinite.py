"""Non-finite values (Megatron's check_for_nan_in_loss_and_grad): every step, inside the
jitted step, a non-finite loss or gradient skips the update for every precision and
layout; the loop stops after max_consecutive_nan_iterations; a non-finite state is never
checkpointed."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.parallel.mesh import create_mesh
from jmegatron.checkpoint import checkpointing
from jmegatron.training.float16_optimizer import all_finite, keep_if
from jmegatron.training.forward_step import gpt_forward_step
from jmegatron.training.loop import pretrain
from jmegatron.training.optimizer import optimizer_steps
from jmegatron.training.run import build

from test_expert_bias import MOE, biases
from test_train_step import random_batches, tiny_cfg


def test_all_finite_and_keep_if():
    tree = {"a": jnp.ones((3,)), "b": jnp.array([1.0, jnp.inf]), "i": jnp.array([1, 2]),
            "amax": jnp.array([jnp.nan])}
    assert not bool(all_finite(tree))
    assert not bool(all_finite(tree, exclude=lambda path: path[0].key == "amax"))
    assert bool(all_finite({k: v for k, v in tree.items() if k != "b"}, exclude=lambda path: path[0].key == "amax"))
    assert bool(all_finite({"i": jnp.array([1])}))  # no floating leaf
    new, old = {"x": jnp.ones(2)}, {"x": jnp.zeros(2)}
    np.testing.assert_array_equal(keep_if(jnp.bool_(True), new, old)["x"], [0, 0])
    np.testing.assert_array_equal(keep_if(jnp.bool_(False), new, old)["x"], [1, 1])


def _batches(run, cfg, n, seed=0):
    out = []
    for b in random_batches(n, run.global_batch_size, cfg.seq_length, 500, seed=seed):
        out.append({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()})
    return out


def _poisoned(batch):
    """A NaN in the loss mask: a NaN loss and NaN gradients, on one data-parallel rank only."""
    mask = batch["loss_mask"].copy()
    mask[0, 0, 3] = np.nan
    return dict(batch, loss_mask=mask)


def _host(state):
    return jax.device_get((state.params, state.opt_state))


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kw,devices", [
    (MOE, 1),                                                  # float32, MoE with expert_bias buffers
    pytest.param({"bf16": True, "use_distributed_optimizer": True,  # bf16, ZeRO-1 over 2 ranks, FP8 meta
                  "fp8": "hybrid", "fp8_amax_history_len": 2}, 2, marks=pytest.mark.slow),
    pytest.param({"fp16": True, "initial_loss_scale": 2.0 ** 10, "pipeline_model_parallel_size": 2}, 2,
                 marks=pytest.mark.slow),                                 # fp16, pipeline
], ids=["fp32", "bf16-zero1", "fp16-pipeline"])
def test_nonfinite_iteration_is_skipped_and_changes_nothing(kw, devices):
    # [b1, poisoned, b2] ends bit-exactly where [b1, b2] does: the poisoned step changed no
    # parameter, buffer (expert_bias, FP8 meta), main parameter, moment or schedule count (the
    # next lr); fp16's scaler backs off as for any overflow; it is counted as skipped and nan.
    cfg = tiny_cfg(lr_warmup_iters=3, **kw)
    run = build(cfg, create_mesh(cfg, jax.devices()[:devices]))
    b1, b2 = _batches(run, cfg, 2)
    state = run.init_state()
    state, m1 = run.train_step(state, run.put_batch(b1))
    before = _host(state)
    count = int(optimizer_steps(before[1], -1))
    state, bad = run.train_step(state, run.put_batch(_poisoned(b2)))
    assert float(bad["skipped"]) == 1.0 and float(bad["nan"]) == 1.0
    assert float(m1["skipped"]) == 0.0 and float(m1["nan"]) == 0.0
    assert int(state.step) == 2  # counts as an iteration (Megatron)
    after = _host(state)
    if cfg.fp16:  # the scaler backs off (hysteresis counts down): everything else is kept
        assert int(after[1].grad_scaler.hysteresis_tracker) == int(before[1].grad_scaler.hysteresis_tracker) - 1
        _assert_same(before[0], after[0])
        _assert_same((before[1].main_params, before[1].inner), (after[1].main_params, after[1].inner))
    else:
        _assert_same(before, after)
    if cfg.num_moe_experts:  # the routers' expert_bias buffers were not advanced either
        assert biases(before[0]) and all(np.array_equal(biases(before[0])[k], v) for k, v in biases(after[0]).items())
    if cfg.fp8:
        assert any("fp8_meta" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(after[0]))
    assert int(optimizer_steps(after[1], -1)) == count
    state, m2 = run.train_step(state, run.put_batch(b2))
    assert float(m2["skipped"]) == 0.0 and float(m2["lr"]) > 0
    # the reference: the same run without the poisoned batch
    ref = run.init_state()
    ref, _ = run.train_step(ref, run.put_batch(b1))
    ref, r2 = run.train_step(ref, run.put_batch(b2))
    assert float(r2["lr"]) == float(m2["lr"])  # the schedule did not advance on the skipped step
    np.testing.assert_array_equal(float(r2["loss"]), float(m2["loss"]))
    _assert_same(jax.device_get(ref.params), jax.device_get(state.params))


def _always_nan(cfg, model, mesh, padded):
    """The language model's forward step with every loss multiplied by NaN (a NaN loss and
    NaN gradients)."""
    fwd = gpt_forward_step(cfg, model, mesh, padded)

    def loss_fn(*args):
        loss, report = fwd.loss_fn(*args)
        return loss * jnp.float32(jnp.nan), report

    return type(fwd)(loss_fn=loss_fn, pipeline_stages=fwd.pipeline_stages, buffers=fwd.buffers)


@pytest.mark.slow
def test_loop_stops_after_max_consecutive_nan_iterations(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    cfg = tiny_cfg(train_iters=10, save=save, save_interval=1, log_interval=1, eval_interval=0,
                   max_consecutive_nan_iterations=3, peak_tflops=1.0)
    with pytest.raises(FloatingPointError) as err:
        pretrain(cfg, create_mesh(cfg, jax.devices()[:1]), forward_step_provider=_always_nan)
    msg = str(err.value)
    assert "iteration 3: 3 consecutive" in msg and "config.max_consecutive_nan_iterations=3" in msg, msg
    out = capsys.readouterr().out
    assert "number of skipped iterations:   1 | number of nan iterations:   1 |" in out
    # the skipped iterations kept the initial state, which is finite: checkpoints were written
    ckpt = checkpointing.Checkpointer(save, create=False)
    steps = ckpt.all_steps()
    assert steps and max(steps) >= 2, steps
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    restored, _ = ckpt.restore(run.abstract_with_shardings(), max(steps))
    _assert_same(jax.device_get(run.init_state().params), jax.device_get(restored.params))
    ckpt.close()


def test_a_nonfinite_state_is_never_checkpointed(tmp_path, capsys):
    # Unchecked (the step applies what it got): iteration 1 makes every parameter NaN; its save (and the end's) is refused,
    # and the log-time check still stops the run.
    save = str(tmp_path / "ckpt")
    cfg = tiny_cfg(train_iters=2, save=save, save_interval=1, log_interval=100, eval_interval=0,
                   check_for_nan_in_loss_and_grad=False, peak_tflops=1.0)
    with pytest.raises(FloatingPointError, match="at iteration 1"):
        pretrain(cfg, create_mesh(cfg, jax.devices()[:1]), forward_step_provider=_always_nan)
    assert "not saving iteration 1: the parameters or optimizer state hold inf/nan" in capsys.readouterr().out
    assert not checkpointing.has_checkpoint(save)
    assert os.path.exists(os.path.join(save, "config.json"))
