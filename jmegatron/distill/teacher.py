"""The frozen teacher: config and parameters from a jmegatron checkpoint or a Hugging Face folder.

Megatron's ``_teacher_provider`` (megatron/post_training/model_provider.py) builds the
teacher from ``--export-kd-teacher-load`` with the teacher checkpoint's own arguments;
here the checkpoint's resolved config builds the teacher model, and its parameters are
restored straight into their own shardings on the student's mesh (the same logical
rules, so e.g. a tensor-parallel student gets a tensor-parallel teacher). Only its
float32 parameters are read (the main parameters of a bf16 / fp16 teacher checkpoint,
the params of a float32 one: Orbax partial restore,
:func:`jmegatron.checkpoint.restore.restore_params`), never its optimizer
moments, each device reading its own shards. The teacher is not in the optimizer and not
in the student's checkpoints; it only runs forward.

A Hugging Face ``save_pretrained`` folder as ``kd_teacher_load`` (a ``config.json`` with a
``model_type``) is read as ``import-hf`` reads it (:func:`jmegatron.checkpoint.hf.read_hf_folder`:
the architecture from its config.json, the weights from its safetensors, on the host; its
multi-token prediction depths left out) and
placed in the same shardings; no conversion step and no copy on disk.

An MoE teacher (``num_moe_experts`` in its checkpoint's config) runs in evaluation mode
(``deterministic=True``: no dropout, its router computes and sows no losses, as
Megatron-Core's router under ModelOpt's ``torch.no_grad()`` + ``eval()`` teacher forward);
its own capacity factor still applies. Under the student's expert parallelism its experts
are split over the ``expert`` mesh axis like the student's (``E_teacher / ep`` per rank):
inside the train step's shard_map the MoE layer dispatches by the size of the manual
``expert`` axis, so a replicated teacher would be taken for a local slice. A dense
teacher is replicated over ``expert`` (its config keeps expert_model_parallel_size=1).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jmegatron.checkpoint.checkpointing import Checkpointer, CheckpointError, has_checkpoint
from jmegatron.checkpoint.hf import is_hf_folder, read_hf_folder
from jmegatron.checkpoint.layout import LayerLayout, convert_layers
from jmegatron.checkpoint.metadata import read_meta
from jmegatron.checkpoint.restore import restore_params
from jmegatron.checkpoint.views import checkpoint_view
from jmegatron.config import ConfigError, JMegatronConfig, base_config, from_configdict
from jmegatron.conversion.hf import hf_architecture
from jmegatron.models.gpt import GPTModel
from jmegatron.reporting.flops import num_parameters
from jmegatron.training.run import build


@dataclasses.dataclass
class Teacher:
    """The frozen teacher: its resolved config, model, parameters (float32 or bf16) in
    ``shardings`` on the student's mesh, and the iteration it was saved at."""

    cfg: JMegatronConfig
    model: GPTModel
    params: Any  # arrays laid out by ``shardings``
    shardings: Any
    iteration: int


