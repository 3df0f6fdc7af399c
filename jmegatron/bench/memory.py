"""``bench memory``: compiled vs theoretical memory, host memory over many steps, and
variable sequence lengths.

Three parts (ByteMLPerf's memory criteria: usage matches the expectation, no growth over
1000+ steps, no failure with sequence lengths varying from 64 to 2048):

1. **Layouts** (``--layouts``, default the config's own): for each parallel layout
   (``tp2-dp4-zero1`` etc., :class:`jmegatron.reporting.memory.ParallelLayout`) the train
   step is compiled from abstract shapes and ``compile().memory_analysis()`` read
   (per device: arguments, outputs, aliased (donated) bytes, temporaries, generated code),
   next to the exact per-device bytes of the TrainState from its shardings and the
   theoretical count of :mod:`jmegatron.reporting.memory` (weights, gradients, optimizer
   state, activations with each recomputation choice; Megatron's own weight+optimizer
   figure). Layouts may use more devices than the training parts (``--train-devices``).
   Every layout keeps the config's micro-batch size and its number of
   micro-batches at dp=1 (the global batch grows with dp, the work per device is fixed).
2. **Host RSS** over ``--steps`` (1000) training steps of the config (psutil, after every
   step, which waits for the step): growth = (median of the last ``--window`` steps -
   median of the ``--window`` steps after ``--warmup-steps``) / that baseline; passes
   under ``--growth-threshold`` (1 %). The number of live JAX arrays is sampled too.
3. **Variable sequence lengths**: ``--varlen-steps`` steps with lengths drawn
   log-uniformly from ``[--min-seq, --max-seq]`` (both ends included), each batch padded
   (loss mask 0) up to the next power of two, so at most ``log2(max/min) + 1`` programs
   are compiled. Compilations are counted with a ``jax.monitoring`` listener on backend
   compiles and the jitted step's cache size; each bucket's compiled memory is read.
   Passes when no step fails, all losses are finite and compilations <= buckets used.
   The model gets ``max_position_embeddings >= --max-seq`` and the micro-batch size
   ``--varlen-micro-batch``.

Outputs in ``--out``: ``memory.json``, ``memory.md``, ``memory_rss.png`` (RSS per step),
``memory_seqlen.png`` (memory by sequence length), ``memory_layouts.png``.

**A log instead** (``--log LOG``, no ``--config``): the memory lines of a Megatron /
ByteMLPerf / jmegatron stdout log or a jmegatron ``metrics.jsonl``
(``[Rank r] (after N iterations) memory (MB) | allocated: ... | max allocated: ... |
reserved: ... | max reserved: ...``, :mod:`jmegatron.bench.megatron_log`), per rank. A rank
with several lines (ByteMLPerf's ``--test-memory`` prints one per logged iteration) gets
the growth test of part 2 on its ``allocated`` series (warm-up ``--warmup-steps`` lines,
default a twentieth; ``--window``; ``--growth-threshold``); a rank with one line is
reported, not judged. Outputs ``memory.json``, ``memory.md`` and ``memory_log.png``.
"""

from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import numpy as np

from jmegatron.bench import common
from jmegatron.bench import megatron_log

# Modules that import JAX are imported inside the commands: `python -m jmegatron.bench
# --devices N` sets XLA_FLAGS after importing every command module and before JAX starts
# (jmegatron.bench.__main__._set_devices).

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
                 "host_alias_size_in_bytes", "host_temp_size_in_bytes", "host_generated_code_size_in_bytes")


