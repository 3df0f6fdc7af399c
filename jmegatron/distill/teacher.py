"""The frozen teacher: config and parameters from a jmegatron checkpoint.

Megatron's ``_teacher_provider`` (megatron/post_training/model_provider.py) builds the
teacher from ``--export-kd-teacher-load`` with the teacher checkpoint's own arguments;
here the checkpoint's resolved config builds the teacher model, and its parameters are
restored straight into their own shardings on the student's mesh (the same logical
rules, so e.g. a tensor-parallel student gets a tensor-parallel teacher). The teacher
is not in the optimizer and not in the student's checkpoints; it only runs forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jmegatron.config import JMegatronConfig, from_configdict
from jmegatron.models.gpt import GPTModel
from jmegatron.training import checkpointing
from jmegatron.training.run import build, restore_state


@dataclasses.dataclass
class Teacher:
    """The frozen teacher: its resolved config, model, parameters (float32 or bf16) in
    ``shardings`` on the student's mesh, and the iteration it was saved at."""

    cfg: JMegatronConfig
    model: GPTModel
    params: Any  # arrays laid out by ``shardings``
    shardings: Any
    iteration: int


def load_teacher(load_dir: str, student_cfg: JMegatronConfig, padded_vocab_size: int, mesh: Mesh,
                 bf16: bool = False) -> Teacher:
    """Load the teacher of ``load_dir`` onto ``mesh``.

    The teacher may differ from the student in depth, width, heads and FFN size but must
    share the vocabulary: a different padded vocabulary raises CheckpointError naming
    both sizes. The student's parallel sizes are used for the teacher (one mesh).
    Raises CheckpointError for a missing or unreadable checkpoint.
    """
    if not checkpointing.has_checkpoint(load_dir):
        raise checkpointing.CheckpointError(f"config.kd_teacher_load={load_dir!r} holds no checkpoint")
    ckpt = checkpointing.Checkpointer(load_dir, create=False)
    meta = ckpt.read_meta()
    saved = dict(meta["config"])
    parallel = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size", "sequence_parallel", "use_megatron_fsdp",
                "micro_batch_size", "global_batch_size")
    saved.update({k: getattr(student_cfg, k) for k in parallel})
    # the same pipeline chunks per stage as the student (its stacked layers in that stage order)
    v = student_cfg.virtual_pipeline_size()
    saved.update(virtual_pipeline_model_parallel_size=v if v > 1 else None,
                 num_layers_per_virtual_pipeline_stage=None, pipeline_schedule=student_cfg.pipeline_schedule,
                 decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
    saved.update(hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16, use_distributed_optimizer=False,
                 kd_teacher_load=None, kd_cfg=None, kd_finalize=False, save=None, load=None)
    tcfg = from_configdict(saved)
    if meta["padded_vocab_size"] != padded_vocab_size:
        raise checkpointing.CheckpointError(
            f"teacher {ckpt.directory} has a padded vocabulary of {meta['padded_vocab_size']} but the student "
            f"has {padded_vocab_size}; teacher and student must share the tokenizer (config.tokenizer_model) "
            f"and make_vocab_size_divisible_by")
    run = build(tcfg, mesh, vocab_size=meta["padded_vocab_size"])
    state, meta = restore_state(run, ckpt)
    ckpt.close()
    params = state.params
    if bf16:
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    return Teacher(cfg=tcfg, model=run.model, params=params, shardings=run.state_shardings.params,
                   iteration=int(meta["iteration"]))
