"""Multi-process runs on JAX's own runtime (jax.distributed, gloo CPU collectives on
127.0.0.1): 2 processes x 2 devices train like 1 process x 4 devices, each process reading
only the rows its devices hold; a dead rank stops the run within a bounded time;
checkpoints are written once and resume."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

TRAIN = [sys.executable, "-m", "jmegatron.train", "--config", "configs/gpt_tiny.py",
         "--config.mock_data=True", "--config.vocab_size=300", "--config.num_layers=2",
         "--config.hidden_size=32", "--config.num_attention_heads=2", "--config.seq_length=32",
         "--config.max_position_embeddings=32", "--config.micro_batch_size=2", "--config.global_batch_size=16",
         "--config.lr_warmup_iters=2", "--config.log_interval=1", "--config.eval_interval=0",
         "--config.peak_tflops=1.0", "--config.tensor_model_parallel_size=2"]


def _env(devices):
    # the suite's compile flag (tests/conftest.py); no compilation cache: the ranks' collectives
    # span processes
    env = {k: v for k, v in os.environ.items() if not k.startswith("JMEGATRON_")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    return env


def _losses(save):
    rows = [json.loads(l) for l in open(os.path.join(save, "metrics.jsonl"))]
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}


def test_two_processes_match_one_and_each_reads_only_its_rows(tmp_path):
    """2 processes x 2 devices (tp2 inside a process, dp2 across them) under the launcher
    train like 1 process x 4 devices; each process reads only the rows its devices hold
    (tests/data_loader_worker.py records the reads); one metrics file and one set of
    checkpoint steps are written by the processes together."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    iters, gbs, rows = 4, 16, 4  # micro_batch_size 2 x dp 2: rows per micro-batch
    args = [f"--config.train_iters={iters}", "--config.save_interval=2", "--config.num_workers=2"]
    worker = [sys.executable, "tests/data_loader_worker.py"]
    r = subprocess.run([sys.executable, "-m", "jmegatron.launch", "--nproc", "2", "--devices-per-proc", "2", "--"]
                       + worker + [str(two)] + TRAIN[3:] + args + [f"--config.save={two / 'run'}"],
                       cwd=REPO, env=_env(1), timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    r1 = subprocess.run(worker + [str(one)] + TRAIN[3:] + args + [f"--config.save={one / 'run'}"], cwd=REPO,
                        env=_env(4), timeout=300, capture_output=True, text=True)
    assert r1.returncode == 0, r1.stderr[-3000:]
    ranks = [json.load(open(two / f"rank{p}.json")) for p in (0, 1)]
    single = json.load(open(one / "rank0.json"))
    trained = iters * gbs  # samples the iterations consume (the prefetch thread may read further)
    assert single["rows"] is None and set(range(trained)) <= set(single["read"])
    for p, rank in enumerate(ranks):
        # process p holds data rank p (its 2 devices are one tensor-parallel pair) = rows 2p, 2p+1
        assert rank["rows"] == [2 * p, 2 * p + 1] and rank["rows_per_microbatch"] == rows
        read = np.array(rank["read"])
        assert np.all(np.isin(read % rows, rank["rows"])), "a process read a row it does not hold"
        mine = [i for i in range(trained) if i % rows in rank["rows"]]
        assert sorted(read[read < trained].tolist()) == mine  # each of its samples exactly once
    assert not set(ranks[0]["read"]) & set(ranks[1]["read"])
    a, b = _losses(one / "run"), _losses(two / "run")
    assert sorted(a) == sorted(b) == list(range(1, iters + 1))
    np.testing.assert_allclose([b[i] for i in range(1, iters + 1)], [a[i] for i in range(1, iters + 1)], rtol=1e-6)
    assert sorted(os.listdir(two / "run")) == ["2", "4", "config.json", "metrics.jsonl", "tensorboard"]
    # (one process resuming a 2-process checkpoint: tests/test_stop.py's SIGTERM test)


def test_dead_rank_stops_the_run(tmp_path):
    cmd = [sys.executable, "-m", "jmegatron.launch", "--nproc", "2", "--devices-per-proc", "2", "--grace", "5",
           "--"] + TRAIN + ["--config.train_iters=100000", f"--config.save={tmp_path / 'x'}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    pids, seen = {}, []
    deadline = time.time() + 240
    for line in proc.stdout:
        seen.append(line)
        m = re.match(r"\[jmegatron.launch\] rank (\d+): pid (\d+)", line)
        if m:
            pids[int(m.group(1))] = int(m.group(2))
        if "iteration        2/" in line or time.time() > deadline:
            break
    assert 1 in pids, "".join(seen)
    t0 = time.time()
    os.kill(pids[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    elapsed = time.time() - t0
    assert proc.returncode != 0
    assert "rank 1 exited with -9" in out and "stopping the other ranks" in out, out[-2000:]
    assert elapsed < 60, elapsed


# --- the launcher's environment per rank (pure: the GPU count injected) ---

from jmegatron.distributed import ENV_LOCAL_DEVICE_IDS, target_platform  # noqa: E402
from jmegatron.launch import rank_env  # noqa: E402


@pytest.mark.parametrize("base,gpus,platform", [
    ({}, 0, "cpu"),  # no GPU, nothing set: the CPU, as before
    ({}, 8, None),  # a GPU machine: JAX_PLATFORMS left unset, JAX picks the GPU
    ({"JAX_PLATFORMS": "cpu"}, 8, "cpu"),  # the user's choice passes through
    ({"JAX_PLATFORMS": "cuda"}, 8, "cuda"),
])
def test_launcher_passes_jax_platforms_through_and_forces_nothing_on_a_gpu_machine(base, gpus, platform):
    env = rank_env(base, 1, 2, 1234, gpu_count=gpus)
    assert env.get("JAX_PLATFORMS") == platform
    assert env["JMEGATRON_PROCESS_ID"] == "1" and env["JMEGATRON_COORDINATOR"] == "127.0.0.1:1234"
    assert target_platform(env, gpus) == ("cpu" if platform == "cpu" or gpus == 0 else "gpu")


def test_launcher_devices_per_proc_cpu_devices_or_gpu_ids():
    cpu = rank_env({"XLA_FLAGS": "--x"}, 0, 2, 1, devices_per_proc=3, gpu_count=0)
    assert cpu["XLA_FLAGS"] == "--x --xla_force_host_platform_device_count=3" and ENV_LOCAL_DEVICE_IDS not in cpu
    gpu = rank_env({}, 1, 2, 1, devices_per_proc=4, gpu_count=8)
    assert gpu[ENV_LOCAL_DEVICE_IDS] == "4,5,6,7" and "XLA_FLAGS" not in gpu
    with pytest.raises(ValueError, match="needs 10 GPUs; this machine has 8"):
        rank_env({}, 0, 2, 1, devices_per_proc=5, gpu_count=8)
