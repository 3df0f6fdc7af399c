"""Validation as Megatron-LM does it: the split sized for every evaluation, an iterator that
continues between evaluations and across a resume; eval_fixed_batches keeps the first batches."""

import jax
import pytest

from jmegatron.config import base_config, from_configdict
from jmegatron.data.builder import get_train_valid_test_num_samples
from jmegatron.parallel.mesh import create_mesh
from jmegatron.checkpoint import checkpointing
from jmegatron.training import loop
from jmegatron.training.loop import pretrain


def _cfg(save=None, **kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 256
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 1, 32, 2, 16
    c.micro_batch_size, c.global_batch_size = 2, 4
    c.train_iters, c.log_interval, c.eval_interval, c.eval_iters = 6, 2, 2, 3
    c.peak_tflops = 1.0
    c.save = None if save is None else str(save)
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


def megatron_num_samples(train_iters, train_samples, eval_interval, eval_iters, gbs):
    """megatron/training/training.py get_train_valid_test_num_samples."""
    train = train_samples if train_samples else train_iters * gbs
    eval_iters_all = (train_iters // eval_interval + 1) * eval_iters
    return train, eval_iters_all * gbs, eval_iters * gbs


@pytest.mark.parametrize("kw", [dict(train_iters=100, eval_interval=7, eval_iters=3),
                                dict(train_iters=20, eval_interval=20, eval_iters=1),
                                dict(train_iters=None, train_samples=1000, global_batch_size=16, eval_interval=5, eval_iters=2)])
def test_split_sizes_are_megatrons(kw):
    cfg = _cfg(**kw)
    gbs = cfg.global_batch_size
    assert get_train_valid_test_num_samples(cfg, gbs) == megatron_num_samples(
        cfg.train_iters, cfg.train_samples, cfg.eval_interval, cfg.eval_iters, gbs)
    fixed = cfg.replace(eval_fixed_batches=True)
    assert get_train_valid_test_num_samples(fixed, gbs)[1] == cfg.eval_iters * gbs


def _record_eval_starts(monkeypatch):
    starts = []
    real = loop.evaluate

    def spy(run, params, dataset, num_iters, consumed_samples=0):
        starts.append(consumed_samples)
        return real(run, params, dataset, num_iters, consumed_samples)

    monkeypatch.setattr(loop, "evaluate", spy)
    return starts


@pytest.mark.slow
def test_valid_iterator_continues_and_resumes(tmp_path, monkeypatch):
    starts = _record_eval_starts(monkeypatch)
    mesh = create_mesh(_cfg(), jax.devices()[:1])
    per_eval = 3 * 4  # eval_iters x global batch
    out = pretrain(_cfg(tmp_path / "a"), mesh)
    assert starts == [0, per_eval, 2 * per_eval]  # evaluations at 2, 4, 6
    vals = out["val_loss"]
    meta = checkpointing.Checkpointer(str(tmp_path / "a"), create=False).read_meta()
    assert meta["consumed_valid_samples"] == 3 * per_eval

    # stopped at iteration 4 and resumed: the third evaluation reads the third batches again
    starts.clear()
    pretrain(_cfg(tmp_path / "b", exit_interval=4), mesh)
    resumed = pretrain(_cfg(tmp_path / "b"), mesh)
    assert starts == [0, per_eval, 2 * per_eval]
    assert resumed["val_loss"] == vals

    # today's behaviour on request: the same first batches at every evaluation
    starts.clear()
    fixed = pretrain(_cfg(tmp_path / "c", eval_fixed_batches=True), mesh)
    assert starts == [0, 0, 0]
    assert fixed["val_loss"] != vals  # a different validation sample at the last evaluation
    meta = checkpointing.Checkpointer(str(tmp_path / "c"), create=False).read_meta()
    assert meta["consumed_valid_samples"] == 0
