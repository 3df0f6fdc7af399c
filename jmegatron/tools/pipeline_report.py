"""``python -m jmegatron.tools.pipeline_report --config C [--m 4 8 16] [--devices N] [--virtual V]
[--schedules gpipe 1f1b ...] [--json PATH] [--config.<field>=<value> ...]``

The pipeline schedule report. For the config's pipeline size ``p``, its
virtual size ``v`` (or ``--virtual``), each number of micro-batches ``m`` and each
applicable schedule (gpipe and 1f1b; interleaved_1f1b when ``v > 1``), it builds the run
(:func:`jmegatron.training.run.build`, mock data, ``global_batch_size = m x
micro_batch_size x dp``), compiles its train step and prints one markdown row:

* **bubble**: idle stage-slots over all of the compiled schedule
  (:meth:`~jmegatron.parallel.schedules.PipelineSchedule.bubble_fraction`) next to
  Megatron's ``(p - 1) / (m + p - 1)``, or ``(p - 1) / (v m + p - 1)`` interleaved
  (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", section 2.2);
* **ppermutes and bytes per step**: analytic, 2 per tick (activations forward, their
  gradients back) x the schedule's ticks, each ``[micro_batch_size, seq_length,
  hidden_size]`` in the model's dtype; next to the compiled program's: every
  ``collective-permute`` instruction of the compiled HLO (``compiled.as_text()``) over
  the ``pipeline`` mesh axis, times the ``known_trip_count`` of the while loops around it
  (:func:`jmegatron.reporting.collectives.parse_collectives`). The tick ``lax.scan`` is one
  while loop of ``num_ticks`` trips holding two permutes, printed as ``ops x trips``;
* **peak live micro-batch activations per stage** (stage inputs kept for the backward:
  :meth:`~jmegatron.parallel.schedules.PipelineSchedule.peak_live_activations`) next to
  Megatron's (warm-up micro-batches + the one in flight, megatron/core/pipeline_parallel/
  schedules.py): GPipe ``m``; 1F1B ``min(p - s, m)``; interleaved ``min((p - s - 1) 2 +
  (v - 1) p + 1, v m)``. jmegatron's 1F1B keeps ``2 (p - s) - 1`` (one forward and one
  backward per tick with one-tick hops; docs/PIPELINE.md): still independent of ``m``;
* **temporary memory per device** of the compiled program
  (``compiled.memory_analysis().temp_size_in_bytes``; "n/a" where the backend gives none).

Devices: ``--devices N`` simulates N CPU devices when JAX has not started yet (it sets
``XLA_FLAGS=--xla_force_host_platform_device_count``) and builds the mesh over the first
N devices; by default all devices. Bad input (config, sizes, schedule) exits 2 naming the
field or flag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from jmegatron.command_line import parse_args
from jmegatron.config import load_config_file
from jmegatron.reporting.collectives import parse_collectives

# Modules that import JAX (jax, pretrain_gpt, parallel.*) are imported inside the functions
# that need them: main() must set XLA_FLAGS (--devices) before JAX starts.

COLUMNS = ("schedule", "p", "v", "m", "ticks", "bubble", "Megatron bubble", "ppermutes/step (analytic)",
           "ppermutes/step (HLO: ops x trips)", "bytes/step (analytic)", "bytes/step (HLO)",
           "peak live acts per stage", "Megatron live acts", "temp bytes/device")


def applicable_schedules(virtual_size: int) -> list[str]:
    """gpipe and 1f1b (with one chunk per stage), plus interleaved_1f1b when ``v > 1``."""
    return ["gpipe", "1f1b"] + (["interleaved_1f1b"] if virtual_size > 1 else [])


def megatron_live_activations(name: str, p: int, m: int, v: int) -> list[int]:
    """Megatron's live micro-batch activations per stage ``s``: its warm-up forwards
    (``forward_backward_pipelining_without_interleaving``: ``min(p - s - 1, m)``; with
    interleaving: ``min((p - s - 1) * 2 + (v - 1) * p, v m)``) plus the one in flight;
    all ``m`` for GPipe (every forward before the first backward)."""
    if name == "gpipe":
        return [m] * p
    if name == "1f1b":
        return [min(p - s, m) for s in range(p)]
    return [min((p - s - 1) * 2 + (v - 1) * p + 1, v * m) for s in range(p)]


def analyze(cfg, mesh, name: str, num_microbatches: int, virtual_size: int) -> dict:
    """One row of the report: build ``cfg`` with schedule ``name``, ``m`` micro-batches
    and ``v`` chunks per stage (v is forced to 1 for gpipe / 1f1b) on ``mesh``, compile
    its train step and measure it. Raises ConfigError (a ValueError) for sizes that do not
    fit (e.g. interleaving with ``m`` not a multiple of ``p``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jmegatron.parallel.rules import batch_shardings, data_parallel_size
    from jmegatron.parallel.schedules import build_schedule
    from jmegatron.pretrain_gpt import build

    v = virtual_size if name == "interleaved_1f1b" else 1
    dp = data_parallel_size(mesh)  # Megatron's: the ranks that split the batch (data x expert)
    c = cfg.replace(pipeline_schedule=name, virtual_pipeline_model_parallel_size=v if v > 1 else None,
                    num_layers_per_virtual_pipeline_stage=None,
                    global_batch_size=num_microbatches * cfg.micro_batch_size * dp)
    c.virtual_pipeline_size()  # validates the split of the layers into p x v chunks
    run = build(c, mesh)
    p, m = c.pipeline_model_parallel_size, run.num_microbatches
    schedule = build_schedule(name, p, m, v)
    rows = run.global_batch_size // m
    batch = {k: jax.ShapeDtypeStruct((m, rows, c.seq_length), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=sh) for k, sh in batch_shardings(run.mesh, c.reset_attention_mask).items()}
    compiled = run.train_step.lower(run.abstract_with_shardings(), batch, *run.extra_args).compile()
    permutes = [x for x in parse_collectives(compiled.as_text(), run.mesh) if x.kind == "collective-permute"]
    other_axes = sorted({",".join(x.axes) for x in permutes if x.axes != ("pipeline",)})
    try:
        temp = compiled.memory_analysis().temp_size_in_bytes
    except Exception:  # noqa: BLE001 - backends without memory analysis
        temp = None
    act_bytes = c.micro_batch_size * c.seq_length * c.hidden_size * np.dtype(run.model.cfg.dtype).itemsize
    analytic = schedule.ppermutes_per_step()
    return {
        "schedule": name, "p": p, "v": v, "m": m, "data_parallel_size": dp, "ticks": schedule.num_ticks,
        "bubble": schedule.bubble_fraction(), "megatron_bubble": schedule.megatron_bubble_fraction(),
        "ppermutes_analytic": analytic,
        "ppermute_ops_in_hlo": len(permutes),
        "ppermute_trip_counts": sorted({x.per_step for x in permutes}),
        "ppermutes_hlo": sum(x.per_step for x in permutes),
        "ppermutes_not_over_pipeline": other_axes,
        "activation_bytes": act_bytes,
        "bytes_analytic": analytic * act_bytes,
        "bytes_hlo": sum(x.bytes * x.per_step for x in permutes),
        "peak_live_activations": schedule.peak_live_activations(),
        "megatron_live_activations": megatron_live_activations(name, p, m, v),
        "num_slots": schedule.num_slots,
        "temp_size_in_bytes": temp,
    }


def _row(r: dict) -> list[str]:
    trips = "/".join(str(t) for t in r["ppermute_trip_counts"]) or "-"
    temp = "n/a" if r["temp_size_in_bytes"] is None else f"{r['temp_size_in_bytes']:,}"
    return [r["schedule"], str(r["p"]), str(r["v"]), str(r["m"]), str(r["ticks"]), f"{r['bubble']:.4f}",
            f"{r['megatron_bubble']:.4f}", str(r["ppermutes_analytic"]),
            f"{r['ppermutes_hlo']} ({r['ppermute_ops_in_hlo']} x {trips})", f"{r['bytes_analytic']:,}",
            f"{r['bytes_hlo']:,}", ",".join(map(str, r["peak_live_activations"])),
            ",".join(map(str, r["megatron_live_activations"])), temp]


def format_report(report: dict) -> str:
    """The markdown table (and its notes) the CLI prints for :func:`main`'s report dict."""
    cfg = report["config"]
    lines = [f"pipeline_report: {report['config_path']}: {cfg['num_layers']} layers x {cfg['hidden_size']} hidden, "
             f"seq {cfg['seq_length']}, micro-batch {cfg['micro_batch_size']}, dtype {cfg['dtype']}; "
             f"mesh {report['mesh']}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in report["rows"]]
    lines += ["", "bubble: idle stage half-slots over all (compiled tick table); Megatron: (p-1)/(v m+p-1).",
              "ppermutes analytic: 2 per tick x ticks; HLO: collective-permute instructions of the compiled "
              "step x the known trip count of the while loop around them (the tick scan).",
              "bytes: ppermutes x [micro_batch_size, seq_length, hidden_size] x dtype size (per device).",
              "live acts: stage inputs kept for the backward, stage 0 first; jmegatron's 1F1B keeps 2(p-s)-1 "
              "(Megatron p-s): one forward and one backward per tick, see docs/PIPELINE.md.",
              "temp bytes: compiled.memory_analysis().temp_size_in_bytes per device."]
    odd = sorted({a for r in report["rows"] for a in r["ppermutes_not_over_pipeline"]})
    if odd:
        lines.append(f"note: collective-permutes over other mesh axes were counted too: {odd}")
    for s in report.get("skipped", []):
        lines.append(f"skipped: {s}")
    return "\n".join(lines)


def report(cfg, mesh, ms: Sequence[int], virtual_size: int, schedules: Optional[Sequence[str]] = None,
           config_path: str = "") -> dict:
    """Every row for ``ms`` x the schedules (default :func:`applicable_schedules`), as a
    JSON-ready dict with ``rows`` and ``skipped`` (interleaved with ``m`` not a multiple of
    ``p``, which Megatron refuses too). Raises ValueError for ``p < 2`` or a schedule that
    does not apply."""
    p = cfg.pipeline_model_parallel_size
    if p < 2:
        raise ValueError(f"config.pipeline_model_parallel_size={p}: the report needs a pipeline; pass "
                         "--config.pipeline_model_parallel_size=2 (or more)")
    allowed = applicable_schedules(virtual_size)
    schedules = list(schedules or allowed)
    for s in schedules:
        if s not in allowed:
            raise ValueError(f"--schedules {s}: with v={virtual_size} the schedules are {allowed} "
                             "(interleaved_1f1b needs --virtual 2 or more)")
    if virtual_size > 1 and cfg.num_layers % (p * virtual_size):
        raise ValueError(f"--virtual {virtual_size}: config.num_layers={cfg.num_layers} does not split into "
                         f"pipeline_model_parallel_size x v = {p} x {virtual_size} equal chunks")
    for m in ms:
        if m < 1:
            raise ValueError(f"--m {m}: the number of micro-batches must be >= 1")
    rows, skipped = [], []
    for name in schedules:
        for m in ms:
            if name == "interleaved_1f1b" and m % p:
                skipped.append(f"interleaved_1f1b m={m}: not a multiple of p={p} (Megatron requires it)")
                continue
            rows.append(analyze(cfg, mesh, name, m, virtual_size))
    return {"config_path": config_path, "mesh": dict(mesh.shape),
            "config": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "seq_length": cfg.seq_length,
                       "micro_batch_size": cfg.micro_batch_size, "dtype": "bfloat16" if cfg.bf16 else "float32",
                       "tensor_model_parallel_size": cfg.tensor_model_parallel_size,
                       "sequence_parallel": cfg.sequence_parallel},
            "rows": rows, "skipped": skipped}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (0, or 2 for bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m jmegatron.tools.pipeline_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="numbers of micro-batches")
    ap.add_argument("--devices", type=int, default=None,
                    help="simulate this many CPU devices (before JAX starts) and build the mesh over them")
    ap.add_argument("--virtual", type=int, default=None,
                    help="model chunks per stage for interleaved_1f1b (default: the config's)")
    ap.add_argument("--schedules", nargs="+", default=None, help="a subset of gpipe 1f1b interleaved_1f1b")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    args, rest = ap.parse_known_args(argv)
    if args.devices and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax

    from jmegatron.parallel.mesh import create_mesh

    try:
        path, overrides = parse_args(rest)
        if path is None:
            raise ValueError("--config is required: python -m jmegatron.tools.pipeline_report --config "
                             "configs/gpt_tiny.py --config.pipeline_model_parallel_size=2 --config.vocab_size=8192")
        overrides.setdefault("mock_data", True)
        cfg = load_config_file(path, overrides)
        v = cfg.virtual_pipeline_size() if args.virtual is None else args.virtual
        if v < 1:
            raise ValueError(f"--virtual {v}: must be >= 1")
        devices = jax.devices()
        if args.devices:
            if args.devices > len(devices):
                raise ValueError(f"--devices {args.devices}: JAX has only {len(devices)} devices (it started "
                                 "before the flag could set XLA_FLAGS)")
            devices = devices[:args.devices]
        mesh = create_mesh(cfg, devices)
        rep = report(cfg, mesh, args.m, v, args.schedules, path)
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
