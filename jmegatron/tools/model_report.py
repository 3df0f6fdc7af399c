"""``python -m jmegatron.tools.model_report --config C [--config.<field>=<value> ...]
[--tp N] [--pp N] [--ep N] [--dp N] [--zero1] [--sp] [--fsdp] [--json PATH]``

Parameters, FLOPs per iteration and theoretical memory per device of any config in any
layout, without building the model or touching a device (so it works for configs and
layouts jmegatron cannot train, e.g. ByteMLPerf's GPT-3 175B at tp 8 x pp 16):

* parameters: :func:`jmegatron.reporting.flops.num_parameters` (exact, jmegatron's model),
  for MoE models also the active ones (:func:`jmegatron.reporting.flops.num_active_parameters`:
  the top-k routed experts a token reaches, not all of them) and the routed experts' share
  per device, and Megatron's count on the most loaded shard
  (:func:`jmegatron.reporting.memory.megatron_num_parameters_on_most_loaded_shard`);
* FLOPs per iteration: Megatron's ``num_floating_point_operations`` for one global batch
  (:func:`jmegatron.reporting.flops.num_floating_point_operations`), per token, per device;
  its core-attention share and what the attention path that runs executes of it (masked
  work, flash-style recompute: :func:`jmegatron.reporting.flops.core_attention_executed_fraction`);
* memory per device: :func:`jmegatron.reporting.memory.theoretical_memory` (float32 master
  weights, gradients, AdamW moments, activations with each recomputation choice; pipeline
  stages as Megatron's ``theoretical_memory_usage.py``) and Megatron's own weight+optimizer
  and activation formulas (:func:`~jmegatron.reporting.memory.megatron_weight_and_optimizer_memory`,
  :func:`~jmegatron.reporting.memory.megatron_activation_memory`).

The layout: ``--tp/--pp/--ep/--dp/--zero1/--sp/--fsdp``, else the config file's module
constant ``LAYOUT`` (a dict of ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``data_parallel_size``, optionally ``expert_model_parallel_size``: the layout of the script a
config transcribes, e.g. configs/bytemlperf/gpt3_175b.py, ds_like_2node.py), else the
config's own parallel fields with dp 1. ``dp`` is jmegatron's ``data`` mesh axis, which
excludes the expert axis: devices = tp x pp x ep x dp, and the global batch splits over
Megatron's data-parallel size dp x ep (:class:`jmegatron.reporting.memory.ParallelLayout`).
``--config.<field>`` overrides as :mod:`jmegatron.train`. Bad input exits 2 with the
field or flag named.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from typing import Optional, Sequence

from jmegatron.command_line import parse_args
from jmegatron.config import load_config_file
from jmegatron.distill.teacher import teacher_config
from jmegatron.models.backend import resolve_impls
from jmegatron.reporting import flops, memory
from jmegatron.reporting.memory import ParallelLayout

GIB = 2 ** 30
MIB = 2 ** 20


def config_layout(path: str) -> dict:
    """The ``LAYOUT`` dict a config file defines, or ``{}``. Raises FileNotFoundError,
    ValueError for a LAYOUT with other keys."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (pass --config configs/gpt_tiny.py)")
    spec = importlib.util.spec_from_file_location(f"_jmegatron_report_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layout = dict(getattr(module, "LAYOUT", {}) or {})
    allowed = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
               "expert_model_parallel_size"}
    if set(layout) - allowed:
        raise ValueError(f"{path}: LAYOUT has unknown keys {sorted(set(layout) - allowed)}; allowed: {sorted(allowed)}")
    return layout


def report(cfg, layout, num_microbatches: int) -> dict:
    """Every figure of the report (counts and bytes per device) as a JSON-ready dict.
    ``cfg`` is validated and carries the layout's tensor size (its padded vocabulary);
    ``layout`` is a :class:`jmegatron.reporting.memory.ParallelLayout`."""

    padded = cfg.padded_vocab_size()
    global_batch = num_microbatches * cfg.micro_batch_size * layout.megatron_data_parallel_size
    flops_iter = flops.num_floating_point_operations(cfg, global_batch, padded)
    est = memory.theoretical_memory(cfg, padded, layout, num_microbatches=num_microbatches)
    megatron_state = memory.megatron_weight_and_optimizer_memory(cfg, padded, layout)
    megatron_act = memory.megatron_activation_memory(cfg, padded, layout, num_microbatches)
    impl = resolve_impls(cfg)["attention_impl"]
    cp = layout.context_parallel_size
    kernel = impl == "cpu" and not cfg.bf16 and not (cp > 1 and cfg.attention_dropout > 0)
    attention_path = ((f"cp {cp} {cfg.cp_comm_type}, " if cp > 1 else "")
                      + ("CPU kernel" if kernel else "XLA") + (" blocks" if cp > 1 else ""))
    attention_flops = flops.core_attention_flops(cfg, global_batch)
    return {
        "teacher": teacher_report(cfg, layout),
        "layout": layout.name, "num_devices": layout.num_devices,
        "context_parallel_size": layout.context_parallel_size,
        "micro_batch_size": cfg.micro_batch_size, "num_microbatches": num_microbatches,
        "global_batch_size": global_batch, "seq_length": cfg.seq_length, "padded_vocab_size": padded,
        "megatron_data_parallel_size": layout.megatron_data_parallel_size,
        "num_parameters": flops.num_parameters(cfg, padded),
        "num_active_parameters": flops.num_active_parameters(cfg, padded),
        "parameters_per_device": est.parameters_per_device,
        "expert_parameters_per_device": memory.expert_parameters_per_device(cfg, padded, layout),
        "megatron_parameters_on_most_loaded_shard": memory.megatron_num_parameters_on_most_loaded_shard(
            cfg, padded, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size),
        "flops_per_iteration": flops_iter,
        "flops_per_token": flops_iter / (global_batch * cfg.seq_length),
        "flops_per_iteration_per_device": flops_iter / layout.num_devices,
        "core_attention_flops": attention_flops, "attention_path": attention_path,
        "core_attention_executed_flops": attention_flops * flops.core_attention_executed_fraction(
            cfg, impl, cp, cfg.cp_comm_type),
        "memory": est.to_dict(),
        "megatron_memory": {"weight_and_optimizer": megatron_state, "activations": megatron_act,
                            "total": megatron_state + megatron_act},
    }


