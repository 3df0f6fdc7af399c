"""Offline distillation: ``python -m jmegatron.tools.cache_teacher_logits`` writes a teacher's
top-K log-probabilities per training sample, and a run with ``kd_teacher_logits_path``
reads them instead of running the teacher. Offline equals online top-K distillation on the
same samples (loss and every gradient); the cache resumes after a SIGKILL with the same
contents as one written in one go; a cache built for other data or another K is refused,
naming the field."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from jmegatron.data.builder import build_datasets
from jmegatron.data.loader import BatchLoader
from jmegatron.data.teacher_logits import IDS_KEY, LOGPROBS_KEY, CacheMismatchError, samples_done
from jmegatron.distill.config import DistillConfigError
from jmegatron.parallel.mesh import create_mesh
from jmegatron.pretrain_gpt import build
from jmegatron.reporting import memory
from jmegatron.tools.cache_teacher_logits import build_cache

from test_checkpoint_resume import cfg_for as _cfg_for
from test_distill_moe import save_teacher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = 16


def cfg_for(save, **kw):
    return _cfg_for(save, **{"vocab_size": 512, "train_iters": 2, "global_batch_size": 8, "micro_batch_size": 1,
                             "hidden_dropout": 0.0, "attention_dropout": 0.0, "eval_interval": 0, "lr_warmup_iters": 1,
                             **kw})


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher of fresh weights with init std 0.3 (logits far from uniform), saved once."""
    return save_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, teacher_dir):
    d = str(tmp_path_factory.mktemp("cache"))
    meta = build_cache(cfg_for(d + "_run", kd_teacher_load=teacher_dir), d, K, batch_size=4)
    assert meta["samples_done"] == meta["num_samples"] == 16
    return d


def grads_of(cfg, n=1):
    run = build(cfg, create_mesh(cfg, jax.devices()[:n]))
    train, _, _ = build_datasets(cfg, run.global_batch_size)
    batch = next(iter(BatchLoader(train, run.global_batch_size, run.num_microbatches)))
    g, report, _ = run.compute_grads(run.init_state(), run.put_batch(batch), *run.extra_args)
    return jax.device_get(g), jax.device_get(report), batch


def test_offline_equals_online_top_k_distillation(tmp_path, teacher_dir, cache_dir):
    kd = tmp_path / "kd.yaml"
    kd.write_text(f"logit_kl_topk: {K}\nskip_lm_loss: false\n")
    g_on, r_on, _ = grads_of(cfg_for(tmp_path / "on", kd_teacher_load=teacher_dir, kd_cfg=str(kd)))
    g_off, r_off, batch = grads_of(cfg_for(tmp_path / "off", kd_teacher_logits_path=cache_dir, kd_cfg=str(kd)))
    assert batch[IDS_KEY].shape == (8, 1, 32, K) and batch[LOGPROBS_KEY].dtype == np.float32
    for k in ("loss", "kd_loss", "logits_distillation_loss", "lm_loss"):
        np.testing.assert_allclose(r_off[k], r_on[k], rtol=1e-6, err_msg=k)
    assert r_off["logits_distillation_loss"] > 0.1
    # gradients: float32 rounding of the cached log-probabilities (logits - log-sum-exp): 2e-6
    # of each weight's largest entry at most, seen
    for a, b in zip(jax.tree.leaves(g_off), jax.tree.leaves(g_on)):
        scale = np.max(np.abs(b)) + 1e-12
        np.testing.assert_allclose(a / scale, b / scale, atol=5e-6)
    # under dp 4 the rows arrive split over the data ranks: the same loss
    _, r4, _ = grads_of(cfg_for(tmp_path / "off4", kd_teacher_logits_path=cache_dir, kd_cfg=str(kd)), 4)
    np.testing.assert_allclose(r4["kd_loss"], r_off["kd_loss"], rtol=1e-5)


