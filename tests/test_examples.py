"""examples/: simple_train_loop.py (the pieces used from research code) and custom_loss.py (one's
own loss through the forward-step seam), run as a user would."""

import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, subprocess_env


def test_simple_train_loop_runs_and_learns():
    r = subprocess.run([sys.executable, "examples/simple_train_loop.py", "--iterations", "20"], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=subprocess_env(8))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(l.split("lm loss ")[1].split(",")[0]) for l in r.stdout.splitlines() if "lm loss" in l]
    assert len(losses) == 20 and all(np.isfinite(losses))
    assert "8 devices" in r.stdout and "'data': 8" in r.stdout
    # A fresh model predicts about uniformly over the 1000-token vocabulary: ln(1000) = 6.91.
    assert abs(losses[0] - np.log(1000)) < 0.1, losses[0]
    # The mock documents count up (next token = this one + 1), which the model learns: the loss
    # falls by more than half a nat (measured: 6.94 -> 5.89), and every block of 5 iterations
    # averages below the block before it (not a single lucky batch).
    assert losses[-1] < losses[0] - 0.5, losses
    blocks = [np.mean(losses[i:i + 5]) for i in range(0, 20, 5)]
    assert all(b < a for a, b in zip(blocks, blocks[1:])), blocks


def test_custom_loss_example_reports_its_metrics(tmp_path):
    """examples/custom_loss.py: a label-smoothed loss through the forward-step seam, on two
    data-parallel CPU devices; its extra metrics reach Megatron's console line,
    metrics.jsonl and TensorBoard under their keys."""
    from test_tracking import strict_loads, tensorboard_scalars

    r = subprocess.run([sys.executable, "examples/custom_loss.py", "--iterations", "10", "--save", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=subprocess_env(2))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [l for l in r.stdout.splitlines() if " iteration " in l and "/      10 |" in l]
    console = [{k: float(re.search(rf" {k}: ([0-9.E+-]+) \|", l).group(1))
                for k in ("lm loss", "label_smoothed_loss", "token_accuracy")} for l in lines]
    records = [strict_loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in records if "step_losses" in x]
    assert [x["iteration"] for x in train] == [5, 10] and len(console) == 2
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    for printed, rec in zip(console, train):  # one value, three places
        assert printed["lm loss"] == float(f"{rec['lm_loss']:.6E}")
        for key in ("label_smoothed_loss", "token_accuracy"):
            assert printed[key] == float(f"{rec[key]:.6E}")
            assert tb[key][rec["iteration"]] == pytest.approx(rec[key], rel=1e-6)
    # Smoothing moves probability off the next token: once the model is sure of it, the
    # smoothed loss exceeds the plain cross-entropy; the counting documents are learnt.
    assert train[-1]["label_smoothed_loss"] > train[-1]["lm_loss"]
    assert train[-1]["token_accuracy"] > train[0]["token_accuracy"]
    assert f"iteration 10: lm loss {train[-1]['lm_loss']:.4f}" in r.stdout