def teacher_stage_layers(student_cfg: JMegatronConfig, teacher_layers: int,
                         load_dir: str = "the teacher") -> tuple[Optional[int], Optional[int]]:
    """The teacher's ``(decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers)``
    under the student's pipeline layout: the student's uneven first / last stage sizes
    scaled by ``teacher_layers / student num_layers``, so every pipeline chunk holds the
    same fraction of both models (what lets a chunk compute its intermediate pairs and the
    stages send the two hidden states together); (None, None) for an even student.

    Raises ConfigError naming the student's field when a scaled size is not a whole number
    of layers."""
    out = []
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        n = getattr(student_cfg, name)
        if n is not None and (n * teacher_layers) % student_cfg.num_layers:
            raise ConfigError(
                f"config.{name}={n} of the student's {student_cfg.num_layers} layers gives {load_dir}'s "
                f"{teacher_layers} layers {n * teacher_layers / student_cfg.num_layers:g} on that stage (the teacher "
                f"splits in the student's proportions); choose {name} so that {name} x {teacher_layers} / "
                f"{student_cfg.num_layers} is a whole number")
        out.append(None if n is None else n * teacher_layers // student_cfg.num_layers)
    return out[0], out[1]


def teacher_config(load_dir: str, student_cfg: JMegatronConfig, bf16: bool = False) -> tuple[JMegatronConfig, dict]:
    """The teacher's resolved config under the student's layout (see :func:`load_teacher`)
    and ``{"padded_vocab_size", "iteration", "hf"}`` of ``load_dir``, reading only its
    config (a jmegatron checkpoint's meta or a Hugging Face ``config.json``): what
    :func:`load_teacher` builds and ``model_report`` counts. Raises as
    :func:`load_teacher`."""
    hf = is_hf_folder(load_dir) and not has_checkpoint(load_dir)
    if hf:
        try:
            fields = read_hf_folder(load_dir, mtp=False).fields
        except ValueError as e:
            raise ConfigError(f"config.kd_teacher_load={load_dir!r} (a Hugging Face folder): {e}") from None
        saved = dict(base_config().to_dict(), **fields, mock_data=True,
                     seq_length=min(student_cfg.seq_length, fields["max_position_embeddings"]),
                     make_vocab_size_divisible_by=student_cfg.make_vocab_size_divisible_by,
                     scan_layers=student_cfg.scan_layers)
        from_configdict(saved)  # the teacher's own fields are valid before the student's layout applies
        meta = {"padded_vocab_size": from_configdict(dict(saved, tensor_model_parallel_size=student_cfg.
                                                            tensor_model_parallel_size)).padded_vocab_size(),
                "iteration": 0}
    else:
        if not has_checkpoint(load_dir):
            raise CheckpointError(f"config.kd_teacher_load={load_dir!r} holds no checkpoint (a "
                                  f"jmegatron checkpoint or a Hugging Face folder)")
        meta = read_meta(load_dir)
        saved = dict(meta["config"])
    parallel = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "cp_comm_type",
                "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
                "use_megatron_fsdp", "micro_batch_size", "global_batch_size")
    saved.update({k: getattr(student_cfg, k) for k in parallel})
    if student_cfg.kd_teacher_use_megatron_fsdp is not None:  # the teacher's own layout
        # its layers scanned: under GSPMD each layer's sharded weights are gathered inside the loop;
        # XLA's attention and matmuls, which GSPMD partitions (a custom-call kernel, CPU FFI or
        # Pallas, would have its operands gathered whole)
        saved.update(use_megatron_fsdp=bool(student_cfg.kd_teacher_use_megatron_fsdp), scan_layers=True,
                     attention_impl="xla", matmul_impl="xla")
    experts = saved.get("num_moe_experts")
    ep = student_cfg.expert_model_parallel_size
    if experts is None:  # dense: replicated over the expert axis
        saved.update(expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    elif experts % ep:
        raise ConfigError(f"teacher {load_dir} has num_moe_experts={experts}, not divisible by the student's "
                          f"expert_model_parallel_size={ep} (the teacher's experts split over the same expert "
                          f"ranks); choose an expert_model_parallel_size that divides both expert counts.")
    # the same pipeline chunks per stage as the student (its stacked layers in that stage order)
    v = student_cfg.virtual_pipeline_size()
    first, last = teacher_stage_layers(student_cfg, int(saved["num_layers"]), load_dir)
    saved.update(virtual_pipeline_model_parallel_size=v if v > 1 else None,
                 num_layers_per_virtual_pipeline_stage=None, pipeline_schedule=student_cfg.pipeline_schedule,
                 decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last)
    saved.update(checkpoint_view("read"))
    saved.update(hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16, use_distributed_optimizer=False)
    try:
        tcfg = from_configdict(saved)
    except ConfigError as e:
        raise ConfigError(f"teacher {load_dir} (config.kd_teacher_load) under the student's parallel layout: "
                          f"{e}") from None
    return tcfg, dict(meta, hf=hf)


def describe_teacher(load_dir: str, tcfg: JMegatronConfig, meta: dict, student_cfg: JMegatronConfig,
                     bf16: bool = False) -> str:
    """One line naming a teacher: its path and family (a Hugging Face folder's architecture,
    or the one a jmegatron checkpoint exports as, with its iteration), layers, hidden size,
    parameter count and layout on the student's mesh (``tcfg`` and ``meta`` of
    :func:`teacher_config`)."""
    if meta["hf"]:
        family = f"{read_hf_folder(load_dir, mtp=False).architecture} folder"
    else:
        try:
            family = f"jmegatron checkpoint ({hf_architecture(tcfg)} layout)"
        except ValueError:
            family = "jmegatron checkpoint"
        family += f", iteration {meta['iteration']}"
    if student_cfg.kd_teacher_use_megatron_fsdp is not None:
        layout = "its own layout: " + ("parameters sharded over the data ranks (FSDP)"
                                       if student_cfg.kd_teacher_use_megatron_fsdp else "replicated over the data ranks")
    else:
        parts = [f"tensor {tcfg.tensor_model_parallel_size}"] if tcfg.tensor_model_parallel_size > 1 else []
        if tcfg.pipeline_model_parallel_size > 1:
            parts.append(f"pipeline {tcfg.pipeline_model_parallel_size}")
        if tcfg.num_moe_experts and tcfg.expert_model_parallel_size > 1:
            parts.append(f"experts over {tcfg.expert_model_parallel_size}")
        layout = "the student's layout, replicated over the data ranks" + (f" ({', '.join(parts)})" if parts else "")
    moe = f", {tcfg.num_moe_experts} experts" if tcfg.num_moe_experts else ""
    return (f"{os.path.abspath(load_dir)} ({family}): {tcfg.num_layers} layers x {tcfg.hidden_size} hidden{moe}, "
            f"{num_parameters(tcfg, meta['padded_vocab_size']):,} parameters "
            f"({'bf16' if bf16 else 'float32'}), {layout}")


def load_teacher(load_dir: str, student_cfg: JMegatronConfig, padded_vocab_size: Optional[int], mesh: Mesh,
                 bf16: bool = False) -> Teacher:
    """Load the teacher of ``load_dir`` onto ``mesh``.

    The teacher may differ from the student in depth, width, heads and FFN size, and be
    dense or MoE whatever the student is, but must share the vocabulary: a different
    padded vocabulary raises CheckpointError naming both sizes (``padded_vocab_size`` None:
    the teacher keeps its own, for distillation across tokenizers,
    :mod:`jmegatron.distill.cross_tokenizer`). The student's parallel
    sizes are used for the teacher (one mesh); an MoE teacher's experts split over the
    student's expert_model_parallel_size (module doc), a dense teacher keeps 1;
    ``kd_teacher_use_megatron_fsdp`` (not None) replaces the student's
    ``use_megatron_fsdp`` for the teacher, whose layers are then scanned (``scan_layers``)
    and run XLA's attention and matmuls (GSPMD partitions them). Under uneven
    pipeline stages the teacher's stages are the student's scaled to its depth
    (:func:`teacher_stage_layers`). Prints :func:`describe_teacher`'s line (process 0).

    ``load_dir`` may be a Hugging Face folder (module doc); its padded vocabulary follows
    the student's padding rule.

    Raises CheckpointError for a missing or unreadable checkpoint; ConfigError (naming the
    teacher's field) for an MoE teacher whose expert count the student's expert_model_parallel_size does not divide,
    a Hugging Face architecture jmegatron cannot represent, or any other teacher setting
    the student's layout cannot run.
    """
    tcfg, meta = teacher_config(load_dir, student_cfg, bf16)
    hf = meta["hf"]
    description = describe_teacher(load_dir, tcfg, meta, student_cfg, bf16)
    if padded_vocab_size is not None and meta["padded_vocab_size"] != padded_vocab_size:
        raise CheckpointError(
            f"teacher {load_dir} has a padded vocabulary of {meta['padded_vocab_size']} but the student "
            f"has {padded_vocab_size}; teacher and student must share the tokenizer (config.tokenizer_model) "
            f"and make_vocab_size_divisible_by")
    run = build(tcfg, mesh, vocab_size=meta["padded_vocab_size"])
    # float32 targets in the teacher's parameter shardings on the student's mesh
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype,
                                          sharding=s),
        run.abstract_state.params, run.state_shardings.params)
    if hf:
        host = read_hf_folder(load_dir, mtp=False).params(tcfg, meta["padded_vocab_size"])
        host = convert_layers(host, LayerLayout(bool(tcfg.scan_layers)), LayerLayout.of_config(tcfg), tcfg.num_layers)
        params = jax.tree.map(lambda a, t: jax.device_put(a, t.sharding), host, target)
    else:
        ckpt = Checkpointer(load_dir, create=False)
        try:
            params, meta = restore_params(ckpt, target, tcfg, source="main")
        finally:
            ckpt.close()
    if bf16:
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    if jax.process_index() == 0:
        print(f"[jmegatron] teacher: {description}", flush=True)
    return Teacher(cfg=tcfg, model=run.model, params=params, shardings=run.state_shardings.params,
                   iteration=int(meta["iteration"]))
