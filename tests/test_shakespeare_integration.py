"""The main job end to end on real text: Shakespeare -> tokenizer -> .bin/.idx -> train
(CLI) -> evaluate -> sample, each through its command-line entry point."""

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow


def run(args, **kw):
    env = subprocess_env(1)
    r = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600, **kw)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def test_train_on_shakespeare(tmp_path, shakespeare_dir):
    plays = sorted(str(p) for p in shakespeare_dir.glob("*_gut.txt"))
    assert len(plays) == 42
    tok = tmp_path / "tokenizer.json"
    run(["jmegatron.tools.train_tokenizer", "--input", *plays, "--vocab-size", "2048", "--output", str(tok)])
    out = run(["jmegatron.tools.preprocess_data", "--input", *plays, "--output-prefix", str(tmp_path / "shk"),
               "--tokenizer-model", str(tok), "--append-eod", "--workers", "2"])
    prefix = out.strip().splitlines()[-1]
    assert prefix.endswith("shk_text_document")
    save = tmp_path / "ckpt"
    train_out = run(["jmegatron.train", "--config", "configs/gpt_tiny.py", f"--config.data_path={prefix}",
         f"--config.tokenizer_model={tok}", f"--config.save={save}", "--config.num_layers=2",
         "--config.seq_length=128", "--config.max_position_embeddings=128", "--config.train_iters=40",
         "--config.lr_warmup_iters=5", "--config.log_interval=10", "--config.eval_interval=20",
         "--config.eval_iters=2", "--config.save_interval=20", "--config.peak_tflops=1.0"])
    # Megatron's report_theoretical_memory line, from jmegatron.reporting.memory
    assert re.search(r"theoretical memory per device \(MiB\): weights [\d.]+, .* total [\d.]+", train_out)
    rows = [json.loads(l) for l in open(save / "metrics.jsonl")]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(losses) == 4 and len(vals) == 2
    assert losses[-1] < losses[0] - 0.5  # it learns from the text (ln 2048 = 7.6 at the start)
    assert vals[-1] < vals[0]
    ev = json.loads(run(["jmegatron.evaluate", "--load", str(save), "--split", "test"]).strip().splitlines()[-1])
    assert ev["iteration"] == 40 and ev["ppl"] < 2048
    text = run(["jmegatron.tools.sample", "--load", str(save), "--prompt", "ROMEO:", "--max-new-tokens", "20"])
    assert "ROMEO:" in text and len(text.split("ROMEO:")[-1].strip()) > 0
