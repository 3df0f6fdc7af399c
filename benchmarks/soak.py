"""A long training run watched from outside: the trainer's host RSS, open files and
threads against the iteration (issue 16's soak: nothing may grow with the steps or the
checkpoints).

    python benchmarks/soak.py [--config configs/gpt_tiny.py] [--train-iters 2000]
        [--save-interval 50] [--interval 2] [--data-prefix P --tokenizer T | --mock]
        [--out docs/bench/soak] [--set field=value ...]

Data as ``benchmarks/prefetch.py`` finds it. Runs ``python -m jmegatron.train`` (the CLI
users run: its host allocator, prefetch thread and Orbax checkpointer) with a checkpoint
every ``--save-interval`` iterations into a temporary directory, and samples the process
with psutil every ``--interval`` seconds: resident set size (bytes), open file
descriptors, threads, and the newest iteration the console printed (``log_interval``
10, so to within 10 iterations).

Writes ``OUT/soak.json``: every sample, and per metric the median and maximum over the
early window (``--window`` iterations after ``--warmup``) and over the last window, and
the change between the medians (RSS in %, files and threads in counts; a save opens
files and starts threads for a moment, so maxima depend on where samples fall). The
verdict ``flat`` needs RSS's median to grow less than ``--rss-tolerance`` percent and the
late medians of files and threads to be no higher than the early ones. Exits 1 if the
trainer fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from prefetch import REPO, find_data  # noqa: E402  (the same data search)

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+")


def window_stats(samples: list[dict], lo: int, hi: int) -> dict:
    """Median and max of each metric over the samples with ``lo <= iteration < hi``."""
    rows = [s for s in samples if lo <= s["iteration"] < hi]
    if not rows:
        raise SystemExit(f"no samples between iterations {lo} and {hi}: raise --train-iters or lower --interval")
    return {k: {"median": statistics.median(r[k] for r in rows), "max": max(r[k] for r in rows)}
            for k in ("rss_bytes", "open_files", "threads")} | {"samples": len(rows), "iterations": [lo, hi]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpt_tiny.py")
    p.add_argument("--train-iters", type=int, default=2000)
    p.add_argument("--save-interval", type=int, default=50)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--warmup", type=int, default=100, help="iterations before the early window")
    p.add_argument("--window", type=int, default=300, help="iterations in the early and the last window")
    p.add_argument("--rss-tolerance", type=float, default=2.0, help="percent")
    p.add_argument("--data-prefix")
    p.add_argument("--tokenizer")
    p.add_argument("--mock", action="store_true")
    p.add_argument("--out", default="docs/bench/soak")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="more config overrides")
    args = p.parse_args(argv)
    if args.train_iters < args.warmup + 2 * args.window:
        p.error(f"--train-iters {args.train_iters} must be >= --warmup + 2 x --window "
                f"({args.warmup + 2 * args.window})")

    data = find_data(args)
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        cmd = [sys.executable, "-m", "jmegatron.train", "--config", args.config,
               f"--config.train_iters={args.train_iters}", f"--config.save_interval={args.save_interval}",
               f"--config.save={tmp}/ckpt", "--config.log_interval=10", "--config.eval_interval=0"]
        cmd += [f"--config.data_path={data[0]}", f"--config.tokenizer_model={data[1]}"] if data else \
            ["--config.mock_data=True"]
        cmd += [f"--config.{s}" for s in args.set]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        newest = {"iteration": 0}
        log_tail: list[str] = []

        def read_console():
            for line in proc.stdout:
                log_tail.append(line)
                del log_tail[:-40]
                m = ITERATION.search(line)
                if m:
                    newest["iteration"] = int(m.group(1))

        reader = threading.Thread(target=read_console, daemon=True)
        reader.start()
        watched = psutil.Process(proc.pid)
        samples, start = [], time.time()
        while proc.poll() is None:
            try:
                with watched.oneshot():
                    samples.append({"t": round(time.time() - start, 2), "iteration": newest["iteration"],
                                    "rss_bytes": watched.memory_info().rss, "open_files": watched.num_fds(),
                                    "threads": watched.num_threads()})
            except psutil.NoSuchProcess:
                break
            time.sleep(args.interval)
        proc.wait()
        reader.join(timeout=10)
    if proc.returncode != 0:
        sys.stderr.write("".join(log_tail))
        print(f"the trainer exited with {proc.returncode}", file=sys.stderr)
        return 1

    early = window_stats(samples, args.warmup, args.warmup + args.window)
    late = window_stats(samples, args.train_iters - args.window, args.train_iters + 1)
    rss_growth = 100.0 * (late["rss_bytes"]["median"] / early["rss_bytes"]["median"] - 1.0)
    change = {"rss_percent": round(rss_growth, 3),
              "open_files": late["open_files"]["median"] - early["open_files"]["median"],
              "threads": late["threads"]["median"] - early["threads"]["median"]}
    flat = rss_growth < args.rss_tolerance and change["open_files"] <= 0 and change["threads"] <= 0
    summary = {"command": " ".join(cmd).replace(tmp, "TMP"), "train_iters": args.train_iters,
               "checkpoints": args.train_iters // args.save_interval, "wall_s": round(time.time() - start, 1),
               "early": early, "late": late, "change": change,
               "overall_max": {k: max(s[k] for s in samples) for k in ("rss_bytes", "open_files", "threads")},
               "verdict": "flat" if flat else "GROWS"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(dict(summary, samples=samples), f, indent=1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
