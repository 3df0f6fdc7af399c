"""Megatron's mixed precision: bf16 / fp16 model parameters with float32 main parameters in
the optimizer, float32 gradient accumulation, fp16 dynamic loss scaling against
megatron-core's own DynamicGradScaler, skipped iterations, ZeRO-1, the pipeline and resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.float16_optimizer import Float16OptimizerState
from jmegatron.training.grad_scaler import GradScaler
from jmegatron.training.loop import pretrain
from jmegatron.training.run import build

from test_train_step import (UNIT_ROUNDOFF, assert_same_update, learnable_batches, random_batches, tiny_cfg,
                             train_main_params, update_rtol)

# Trajectories that learn: the cyclic tokens of learnable_batches (the loss falls from 6.3 to
# 5.6 in 3 steps), the full rate from step 1 (tiny_cfg warms up over one step, which runs at
# lr 0) and no linear-layer biases (the key bias's exact gradient is 0, so Adam would turn its
# rounding noise into full-size steps that no tolerance bounds)
LEARN = dict(lr_warmup_iters=0, add_bias_linear=False)
STEPS = 3
FLAGS = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
_FLOAT32 = {}


def learn(cfg, num_devices, check_state=None):
    """train_main_params over STEPS learnable batches of the global batch 16."""
    return train_main_params(cfg, num_devices, learnable_batches(STEPS, 16, cfg.seq_length, 500), check_state)


def assert_same_training(got, want, dtype):
    """Two learn() results whose arithmetic differs by ``dtype`` rounding (unit roundoff u):
    losses to u, grad norms to 4u (means over the batch's tokens), the main parameters' summed
    update to update_rtol; the reference learns."""
    u = UNIT_ROUNDOFF[np.dtype(dtype).name]
    assert want[0][-1] < want[0][0] - 0.5, want[0]
    np.testing.assert_allclose(got[0], want[0], rtol=u)
    np.testing.assert_allclose(got[1], want[1], rtol=4 * u)
    cfg = want[4].cfg
    assert_same_update(got[3], want[3], want[2], update_rtol(dtype, 16 * cfg.seq_length, cfg.num_layers, STEPS))


def _float_dtypes(tree):
    return {np.dtype(a.dtype) for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)}


def test_bf16_main_params_keep_updates_below_bf16_resolution():
    # A rate so small that no bf16 weight moves: the float32 main weights still accumulate
    # the updates (what plain bf16 parameters would lose), and the model stays their cast.
    cfg = tiny_cfg(bf16=True, lr=1e-7, lr_warmup_iters=0, weight_decay=0.0, clip_grad=0.0)
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    state = run.init_state()
    p0, w0 = jax.device_get((state.params, state.opt_state.main_params))
    for b in random_batches(2, run.global_batch_size, cfg.seq_length, 500):
        b = {k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()}
        state, _ = run.train_step(state, run.put_batch(b))
    p1, w1 = jax.device_get((state.params, state.opt_state.main_params))
    moved = [np.mean(a != b) for a, b in zip(jax.tree.leaves(w1), jax.tree.leaves(w0))]
    assert min(moved) > 0.5, moved  # Adam moves every main weight by ~lr
    # ... while the bf16 weight matrices (|w| ~ 0.02: spacing ~1e-4 >> 1e-7) stay put (biases
    # start at 0, where bf16 resolves 1e-7, so they move)
    matrices = lambda t: [a for path, a in jax.tree_util.tree_leaves_with_path(t)  # noqa: E731
                          if path[-1].key in ("kernel", "embedding")]
    changed = [np.mean(a != b) for a, b in zip(matrices(p1), matrices(p0))]
    assert len(changed) >= 8 and max(changed) < 0.05, changed  # (weights near 0 do move)


@pytest.mark.parametrize("flag", list(FLAGS))
def test_16bit_trajectory_follows_float32(flag):
    """16-bit model parameters with float32 main parameters in the optimizer, the model the
    cast of the main parameters after every step, training as float32 does up to the dtype's
    rounding; fp16 at a fixed scale that never overflows here: the scaled backward and the
    unscale."""
    dtype = FLAGS[flag]

    def model_is_the_cast_of_main(state, m):
        assert isinstance(state.opt_state, Float16OptimizerState)
        assert float(m["skipped"]) == 0.0
        main, params = jax.device_get((state.opt_state.main_params, state.params))
        assert _float_dtypes(params) == {np.dtype(dtype)} and _float_dtypes(main) == {np.dtype(np.float32)}
        for p, w in zip(jax.tree.leaves(params), jax.tree.leaves(main)):
            np.testing.assert_array_equal(p, w.astype(dtype))  # model = round(main), every step

    got = learn(tiny_cfg(**LEARN, **{flag: True}, initial_loss_scale=2.0 ** 12), 8, model_is_the_cast_of_main)
    if "float32" not in _FLOAT32:
        _FLOAT32["float32"] = learn(tiny_cfg(**LEARN), 8)
    assert _float_dtypes(got[4].abstract_state.params) == {np.dtype(dtype)}
    assert_same_training(got, _FLOAT32["float32"], dtype)


def test_gradient_accumulation_dtype():
    # Megatron's accumulate_allreduce_grads_in_fp32 (forced under bf16): the step's
    # accumulated, reduced gradients are float32; fp16 without it keeps float16
    for kw, want in ((dict(bf16=True), np.float32), (dict(fp16=True), np.float16),
                     (dict(fp16=True, accumulate_allreduce_grads_in_fp32=True), np.float32)):
        cfg = tiny_cfg(micro_batch_size=4, initial_loss_scale=2.0 ** 10, **kw)
        run = build(cfg, create_mesh(cfg, jax.devices()[:2]))
        assert run.num_microbatches == 2
        b = random_batches(1, run.global_batch_size, cfg.seq_length, 500)[0]
        b = {k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()}
        # the traced step's output types (the values: the trajectory tests below compile it)
        grads, _, _ = jax.eval_shape(run.compute_grads, run.abstract_state, run.put_batch(b))
        assert _float_dtypes(grads) == {np.dtype(want)}, kw


class _CpuTensor:
    """megatron-core's grad scaler allocates on 'cuda': the same tensors on the CPU."""

    def __init__(self, torch):
        self._tensor = torch.tensor

    def __call__(self, *args, device=None, **kw):
        return self._tensor(*args, **kw)


@pytest.mark.parametrize("hysteresis,window", [(2, 3), (1, 2), (3, 1)])
def test_dynamic_loss_scale_matches_megatron_core(monkeypatch, hysteresis, window):
    import torch
    from megatron.core.optimizer import grad_scaler
    monkeypatch.setattr(torch, "tensor", _CpuTensor(torch))
    ref = grad_scaler.DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=4.0, growth_factor=2.0,
                                        backoff_factor=0.5, growth_interval=window, hysteresis=hysteresis)
    ours = GradScaler(initial_scale=2.0 ** 10, min_scale=4.0, growth_interval=window, hysteresis=hysteresis)
    state = ours.init()
    update = jax.jit(ours.update)
    rs = np.random.RandomState(hysteresis * 10 + window)
    # runs of overflows long enough to reach min_scale, and clean runs long enough to grow
    flags = [bool(f) for f in rs.rand(200) < 0.45] + [True] * 12 + [False] * 7
    for i, found_inf in enumerate(flags):
        ref.update(found_inf)
        state = update(state, jnp.bool_(found_inf))
        assert float(state.scale) == float(ref.scale.item()), i
        assert int(state.growth_tracker) == ref._growth_tracker, i
        assert int(state.hysteresis_tracker) == ref._hysteresis_tracker, i