def teacher_report(cfg, layout) -> Optional[dict]:
    """A distillation config's teacher (``kd_teacher_load``, read for its config only:
    :func:`jmegatron.distill.teacher.teacher_config`): its parameters and their bytes per
    device in the layout the run gives it (the student's, or its own with
    ``kd_teacher_use_megatron_fsdp``: split over the data ranks); None without a teacher."""
    if not cfg.kd_teacher_load or cfg.kd_finalize:
        return None
    tcfg, meta = teacher_config(cfg.kd_teacher_load, cfg, cfg.kd_teacher_bf16)
    padded = meta["padded_vocab_size"]
    t_layout = dataclasses.replace(layout, use_megatron_fsdp=tcfg.use_megatron_fsdp, use_distributed_optimizer=False,
                                   expert_model_parallel_size=tcfg.expert_model_parallel_size)
    per_device = memory.parameters_per_device(tcfg, padded, t_layout)
    return {"load": cfg.kd_teacher_load, "num_parameters": flops.num_parameters(tcfg, padded),
            "parameters_per_device": per_device, "bytes_per_device": per_device * (2 if cfg.kd_teacher_bf16 else 4),
            "layout": "its own: split over the data ranks" if tcfg.use_megatron_fsdp and not cfg.use_megatron_fsdp
            else "the student's"}