# runs the tool, SIGKILLing itself at its 3rd progress commit: batch 3 is in the flushed
# arrays, progress.json still says 2 (the worst moment to die)
KILLED_AT_THIRD_COMMIT = """
import os, signal, sys
from jmegatron.tools import cache_teacher_logits as tool
real, commits = tool._write_json, []
def write(path, value):
    if path.endswith("progress.json"):
        commits.append(value)
        if len(commits) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    real(path, value)
tool._write_json = write
sys.exit(tool.main(sys.argv[1:]))
"""


def test_cache_resumes_after_a_kill(tmp_path, teacher_dir, cache_dir):
    """SIGKILL between a batch's flush and its progress commit; the same command again goes
    on from the last committed batch, and the cache equals one written in one go."""
    out = str(tmp_path / "killed")
    args = ["--config", os.path.join(REPO, "configs", "gpt_tiny.py"), "--output", out, "--top-k", str(K),
            "--batch-size", "1"]
    fields = dict(mock_data=True, vocab_size=512, num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=32,
                  max_position_embeddings=32, micro_batch_size=1, global_batch_size=8, train_iters=2,
                  seed=cfg_for(tmp_path).seed, lr_warmup_iters=1, kd_teacher_load=teacher_dir, save=None)
    args += [f"--config.{k}={v}" for k, v in fields.items()]
    from conftest import subprocess_env

    env = dict(subprocess_env(1), PYTHONPATH=REPO)  # one device, the suite's compile flags and cache
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_THIRD_COMMIT] + args, env=env, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert samples_done(out) == 2
    tool = [sys.executable, "-m", "jmegatron.tools.cache_teacher_logits"]
    done = subprocess.run(tool + args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # went on, did not restart, and said so; progress is one tqdm bar on stderr, not a line per batch
    assert f"cache_teacher_logits: {out} holds 2/16 samples; going on from sample 2" in done.stdout.splitlines()
    assert not [line for line in done.stdout.splitlines() if line.endswith("/16 samples")], done.stdout
    assert "cache_teacher_logits: 100%" in done.stderr and "16/16" in done.stderr, done.stderr[-2000:]
    one_go = str(tmp_path / "one_go")
    assert subprocess.run(tool + [a if a != out else one_go for a in args], env=env, capture_output=True,
                          timeout=300).returncode == 0
    for name in ("ids.npy", "logprobs.npy"):
        np.testing.assert_array_equal(np.load(os.path.join(out, name)), np.load(os.path.join(one_go, name)))


def test_a_cache_for_other_data_or_another_k_is_refused(tmp_path, teacher_dir, cache_dir):
    with pytest.raises(CacheMismatchError, match=r"data\.seed: the cache has 1234, this run 7"):
        build_datasets(cfg_for(tmp_path / "s", kd_teacher_logits_path=cache_dir, seed=7), 8)
    with pytest.raises(CacheMismatchError, match="holds 16 complete samples of 16; this run reads 24"):
        build_datasets(cfg_for(tmp_path / "n", kd_teacher_logits_path=cache_dir, train_iters=3), 8)
    kd = tmp_path / "kd.yaml"
    kd.write_text("logit_kl_topk: 8\n")
    with pytest.raises(CacheMismatchError, match="top 16 tokens; the distillation YAML asks logit_kl_topk=8"):
        build(cfg_for(tmp_path / "k", kd_teacher_logits_path=cache_dir, kd_cfg=str(kd)))
    with pytest.raises(CacheMismatchError, match="top_k: the cache has 16, this run 8"):
        build_cache(cfg_for(tmp_path / "c", kd_teacher_load=teacher_dir), cache_dir, 8)
    assert json.load(open(os.path.join(cache_dir, "progress.json")))["samples_done"] == 16  # untouched


def test_a_teacher_on_its_own_layout_equals_one_device(tmp_path, teacher_dir):
    """kd_teacher_use_megatron_fsdp: the teacher's parameters sharded over the data ranks
    (the student's are not), its top-K computed before the student's loop under GSPMD; tp2 x
    dp4 equals one device in loss and every gradient (one device runs the data ranks'
    micro-batches of 1 row one after another: the balancer's ratios are each one's)."""
    kd = tmp_path / "kd.yaml"
    kd.write_text(f"logit_kl_topk: {K}\nskip_lm_loss: false\n")
    g1, r1, _ = grads_of(cfg_for(tmp_path / "one", kd_teacher_load=teacher_dir, kd_cfg=str(kd)))
    cfg = cfg_for(tmp_path / "own", kd_teacher_load=teacher_dir, kd_cfg=str(kd), kd_teacher_use_megatron_fsdp=True,
                  tensor_model_parallel_size=2)
    run = build(cfg, create_mesh(cfg, jax.devices()[:8]))
    # the teacher's weights are split over the data ranks, the student's are whole on each
    fc1 = run.extra_args[0]["decoder_layers"]["mlp"]["linear_fc1"]["kernel"]  # scanned: [layers, h, ffn]
    assert "data" in str(fc1.sharding.spec) and fc1.addressable_shards[0].data.size * 8 == fc1.size
    assert "data" not in str(run.state_shardings.params["decoder_layers_0"]["mlp"]["linear_fc1"]["kernel"].spec)
    # the memory line's "frozen inputs": the teacher's bytes on one device, as laid out
    whole = sum(a.nbytes for a in jax.tree.leaves(run.extra_args))
    assert whole / 8 <= memory.bytes_per_device(run.extra_args) < whole / 4
    g2, r2, _ = grads_of(cfg, 8)
    for k in ("loss", "kd_loss", "logits_distillation_loss", "lm_loss"):
        np.testing.assert_allclose(r2[k], r1[k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        scale = np.max(np.abs(b)) + 1e-12
        np.testing.assert_allclose(a / scale, b / scale, atol=1e-5)
    kd.write_text("skip_lm_loss: false\n")  # the full-vocabulary KL needs the teacher's logits in the loop
    with pytest.raises(DistillConfigError, match="kd_teacher_use_megatron_fsdp .* set logit_kl_topk"):
        build(cfg, create_mesh(cfg, jax.devices()[:8]))


def test_model_report_counts_the_teacher_in_its_layout(tmp_path, teacher_dir, capsys):
    from jmegatron.tools import model_report

    def teacher_line(*extra):
        out = str(tmp_path / "r.json")
        assert model_report.main(["--config", os.path.join(REPO, "configs", "gpt_tiny.py"), "--dp", "4", "--json", out, "--config.mock_data=True",
                                  "--config.vocab_size=512", "--config.micro_batch_size=2",
                                  f"--config.kd_teacher_load={teacher_dir}", *extra]) == 0
        text = capsys.readouterr().out
        assert "teacher (frozen)" in text
        return json.load(open(out))["teacher"]

    same, own = teacher_line(), teacher_line("--config.kd_teacher_use_megatron_fsdp=True")
    assert same["layout"] == "the student's" and own["layout"].startswith("its own")
    assert same["num_parameters"] == own["num_parameters"] > 0
    assert own["bytes_per_device"] < same["bytes_per_device"] / 2  # split over the 4 data ranks (norms whole)


def test_a_finalized_offline_student_keeps_no_distillation_setting(tmp_path):
    """kd_finalize's checkpoint meta (and config.json) is a plain student's: an offline run's
    ``kd_teacher_logits_path`` is dropped with the other distillation settings, so a run
    started from that config.json trains without distillation."""
    from types import SimpleNamespace

    from jmegatron.config import DISTILLATION_RESETS, JMegatronConfig
    from jmegatron.training.run import checkpoint_meta

    cfg = JMegatronConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                          max_position_embeddings=16, micro_batch_size=1, global_batch_size=1, vocab_size=64,
                          mock_data=True, kd_finalize=True, kd_teacher_logits_path=str(tmp_path / "cache"),
                          kd_teacher_bf16=True, load=str(tmp_path / "run"), save=str(tmp_path / "final"))
    saved = checkpoint_meta(cfg, SimpleNamespace(padded_vocab_size=128, aux_modules={}), 3, 3)["config"]
    assert {k: saved[k] for k in DISTILLATION_RESETS} == DISTILLATION_RESETS
    JMegatronConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})  # a valid plain run