def test_constant_loss_scale_never_changes():
    s = GradScaler(initial_scale=128.0, dynamic=False)
    st = s.init()
    for f in (True, True, False):
        st = s.update(st, jnp.bool_(f))
    assert float(st.scale) == 128.0


def test_fp16_skips_overflowing_iterations_and_backs_off():
    # 2^32 overflows float16 gradients: each such iteration is skipped (parameters, moments and
    # the learning-rate schedule unchanged), the scale halves once hysteresis (2) is spent,
    # and training proceeds once it fits
    cfg = tiny_cfg(fp16=True, initial_loss_scale=2.0 ** 32, hysteresis=2, lr_warmup_iters=4)
    run = build(cfg, create_mesh(cfg, jax.devices()[:8]))
    state = run.init_state()
    scales, skipped, lrs = [], [], []
    for b in random_batches(24, run.global_batch_size, cfg.seq_length, 500):
        b = {k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()}
        before = jax.device_get(state.params)
        state, m = run.train_step(state, run.put_batch(b))
        scales.append(float(m["loss_scale"]))
        skipped.append(int(m["skipped"]))
        lrs.append(float(m["lr"]))
        if skipped[-1]:
            for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params))):
                np.testing.assert_array_equal(a, c)
    first_ok = skipped.index(0)
    assert first_ok >= 2 and all(skipped[:first_ok]), skipped
    assert sum(skipped[first_ok:]) <= 2, skipped  # near the edge an overflow may still come
    assert scales[0] == 2.0 ** 32 and scales[1] == 2.0 ** 32  # hysteresis 2: no back-off yet
    assert all(scales[i + 1] == scales[i] / 2 for i in range(1, first_ok)), scales[:first_ok + 1]
    assert lrs[:first_ok + 1] == [lrs[0]] * (first_ok + 1)  # the schedule waits for the first update
    assert lrs[first_ok + 1] > lrs[first_ok]  # warming up from then on
    assert int(state.step) == 24


