"""A checkpoint saved under tp2 x dp4 resumes under dp8 and under tp4 x dp2 (Orbax
restores into the new shardings) and continues with the losses of an uninterrupted run."""

import shutil

import numpy as np
import pytest

from jmegatron.training.loop import pretrain

from test_checkpoint_resume import cfg_for


def layout_cfg(save, **kw):
    # vocab 512 pads to 512 under tp 1, 2 and 4 (Megatron pads to a multiple of 128 x tp)
    return cfg_for(save, vocab_size=512, hidden_dropout=0.0, attention_dropout=0.0, num_attention_heads=4,
                   micro_batch_size=2, train_iters=6, eval_interval=0, **kw)


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    """The uninterrupted tp2 x dp4 run's losses and its save directory, checkpoints at
    iterations 3 and 6 (trained once; each case resumes from its own copy without 6)."""
    d = tmp_path_factory.mktemp("tp2")
    full = pretrain(layout_cfg(d / "full", tensor_model_parallel_size=2, save_interval=3))
    assert sorted(p.name for p in (d / "full").iterdir() if p.name.isdigit()) == ["3", "6"]
    return full["losses"], d / "full"


# tp2 -> tp1 (dp8) and tp2 -> tp4 with SP and ZeRO-1 (the tensor split of a plain tp4, and the
# optimizer state resharded over the data ranks)
@pytest.mark.parametrize("new_layout", [dict(), dict(tensor_model_parallel_size=4, sequence_parallel=True,
                                                     use_distributed_optimizer=True)])
def test_resume_under_another_layout(tmp_path, new_layout, tp2_runs):
    full_losses, saved = tp2_runs
    shutil.copytree(saved, tmp_path / "saved")
    shutil.rmtree(tmp_path / "saved" / "6")  # resumes from iteration 3
    resumed = pretrain(layout_cfg(tmp_path / "saved", **new_layout))
    assert resumed["run"].mesh.shape["tensor"] == new_layout.get("tensor_model_parallel_size", 1)
    assert sorted(resumed["losses"]) == [4, 5, 6]
    np.testing.assert_allclose([resumed["losses"][i] for i in (4, 5, 6)],
                               [full_losses[i] for i in (4, 5, 6)], rtol=1e-5)
