"""``bench mfu``: training throughput of a config: tokens/s, TFLOP/s per device and MFU.

Builds the run (mesh from the config's parallel sizes over the visible devices), trains
``--warmup`` untimed steps (compilation included), then times ``--steps`` steps one by one
(each waited for with ``block_until_ready``; the batch is placed on the devices before the
clock starts, so data loading is not timed). From the median step time ``t``:

* tokens/s = ``global_batch_size * seq_length / t``;
* TFLOP/s per device = ``num_floating_point_operations(cfg, global_batch_size) / (t * 1e12 *
  devices)`` (:mod:`jmegatron.reporting.flops`, Megatron's model-FLOPs formula);
* MFU = that over the per-device peak of :func:`jmegatron.reporting.peak.resolve_peak_for_config`
  (the trainer's): ``config.peak_tflops`` if set, else the ``bench peak`` record stored for
  this machine for the compute dtype (bfloat16 with ``bf16``), else the theoretical peak;
  nothing is timed for it. ``mfu_theoretical`` is the same over the theoretical peak (cores
  x clock x FLOP/cycle, or the accelerator's spec sheet). An MFU above 100% means the peak
  is wrong: a warning says so.

Outputs in ``--out``: ``mfu.json``, ``mfu.md``, ``mfu.png`` (step times).
"""

from __future__ import annotations

import time

import numpy as np

from jmegatron.bench import common

# Modules that import JAX are imported inside the commands: `python -m jmegatron.bench
# --devices N` sets XLA_FLAGS after importing every command module and before JAX starts
# (jmegatron.bench.__main__._set_devices).


def register(sub) -> None:
    """Add the ``mfu`` subcommand to the bench CLI's subparsers."""
    p = common.add_command(sub, "mfu", "tokens/s, TFLOP/s per device and MFU of a config", __doc__)
    common.add_config_arguments(p)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median taken)")
    p.add_argument("--peak-file", default=None, help="measured peak to use (default runs/bench/peak.json)")
    common.add_out_argument(p, "mfu")
    p.set_defaults(func=run)


def peak_for(cfg, peak_file=None, num_local_devices=None):
    """The :class:`jmegatron.reporting.peak.PeakChoice` of ``cfg``, as every MFU in jmegatron."""
    from jmegatron.reporting.peak import resolve_peak_for_config

    return resolve_peak_for_config(cfg, peak_file, num_local_devices)


def run(args) -> int:
    """Run ``bench mfu`` from parsed arguments; returns the exit status."""
    if args.warmup < 1 or args.steps < 1:
        raise common.BenchError("--warmup and --steps must be >= 1 (the first step compiles)")
    cfg = common.load_config_for_steps(args, args.warmup + args.steps)

    import jax

    from jmegatron.data.loader import BatchLoader
    from jmegatron.reporting import flops
    from jmegatron.pretrain_gpt import build
    from jmegatron.data.builder import build_datasets

    cfg = common.bench_config(cfg)
    run_ = build(cfg)
    state = run_.init_state()
    train_ds, _, _ = build_datasets(cfg, run_.global_batch_size)
    loader = BatchLoader(train_ds, run_.global_batch_size, run_.num_microbatches)
    times, losses = [], []
    t_compile = None
    for i in range(args.warmup + args.steps):
        batch = run_.put_batch(next(loader))
        jax.block_until_ready(batch)
        t0 = time.perf_counter()
        state, metrics = run_.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        dt = time.perf_counter() - t0
        losses.append(float(metrics["loss"]))
        if i == 0:
            t_compile = dt
        if i >= args.warmup:
            times.append(dt)
    devices = run_.mesh.devices.size
    step = float(np.median(times))
    tokens = run_.global_batch_size * cfg.seq_length
    flops_per_step = flops.num_floating_point_operations(cfg, run_.global_batch_size, run_.padded_vocab_size)
    tflops = flops.tflops_per_device(flops_per_step, step, devices)
    choice = peak_for(cfg, args.peak_file, devices)
    peak, source, theo = choice.tflops, choice.source, choice.theoretical_tflops
    result = {
        "command": "mfu", "config": args.config, "config_overrides": args.config_overrides,
        "mesh": dict(run_.mesh.shape), "num_devices": devices, "bf16": cfg.bf16,
        "global_batch_size": run_.global_batch_size, "num_microbatches": run_.num_microbatches,
        "seq_length": cfg.seq_length, "num_parameters": flops.num_parameters(cfg, run_.padded_vocab_size),
        "flops_per_step": flops_per_step, "flops_per_token": flops_per_step / tokens,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "first_step_seconds": t_compile,
        "step_seconds": times, "median_step_seconds": step,
        "step_seconds_p10_p90": [float(np.percentile(times, 10)), float(np.percentile(times, 90))],
        "tokens_per_second": tokens / step, "tokens_per_second_per_device": tokens / step / devices,
        "tflops_per_device": tflops, "peak_tflops": peak, "peak_source": source,
        "mfu": flops.mfu(tflops, peak) if peak else None,
        "theoretical_peak_tflops": theo, "theoretical_peak_source": choice.theoretical_source,
        "mfu_theoretical": flops.mfu(tflops, theo) if theo else None,
        "losses": losses, "environment": common.environment()}
    out = common.out_dir(args)
    common.write_json(out / "mfu.json", result)
    _chart(result, out / "mfu.png")
    common.write_text(out / "mfu.md", markdown(result))
    print(f"[bench mfu] median step {1e3 * step:.1f} ms | {result['tokens_per_second']:.0f} tokens/s | "
          f"{tflops:.4f} TFLOP/s/device | MFU {common.pct(result['mfu'])} of {common.fmt(peak)} ({source}) | "
          f"MFU {common.pct(result['mfu_theoretical'])} of the theoretical {common.fmt(theo)}; results in {out}")
    if result["mfu"] is not None and result["mfu"] > 1.0:
        print(f"[bench mfu] WARNING: {choice.mfu_warning(result['mfu'])}")
    return 0