@pytest.mark.parametrize("flag", ["fp16"])  # (bf16 shares the path; fp16 adds the scaler)
def test_zero1_shards_main_params_and_matches_one_device(flag):
    kw = {flag: True, "initial_loss_scale": 2.0 ** 12, **LEARN}
    zero1 = learn(tiny_cfg(use_distributed_optimizer=True, **kw), 8)
    run8 = zero1[4]
    main_sh = run8.state_shardings.opt_state.main_params
    assert any("data" in str(s.spec) for s in jax.tree.leaves(main_sh))  # ZeRO-1: the main copy is sharded
    assert all("data" not in str(s.spec) for s in jax.tree.leaves(run8.state_shardings.params))
    assert_same_training(zero1, learn(tiny_cfg(micro_batch_size=16, **kw), 1), FLAGS[flag])


@pytest.mark.parametrize("flag", ["fp16"])  # the scaled backward seed and 16-bit accumulation
def test_pipeline_matches_no_pipeline(flag):
    # the stacked one-stage model (scan_layers) stores the layers as pp 2 x 1F1B does: [4, ...]
    kw = {flag: True, "initial_loss_scale": 2.0 ** 12, "num_layers": 4, "micro_batch_size": 4, **LEARN}
    pipelined = learn(tiny_cfg(pipeline_model_parallel_size=2, **kw), 4)
    assert pipelined[4].mesh.shape["pipeline"] == 2
    assert_same_training(pipelined, learn(tiny_cfg(scan_layers=True, **kw), 2), FLAGS[flag])


@pytest.mark.parametrize("flag", ["fp16"])  # main params and the scaler's state (bf16: the main params only)
def test_resume_keeps_main_params_and_is_bit_exact(tmp_path, flag):
    from test_checkpoint_resume import cfg_for

    kw = {flag: True, "train_iters": 8, "eval_interval": 0, "log_interval": 1, "initial_loss_scale": 2.0 ** 20,
          "loss_scale_window": 2}
    full = pretrain(cfg_for(tmp_path / "full", **kw))
    pretrain(cfg_for(tmp_path / "resumed", exit_interval=4, **kw))
    second = pretrain(cfg_for(tmp_path / "resumed", **kw))
    assert sorted(second["losses"]) == list(range(5, 9))
    for it in range(5, 9):
        assert second["losses"][it] == full["losses"][it], it
    from jmegatron.checkpoint import checkpointing

    ckpt = checkpointing.Checkpointer(str(tmp_path / "resumed"), create=False)
    meta = ckpt.read_meta()
    assert meta["config"][flag] is True
    ckpt.close()
    from jmegatron.training.run import restore_run

    _, state, _ = restore_run(str(tmp_path / "resumed"))
    assert _float_dtypes(state.opt_state.main_params) == {np.dtype(np.float32)}
    if flag == "fp16":
        assert float(state.opt_state.grad_scaler.scale) != 2.0 ** 20  # the scaler's state came back too


def test_restore_across_precisions(tmp_path):
    # float32 -> bf16 (fine-tuning in bf16): the float32 weights become the main params, the
    # moments carry over; bf16 -> float32 (and a float32 teacher / export of a bf16 run) take
    # the main params. The sources are saved initial states (what is read does not depend on
    # training; tests/test_checkpoint_resume.py resumes trained runs)
    from test_checkpoint_resume import cfg_for

    from jmegatron.checkpoint import checkpointing
    from jmegatron.training.run import checkpoint_meta, restore_state

    kw = {"train_iters": 3, "eval_interval": 0, "log_interval": 1, "lr_warmup_iters": 1}
    sources, saved_states = {}, {}
    for src, bf16 in (("f32", False), ("b16", True)):
        cfg = cfg_for(tmp_path / src, bf16=bf16, **kw)
        sources[src] = build(cfg, create_mesh(cfg, jax.devices()[:8]))
        saved_states[src] = sources[src].init_state()
        ckpt = checkpointing.Checkpointer(str(tmp_path / src))
        ckpt.save(1, saved_states[src], checkpoint_meta(cfg, sources[src], 1, 0))
        ckpt.wait()
        ckpt.close()
    for src, flag in (("f32", True), ("b16", False)):
        run = sources["b16" if flag else "f32"]
        cfg = run.cfg
        ckpt = checkpointing.Checkpointer(str(tmp_path / src), create=False)
        state, _ = restore_state(run, ckpt)
        ckpt.close()
        saved = saved_states[src]
        want_main = saved.params if flag else saved.opt_state.main_params
        got_main = state.opt_state.main_params if flag else state.params
        for a, b in zip(jax.tree.leaves(jax.device_get(got_main)), jax.tree.leaves(jax.device_get(want_main))):
            np.testing.assert_array_equal(a, b)
        assert _float_dtypes(state.params) == {np.dtype(jnp.bfloat16 if flag else np.float32)}
        b = random_batches(1, run.global_batch_size, cfg.seq_length, 300)[0]
        b = {k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()}
        _, m = run.train_step(state, run.put_batch(b))
        assert np.isfinite(float(m["lm_loss"]))