def register(sub) -> None:
    """Add the ``memory`` subcommand to the bench CLI's subparsers."""
    p = common.add_command(sub, "memory",
                           "compiled vs theoretical memory, RSS over many steps, variable lengths", __doc__)
    common.add_config_arguments(p, required=False)
    p.add_argument("--log", default=None, metavar="LOG",
                   help="read the memory lines of a Megatron/jmegatron stdout log or metrics.jsonl instead of "
                        "training (no --config)")
    p.add_argument("--layouts", default=None,
                   help="comma-separated layouts to compile, e.g. tp1-dp1,tp2-dp4-zero1,tp2-sp-dp4 "
                        "(default: the config's layout on the visible devices; more devices: --devices)")
    p.add_argument("--train-devices", type=int, default=None, metavar="N",
                   help="devices the RSS and variable-length tests train on (the config's tp, dp = N / tp; "
                        "default all visible); layouts may use more")
    p.add_argument("--steps", type=int, default=1000, help="training steps of the RSS test (0 skips it)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps before the RSS baseline (default max(10, steps // 20))")
    p.add_argument("--window", type=int, default=50, help="steps in the baseline and final RSS medians")
    p.add_argument("--growth-threshold", type=float, default=0.01, help="allowed RSS growth fraction (0.01)")
    p.add_argument("--varlen-steps", type=int, default=30, help="steps of the variable-length test (0 skips it)")
    p.add_argument("--min-seq", type=int, default=64)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--varlen-micro-batch", type=int, default=1, help="micro-batch size of the variable-length test")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn sequence lengths")
    common.add_out_argument(p, "memory")
    p.set_defaults(func=run)


# ------------------------------------------------------------------ pure helpers
def bucket_length(length: int, min_bucket: int = 1) -> int:
    """The power of two ``>= max(length, min_bucket)``. Raises ValueError for length < 1."""
    if length < 1:
        raise ValueError(f"sequence length {length} must be >= 1")
    return 1 << (max(length, min_bucket) - 1).bit_length()


def draw_lengths(n: int, min_seq: int, max_seq: int, seed: int = 0) -> list[int]:
    """``n`` sequence lengths in ``[min_seq, max_seq]``: both ends, then log-uniform draws,
    shuffled (numpy ``default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    ends = [min_seq, max_seq][:n]
    draws = np.exp(rng.uniform(math.log(min_seq), math.log(max_seq), size=max(n - len(ends), 0)))
    lengths = ends + [int(np.clip(round(x), min_seq, max_seq)) for x in draws]
    rng.shuffle(lengths)
    return [int(x) for x in lengths]


def rss_growth(rss: Sequence[float], warmup: int, window: int = 50, threshold: float = 0.01) -> dict:
    """Growth of a per-step memory series: ``baseline`` = median of ``rss[warmup:warmup +
    window]``, ``final`` = median of the last ``window`` values, ``growth`` = (final -
    baseline) / baseline, ``passed`` = growth < threshold; also ``max_after_warmup``.
    The windows shrink to fit short series. Raises ValueError when nothing follows warm-up."""
    rss = np.asarray(rss, np.float64)
    if len(rss) <= warmup:
        raise ValueError(f"{len(rss)} steps leave nothing after warmup={warmup}")
    after = rss[warmup:]
    w = max(1, min(window, len(after) // 2 or 1))
    baseline, final = float(np.median(after[:w])), float(np.median(after[-w:]))
    growth = (final - baseline) / baseline
    return {"warmup_steps": warmup, "window": w, "baseline_bytes": baseline, "final_bytes": final,
            "growth": growth, "max_after_warmup_bytes": float(after.max()), "threshold": threshold,
            "passed": bool(growth < threshold)}


class CompileCounter:
    """Counts XLA backend compilations (``jax.monitoring`` event ``COMPILE_EVENT``) while
    ``active``. The listener is registered once per process."""

    _instance: Optional["CompileCounter"] = None

    def __init__(self):
        self.count = 0
        self.active = False

    @classmethod
    def get(cls) -> "CompileCounter":
        if cls._instance is None:
            import jax

            cls._instance = cls()
            jax.monitoring.register_event_duration_secs_listener(cls._instance._on_event)
        return cls._instance

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if self.active and event == COMPILE_EVENT:
            self.count += 1


def memory_stats(compiled) -> dict:
    """The fields of ``compiled.memory_analysis()`` (bytes per device), plus
    ``peak_estimate_bytes`` = arguments + outputs - aliased + temporaries."""
    ma = compiled.memory_analysis()
    stats = {f: int(getattr(ma, f, 0) or 0) for f in MEMORY_FIELDS}
    stats["peak_estimate_bytes"] = (stats["argument_size_in_bytes"] + stats["output_size_in_bytes"]
                                    - stats["alias_size_in_bytes"] + stats["temp_size_in_bytes"])
    return stats


def per_device_bytes(abstract, shardings) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs laid out by ``shardings``
    (the largest shard, i.e. the first device's)."""
    import jax

    total = 0
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += int(np.prod(s.shard_shape(a.shape), dtype=np.int64)) * np.dtype(a.dtype).itemsize
    return total


