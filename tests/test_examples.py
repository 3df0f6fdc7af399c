"""examples/simple_train_loop.py: the pieces used from research code, run as a user would."""

import os
import subprocess
import sys

import numpy as np

from conftest import REPO


def test_simple_train_loop_runs_and_learns():
    r = subprocess.run([sys.executable, "examples/simple_train_loop.py"], cwd=REPO, capture_output=True,
                       text=True, timeout=300,
                       env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(l.split("lm loss ")[1].split(",")[0]) for l in r.stdout.splitlines() if "lm loss" in l]
    assert len(losses) == 5 and all(np.isfinite(losses))
    assert "8 devices" in r.stdout and "'data': 8" in r.stdout
