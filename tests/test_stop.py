"""Stopping several processes: SIGTERM to the launcher makes every rank save the same
iteration, a bounded number of iterations after the signal whatever log_interval, and exit
0; the launcher never kills a rank that is still saving before --stop-timeout; a rank
killed in the middle of a save leaves no checkpoint marked complete (Orbax's commit
protocol: the step stays a tmp directory, absent from all_steps)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import REPO

LAUNCH = [sys.executable, "-m", "jmegatron.launch"]
TRAIN = [sys.executable, "-m", "jmegatron.train", "--config", "configs/gpt_tiny.py",
         "--config.mock_data=True", "--config.vocab_size=300", "--config.num_layers=2",
         "--config.hidden_size=32", "--config.num_attention_heads=2", "--config.seq_length=32",
         "--config.max_position_embeddings=32", "--config.micro_batch_size=2", "--config.global_batch_size=8",
         "--config.lr_warmup_iters=2", "--config.eval_interval=0", "--config.peak_tflops=1.0"]


def _env(devices=1):
    # the suite's compile flag (tests/conftest.py); no compilation cache: the launched ranks'
    # collectives span processes
    env = {k: v for k, v in os.environ.items() if not k.startswith("JMEGATRON_")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    return env


def test_launcher_waits_for_a_slow_save_until_stop_timeout(tmp_path):
    # A rank that takes 3 s to "save" after SIGTERM is waited for (the old launcher killed it
    # 6 x --grace = 1.2 s after forwarding); one that never exits is killed at --stop-timeout,
    # or at once by a second SIGTERM to the launcher.
    # Readiness is a file per rank (not a pipe: a pipe's reader can block on a rank that
    # outlives a failed launcher), written once the rank's handler is installed.
    slow = textwrap.dedent("""
        import os, pathlib, signal, sys, time
        done = []
        signal.signal(signal.SIGTERM, lambda *a: done.append(time.time()))
        pathlib.Path(sys.argv[2], f"ready.{os.getpid()}").touch()
        while not done:
            time.sleep(0.05)
        time.sleep(float(sys.argv[1]))  # the save
    """)
    script = tmp_path / "slow.py"
    script.write_text(slow)
    for case, (save_s, timeout, expect_rc, signals) in enumerate(((3.0, 30, 0, 1), (600.0, 2, 1, 1),
                                                                  (600.0, 60, 1, 2))):
        flags, log = tmp_path / f"ready{case}", tmp_path / f"launcher{case}.err"
        flags.mkdir()
        with open(log, "w") as err_file:
            proc = subprocess.Popen(LAUNCH + ["--nproc", "2", "--grace", "0.2", "--stop-timeout", str(timeout),
                                              "--", sys.executable, str(script), str(save_s), str(flags)],
                                    cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=err_file)
        try:
            deadline = time.time() + 60
            while len(list(flags.iterdir())) < 2:
                assert proc.poll() is None and time.time() < deadline, log.read_text()
                time.sleep(0.05)
            t0 = time.time()
            for _ in range(signals):
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            left = []  # ranks alive after the launcher exited: killed here, and the case fails
            for f in flags.iterdir():
                try:
                    os.kill(int(f.name.split(".")[1]), signal.SIGKILL)
                    left.append(f.name)
                except ProcessLookupError:
                    pass
        elapsed, err = time.time() - t0, log.read_text()
        assert not left, (case, left, err)
        assert proc.returncode == expect_rc, err
        if expect_rc == 0:
            assert elapsed >= save_s - 0.5
        elif signals == 1:
            assert timeout - 0.5 <= elapsed < timeout + 10, elapsed
            assert "--stop-timeout" in err, err
        else:
            assert elapsed < 15 and "--stop-timeout" not in err, (elapsed, err)


@pytest.mark.slow
def test_sigterm_to_the_launcher_both_ranks_save_the_same_iteration_and_resume(tmp_path):
    save = str(tmp_path / "ckpt")
    cmd = LAUNCH + ["--nproc", "2", "--devices-per-proc", "1", "--"] + TRAIN + [
        "--config.train_iters=1000000", "--config.log_interval=100000", f"--config.save={save}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.time() + 240
    for line in proc.stdout:  # rank 0 prints this just before its first step
        seen.append(line)
        if "theoretical memory per device" in line or time.time() > deadline:
            break
    time.sleep(3.0)  # a few steps (log_interval is far away: nothing is printed per step)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    out = "".join(seen) + out
    assert proc.returncode == 0, out[-4000:]
    noticed = {int(p): int(i) for p, i in re.findall(r"process (\d): signal \d+ noticed at iteration (\d+)", out)}
    saved = [int(i) for i in re.findall(r"saving a checkpoint at iteration (\d+)", out)]
    assert sorted(noticed) == [0, 1], out[-4000:]
    assert len(saved) == 2 and saved[0] == saved[1], saved  # both ranks, the same iteration
    # the ranks agree through the step after the first flagged one: a bound independent of log_interval
    assert min(noticed.values()) < saved[0] <= min(noticed.values()) + 1, (noticed, saved)
    from jmegatron.checkpoint.checkpointing import Checkpointer

    ckpt = Checkpointer(save, create=False)
    assert ckpt.all_steps() == [saved[0]]
    ckpt.close()
    more = subprocess.run(TRAIN + [f"--config.train_iters={saved[0] + 2}", "--config.log_interval=1",
                                   "--config.override_opt_param_scheduler=True",
                                   f"--config.save={save}"], cwd=REPO, env=_env(2), timeout=300,
                          capture_output=True, text=True)
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"at iteration {saved[0]}" in more.stdout and f"iteration {saved[0] + 2:8d}/" in more.stdout


SAVE_KILL = textwrap.dedent('''
    """Under the launcher, 2 processes x 1 device: save step 1, then step 2 with rank 1
    SIGKILLed inside the save at Orbax barrier sys.argv[2]."""
    import os, signal, sys
    import numpy as np
    from jmegatron.distributed import initialize_from_env
    initialize_from_env()
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from orbax.checkpoint._src.multihost import multihost
    from jmegatron.checkpoint.checkpointing import Checkpointer

    directory, kill_at = sys.argv[1], sys.argv[2]
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))

    def state(value):
        return {"w": jax.make_array_from_callback((8, 4), sharding, lambda i: np.full((4, 4), value, np.float32))}

    ckpt = Checkpointer(directory)
    ckpt.save(1, state(1.0), {"iteration": 1})
    ckpt.wait()
    original = multihost.sync_global_processes

    def sync(name, *args, **kwargs):
        if jax.process_index() == 1 and name == kill_at:
            print(f"rank 1 killed at {name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(name, *args, **kwargs)

    multihost.sync_global_processes = sync
    ckpt.save(2, state(2.0), {"iteration": 2})
    ckpt.wait()
    print("step 2 saved", flush=True)
''')


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["create_tmp_directory:post", "Checkpointer:save"])
def test_a_rank_killed_mid_save_leaves_no_complete_checkpoint(tmp_path, kill_at):
    # create_tmp_directory:post: nothing of step 2 written yet; Checkpointer:save: every
    # rank's shards written, the commit (rename by rank 0) not done.
    script, directory = tmp_path / "save_kill.py", str(tmp_path / "ckpt")
    script.write_text(SAVE_KILL)
    r = subprocess.run(LAUNCH + ["--nproc", "2", "--devices-per-proc", "1", "--grace", "3", "--",
                                 sys.executable, str(script), directory, kill_at],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode != 0 and f"rank 1 killed at {kill_at}" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "step 2 saved" not in r.stdout
    import jax
    from jax.sharding import SingleDeviceSharding

    from jmegatron.checkpoint.checkpointing import Checkpointer, has_checkpoint

    ckpt = Checkpointer(directory, create=False)
    assert ckpt.all_steps() == [1] and has_checkpoint(directory)
    assert not os.path.exists(os.path.join(directory, "2"))  # at most a tmp directory
    target = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}
    state, meta = ckpt.restore(target)
    assert meta["iteration"] == 1
    np.testing.assert_array_equal(np.asarray(state["w"]), np.ones((8, 4), np.float32))
    ckpt.close()
