"""Checkpoints that survive anything (issue 16 item 2): async saves under donation,
SIGKILL during saves, corrupt checkpoints and the fallback, Megatron's load options."""

import dataclasses
import glob
import os
import shutil

import jax
import numpy as np
import optax
import pytest

from jmegatron.config import ConfigError, base_config, from_configdict
from jmegatron.data.builder import build_datasets
from jmegatron.data.loader import BatchLoader
from jmegatron.checkpoint import checkpointing
from jmegatron.training.loop import fresh_rng, load_or_init, pretrain
from jmegatron.training.run import build


def cfg_for(save, **kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 256
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 2, 32, 2, 16
    c.micro_batch_size, c.global_batch_size = 1, 8  # 8 devices: dp 8
    c.train_iters, c.log_interval, c.eval_interval, c.eval_iters = 10, 2, 0, 1
    c.lr, c.lr_warmup_iters, c.lr_decay_style, c.peak_tflops = 1e-3, 2, "cosine", 1.0
    c.save = str(save)
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def same_bits(x, y):
    return x.dtype == y.dtype and np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


def bit_equal(a, b):
    a, b = host(a), host(b)
    return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def pre(tmp_path_factory):
    """A run with async saves every 2 iterations, stopped by exit_interval at 6 of 10 (steps
    2, 4, 6 kept). Records, right after each save returned, whether Orbax was still writing
    it (the loop's next step donates the state at once)."""
    d = tmp_path_factory.mktemp("pre")
    writing = []
    save = checkpointing.Checkpointer.save

    def recording_save(self, *a, **kw):
        save(self, *a, **kw)
        writing.append(self._manager.is_saving_in_progress())

    with pytest.MonkeyPatch.context() as m:
        m.setattr(checkpointing.Checkpointer, "save", recording_save)
        summary = pretrain(cfg_for(d, save_interval=2, exit_interval=6, keep_checkpoints=3, async_save=True))
    return d, summary, writing


def test_exit_interval_saves_and_stops(pre):
    d, summary, _ = pre
    assert summary["iteration"] == 6 and sorted(summary["losses"]) == [1, 2, 3, 4, 5, 6]
    assert checkpointing.Checkpointer(str(d), create=False).all_steps() == [2, 4, 6]


def test_async_save_then_donated_steps_writes_the_saved_iteration(pre):
    """The loop's async saves return and the next steps donate the state at once: every
    saved step restores bit-exactly to a synchronous replay's state at that iteration."""
    d, _, writing = pre
    assert any(writing[:-1]), f"no save was still being written when the next step ran: {writing}"
    cfg = cfg_for(d)
    run = build(cfg)
    train_ds, _, _ = build_datasets(cfg, run.global_batch_size)
    loader = BatchLoader(train_ds, run.global_batch_size, run.num_microbatches)
    ckpt = checkpointing.Checkpointer(str(d), create=False)
    state = run.init_state()
    for it in range(1, 7):
        state, _ = run.train_step(state, run.put_batch(loader.batch_at((it - 1) * run.global_batch_size)))
        if it % 2 == 0:
            restored, meta = ckpt.restore(run.abstract_with_shardings(), it)
            assert meta["iteration"] == it and bit_equal(restored, state), it


def _largest_file(root):
    files = [p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(p)]
    return max(files, key=os.path.getsize)


def _cut_short(d):
    p = _largest_file(d / "6" / "state")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)