# ------------------------------------------------------------------ phases
def _abstract_batch(run, num_micro: int, rows: int, seq: int) -> dict:
    import jax

    from jmegatron.parallel.rules import batch_shardings

    sh = batch_shardings(run.mesh, run.cfg.reset_attention_mask)
    return {k: jax.ShapeDtypeStruct((num_micro, rows, seq), np.float32 if k == "loss_mask" else np.int32,
                                    sharding=sh[k]) for k in sh}


def layout_report(cfg, layout, num_micro: int) -> dict:
    """Compile the train step of ``cfg`` laid out as ``layout`` (from abstract shapes, no
    allocation) and return its memory analysis, the exact state bytes per device and the
    theoretical estimate. Raises BenchError when the layout needs more devices."""
    import jax

    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.reporting import memory as memory_lib
    from jmegatron.pretrain_gpt import build

    if layout.num_devices > jax.device_count():
        raise common.BenchError(f"layout {layout.name} needs {layout.num_devices} devices, {jax.device_count()} "
                                f"visible; run python -m jmegatron.bench --devices {layout.num_devices} memory ...")
    dp = layout.data_parallel_size
    cfg_l = cfg.replace(tensor_model_parallel_size=layout.tensor_model_parallel_size,
                        sequence_parallel=layout.sequence_parallel,
                        use_distributed_optimizer=layout.use_distributed_optimizer,
                        use_megatron_fsdp=layout.use_megatron_fsdp,
                        context_parallel_size=layout.context_parallel_size,
                        global_batch_size=num_micro * cfg.micro_batch_size * dp)
    run = build(cfg_l, create_mesh(cfg_l, jax.devices()[:layout.num_devices]))
    t0 = time.perf_counter()
    compiled = run.train_step.lower(run.abstract_with_shardings(),
                                    _abstract_batch(run, num_micro, cfg.micro_batch_size * dp, cfg.seq_length)
                                    ).compile()
    seconds = time.perf_counter() - t0
    estimate = memory_lib.theoretical_memory(cfg_l, run.padded_vocab_size, layout)
    batch_bytes = 4 * 4 * num_micro * cfg.micro_batch_size * cfg.seq_length  # 4 int32/float32 arrays
    state = {"params": per_device_bytes(run.abstract_state.params, run.state_shardings.params),
             "opt_state": per_device_bytes(run.abstract_state.opt_state, run.state_shardings.opt_state)}
    return {"layout": layout.name, "mesh": dict(run.mesh.shape), "padded_vocab_size": run.padded_vocab_size,
            "compile_seconds": seconds, "compiled": memory_stats(compiled), "state_bytes_per_device": state,
            "batch_bytes_per_device": batch_bytes, "theoretical": estimate.to_dict()}


def _train_mesh(cfg, num_devices: Optional[int]):
    import jax

    from jmegatron.parallel.mesh import create_mesh

    return create_mesh(cfg, jax.devices()[:num_devices] if num_devices else None)


def rss_phase(cfg, steps: int, warmup: int, window: int, threshold: float,
              num_devices: Optional[int] = None) -> dict:
    """Train ``steps`` steps on the first ``num_devices`` devices (default all), recording
    the process RSS after each (see the module docstring)."""
    import jax
    import psutil

    from jmegatron.data.loader import BatchLoader
    from jmegatron.pretrain_gpt import build
    from jmegatron.data.builder import build_datasets

    run = build(cfg, _train_mesh(cfg, num_devices))
    state = run.init_state()
    train_ds, _, _ = build_datasets(cfg, run.global_batch_size)
    loader = BatchLoader(train_ds, run.global_batch_size, run.num_microbatches)
    proc = psutil.Process()
    rss, losses, live = [], [], []
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = run.train_step(state, run.put_batch(next(loader)))
        losses.append(float(metrics["loss"]))  # waits for the step
        rss.append(proc.memory_info().rss)
        if i % 100 == 0 or i == steps - 1:
            live.append([i + 1, len(jax.live_arrays())])
    seconds = time.perf_counter() - t0
    growth = rss_growth(rss, warmup, window, threshold)
    return {"steps": steps, "seconds": seconds, "rss_bytes": rss, "losses_first_last": [losses[0], losses[-1]],
            "all_losses_finite": bool(np.all(np.isfinite(losses))), "live_arrays": live,
            "live_arrays_constant": len({n for _, n in live[1:]}) <= 1, **growth,
            "passed": growth["passed"] and bool(np.all(np.isfinite(losses)))}


