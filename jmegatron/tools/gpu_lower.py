"""``python -m jmegatron.tools.gpu_check --lower-only [--config C [--config.FIELD=VALUE ...]]``:
the train step lowered for an NVIDIA GPU on a machine without one.

Each row builds a config's train step on one local device with the Pallas attention and
cross-entropy kernels, traces it on abstract arguments with the kernels emitting Triton
(:func:`jmegatron.kernels.pallas.common.emit_triton`) and lowers it with
``lowering_platforms=("cuda",)``. The row says whether it lowered (or the error's first
line), how many Triton custom calls (``__gpu$xla.gpu.triton``) the StableHLO holds, and, for
FP8 rows, whether the dots' operands are ``f8E4M3FN`` / ``f8E5M2``. Lowering stops before
Triton's own compile to PTX and XLA's GPU compiler: tile sizes against shared memory and
XLA's choice of cuBLASLt's FP8 GEMM are only checked on a GPU (docs/GPU.md).

Not covered yet: layouts over several devices (they need a mesh of ``cuda`` abstract
devices) and cuDNN attention (JAX checks the device's compute capability when it traces it).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jmegatron.config import JMegatronConfig, get_config_of, load_config_file
from jmegatron.kernels.pallas.common import emit_triton
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRITON_CALL = "__gpu$xla.gpu.triton"
# The shipped shapes at their real head dimensions, two layers each (the lowering's cost
# grows with the layers, what it checks does not).
DEFAULT_CONFIGS = tuple(os.path.join(REPO, "configs", c) for c in (
    "gpt_tiny.py", os.path.join("bytemlperf", "gpt3_345m.py"), os.path.join("bytemlperf", "moe.py"), "llama3_8b.py"))
PRECISIONS = {"bf16": dict(bf16=True), "fp8": dict(bf16=True, fp8="hybrid")}


@dataclasses.dataclass
class LoweringRow:
    """One config x precision of the table: the config file (relative to the repository),
    the head dimension (``kv_channels``), the status, the number of Triton custom calls, the
    FP8 operand types found, and the seconds the build, trace and lowering took."""

    config: str
    precision: str
    head_dim: int
    status: str  # "lowered" or "ERROR: <type>: <first line>"
    triton_calls: int = 0
    fp8_types: str = ""  # "f8E4M3FN f8E5M2" present in the lowered text (FP8 rows)
    seconds: float = 0.0


def lowering_config(path: str, precision: str, overrides: Optional[dict] = None) -> JMegatronConfig:
    """``path``'s config for a lowering row: mock data (the config's vocabulary, else GPT-2's
    padded 50304), two layers (an MoE config's layers all MoE: its dense/MoE pattern names
    more layers), one micro-batch of one sequence, one device, Pallas attention and
    cross-entropy, no dropout, ``precision``'s fields, then ``overrides``. Raises
    ConfigError / FileNotFoundError as :func:`jmegatron.config.load_config_file`."""
    vocab = get_config_of(path).get("vocab_size") or 50304
    fields = dict(mock_data=True, vocab_size=vocab, num_layers=2, micro_batch_size=1, global_batch_size=1, attention_impl="pallas",
                  cross_entropy_impl="pallas", hidden_dropout=0.0, attention_dropout=0.0,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                  expert_model_parallel_size=1, sequence_parallel=False, use_distributed_optimizer=False,
                  **PRECISIONS[precision], **(overrides or {}))
    if get_config_of(path).get("num_moe_experts") is not None:
        fields.setdefault("moe_layer_freq", 1)
    return load_config_file(path, fields)


def lower_train_step(cfg: JMegatronConfig) -> tuple[str, float]:
    """(the StableHLO text of ``cfg``'s train step lowered for ``cuda``, seconds)."""
    t0 = time.time()
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    shape = (run.num_microbatches, run.global_batch_size // run.num_microbatches, cfg.seq_length)
    ids = jax.ShapeDtypeStruct(shape, jnp.int32)
    batch = {"tokens": ids, "labels": ids, "position_ids": ids, "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32)}
    with emit_triton():
        traced = run.train_step.jitted.trace(run.abstract_with_shardings(), batch, run.train_step.flags(False))
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    return text, time.time() - t0


def lowering_row(path: str, precision: str, overrides: Optional[dict] = None) -> LoweringRow:
    """One row: never raises for a lowering failure (its first line is the status)."""
    name = os.path.relpath(os.path.abspath(path), REPO)
    try:
        cfg = lowering_config(path, precision, overrides)
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        return LoweringRow(name, precision, 0, f"ERROR: {type(e).__name__}: {str(e).splitlines()[0]}")
    try:
        text, seconds = lower_train_step(cfg)
    except Exception as e:  # a Triton lowering error, an XLA one: the table goes on
        return LoweringRow(name, precision, cfg.kv_channels, f"ERROR: {type(e).__name__}: {str(e).splitlines()[0]}")
    fp8 = " ".join(t for t in ("f8E4M3FN", "f8E5M2") if t in text)
    return LoweringRow(name, precision, cfg.kv_channels, "lowered", text.count(TRITON_CALL), fp8, seconds)


def format_rows(rows: Sequence[LoweringRow]) -> str:
    """The rows as a Markdown table (the one docs/GPU.md quotes)."""
    lines = ["| config | precision | head dim | lowered for cuda | Triton calls | FP8 operand types | seconds |",
             "|---|---|---:|---|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r.config} | {r.precision} | {r.head_dim} | {r.status} | {r.triton_calls} | "
                     f"{r.fp8_types or '-'} | {r.seconds:.1f} |")
    return "\n".join(lines)


def main(configs: Sequence[str], overrides: Optional[dict] = None, precisions: Sequence[str] = tuple(PRECISIONS)
         ) -> int:
    """Print the table of every config x precision; 1 when a row did not lower (or an FP8 row
    has no FP8 operands), else 0."""
    rows = [lowering_row(c, p, overrides) for c in configs for p in precisions]
    print(f"gpu_check --lower-only: train steps lowered for cuda on {jax.devices()[0].platform} "
          f"(jax {jax.__version__}; Pallas attention and cross-entropy in Triton)")
    print(format_rows(rows))
    bad = [r for r in rows if r.status != "lowered" or r.triton_calls == 0
           or (r.precision == "fp8" and "f8E4M3FN" not in r.fp8_types)]
    return 1 if bad else 0