def _garbage_bytes(d):
    p = _largest_file(d / "6" / "state")
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.seek(size // 3)
        f.write(np.random.default_rng(0).integers(0, 256, size // 3, dtype=np.uint8).tobytes())


def _missing_item(d):
    shutil.rmtree(d / "6" / "state")


def _garbage_meta(d):
    (d / "6" / "meta" / "metadata").write_text("{not json")


@pytest.mark.parametrize("corrupt", [_cut_short, _garbage_bytes, _missing_item, _garbage_meta])
def test_corrupt_checkpoint_falls_back_to_the_previous(pre, tmp_path, capsys, corrupt):
    src = pre[0]
    d = tmp_path / "c"
    shutil.copytree(src, d)
    corrupt(d)
    run = build(cfg_for(d))
    state, iteration, consumed, _ = load_or_init(run, None)
    assert iteration == 4 and consumed == 4 * 8
    assert "WARNING ckpt_fallback: checkpoint step 6 in" in capsys.readouterr().out
    expected, _ = checkpointing.Checkpointer(str(src), create=False).restore(run.abstract_with_shardings(), 4)
    assert bit_equal(state, expected)
    # ckpt_fallback off: the error names the step, the path and the way out
    run_off = dataclasses.replace(run, cfg=run.cfg.replace(ckpt_fallback=False))
    with pytest.raises(checkpointing.CorruptCheckpointError, match=r"(?s)step 6 in .*/c is corrupt.*ckpt_fallback=True "
                                                                   r"to resume from step 4") as e:
        load_or_init(run_off, None)
    assert e.value.step == 6 and e.value.path == str(d)


def test_changed_values_are_caught_by_the_fingerprints(pre):
    src = pre[0]
    run = build(cfg_for(src))
    ckpt = checkpointing.Checkpointer(str(src), create=False)
    state, meta = ckpt.restore(run.abstract_with_shardings(), 6)
    assert set(meta["fingerprints"]) == {checkpointing._leaf_name(p)
                                         for p, _ in jax.tree_util.tree_leaves_with_path(state)}
    ckpt.verify(state, meta, 6)  # intact
    leaves, treedef = jax.tree.flatten(state)
    names = [checkpointing._leaf_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    i = next(i for i, n in enumerate(names) if n.startswith("params/"))
    values = np.asarray(leaves[i]).copy()
    values.reshape(-1).view(np.uint32)[-1] ^= 1  # one bit of one float32 value
    leaves[i] = jax.device_put(values, leaves[i].sharding)
    bumped = jax.tree.unflatten(treedef, leaves)
    with pytest.raises(checkpointing.CorruptCheckpointError, match=r"1 array\(s\) differ .*" + names[i]):
        ckpt.verify(bumped, meta, 6)
    # the same values in another sharding have the same fingerprints
    replicated = jax.device_put(state, jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec()))
    assert checkpointing.state_fingerprints(replicated) == meta["fingerprints"]


def test_every_checkpoint_corrupt_is_an_error_and_a_killed_save_is_ignored(pre, tmp_path, capsys):
    src = pre[0]
    d = tmp_path / "all"
    shutil.copytree(src, d)
    shutil.copytree(d / "6", d / "8.orbax-checkpoint-tmp-1234")  # what a save killed mid-write leaves
    run = build(cfg_for(d))
    _, iteration, _, _ = load_or_init(run, None)
    assert iteration == 6
    out = capsys.readouterr().out
    assert "WARNING: ignoring" in out and "8.orbax-checkpoint-tmp-1234" in out
    for step in (2, 4, 6):
        (d / str(step) / "meta" / "metadata").write_text("garbage")
    with pytest.raises(checkpointing.CorruptCheckpointError, match="(?s)step 2 .*no earlier complete checkpoint"):
        load_or_init(run, None)


def test_load_options_finetune_no_load_optim_no_load_rng(pre, tmp_path):
    src = pre[0]
    run = build(cfg_for(tmp_path / "ft", load=str(src), seed=7))
    saved, _ = checkpointing.Checkpointer(str(src), create=False).restore(run.abstract_with_shardings(), 6)
    fresh = run.init_state()  # seed 7 (the checkpoint's run used seed 1234)

    def load(**kw):
        return load_or_init(dataclasses.replace(run, cfg=cfg_for(tmp_path / "ft", load=str(src), seed=7, **kw)), None)

    def adam(opt_state):
        return [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                if isinstance(x, optax.ScaleByAdamState)][0]

    def schedule_count(opt_state):
        is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
        return [int(x.count) for x in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(x)]

    state, iteration, consumed, consumed_valid = load(finetune=True)
    assert (iteration, consumed, consumed_valid, int(state.step)) == (0, 0, 0, 0)
    assert bit_equal(state.params, saved.params)
    assert bit_equal(state.opt_state, fresh.opt_state) and bit_equal(state.rng, fresh.rng)

    state, iteration, consumed, _ = load(no_load_optim=True)
    assert (iteration, consumed, int(state.step)) == (6, 48, 6)
    assert bit_equal(state.params, saved.params) and bit_equal(state.rng, saved.rng)
    assert int(adam(state.opt_state).count) == 0 and not any(np.any(x) for x in host(adam(state.opt_state).mu))
    assert schedule_count(state.opt_state) == schedule_count(saved.opt_state) == [6]  # the LR continues

    state, iteration, _, _ = load(no_load_rng=True)
    assert iteration == 6 and bit_equal(state.params, saved.params) and bit_equal(state.opt_state, saved.opt_state)
    assert bit_equal(state.rng, fresh.rng) and not bit_equal(state.rng, saved.rng)
    assert bit_equal(fresh_rng(7), fresh.rng)


def test_finetune_trains_from_zero_and_exit_duration_saves_and_stops(pre, tmp_path):
    src = pre[0]
    # exit_duration_in_mins counts from the start of pretrain (Megatron's _TRAIN_START_TIME): the setup
    # alone exceeds 1e-6 minutes, so the run stops after its first iteration and saves it
    out = pretrain(cfg_for(tmp_path / "ft", load=str(src), finetune=True, exit_duration_in_mins=1e-6))
    assert out["iteration"] == 1 and sorted(out["losses"]) == [1] and out["interrupted"]
    meta = checkpointing.Checkpointer(str(tmp_path / "ft"), create=False).read_meta()
    assert (meta["iteration"], meta["consumed_train_samples"]) == (1, 8)


@pytest.mark.parametrize("kw, match", [
    (dict(finetune=True), r"config.finetune=True applies to the checkpoint read from config.load"),
    (dict(no_load_optim=True, load="SAVE"), r"config.no_load_optim=True .* is config.save"),
    (dict(exit_duration_in_mins=0.0), r"config.exit_duration_in_mins=0.0 must be > 0"),
])
def test_load_option_config_errors(tmp_path, kw, match):
    kw = {k: (str(tmp_path) if v == "SAVE" else v) for k, v in kw.items()}
    with pytest.raises(ConfigError, match=match):
        cfg_for(tmp_path, **kw)


@pytest.mark.slow
def test_sigkill_during_saves_resumes_bit_exactly(tmp_path):
    """The trainer is SIGKILLed at random points of its saves, 4 times (2 sync, 2 async;
    JMEGATRON_FAULT_KILLS to change); each time the newest complete checkpoint restores
    bit-exactly to an uninterrupted run's state at that iteration, and a last process
    trains to the end and matches the uninterrupted run's final state. The many-kill
    campaign (100 kills, docs/RELIABILITY.md) is ``python -m jmegatron.tools.checkpoint_faults``'s
    job; here a few kills check that the machinery and the resume path still work."""
    from jmegatron.tools.checkpoint_faults import campaign

    kills = int(os.environ.get("JMEGATRON_FAULT_KILLS", "4"))
    s = campaign(str(tmp_path), kills, seed=1234)
    print({k: v for k, v in s.items() if k != "records"})
    assert s["killed_by_sigkill"] == kills, s["records"]
    assert s["resumed_bit_exactly"] == kills, s["records"]
    assert s["final_state_bit_exact"], s["final_output"]
    assert s["killed_inside_orbax_write"] >= 1  # the kills reach into Orbax's write, not only between saves
