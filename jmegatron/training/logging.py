"""Training reports: console progress line, TensorBoard events and ``metrics.jsonl``.

The console line follows Megatron's ``training_log`` (megatron/training/training.py):
iteration, lm loss (averaged over the logging interval), learning rate, grad norm,
throughput (tokens/s), TFLOP/s per device and MFU against a peak.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Optional

import numpy as np


# Report keys -> Megatron's console names (pretrain_gpt.py loss_func; the distillation
# loss_func's "kd loss", "logits distillation loss", "intermediate distillation loss").
REPORT_NAMES = {
    "lm_loss": "lm loss",
    "kd_loss": "kd loss",
    "logits_distillation_loss": "logits distillation loss",
    "intermediate_distillation_loss": "intermediate distillation loss",
}


class MetricsLogger:
    """Writes training and validation metrics.

    ``metrics.jsonl`` gets one JSON object per logged iteration with ``iteration``,
    ``lm_loss``, ``lr``, ``grad_norm``, ``tokens_per_sec``, ``tflops_per_device``,
    ``mfu`` (fraction of peak), plus ``val_loss`` and ``val_ppl`` at evaluations, and the
    distillation losses (``kd_loss``, ``logits_distillation_loss``,
    ``intermediate_distillation_loss``) when distilling. Losses and ``grad_norm`` are
    means over the iterations since the last log; ``step_losses`` lists each of those
    iterations' own ``lm_loss`` (or, when the LM loss is not computed, the optimised loss).
    """

    def __init__(self, save_dir: Optional[str], tensorboard_dir: Optional[str],
                 flops_per_iteration: float, num_devices: int, peak_tflops: float,
                 train_iters: int, stream=None, theoretical_peak_tflops: Optional[float] = None):
        self.flops_per_iteration = flops_per_iteration
        self.theoretical_peak_tflops = theoretical_peak_tflops
        self.num_devices = num_devices
        self.peak_tflops = peak_tflops
        self.train_iters = train_iters
        self.stream = stream or sys.stdout
        self._jsonl = None
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            self._jsonl = open(os.path.join(save_dir, "metrics.jsonl"), "a", buffering=1)
        self._tb = None
        if tensorboard_dir:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(tensorboard_dir)

    def log_train(self, iteration: int, step_metrics: list[dict[str, Any]], elapsed_s: float) -> dict:
        """Report the host-side metrics of the last ``len(step_metrics)`` iterations,
        which took ``elapsed_s`` seconds of wall time. Returns the JSON record."""
        n = len(step_metrics)
        main = "lm_loss" if "lm_loss" in step_metrics[0] else "loss"
        losses = [float(m[main]) for m in step_metrics]
        tokens = float(sum(float(m["num_tokens"]) for m in step_metrics))
        tflops = self.flops_per_iteration * n / max(elapsed_s, 1e-9) / self.num_devices / 1e12
        reported = [k for k in REPORT_NAMES if k in step_metrics[0]]
        record = {
            "iteration": iteration,
            **{k: float(np.mean([float(m[k]) for m in step_metrics])) for k in reported},
            "lr": float(step_metrics[-1]["lr"]),
            "grad_norm": float(np.mean([float(m["grad_norm"]) for m in step_metrics])),
            "tokens_per_sec": tokens / max(elapsed_s, 1e-9),
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else float("nan"),
            "mfu_theoretical": tflops / self.theoretical_peak_tflops if self.theoretical_peak_tflops else float("nan"),
            "step_time_s": elapsed_s / n,
            "step_losses": losses,
        }
        losses_text = "".join(f" {REPORT_NAMES[k]}: {record[k]:.6E} |" for k in reported)
        self.stream.write(
            f" iteration {iteration:8d}/{self.train_iters:8d} |{losses_text}"
            f" learning rate: {record['lr']:.6E} | grad norm: {record['grad_norm']:.3f} |"
            f" elapsed time per iteration (ms): {1e3 * record['step_time_s']:.1f} |"
            f" tokens/s: {record['tokens_per_sec']:.0f} | TFLOP/s/device: {tflops:.4f} |"
            f" MFU: {100 * record['mfu']:.1f}%\n")
        self.stream.flush()
        self._write(record, {k: record[k] for k in (*reported, "lr", "grad_norm", "tokens_per_sec",
                                                     "tflops_per_device", "mfu")}, iteration)
        return record

    def log_eval(self, iteration: int, val_loss: float, prefix: str = "validation") -> dict:
        """Report a validation loss (nats per token) and its perplexity."""
        ppl = math.exp(min(val_loss, 700.0))
        record = {"iteration": iteration, "val_loss": val_loss, "val_ppl": ppl}
        if prefix != "validation":
            record = {"iteration": iteration, f"{prefix}_loss": val_loss, f"{prefix}_ppl": ppl}
        bar = "-" * 90
        self.stream.write(f"{bar}\n {prefix} loss at iteration {iteration} | lm loss value: "
                          f"{val_loss:.6E} | lm loss PPL: {ppl:.6E} |\n{bar}\n")
        self.stream.flush()
        self._write(record, {k: v for k, v in record.items() if k != "iteration"}, iteration)
        return record

    def _write(self, record: dict, scalars: dict, iteration: int) -> None:
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, iteration)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
