"""Process-local reads with 2 real processes (jax.distributed, gloo on 127.0.0.1): each
process reads only the rows its devices hold, and training matches one process reading
whole batches (tests/data_loader_worker.py records each process's reads)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

ITERS, GBS, ROWS = 3, 16, 8  # micro_batch_size 2 x dp 4: rows per micro-batch
ARGS = ["--config", "configs/gpt_tiny.py", "--config.mock_data=True", "--config.vocab_size=300",
        "--config.num_layers=1", "--config.hidden_size=32", "--config.num_attention_heads=2",
        "--config.seq_length=16", "--config.max_position_embeddings=16", "--config.micro_batch_size=2",
        f"--config.global_batch_size={GBS}", f"--config.train_iters={ITERS}", "--config.lr_warmup_iters=1",
        "--config.log_interval=1", "--config.eval_interval=0", "--config.peak_tflops=1.0",
        "--config.num_workers=2"]


def _env(devices):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JMEGATRON_")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def test_each_process_reads_only_its_rows_and_training_matches_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    worker = [sys.executable, "tests/data_loader_worker.py"]
    r = subprocess.run([sys.executable, "-m", "jmegatron.launch", "--nproc", "2", "--devices-per-proc", "2", "--"]
                       + worker + [str(two)] + ARGS, cwd=REPO, env=_env(1), timeout=400, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    r1 = subprocess.run(worker + [str(one)] + ARGS, cwd=REPO, env=_env(4), timeout=400, capture_output=True,
                        text=True)
    assert r1.returncode == 0, r1.stderr[-3000:]
    ranks = [json.load(open(two / f"rank{p}.json")) for p in (0, 1)]
    single = json.load(open(one / "rank0.json"))
    trained = ITERS * GBS  # samples the 3 iterations consume (the prefetch thread may read further)
    assert single["rows"] is None and set(range(trained)) <= set(single["read"])
    for p, rank in enumerate(ranks):
        # dp 4 over 2 processes x 2 devices: process p holds data ranks 2p, 2p+1 = rows 4p..4p+3
        assert rank["rows"] == list(range(4 * p, 4 * p + 4)) and rank["rows_per_microbatch"] == ROWS
        read = np.array(rank["read"])
        assert np.all(np.isin(read % ROWS, rank["rows"])), "a process read a row it does not hold"
        mine = [i for i in range(trained) if i % ROWS in rank["rows"]]
        assert sorted(read[read < trained].tolist()) == mine  # each of its samples exactly once
    assert not set(ranks[0]["read"]) & set(ranks[1]["read"])
    a, b = single["losses"], ranks[0]["losses"]
    assert sorted(a) == sorted(b) == [str(i) for i in range(1, ITERS + 1)]
    np.testing.assert_allclose([b[k] for k in sorted(b)], [a[k] for k in sorted(a)], rtol=1e-6)
