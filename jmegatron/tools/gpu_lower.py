"""``python -m jmegatron.tools.gpu_check --lower-only [--device-kind KIND] [--config C
[--config.FIELD=VALUE ...]]``: the train step lowered for an NVIDIA GPU on a machine without one.

Each row builds a config's train step on the local CPU devices (one, or two for the tp2 /
cp2 layouts: ``XLA_FLAGS=--xla_force_host_platform_device_count``), traces it on abstract
arguments for the named GPU (:func:`jmegatron.kernels.gpu_target.lowering_for`: the Pallas
kernels emit Triton, cuDNN's checks see that GPU) and lowers it with
``lowering_platforms=("cuda",)``. The sharding annotations of the lowered module are the
same whatever devices the mesh holds. The row says whether it lowered (or the error's first
line), which attention ran, how many Triton (``__gpu$xla.gpu.triton``) and cuDNN
(``__cudnn$fmha*``) custom calls the StableHLO holds, and, for FP8 rows, whether the dots'
operands are ``f8E4M3FN`` / ``f8E5M2``. Lowering stops before Triton's own compile to PTX
and XLA's GPU compiler: tile sizes against shared memory and XLA's choice of cuBLASLt's FP8
GEMM are only checked on a GPU (docs/GPU.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jmegatron.config import JMegatronConfig, get_config_of, load_config_file
from jmegatron.kernels import gpu_target
from jmegatron.models.backend import Backend
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRITON_CALL = "__gpu$xla.gpu.triton"
CUDNN_CALL = re.compile(r"__cudnn\$fmha\w*")
# The shipped shapes at their real head dimensions, two layers each (the lowering's cost
# grows with the layers, what it checks does not).
DEFAULT_CONFIGS = tuple(os.path.join(REPO, "configs", c) for c in (
    "gpt_tiny.py", os.path.join("bytemlperf", "gpt3_345m.py"), os.path.join("bytemlperf", "moe.py"), "llama3_8b.py"))
PRECISIONS = {"bf16": dict(bf16=True), "fp8": dict(bf16=True, fp8="hybrid")}
# layout name -> (devices, config fields)
LAYOUTS = {"1": (1, {}), "tp2": (2, dict(tensor_model_parallel_size=2)),
           "tp2+sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
           "cp2": (2, dict(context_parallel_size=2))}
ATTENTIONS = ("pallas", "auto")  # "auto": the backend's choice for the named GPU (cuDNN where it takes the shape)


@dataclasses.dataclass(frozen=True)
class Case:
    """One row to lower: a config file, ``precision`` (a key of :data:`PRECISIONS`),
    ``attention`` (``attention_impl``) and ``layout`` (a key of :data:`LAYOUTS`)."""

    config: str
    precision: str = "bf16"
    attention: str = "pallas"
    layout: str = "1"


def default_cases(configs: Sequence[str] = DEFAULT_CONFIGS) -> list[Case]:
    """Every config in bf16 and FP8 with Pallas attention and with the backend's choice
    (cuDNN) in bf16, on one device; then the last config (Llama-3-8B by default: head_dim 128,
    GQA) with Pallas attention under tp2 (+ sequence parallelism in bf16: the pure-JAX FP8
    path refuses it) and cp2 (ring attention's blocks) in both precisions."""
    cases = [Case(c, p, a) for c in configs for a in ATTENTIONS for p in PRECISIONS
             if not (a == "auto" and p == "fp8")]
    last = configs[-1]
    return cases + [Case(last, "bf16", "pallas", "tp2+sp"), Case(last, "fp8", "pallas", "tp2"),
                    Case(last, "bf16", "pallas", "cp2"), Case(last, "fp8", "pallas", "cp2")]


@dataclasses.dataclass
class LoweringRow:
    """One row of the table: the case (config relative to the repository), the head
    dimension (``kv_channels``), the attention that ran, the status, the Triton and cuDNN
    custom calls, the FP8 operand types found, and the seconds build + trace + lower took."""

    config: str
    precision: str
    layout: str
    head_dim: int
    attention: str
    status: str  # "lowered" | "ERROR: <type>: <first line>" | "skipped: <reason>"
    triton_calls: int = 0
    cudnn_calls: int = 0
    fp8_types: str = ""  # "f8E4M3FN f8E5M2" present in the lowered text (FP8 rows)
    seconds: float = 0.0


def lowering_config(case: Case, overrides: Optional[dict] = None) -> JMegatronConfig:
    """``case``'s config for a lowering row: mock data (the config's vocabulary, else GPT-2's
    padded 50304), two layers (an MoE config's layers all MoE: its dense/MoE pattern names
    more layers), one sequence per data rank, no dropout, the case's attention (and the Pallas
    cross-entropy), precision and layout, then ``overrides``. Raises ConfigError /
    FileNotFoundError as :func:`jmegatron.config.load_config_file`."""
    of = get_config_of(case.config)
    fields = dict(mock_data=True, vocab_size=of.get("vocab_size") or 50304, num_layers=2, micro_batch_size=1,
                  global_batch_size=1, attention_impl=case.attention, cross_entropy_impl="pallas", hidden_dropout=0.0,
                  attention_dropout=0.0, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                  context_parallel_size=1, expert_model_parallel_size=1, sequence_parallel=False,
                  use_distributed_optimizer=False, **PRECISIONS[case.precision])
    fields.update(LAYOUTS[case.layout][1])
    if of.get("num_moe_experts") is not None:
        fields["moe_layer_freq"] = 1
    fields.update(overrides or {})
    return load_config_file(case.config, fields)


def lower_train_step(cfg: JMegatronConfig, devices: Sequence, device_kind: str = gpu_target.DEFAULT_DEVICE_KIND
                     ) -> tuple[str, str, float]:
    """(the StableHLO text of ``cfg``'s train step lowered for ``device_kind`` on a mesh of
    ``devices``, the attention it resolved to, seconds)."""
    t0 = time.time()
    with gpu_target.lowering_for(device_kind):
        run = build(cfg, create_mesh(cfg, list(devices)))
        attention = Backend.from_config(cfg).attention
        shape = (run.num_microbatches, run.global_batch_size // run.num_microbatches, cfg.seq_length)
        ids = jax.ShapeDtypeStruct(shape, jnp.int32)
        batch = {"tokens": ids, "labels": ids, "position_ids": ids, "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32)}
        if cfg.context_parallel_size > 1:  # each slot's sequence position (Run.put_batch)
            batch["positions"] = ids
        traced = run.train_step.jitted.trace(run.abstract_with_shardings(), batch, run.train_step.flags(False))
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    return text, attention, time.time() - t0


def _error(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"ERROR: {type(e).__name__}: {lines[0][:240] if lines else ''}"


def lowering_row(case: Case, overrides: Optional[dict] = None,
                 device_kind: str = gpu_target.DEFAULT_DEVICE_KIND) -> LoweringRow:
    """One row: never raises for a config or lowering failure (its first line is the status)."""
    row = LoweringRow(os.path.relpath(os.path.abspath(case.config), REPO), case.precision, case.layout, 0,
                      case.attention, "lowered")
    n = LAYOUTS[case.layout][0]
    devices = jax.devices("cpu")
    if len(devices) < n:
        row.status = (f"skipped: needs {n} CPU devices, this process has {len(devices)} "
                      f"(XLA_FLAGS=--xla_force_host_platform_device_count={n})")
        return row
    try:
        cfg = lowering_config(case, overrides)
        row.head_dim = cfg.kv_channels
        text, row.attention, row.seconds = lower_train_step(cfg, devices[:n], device_kind)
    except Exception as e:  # a config, Triton or cuDNN lowering error: the table goes on
        row.status = _error(e)
        return row
    row.triton_calls = text.count(TRITON_CALL)
    row.cudnn_calls = len(CUDNN_CALL.findall(text))
    row.fp8_types = " ".join(t for t in ("f8E4M3FN", "f8E5M2") if t in text)
    return row


def format_rows(rows: Sequence[LoweringRow]) -> str:
    """The rows as a Markdown table (the one docs/GPU.md quotes)."""
    lines = ["| config | precision | layout | head dim | attention | lowered for cuda | Triton calls | cuDNN calls "
             "| FP8 operand types | seconds |", "|---|---|---|---:|---|---|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r.config} | {r.precision} | {r.layout} | {r.head_dim} | {r.attention} | {r.status} | "
                     f"{r.triton_calls} | {r.cudnn_calls} | {r.fp8_types or '-'} | {r.seconds:.1f} |")
    return "\n".join(lines)


def row_ok(r: LoweringRow) -> bool:
    """Lowered, with the kernels the row names (Triton calls for Pallas attention, cuDNN
    calls for cuDNN), and FP8 operands in an FP8 row."""
    kernels = r.cudnn_calls if r.attention == "cudnn" else r.triton_calls
    return r.status == "lowered" and kernels > 0 and (r.precision != "fp8" or "f8E4M3FN" in r.fp8_types)


def report_lowering(cases: Sequence[Case], overrides: Optional[dict] = None,
                    device_kind: str = gpu_target.DEFAULT_DEVICE_KIND) -> int:
    """Print the table of ``cases`` lowered for ``device_kind``; 1 when a row is not
    :func:`row_ok`, else 0. Raises ValueError for an unknown ``device_kind``."""
    cc = gpu_target.compute_capability_of(device_kind)
    rows = [lowering_row(c, overrides, device_kind) for c in cases]
    print(f"gpu_check --lower-only: train steps lowered for cuda ({device_kind}, compute capability "
          f"{cc[0]}.{cc[1]}) on {jax.devices()[0].platform} (jax {jax.__version__})")
    print(format_rows(rows))
    return 0 if all(row_ok(r) for r in rows) else 1
