"""The environment report of ``benchmarks/gpu_run.sh``: Python and library versions, the
first device, the backend resolved for gpt3_345m, Transformer Engine's availability, the
float32 matmul precision, and which FP8 dtypes and GEMM calls the compiled FP8 train step
of gpt_tiny (full shape, one device) holds.

``python benchmarks/gpu_env.py`` (runs on the CPU too; there the FP8 dots are emulated)."""

import re
import sys

import flax
import jax
import jaxlib
import numpy as np
import optax
import orbax.checkpoint as ocp

from jmegatron.config import load_config_file
from jmegatron.data.gpt_dataset import MockGPTDataset
from jmegatron.data.loader import BatchLoader
from jmegatron.models import te
from jmegatron.models.backend import resolve_impls
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build


def main() -> None:
    print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__,
          "| flax", flax.__version__, "| optax", optax.__version__, "| orbax", ocp.__version__, "| numpy",
          np.__version__)
    d = jax.devices()[0]
    print("device:", d.platform, d.device_kind, "| compute capability", getattr(d, "compute_capability", "-"),
          "| count", jax.device_count())
    print("jax_default_matmul_precision:", jax.config.jax_default_matmul_precision,
          "(None: float32 dots may run in TF32 on Ampere and later)")
    for over in ({}, {"attention_dropout": 0.0}):
        print("gpt3_345m", over, "resolved:", resolve_impls(load_config_file("configs/gpt3_345m.py", over)))
    print("transformer engine:", te.te_available())
    cfg = load_config_file("configs/gpt_tiny.py", dict(
        bf16=True, fp8="hybrid", mock_data=True, vocab_size=50257, hidden_dropout=0.0, attention_dropout=0.0, save=None))
    run = build(cfg, create_mesh(cfg, [d]))
    state = run.init_state()
    data = MockGPTDataset(num_samples=run.global_batch_size, seq_length=cfg.seq_length,
                          vocab_size=cfg.vocab_size, seed=cfg.seed)
    batch = run.put_batch(next(BatchLoader(data, run.global_batch_size, run.num_microbatches)))
    hlo = run.train_step.lower(state, batch).compile().as_text()
    dtypes = {t: len(re.findall(rf"\b{t}\[", hlo)) for t in ("f8e4m3fn", "f8e5m2", "bf16", "f32")}
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    print("fp8 train step (gpt_tiny): array types in the compiled HLO:", dtypes)
    print("fp8 train step custom calls:", calls)
    gemm_f8 = [l.strip()[:200] for l in hlo.splitlines() if "f8e4m3fn" in l and ("gemm" in l or "dot(" in l)]
    print(f"fp8 train step: {len(gemm_f8)} GEMM/dot instructions with f8e4m3fn operands; first:",
          gemm_f8[:1])


if __name__ == "__main__":
    main()