def varlen_phase(cfg, lengths: Sequence[int], min_bucket: int, num_devices: Optional[int] = None) -> dict:
    """Train one step per length in ``lengths`` (batches cut from ``cfg.seq_length``-long
    samples and padded to their power-of-two bucket with loss mask 0)."""
    import psutil

    from jmegatron.data.loader import BatchLoader
    from jmegatron.reporting import memory as memory_lib
    from jmegatron.pretrain_gpt import build
    from jmegatron.data.builder import build_datasets
    from jmegatron.reporting.memory import ParallelLayout

    run = build(cfg, _train_mesh(cfg, num_devices))
    state = run.init_state()
    train_ds, _, _ = build_datasets(cfg, run.global_batch_size)
    loader = BatchLoader(train_ds, run.global_batch_size, run.num_microbatches)
    layout = ParallelLayout.from_config(cfg, run.mesh.shape["data"])
    proc = psutil.Process()
    counter = CompileCounter.get()
    counter.count, counter.active = 0, True
    steps, buckets, error = [], {}, None
    try:
        for i, length in enumerate(lengths):
            b = bucket_length(length, min_bucket)
            full = loader.batch_at(i * run.global_batch_size)
            host = {}
            for k, v in full.items():
                cut = v[..., :length]
                host[k] = np.concatenate([cut, np.zeros(cut.shape[:-1] + (b - length,), cut.dtype)], axis=-1)
            batch = run.put_batch(host)
            t0 = time.perf_counter()
            if b not in buckets:
                before = counter.count
                compiled = run.train_step.compiled(state, batch)  # the program the step then runs
                est = memory_lib.activation_memory(cfg.replace(seq_length=b), run.padded_vocab_size, layout)
                buckets[b] = {"bucket": b, "compiled": memory_stats(compiled),
                              "theoretical_activations_bytes": est.total, "compiles_for_bucket": counter.count - before,
                              "max_rss_bytes": 0, "steps": 0}
            state, metrics = run.train_step(state, batch)
            loss = float(metrics["loss"])
            rss = proc.memory_info().rss
            buckets[b]["max_rss_bytes"] = max(buckets[b]["max_rss_bytes"], rss)
            buckets[b]["steps"] += 1
            steps.append({"step": i + 1, "length": length, "bucket": b, "loss": loss, "rss_bytes": rss,
                          "seconds": time.perf_counter() - t0})
    except Exception as e:  # a failure at some length is the finding, not a crash of the bench
        error = f"{type(e).__name__}: {e}"
    finally:
        counter.active = False
    cache_size = getattr(run.train_step, "_cache_size", lambda: None)()
    finite = all(math.isfinite(s["loss"]) for s in steps)
    bound = len(buckets)
    return {"lengths": list(lengths), "min_bucket": min_bucket, "micro_batch_size": cfg.micro_batch_size,
            "steps": steps, "buckets": [buckets[k] for k in sorted(buckets)], "buckets_used": bound,
            "max_buckets": int(math.log2(bucket_length(max(lengths), min_bucket) // min_bucket)) + 1,
            "backend_compiles": counter.count, "jit_cache_size": cache_size, "error": error,
            "all_losses_finite": finite,
            "passed": error is None and finite and counter.count <= bound and len(steps) == len(lengths)}


# ------------------------------------------------------------------ the command
def run(args) -> int:
    """Run ``bench memory`` from parsed arguments; returns the exit status (0 pass, 1 a check failed, 2 bad input)."""
    from jmegatron.reporting.memory import ParallelLayout

    if args.log is not None:
        if args.config is not None:
            raise common.BenchError("give --log LOG or --config CONFIG.py, not both")
        return run_log(args)
    if args.config is None:
        raise common.BenchError("--config CONFIG.py is required (or --log LOG to read a log's memory lines)")
    if args.steps < 0 or args.varlen_steps < 0:
        raise common.BenchError("--steps and --varlen-steps must be >= 0")
    if not 1 <= args.min_seq <= args.max_seq:
        raise common.BenchError(f"--min-seq={args.min_seq} and --max-seq={args.max_seq} need 1 <= min <= max")
    warmup = args.warmup_steps if args.warmup_steps is not None else max(10, args.steps // 20)
    if args.steps and warmup >= args.steps:
        raise common.BenchError(f"--warmup-steps={warmup} must be below --steps={args.steps}")
    try:
        layouts = [ParallelLayout.parse(t) for t in args.layouts.split(",")] if args.layouts else None
    except ValueError as e:
        raise common.BenchError(f"--layouts: {e}") from None
    cfg = common.bench_config(common.load_config_for_steps(args, args.steps))

    import jax

    # Every layout does the same work per device: the config's micro-batch size and its
    # number of micro-batches at dp=1 (the global batch grows with dp).
    num_micro = cfg.num_microbatches(1)
    if args.train_devices is not None and not 1 <= args.train_devices <= jax.device_count():
        raise common.BenchError(f"--train-devices={args.train_devices} must be in 1..{jax.device_count()} "
                                "(the visible devices; more with --devices)")
    train_devices = args.train_devices or jax.device_count()
    layouts = layouts or [ParallelLayout.from_config(cfg, cfg.data_parallel_size(train_devices))]
    result = {"command": "memory", "config": args.config, "config_overrides": args.config_overrides,
              "train_devices": train_devices,
              "micro_batch_size": cfg.micro_batch_size, "num_microbatches": num_micro,
              "seq_length": cfg.seq_length, "bf16": cfg.bf16, "recompute_granularity": cfg.recompute_granularity}
    result["layouts"], result["layout_errors"] = [], []
    for layout in layouts:
        try:
            result["layouts"].append(layout_report(cfg, layout, num_micro))
        except common.BenchError:
            raise
        except Exception as e:  # a layout that does not compile is a finding, reported, not a crash
            result["layout_errors"].append({"layout": layout.name, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            print(f"[bench memory] {layout.name}: FAILED to compile: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for lr in result["layouts"]:
        print(f"[bench memory] {lr['layout']}: compiled args {common.mib(lr['compiled']['argument_size_in_bytes']):.1f} "
              f"MiB, temp {common.mib(lr['compiled']['temp_size_in_bytes']):.1f} MiB; theoretical total "
              f"{common.mib(lr['theoretical']['total']):.1f} MiB", flush=True)
    if args.steps:
        result["rss"] = rss_phase(cfg, args.steps, warmup, args.window, args.growth_threshold, train_devices)
        print(f"[bench memory] RSS over {args.steps} steps: growth {100 * result['rss']['growth']:.3f}% "
              f"(baseline {common.mib(result['rss']['baseline_bytes']):.1f} MiB)", flush=True)
    if args.varlen_steps:
        pos = max(cfg.max_position_embeddings, args.max_seq)
        cfg_v = common.bench_config(common.load_config_for_steps(
            args, args.varlen_steps, seq_length=args.max_seq, max_position_embeddings=pos,
            micro_batch_size=args.varlen_micro_batch, global_batch_size=None))
        lengths = draw_lengths(args.varlen_steps, args.min_seq, args.max_seq, args.seed)
        result["varlen"] = varlen_phase(cfg_v, lengths, bucket_length(args.min_seq), train_devices)
        v = result["varlen"]
        print(f"[bench memory] variable lengths {args.min_seq}..{args.max_seq}: {len(v['steps'])} steps, "
              f"{v['backend_compiles']} compilations for {v['buckets_used']} buckets"
              + (f", FAILED: {v['error']}" if v["error"] else ""), flush=True)
    checks = [result[k]["passed"] for k in ("rss", "varlen") if k in result] + [not result["layout_errors"]]
    result["passed"] = all(checks)
    result["environment"] = common.environment()
    out = common.out_dir(args)
    common.write_json(out / "memory.json", result)
    _charts(result, out)
    common.write_text(out / "memory.md", markdown(result))
    print(f"[bench memory] {'PASS' if result['passed'] else 'FAIL'}; results in {out}")
    return 0 if result["passed"] else 1


def log_memory_report(memory: dict, warmup: Optional[int], window: int, threshold: float) -> dict:
    """Per rank of ``{rank: [MemoryRecord]}`` (:mod:`jmegatron.bench.megatron_log`): the
    iterations and the four series (MB; a repeated iteration keeps its last record), and,
    with two records or more, :func:`rss_growth` of ``allocated`` (``warmup`` None: a
    twentieth of the records) plus the ``reserved`` growth (reported only). ``passed``:
    every judged rank's growth below ``threshold``; None when no rank has two records."""
    ranks = {}
    for rank, records in sorted(memory.items()):
        by_it = {r.iteration: r for r in records}
        its = sorted(by_it)
        entry = {"iterations": its, "source": by_it[its[-1]].source,
                 **{k: [by_it[i].value(k) for i in its] for k in ("allocated", "max_allocated", "reserved",
                                                                  "max_reserved")}}
        if len(its) >= 2:
            w = len(its) // 20 if warmup is None else warmup
            if w >= len(its):
                raise common.BenchError(f"--warmup-steps={w} leaves none of rank {rank}'s {len(its)} memory lines")
            entry["growth"] = rss_growth(entry["allocated"], w, window, threshold)
            entry["reserved_growth"] = rss_growth(entry["reserved"], w, window, threshold)["growth"]
        ranks[rank] = entry
    judged = [e["growth"]["passed"] for e in ranks.values() if "growth" in e]
    return {"ranks": ranks, "judged_ranks": len(judged), "passed": all(judged) if judged else None}


def run_log(args) -> int:
    """``bench memory --log LOG``: the memory lines of a log, per rank (module docstring)."""

    log = megatron_log.read_log(args.log, "--log")
    if not log.memory:
        raise common.BenchError(f"--log {args.log} has no memory line ('[Rank r] (after N iterations) memory (MB) | "
                                "allocated: ...'; Megatron prints one after the first logged iteration, ByteMLPerf's "
                                "--test-memory one at every logged iteration)")
    report = log_memory_report(log.memory, args.warmup_steps, args.window, args.growth_threshold)
    result = {"command": "memory", "log": args.log, "log_format": log.format, **report}
    out = common.out_dir(args)
    common.write_json(out / "memory.json", result)
    _log_chart(result, out / "memory_log.png")
    common.write_text(out / "memory.md", log_markdown(result))
    verdict = {True: "PASS", False: "FAIL", None: "no growth judged (one memory line per rank)"}[result["passed"]]
    print(f"[bench memory] {args.log}: {len(report['ranks'])} ranks, {verdict}; results in {out}")
    return 1 if result["passed"] is False else 0


def log_markdown(r: dict) -> str:
    """The markdown summary of ``bench memory --log``."""
    rows = []
    for rank, e in r["ranks"].items():
        g = e.get("growth")
        rows.append([str(rank), len(e["iterations"]), f"{e['allocated'][-1]:.2f}", f"{e['max_allocated'][-1]:.2f}",
                     f"{e['reserved'][-1]:.2f}", f"{e['max_reserved'][-1]:.2f}",
                     common.pct(g["growth"]) if g else "-", common.pct(e.get("reserved_growth")),
                     ("yes" if g["passed"] else "**no**") if g else "not judged", str(e["source"])])
    verdict = {True: "**PASS**", False: "**FAIL**", None: "Not judged (one memory line per rank)"}[r["passed"]]
    return "\n".join([
        "# Memory from a log", "", f"`{r['log']}` ({r['log_format']}). {verdict}: growth of `allocated` per rank "
        "(median of the last lines against the median after warm-up).", "",
        common.markdown_table(["rank", "lines", "allocated MB (last)", "max allocated", "reserved", "max reserved",
                               "allocated growth", "reserved growth", "below threshold", "source"], rows), "",
        "Source `None`: a Megatron log (torch.cuda's caching allocator).", "", "![memory per rank](memory_log.png)"])


def _log_chart(r: dict, path) -> None:
    plt = common.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for rank, e in r["ranks"].items():
        a.plot(e["iterations"], e["allocated"], marker=".", lw=1, label=f"rank {rank}")
        b.plot(e["iterations"], e["reserved"], marker=".", lw=1, label=f"rank {rank}")
    for ax, name in ((a, "allocated"), (b, "reserved")):
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"{name} (MB)")
        ax.set_title(f"{name} per rank")
        ax.grid(alpha=0.3)
        if len(r["ranks"]) <= 16:
            ax.legend(fontsize=7)
    common.save_figure(fig, path)


# ------------------------------------------------------------------ reporting
def markdown(r: dict) -> str:
    """The markdown summary of a ``bench memory`` result (its JSON object)."""
    lines = ["# Memory", "",
             f"`{r['config']}` {' '.join(r['config_overrides'])}: micro-batch {r['micro_batch_size']} x "
             f"{r['seq_length']} tokens, {r['num_microbatches']} micro-batches, "
             f"{'bf16' if r['bf16'] else 'float32'}, recompute {r['recompute_granularity']}. "
             f"Overall: {'**PASS**' if r['passed'] else '**FAIL**'}.", "",
             "## Compiled step vs theory, per device", "",
             common.markdown_table(common.LAYOUT_HEADER, common.layout_rows(r["layouts"])), "",
             *[f"- **{e['layout']} failed to compile**: `{e['error'][:300]}`" for e in r.get("layout_errors", [])],
             "",
             "Theory: float32 weights, gradient accumulator and AdamW moments (`jmegatron/reporting/memory.py`); "
             "activations of one micro-batch (the micro-batch loop holds one at a time); under FSDP the "
             "all-gathered parameters and their whole gradients. Compiled: "
             "`memory_analysis()` of the train step; arguments minus the batch = the TrainState shard; "
             "peak = args + outputs - aliased (donated) + temporaries. The theory counts what the "
             "backward pass keeps (Megatron's model); XLA's temporaries also hold the backward pass's "
             "own working buffers, hence a ratio above 1.", ""]
    rec_rows = [[lr["layout"], *(common.mib(lr["theoretical"]["activations_by_recompute"][k])
                                 for k in ("none", "selective", "full")),
                 common.mib(lr["theoretical"]["megatron_weight_and_optimizer"])] for lr in r["layouts"]]
    lines += [common.markdown_table(["layout", "act. MiB (no recompute)", "selective", "full",
                                     "Megatron weight+opt MiB"], rec_rows), "",
              "![memory per layout](memory_layouts.png)", ""]
    if "rss" in r:
        s = r["rss"]
        lines += ["## Host RSS over training steps", "",
                  f"{'**PASS**' if s['passed'] else '**FAIL**'}: {s['steps']} steps in {s['seconds']:.0f} s; RSS "
                  f"baseline (median of steps {s['warmup_steps'] + 1}-{s['warmup_steps'] + s['window']}) "
                  f"{common.mib(s['baseline_bytes']):.1f} MiB, final (median of the last {s['window']}) "
                  f"{common.mib(s['final_bytes']):.1f} MiB: growth **{100 * s['growth']:.3f}%** (threshold "
                  f"{100 * s['threshold']:.1f}%); max after warm-up {common.mib(s['max_after_warmup_bytes']):.1f} MiB. "
                  f"Live JAX arrays {s['live_arrays'][0][1]} -> {s['live_arrays'][-1][1]} "
                  f"({'constant' if s['live_arrays_constant'] else 'changing'} after the first step).", "",
                  "![RSS per step](memory_rss.png)", ""]
    if "varlen" in r:
        v = r["varlen"]
        rows = [[b["bucket"], b["steps"], common.mib(b["compiled"]["temp_size_in_bytes"]),
                 common.mib(b["theoretical_activations_bytes"]), common.mib(b["compiled"]["peak_estimate_bytes"]),
                 common.mib(b["max_rss_bytes"])] for b in v["buckets"]]
        lines += ["## Variable sequence lengths", "",
                  f"{'**PASS**' if v['passed'] else '**FAIL**'}: {len(v['steps'])} of {len(v['lengths'])} steps, "
                  f"lengths {min(v['lengths'])}..{max(v['lengths'])} (micro-batch {v['micro_batch_size']}), padded to "
                  f"powers of two: **{v['backend_compiles']} compilations** for {v['buckets_used']} buckets used "
                  f"(at most {v['max_buckets']}); jit cache size {v['jit_cache_size']}."
                  + (f" Error: `{v['error']}`." if v["error"] else ""), "",
                  common.markdown_table(["bucket", "steps", "compiled temp MiB", "theory activations MiB",
                                         "compiled peak MiB", "max RSS MiB"], rows), "",
                  "![memory by sequence length](memory_seqlen.png)"]
    return "\n".join(lines)


def _charts(r: dict, out) -> None:
    plt = common.pyplot()
    # layouts: theory (stacked) next to compiled (stacked)
    fig, ax = plt.subplots(figsize=(max(5, 1.8 * len(r["layouts"]) + 2), 4))
    x = np.arange(len(r["layouts"]))
    for i, lr in enumerate(r["layouts"]):
        t, c = lr["theoretical"], lr["compiled"]
        bottom = 0.0
        for key, color in (("weights", "#4c72b0"), ("optimizer_state", "#55a868"), ("gradients", "#c44e52"),
                           ("activations", "#8172b2"), ("fsdp_gathered", "#937860")):
            ax.bar(x[i] - 0.2, common.mib(t.get(key, 0.0)), 0.38, bottom=bottom, color=color,
                   label=key if i == 0 else None)
            bottom += common.mib(t.get(key, 0.0))
        args_ = common.mib(c["argument_size_in_bytes"])
        ax.bar(x[i] + 0.2, args_, 0.38, color="#8c8c8c", label="compiled arguments" if i == 0 else None)
        ax.bar(x[i] + 0.2, common.mib(c["temp_size_in_bytes"]), 0.38, bottom=args_, color="#dd8452",
               label="compiled temporaries" if i == 0 else None)
    ax.set_xticks(x, [lr["layout"] for lr in r["layouts"]])
    ax.set_ylabel("MiB per device")
    ax.set_title("Theory (left) vs compiled step (right)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    common.save_figure(fig, out / "memory_layouts.png")
    if "rss" in r:
        s = r["rss"]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        steps = np.arange(1, len(s["rss_bytes"]) + 1)
        ax.plot(steps, np.asarray(s["rss_bytes"]) / 2 ** 20, lw=0.8, label="RSS")
        ax.axvspan(0, s["warmup_steps"], color="gray", alpha=0.15, label="warm-up")
        ax.axhline(common.mib(s["baseline_bytes"]), color="green", ls="--", lw=1, label="baseline median")
        ax.axhline(common.mib(s["final_bytes"]), color="red", ls=":", lw=1,
                   label=f"final median ({100 * s['growth']:+.3f}%)")
        ax.set_xlabel("step")
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("Host memory per training step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        common.save_figure(fig, out / "memory_rss.png")
    if "varlen" in r and r["varlen"]["buckets"]:
        v = r["varlen"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        bs = [b["bucket"] for b in v["buckets"]]
        left.plot(bs, [common.mib(b["compiled"]["temp_size_in_bytes"]) for b in v["buckets"]], "o-",
                  label="compiled temporaries")
        left.plot(bs, [common.mib(b["theoretical_activations_bytes"]) for b in v["buckets"]], "s--",
                  label="theoretical activations")
        left.plot(bs, [common.mib(b["compiled"]["peak_estimate_bytes"]) for b in v["buckets"]], "^-",
                  label="compiled peak")
        left.set_xscale("log", base=2)
        left.set_yscale("log")
        left.set_xlabel("bucket (padded sequence length)")
        left.set_ylabel("MiB per device")
        left.set_title(f"Memory by sequence length ({v['backend_compiles']} compilations)")
        left.legend(fontsize=8)
        left.grid(alpha=0.3)
        st = v["steps"]
        sc = right.scatter([s["step"] for s in st], [s["rss_bytes"] / 2 ** 20 for s in st],
                           c=[math.log2(s["length"]) for s in st], cmap="viridis", s=18)
        right.plot([s["step"] for s in st], [s["rss_bytes"] / 2 ** 20 for s in st], lw=0.5, color="gray")
        cb = fig.colorbar(sc, ax=right)
        cb.set_label("log2(sequence length)")
        right.set_xlabel("step")
        right.set_ylabel("RSS (MiB)")
        right.set_title("RSS per step, varying lengths")
        right.grid(alpha=0.3)
        common.save_figure(fig, out / "memory_seqlen.png")