def markdown(r: dict) -> str:
    """The markdown summary of a ``bench mfu`` result (its JSON object)."""
    lo, hi = r["step_seconds_p10_p90"]
    return common.summary_page(
        "Training efficiency (MFU)",
        f"`{r['config']}` {' '.join(r['config_overrides'])}: mesh {r['mesh']}, global batch "
        f"{r['global_batch_size']} x {r['seq_length']} tokens, {r['num_parameters']:,} parameters, "
        f"{'bf16' if r['bf16'] else 'float32'}.",
        [
            ["median step time", f"{1e3 * r['median_step_seconds']:.2f} ms (p10 {1e3 * lo:.2f}, p90 {1e3 * hi:.2f}; "
                                 f"{r['timed_steps']} timed after {r['warmup_steps']} warm-up)"],
            ["first step (compile + run)", f"{r['first_step_seconds']:.2f} s"],
            ["tokens/s", f"{r['tokens_per_second']:.1f} ({r['tokens_per_second_per_device']:.1f} per device)"],
            ["model FLOPs per step", f"{r['flops_per_step']:.4g} ({r['flops_per_token']:.4g} per token)"],
            ["TFLOP/s per device", f"{r['tflops_per_device']:.4f}"],
            ["peak TFLOP/s per device", f"{common.fmt(r['peak_tflops'])} ({r['peak_source']})"],
            ["MFU", f"**{common.pct(r['mfu'])}**"],
            ["theoretical peak TFLOP/s per device",
             f"{common.fmt(r.get('theoretical_peak_tflops'))} ({r.get('theoretical_peak_source', '-')})"],
            ["MFU of the theoretical peak", common.pct(r.get("mfu_theoretical"))],
        ],
        "Model FLOPs follow Megatron's `num_floating_point_operations` (matmuls only, causal "
        "attention half-counted, no recomputation), so MFU is comparable with Megatron's logs.", "",
        "![step times](mfu.png)")


def _chart(r: dict, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = list(range(r["warmup_steps"] + 1, r["warmup_steps"] + 1 + len(r["step_seconds"])))
    ax.plot(steps, [1e3 * t for t in r["step_seconds"]], "o-", ms=3, label="step time")
    ax.axhline(1e3 * r["median_step_seconds"], color="red", ls="--", lw=1,
               label=f"median {1e3 * r['median_step_seconds']:.1f} ms, MFU {common.pct(r['mfu'])} "
                     f"({common.pct(r.get('mfu_theoretical'))} of theoretical)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("Timed training steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, path)
