"""Checkpoints: exact resume, incompatible and corrupt checkpoints, SIGTERM saves."""

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.config import base_config, from_configdict
from jmegatron.checkpoint import checkpointing
from jmegatron.training.loop import pretrain

from conftest import REPO, subprocess_env


def cfg_for(save, **kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 300
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 2, 32, 2, 32
    c.micro_batch_size, c.global_batch_size = 1, 16  # 8 devices: dp 8, 2 micro-batches
    c.train_iters, c.log_interval, c.eval_interval, c.eval_iters = 40, 5, 20, 2
    c.lr, c.lr_warmup_iters, c.lr_decay_style, c.peak_tflops = 1e-3, 5, "cosine", 1.0
    c.save = str(save)
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


def test_resume_is_bit_exact(tmp_path):
    # hidden/attention dropout stay on (0.1): the resumed run must reproduce the RNG too.
    full = pretrain(cfg_for(tmp_path / "full"))
    assert full["iteration"] == 40
    first = pretrain(cfg_for(tmp_path / "resumed", exit_interval=20))
    assert first["iteration"] == 20
    second = pretrain(cfg_for(tmp_path / "resumed"))  # same save dir: resumes at 20
    assert sorted(second["losses"]) == list(range(21, 41))
    for it in range(21, 41):
        assert second["losses"][it] == full["losses"][it], it  # bit-identical
    # metrics.jsonl: one object per logged step with the documented keys
    rows = [json.loads(l) for l in open(tmp_path / "full" / "metrics.jsonl")]
    train_rows = [r for r in rows if "lm_loss" in r]
    assert [r["iteration"] for r in train_rows] == list(range(5, 41, 5))
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu"):
        assert key in train_rows[0]
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["iteration"] for r in val_rows] == [20, 40]
    assert val_rows[-1]["val_ppl"] == pytest.approx(np.exp(val_rows[-1]["val_loss"]))
    assert os.path.isdir(tmp_path / "full" / "tensorboard")


def test_incompatible_config_names_both_values(tmp_path):
    pretrain(cfg_for(tmp_path, exit_interval=2))
    with pytest.raises(checkpointing.CheckpointError, match=r"hidden_size: checkpoint 32 vs config 64"):
        pretrain(cfg_for(tmp_path, hidden_size=64))


def test_corrupt_and_missing_checkpoints_fail_clearly(tmp_path):
    with pytest.raises(checkpointing.CheckpointError, match="holds no checkpoint"):
        pretrain(cfg_for(tmp_path / "new", load=str(tmp_path / "nothing")))
    pretrain(cfg_for(tmp_path / "c", exit_interval=2))
    step_dir = tmp_path / "c" / "2" / "state"
    for root, _, files in os.walk(step_dir):
        for f in files:
            p = os.path.join(root, f)
            if os.path.getsize(p) > 64:
                with open(p, "r+b") as fh:
                    fh.truncate(16)
    with pytest.raises(checkpointing.CheckpointError, match="corrupt"):
        pretrain(cfg_for(tmp_path / "c"))


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path):
    save = tmp_path / "sig"
    cmd = [sys.executable, "-m", "jmegatron.train", "--config", "configs/gpt_tiny.py",
           "--config.mock_data=True", "--config.vocab_size=300", "--config.num_layers=2",
           "--config.hidden_size=32", "--config.num_attention_heads=2", "--config.seq_length=32",
           "--config.max_position_embeddings=32", "--config.micro_batch_size=2",
           "--config.global_batch_size=2", "--config.train_iters=100000", "--config.log_interval=1",
           "--config.peak_tflops=1.0", f"--config.save={save}", "--config.save_interval=None"]
    env = subprocess_env(1)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.time() + 180
    for line in proc.stdout:
        seen.append(line)
        if "iteration        3/" in line or time.time() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(seen) + out
    assert "saving a checkpoint" in out
    steps = checkpointing.Checkpointer(str(save), create=False).all_steps()
    assert steps and steps[0] >= 3


def test_rerun_continues_from_save_and_metrics_are_not_duplicated(tmp_path):
    # fine-tune from `load` into a new `save`; a rerun continues from `save`, not from `load`
    pretrain(cfg_for(tmp_path / "pre", exit_interval=5))
    cfg = cfg_for(tmp_path / "ft", load=str(tmp_path / "pre"), exit_interval=10, eval_interval=0)
    first = pretrain(cfg)
    assert sorted(first["losses"]) == list(range(6, 11))
    # a run that died after its last checkpoint left records past it: they are dropped
    with open(tmp_path / "ft" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": 13, "lm_loss": 1.0}) + "\n")
    second = pretrain(cfg.replace(exit_interval=15))
    assert sorted(second["losses"]) == list(range(11, 16))
    its = [json.loads(l)["iteration"] for l in open(tmp_path / "ft" / "metrics.jsonl")]
    assert its == sorted(set(its)) == [10, 15]  # the stray 13 is gone


def test_save_time_is_not_the_next_iterations(tmp_path, monkeypatch):
    # Megatron's save_checkpoint_and_time stops the interval timer while it saves
    slow_save = checkpointing.Checkpointer.save

    def save(self, *a, **kw):
        time.sleep(2.0)
        return slow_save(self, *a, **kw)

    monkeypatch.setattr(checkpointing.Checkpointer, "save", save)
    # (exit_interval, not train_iters: test_resume_is_bit_exact's schedule, so its compiled step)
    pretrain(cfg_for(tmp_path, exit_interval=3, log_interval=1, save_interval=1, eval_interval=0))
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[1]["step_time_s"] < 2.0, rows[1]["step_time_s"]  # iteration 2 after the save at 1
    # Megatron keeps every --save-interval checkpoint (config.keep_checkpoints None)
    assert checkpointing.Checkpointer(str(tmp_path), create=False).all_steps() == [1, 2, 3]


def test_keep_checkpoints_is_an_opt_in_that_names_what_it_deletes(tmp_path, capsys):
    # every save stays by default (test_save_time_is_not_the_next_iterations runs the loop)
    assert cfg_for(tmp_path).keep_checkpoints is None
    ckpt = checkpointing.Checkpointer(str(tmp_path / "two"), max_to_keep=2)
    said = []
    for it in range(1, 5):
        ckpt.save(it, {"w": jnp.full((4,), float(it))}, {"iteration": it})
        said.append([l for l in capsys.readouterr().out.splitlines() if "deleting checkpoint" in l])
        assert ckpt.all_steps() == list(range(max(1, it - 1), it + 1))
    ckpt.close()
    assert [len(s) for s in said] == [0, 0, 1, 1]
    assert "keep_checkpoints=2: deleting checkpoint iteration(s) [1]" in said[2][0]
    assert "iteration(s) [2]" in said[3][0] and "keep_checkpoints=None keeps every save" in said[3][0]
    with pytest.raises(Exception, match=r"keep_checkpoints=0 must be > 0, or None"):
        cfg_for(tmp_path, keep_checkpoints=0)
