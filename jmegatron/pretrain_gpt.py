"""GPT pretraining and distillation: picks the forward step for a config and runs the loop
(Megatron's ``pretrain_gpt.py``, which hands ``model_provider`` and ``forward_step`` to
``pretrain``; with ModelOpt installed its provider turns into the distillation model when
``--export-kd-teacher-load`` is given, as :func:`forward_step_provider` does here).

``python -m jmegatron.train`` and the ByteMLPerf measurements train through
:func:`pretrain`; research code may call :func:`jmegatron.training.loop.pretrain` with its
own provider (:mod:`jmegatron.training.forward_step`).
"""

from __future__ import annotations

from typing import Optional

from jax.sharding import Mesh

from jmegatron.config import JMegatronConfig
from jmegatron.distill.model_provider import distillation_forward_step
from jmegatron.training import loop, run as run_lib
from jmegatron.training.forward_step import gpt_forward_step


def forward_step_provider(cfg: JMegatronConfig) -> run_lib.ForwardStepProvider:
    """Distillation's provider when ``cfg.kd_teacher_load`` (online) or
    ``cfg.kd_teacher_logits_path`` (offline) is set (and not ``kd_finalize``), else the
    language model's."""
    if (cfg.kd_teacher_load or cfg.kd_teacher_logits_path) and not cfg.kd_finalize:
        return distillation_forward_step
    return gpt_forward_step


def build(cfg: JMegatronConfig, mesh: Optional[Mesh] = None, vocab_size: Optional[int] = None) -> run_lib.Run:
    """:func:`jmegatron.training.run.build` with :func:`forward_step_provider`'s choice."""
    return run_lib.build(cfg, mesh, vocab_size, forward_step_provider(cfg))


def pretrain(cfg: JMegatronConfig, mesh: Optional[Mesh] = None) -> dict:
    """:func:`jmegatron.training.loop.pretrain` with :func:`forward_step_provider`'s choice."""
    return loop.pretrain(cfg, mesh, forward_step_provider(cfg))
