"""Kill the trainer (SIGKILL) at random points of its checkpoint saves, resume, check bit-exactness.

    python -m jmegatron.tools.checkpoint_faults --kills 100 --out docs/bench/checkpoint_faults.json

One uninterrupted reference run (gpt_tiny shrunk, mock data, one CPU device, a checkpoint
every iteration, all kept) gives the state at every iteration. Then a chain of trainer
processes shares one save directory: each resumes from the last complete checkpoint there
and is killed by :mod:`jmegatron.checkpoint.checkpointing`'s test hook
(``JMEGATRON_CHECKPOINT_KILL=<n>:<seconds>``: a timer started when the n-th save of the
process begins, so the kill lands inside Orbax's save, in its background write when
``async_save``, or just after). Saves alternate between synchronous and async processes.
After every kill the parent restores the newest checkpoint through the trainer's own path
(:func:`jmegatron.training.run.restore_latest`: fingerprints checked, ``ckpt_fallback``)
and compares every array, bit for bit, with the reference's at that iteration; what the
kill left on disk is recorded (an ``*.orbax-checkpoint-tmp*`` directory: killed inside
Orbax's write). A last process trains to the end; its final state must equal the
reference's. Prints (and with ``--out`` writes) a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any, Optional

from jmegatron.checkpoint import checkpointing
from jmegatron.config import load_config_file
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build, restore_latest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# gpt_tiny shrunk so that a process starts, trains and saves in a few seconds on a CPU
TINY = {"mock_data": True, "vocab_size": 256, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
        "num_attention_heads": 2, "seq_length": 16, "max_position_embeddings": 16, "micro_batch_size": 2,
        "global_batch_size": 2, "log_interval": 1, "eval_interval": 0, "peak_tflops": 1.0,
        "lr_warmup_iters": 2, "save_interval": 1}


def overrides(save: str, train_iters: int, async_save: bool, keep: int) -> dict:
    return dict(TINY, save=save, train_iters=train_iters, async_save=async_save, keep_checkpoints=keep)


def command(o: dict) -> list[str]:
    return [sys.executable, "-m", "jmegatron.train", "--config", "configs/gpt_tiny.py"] + \
        [f"--config.{k}={v}" for k, v in o.items()]


def environment(cache_dir: str, kill: Optional[tuple[int, float]] = None) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONPATH=REPO)
    env.pop("JMEGATRON_CHECKPOINT_KILL", None)
    if kill:
        env["JMEGATRON_CHECKPOINT_KILL"] = f"{kill[0]}:{kill[1]:.4f}"
    return env


def train(o: dict, cache_dir: str, kill=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command(o), cwd=REPO, env=environment(cache_dir, kill), capture_output=True, text=True,
                          timeout=timeout)


def _cfg(o: dict):
    return load_config_file(os.path.join(REPO, "configs", "gpt_tiny.py"), o)


def _host(state: Any) -> list:
    import jax
    import numpy as np

    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def bit_equal(a: list, b: list) -> bool:
    import numpy as np

    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and
                                    np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))
                                    for x, y in zip(a, b))


def campaign(workdir: str, kills: int, seed: int = 0, max_delay: float = 0.25, log=print) -> dict:
    """Run the reference and ``kills`` killed processes under ``workdir``; return the summary
    (``kills``: one record per killed process, ``bit_exact`` counts, the final check)."""
    import jax

    rng = random.Random(seed)
    cache = os.path.join(workdir, "jax_cache")
    # each killed process makes ~1-3 saves of progress; leave room so the chain never finishes early
    train_iters = 3 * kills + 6
    ref_dir, chain_dir = os.path.join(workdir, "reference"), os.path.join(workdir, "chain")
    t0 = time.time()
    ref = train(overrides(ref_dir, train_iters, False, train_iters + 1), cache)
    if ref.returncode:
        raise RuntimeError(f"reference run failed:\n{ref.stdout[-3000:]}\n{ref.stderr[-3000:]}")
    log(f"reference: {train_iters} iterations in {time.time() - t0:.1f} s")
    cfg = _cfg(overrides(ref_dir, train_iters, False, 2))
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    ref_ckpt = checkpointing.Checkpointer(ref_dir, create=False)
    reference: dict[int, list] = {}

    def reference_at(step: int) -> list:
        if step not in reference:
            reference[step] = _host(ref_ckpt.restore(run.abstract_with_shardings(), step)[0])
        return reference[step]

    records = []
    for k in range(kills):
        async_save = k % 2 == 1
        kill = (rng.randint(1, 3), rng.uniform(0.0, max_delay))
        t = time.time()
        p = train(overrides(chain_dir, train_iters, async_save, 2), cache, kill)
        killed = p.returncode == -9
        left = [os.path.basename(d) for d in checkpointing.incomplete_saves(chain_dir)]
        rec = {"process": k, "async_save": async_save, "kill_at_save": kill[0], "delay_s": round(kill[1], 4),
               "killed": killed, "returncode": p.returncode, "tmp_dirs_left": left, "seconds": round(time.time() - t, 1)}
        if not killed:
            rec["output"] = (p.stdout + p.stderr)[-2000:]
        if checkpointing.has_checkpoint(chain_dir):
            ckpt = checkpointing.Checkpointer(chain_dir, create=False)
            rec["steps_on_disk"] = ckpt.all_steps()
            state, meta = restore_latest(run, ckpt)
            rec["resumed_step"] = int(meta["iteration"])
            rec["bit_exact"] = bit_equal(_host(state), reference_at(rec["resumed_step"]))
        else:
            rec["resumed_step"], rec["bit_exact"] = 0, True  # nothing saved yet: a fresh start
        records.append(rec)
        log(json.dumps(rec))
    final = train(overrides(chain_dir, train_iters, False, 2), cache)
    ok = final.returncode == 0
    last = None
    if ok:
        ckpt = checkpointing.Checkpointer(chain_dir, create=False)
        state, meta = restore_latest(run, ckpt)
        last = int(meta["iteration"])
        ok = last == train_iters and bit_equal(_host(state), reference_at(train_iters))
    summary = {
        "kill_points": len(records),
        "killed_by_sigkill": sum(r["killed"] for r in records),
        "killed_inside_orbax_write": sum(bool(r["tmp_dirs_left"]) for r in records),
        "async_processes": sum(r["async_save"] for r in records),
        "resumed_bit_exactly": sum(r["bit_exact"] for r in records),
        "final_iteration": last, "final_state_bit_exact": ok, "train_iters": train_iters,
        "seconds": round(time.time() - t0, 1), "records": records,
        "final_output": None if ok else (final.stdout + final.stderr)[-3000:],
    }
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=0.25, help="kill delay drawn from [0, this] seconds")
    p.add_argument("--workdir", default=None, help="default: a temporary directory")
    p.add_argument("--out", default=None, help="write the JSON summary here")
    a = p.parse_args(argv)
    import tempfile

    progress = open(a.out + ".progress.jsonl", "w") if a.out else None

    def log(line: str) -> None:  # every record as it comes: a long campaign cut short still reports
        print(line, flush=True)
        if progress:
            progress.write(line + "\n")
            progress.flush()

    with tempfile.TemporaryDirectory() as tmp:
        s = campaign(a.workdir or tmp, a.kills, a.seed, a.max_delay, log)
    text = json.dumps(s, indent=1)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: v for k, v in s.items() if k != "records"}))
    ok = s["resumed_bit_exactly"] == s["kill_points"] and s["final_state_bit_exact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
