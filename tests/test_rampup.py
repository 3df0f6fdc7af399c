"""Batch-size ramp-up: the loader follows Megatron's calculator, the jitted step compiles once
per number of micro-batches, and a run resumed mid-ramp is bit-identical."""

import json

import jax
import numpy as np
import pytest

from jmegatron.config import base_config, from_configdict
from jmegatron.data.loader import BatchLoader
from jmegatron.parallel.mesh import create_mesh
from jmegatron.checkpoint import checkpointing
from jmegatron import num_microbatches_calculator as nmc
from jmegatron.training.loop import pretrain

from test_schedules import megatron_rampup_gbs


class IndexDataset:
    """Sample i is the constant sequence i (so a batch shows which samples it holds)."""

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        z = np.full(4, i)
        return {"tokens": z, "labels": z, "loss_mask": np.ones(4), "position_ids": np.arange(4)}


def test_loader_reads_each_iterations_batch_in_order():
    calc = nmc.build_num_microbatches_calculator(24, 2, 2, (4, 4, 50))
    loader = BatchLoader(IndexDataset(), 24, 6, 0, calc)
    consumed = 0
    for _ in range(12):
        batch = next(loader)
        gbs = megatron_rampup_gbs(consumed, 4, 4, 50, 24)
        assert loader.last_global_batch_size == gbs
        assert batch["tokens"].shape == (gbs // 4, 4, 4)  # [num_micro, mbs * dp, seq]
        np.testing.assert_array_equal(batch["tokens"][..., 0].reshape(-1), np.arange(consumed, consumed + gbs))
        consumed += gbs
    assert loader.consumed_samples == consumed
    # a loader created at a mid-ramp position continues with the same batches
    resumed = BatchLoader(IndexDataset(), 24, 6, 20, nmc.build_num_microbatches_calculator(24, 2, 2, (4, 4, 50)))
    assert next(resumed)["tokens"].shape[0] == megatron_rampup_gbs(20, 4, 4, 50, 24) // 4


def _cfg(save, **kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 256
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 1, 32, 2, 16
    c.micro_batch_size, c.global_batch_size = 2, 6
    # one device: global batches 2, 2, 4, then 6 (ramp over 8 samples): 1, 2, 3 micro-batches
    c.rampup_batch_size, c.train_samples = (2, 2, 8), 26
    c.log_interval, c.eval_interval, c.eval_iters = 1, 0, 1
    c.lr, c.lr_warmup_samples, c.lr_decay_style, c.peak_tflops = 1e-3, 10, "cosine", 1.0
    c.save = str(save)
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


@pytest.mark.slow
def test_rampup_compiles_once_per_microbatch_count_and_resumes_exactly(tmp_path):
    cfg = _cfg(tmp_path / "full")
    assert cfg.train_iters == 6  # 4 ramp iterations (2 + 2 + 4 + 6 = 14 samples) + (26 - 14) // 6
    mesh = create_mesh(cfg, jax.devices()[:1])
    full = pretrain(cfg, mesh)
    assert full["iteration"] == 6
    assert full["run"].train_step._cache_size() == 3  # num_micro 1, 2, 3
    meta = checkpointing.Checkpointer(str(tmp_path / "full"), create=False).read_meta()
    assert meta["consumed_train_samples"] == 26
    # the rate follows the samples consumed: warm-up over 10 samples, batches 2, 2, 4, 6, ...
    lrs = [json.loads(line)["lr"] for line in open(tmp_path / "full" / "metrics.jsonl") if '"lr"' in line]
    np.testing.assert_allclose(lrs[:4], [0.0, 1e-3 * 2 / 10, 1e-3 * 4 / 10, 1e-3 * 8 / 10], rtol=1e-6)

    # stop after iteration 2 (consumed 4: the next batch is 4), then resume from the checkpoint
    first = pretrain(_cfg(tmp_path / "resumed", exit_interval=2), mesh)
    assert first["iteration"] == 2
    meta = checkpointing.Checkpointer(str(tmp_path / "resumed"), create=False).read_meta()
    assert meta["consumed_train_samples"] == 4
    second = pretrain(_cfg(tmp_path / "resumed"), mesh)
    assert sorted(second["losses"]) == list(range(3, 7))
    assert second["run"].train_step._cache_size() == 2  # num_micro 2, 3
    for it in range(1, 7):
        got = first["losses"][it] if it <= 2 else second["losses"][it]
        assert got == full["losses"][it], it  # bit-identical
    for a, b in zip(jax.tree.leaves(jax.device_get(full["state"].params)),
                    jax.tree.leaves(jax.device_get(second["state"].params))):
        np.testing.assert_array_equal(a, b)