def format_report(r: dict, config_path: str, bf16: bool, recompute: str) -> str:
    """The console text of :func:`report`'s dict."""
    m, mm = r["memory"], r["megatron_memory"]
    by = m["activations_by_recompute"]
    lines = [
        f"model_report: {config_path}",
        f"layout {r['layout']} ({r['num_devices']} devices); micro-batch {r['micro_batch_size']} x "
        f"{r['num_microbatches']} micro-batches x {r['megatron_data_parallel_size']} (dp x ep) -> global batch {r['global_batch_size']} x "
        f"{r['seq_length']} tokens; padded vocab {r['padded_vocab_size']}",
        "",
        f"parameters:            {r['num_parameters']:,} (jmegatron's model, exact)",
    ]
    if r["num_active_parameters"] != r["num_parameters"]:
        lines.append(f"  active per token:    {r['num_active_parameters']:,} (top-k routed experts, "
                     "shared expert, router, attention, embeddings)")
    lines += [
        f"  per device:          {r['parameters_per_device']:,.0f} (most loaded pipeline stage)",
    ]
    if r["expert_parameters_per_device"]:
        lines.append(f"    routed experts:    {r['expert_parameters_per_device']:,.0f} (split over ep)")
    lines += [
        f"  Megatron's count:    {r['megatron_parameters_on_most_loaded_shard']:,.0f} on the most loaded shard "
        "(no biases, no position embeddings" + (", no router, experts not split over ep)"
                                                 if r["expert_parameters_per_device"] else ")"),
        f"FLOPs per iteration:   {r['flops_per_iteration']:.6g} (Megatron's num_floating_point_operations, "
        "one global batch, fwd + bwd)",
        f"  per token:           {r['flops_per_token']:.6g}",
        f"  per device:          {r['flops_per_iteration_per_device']:.6g}",
        f"  core attention:      {r['core_attention_flops']:.6g} of them (causal); executed by the "
        f"{r['attention_path']} attention: {r['core_attention_executed_flops']:.6g} "
        f"({r['core_attention_executed_flops'] / r['core_attention_flops']:.3f}x, masked work and recompute; "
        "flops.core_attention_executed_fraction)",
        f"theoretical memory per device (jmegatron, {'bf16 compute' if bf16 else 'float32'}, "
        f"fp32 state, recompute {recompute}):",
        f"  weights              {m['weights'] / GIB:10.3f} GiB",
        f"  gradients            {m['gradients'] / GIB:10.3f} GiB",
        f"  optimizer state      {m['optimizer_state'] / GIB:10.3f} GiB",
        f"  activations          {m['activations'] / GIB:10.3f} GiB  (none {by['none'] / GIB:.3f}, selective "
        f"{by['selective'] / GIB:.3f}, full {by['full'] / GIB:.3f})",
    ]
    if m.get("fsdp_gathered"):
        lines.append(f"  FSDP gathered        {m['fsdp_gathered'] / GIB:10.3f} GiB")
    t = r.get("teacher")
    if t:
        lines.append(f"  teacher (frozen)     {t['bytes_per_device'] / GIB:10.3f} GiB  ({t['num_parameters']:,} "
                     f"parameters, {t['parameters_per_device']:,.0f} per device in {t['layout']} layout: "
                     f"{t['load']})")
    lines += [
        f"  total                {(m['total'] + (t['bytes_per_device'] if t else 0)) / GIB:10.3f} GiB",
        "Megatron's theoretical_memory_usage.py (18 B/param or 6 + 12/dp; activations with SP + selective"
        + ("; it has no context-parallel term" if r.get("context_parallel_size", 1) > 1 else "") + "):",
        f"  weight and optimizer {mm['weight_and_optimizer'] / GIB:10.3f} GiB ({mm['weight_and_optimizer'] / MIB:.2f} MB)",
        f"  activations          {mm['activations'] / GIB:10.3f} GiB ({mm['activations'] / MIB:.2f} MB)",
        f"  total                {mm['total'] / GIB:10.3f} GiB ({mm['total'] / MIB:.2f} MB)",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (0, or 2 for bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m jmegatron.tools.model_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=None, help="tensor_model_parallel_size")
    p.add_argument("--pp", type=int, default=None, help="pipeline_model_parallel_size (theory only)")
    p.add_argument("--ep", type=int, default=None, help="expert_model_parallel_size (theory only: MoE models)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (the data mesh axis, without ep)")
    p.add_argument("--cp", type=int, default=None, help="context_parallel_size (default: the config's); the "
                                                         "config's cp_comm_type picks the attention's memory")
    p.add_argument("--zero1", action="store_true", default=None, help="use_distributed_optimizer")
    p.add_argument("--sp", action="store_true", default=None, help="sequence_parallel")
    p.add_argument("--fsdp", action="store_true", default=None, help="use_megatron_fsdp")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    args, rest = p.parse_known_args(argv)

    try:
        path, overrides = parse_args(rest)
        file_layout = config_layout(path) if path is not None else {}
        cfg = load_config_file(path, overrides)
        tp = args.tp or file_layout.get("tensor_model_parallel_size", cfg.tensor_model_parallel_size)
        pp = args.pp or file_layout.get("pipeline_model_parallel_size", cfg.pipeline_model_parallel_size)
        dp = args.dp or file_layout.get("data_parallel_size", 1)
        ep = args.ep or file_layout.get("expert_model_parallel_size", cfg.expert_model_parallel_size)
        zero1 = cfg.use_distributed_optimizer if args.zero1 is None else args.zero1
        sp = cfg.sequence_parallel if args.sp is None else args.sp
        fsdp = cfg.use_megatron_fsdp if args.fsdp is None else args.fsdp
        cp = cfg.context_parallel_size if args.cp is None else args.cp
        for flag, value in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--dp", dp), ("--cp", cp)):
            if value < 1:
                raise ValueError(f"{flag} {value}: parallel sizes must be >= 1")
        if ep > 1 and cfg.num_moe_experts is None:
            raise ValueError(f"--ep {ep}: the config has no experts (config.num_moe_experts is None); use --ep 1")
        if ep > 1 and cfg.num_moe_experts % ep:
            raise ValueError(f"--ep {ep} does not divide config.num_moe_experts={cfg.num_moe_experts} "
                             f"(each expert rank holds the same number of experts)")
        # The tensor size pads the vocabulary; pipeline stages stay out of the config
        # (validation refuses them: the trainer has none), in the layout only.
        # (the expert tensor size follows: the config resolved it to the file's tensor size, and only
        # equal sizes are built)
        cfg = cfg.replace(tensor_model_parallel_size=tp, sequence_parallel=sp, use_distributed_optimizer=zero1,
                          use_megatron_fsdp=fsdp,
                          expert_tensor_parallel_size=tp if cfg.num_moe_experts is not None else None)
        cfg.check_parallel_divisibility(cfg.padded_vocab_size(), dp)
        if cp > 1 and cfg.seq_length % (2 * cp):
            raise ValueError(f"--cp {cp}: seq_length={cfg.seq_length} must be divisible by 2 x {cp} (Megatron's "
                             f"load-balanced split)")
        layout = ParallelLayout(tp, dp, zero1, sp, fsdp, pp, ep, cp)
        num_micro = cfg.num_microbatches(layout.megatron_data_parallel_size)
        r = report(cfg, layout, num_micro)
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(r, path, cfg.bf16, cfg.recompute_granularity))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": path, "config_overrides": overrides, **r}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
