"""``python -m jmegatron.tools.comm_report --config C [--devices 8] [--config.<field>=<value> ...]``

Compiles the train step and reports every collective of the compiled program: kind,
mesh axes, executions per step (collectives inside the micro-batch loop count once per
micro-batch: the while loop's known trip count), elements and bytes; then the
per-device bytes of parameters, gradients and optimizer state from the compiled
program's shardings, and Megatron's analytic communication volumes for the same layout
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2; Megatron-Core's distributed optimizer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from jmegatron.command_line import config_from_argv
from jmegatron.reporting.collectives import Collective, parse_collectives

# Modules that import JAX (pretrain_gpt, parallel.rules, the MoE utilities) are imported
# inside the functions that need them: main() must set XLA_FLAGS (--devices) before JAX starts.

def _tree_bytes(abstract: Any, shardings: Any) -> int:
    import jax

    total = 0
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
    return total


def analyze(run) -> dict:
    """Compile ``run.train_step`` and return the report as a dict (see module docstring)."""
    import jax
    import jax.numpy as jnp

    cfg = run.cfg
    nm, gbs, s = run.num_microbatches, run.global_batch_size, cfg.seq_length
    batch = {k: jax.ShapeDtypeStruct((nm, gbs // nm, s), jnp.float32 if k == "loss_mask" else jnp.int32)
             for k in ("tokens", "labels", "loss_mask", "position_ids")
             + (("segment_ids",) if cfg.reset_attention_mask else ())
             + (("positions",) if cfg.context_parallel_size > 1 else ())}
    compiled = run.train_step.lower(run.abstract_with_shardings(), batch, *run.extra_args).compile()
    colls = parse_collectives(compiled.as_text(), run.mesh)
    state_sh = compiled.input_shardings[0][0]
    abstract = run.abstract_state
    total_param_bytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract.params))
    total_opt_bytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract.opt_state))
    mem = compiled.memory_analysis()
    tp, dp = run.mesh.shape["tensor"], run.mesh.shape["data"]
    b, h, L = cfg.micro_batch_size, cfg.hidden_size, cfg.num_layers
    act = b * s * h
    analytic = {"activation_tensor_elements (b*s*h)": act}
    if tp > 1:
        n = (4 * L + 2) * nm
        if cfg.sequence_parallel:
            analytic["all-gather over tensor of b*s*h, per step"] = n
            analytic["reduce-scatter over tensor of b*s*h, per step"] = n
        else:
            analytic["all-reduce over tensor of b*s*h, per step"] = n
        analytic["note"] = ("Megatron per layer and micro-batch: 2 forward + 2 backward all-reduces "
                            "(or all-gather + reduce-scatter pairs with SP), plus the vocab-parallel "
                            "embedding's forward and the output layer's input-gradient reduction")
    ep = run.mesh.shape.get("expert", 1)
    if ep > 1:
        pp = run.mesh.shape.get("pipeline", 1)
        moe_layers = sum(run.model.cfg.moe_layers()) // pp  # one pipeline rank's (every layer is MoE under pp)
        tokens = b * s  # one rank's tokens per micro-batch
        e, k = cfg.num_moe_experts, cfg.moe_router_topk
        if cfg.moe_token_dispatcher_type == "alltoall":
            from jmegatron.models.moe.moe_utils import get_capacity

            c = tokens if cfg.moe_expert_capacity_factor is None else min(
                tokens, get_capacity(tokens * k, e, cfg.moe_expert_capacity_factor))
            analytic["all-to-all over expert, per step"] = 6 * moe_layers * nm
            analytic["all-to-all elements per rank (tokens [E, C, h], weights [E, C])"] = (e * c * h, e * c)
            analytic["note (expert)"] = (
                "Megatron's alltoall dispatcher per MoE layer and micro-batch: forward dispatch of the tokens "
                "and of their routing weights, combine of the outputs (3), and the backward's 3 for their "
                "gradients; C = capacity (T = b*s when dropless: every token fits). XLA:CPU compiles each "
                "into ep per-peer all-to-alls of 1/ep of the elements")
        else:
            analytic["all-gather over expert, per step"] = 4 * moe_layers * nm
            analytic["reduce-scatter over expert, per step"] = 3 * moe_layers * nm
            analytic["all-gather elements per rank (tokens, top-k indices, weights)"] = (
                tokens * ep * h, tokens * ep * k, tokens * ep * e)
            analytic["note (expert)"] = (
                "Megatron's allgather dispatcher per MoE layer and micro-batch: forward all-gathers of the "
                "tokens, top-k indices and weights and a reduce-scatter of the outputs; backward: reduce-"
                "scatters of the token and weight gradients, an all-gather of the output gradient")
        if pp > 1:
            analytic["note (expert, pipeline)"] = (
                f"counts for one pipeline rank's {moe_layers} MoE layers. The compiled pipeline counts more: "
                "each tick's forward and backward sit in lax.cond branches that the HLO count takes every tick "
                "(idle ticks too), and the backward recomputes the chunk's forward (docs/PIPELINE.md): per "
                "layer of a chunk and tick, the forward's dispatches, the recomputed forward's and the backward's")
    cp = run.mesh.shape.get("context", 1)
    if cp > 1:
        block = b * (s // cp) * (cfg.num_query_groups or cfg.num_attention_heads) // tp * cfg.kv_channels
        if cfg.cp_comm_type == "p2p":
            analytic["collective-permute over context, per step"] = (4 * (cp - 1) + 1) * L * nm
            analytic["K/V blocks sent over context, per step"] = (6 * (cp - 1) + 2) * L * nm
            analytic["collective-permute elements (one K or V block, b*(s/cp)*kv_heads*d)"] = block
            analytic["note (context)"] = (
                "ring attention per layer and micro-batch: forward 2 (cp-1) K/V block sends (Megatron / "
                "Transformer Engine's p2p count, one message each); backward (custom VJP, TE's scheme) (cp-1) "
                "hops of a [K|V] and a [dK|dV] message (4 blocks) and a last [dK|dV] hop home: 2 (cp-1) + 1 "
                "messages, 4 (cp-1) + 2 blocks. Full recomputation repeats the forward's")
        elif cfg.cp_comm_type == "all_gather":
            analytic["all-gather over context of K/V, per step"] = 2 * L * nm
            analytic["reduce-scatter over context of dK/dV, per step"] = 2 * L * nm
        else:
            analytic["all-to-all over context, per step"] = 8 * L * nm
            analytic["note (context)"] = ("Ulysses per layer and micro-batch: q, k, v to heads and the output "
                                          "back (4), and their gradients (4)")
    # Parameters held by one tensor rank: tensor-sharded ones split, the rest (norms,
    # row-parallel biases, position embeddings) whole, as in Megatron.
    from jax.sharding import NamedSharding

    from jmegatron.parallel.rules import spec_without

    param_elems = sum(math.prod(NamedSharding(s.mesh, spec_without(s.spec, "data")).shard_shape(a.shape))
                      for a, s in zip(jax.tree.leaves(abstract.params), jax.tree.leaves(state_sh.params)))
    analytic["parameter elements per tensor rank"] = param_elems
    # the gradients' group: data, and context too under context parallelism (Megatron's DP x CP)
    over = "data x context" if cp > 1 else "data"
    if dp * cp > 1 and not cfg.use_megatron_fsdp:
        if cfg.use_distributed_optimizer:
            analytic[f"reduce-scatter over {over} of gradients, elements per step"] = param_elems
            analytic[f"all-gather over {over} of parameters, elements per step"] = param_elems
        else:
            analytic[f"all-reduce over {over} of gradients, elements per step"] = param_elems
    return {
        "config": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "seq_length", "micro_batch_size",
                                                 "tensor_model_parallel_size", "sequence_parallel",
                                                 "use_distributed_optimizer", "use_megatron_fsdp")},
        "mesh": dict(run.mesh.shape),
        "num_microbatches": nm,
        "collectives": colls,
        "per_device_bytes": {
            "parameters": _tree_bytes(abstract.params, state_sh.params),
            "gradients": _tree_bytes(abstract.params, run.grad_shardings),
            "optimizer_state": _tree_bytes(abstract.opt_state, state_sh.opt_state),
            "total_parameters": total_param_bytes,
            "total_optimizer_state": total_opt_bytes,
        },
        "memory_analysis": {k: getattr(mem, k, None) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")},
        "analytic": analytic,
    }


def summarize(colls: list[Collective]) -> list[dict]:
    """Collectives grouped by (kind, axes, elements): count per step and bytes per step."""
    rows: dict[tuple, dict] = {}
    for c in colls:
        key = (c.kind, c.axes, c.elements)
        r = rows.setdefault(key, {"kind": c.kind, "axes": list(c.axes), "elements": c.elements,
                                  "count_per_step": 0, "bytes_per_step": 0})
        r["count_per_step"] += c.per_step
        r["bytes_per_step"] += c.bytes * c.per_step
    return sorted(rows.values(), key=lambda r: (r["kind"], r["axes"], -r["elements"]))


def format_report(report: dict) -> str:
    """The report as the text table the CLI prints."""
    lines = [f"mesh {report['mesh']}, {report['num_microbatches']} micro-batches, config {report['config']}",
             "", f"{'collective':<16}{'mesh axes':<18}{'elements':>12}{'count/step':>12}{'bytes/step':>14}"]
    for r in summarize(report["collectives"]):
        lines.append(f"{r['kind']:<16}{','.join(r['axes']) or '-':<18}{r['elements']:>12,}"
                     f"{r['count_per_step']:>12}{r['bytes_per_step']:>14,}")
    pd = report["per_device_bytes"]
    lines += ["", "per-device bytes (from the compiled program's shardings):",
              f"  parameters      {pd['parameters']:>14,}  (total {pd['total_parameters']:,})",
              f"  gradients       {pd['gradients']:>14,}",
              f"  optimizer state {pd['optimizer_state']:>14,}  (total {pd['total_optimizer_state']:,})",
              f"  memory_analysis {report['memory_analysis']}", "", "Megatron analytic:"]
    lines += [f"  {k}: {v}" for k, v in report["analytic"].items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m jmegatron.tools.comm_report", add_help=True)
    p.add_argument("--devices", type=int, default=None,
                   help="simulate this many CPU devices (sets XLA_FLAGS before JAX starts)")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    args, rest = p.parse_known_args(argv)
    if args.devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}")
    from jmegatron.pretrain_gpt import build

    try:
        run = build(config_from_argv(rest))
    except (ValueError, FileNotFoundError) as e:  # ConfigError and bad data/teacher settings
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = analyze(run)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "collectives": summarize(report["collectives"])}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
