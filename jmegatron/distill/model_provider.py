"""Distillation's forward step provider: the teacher beside the student, and the KD loss.

Megatron's ``megatron/post_training/model_provider.py`` builds the student, loads the
teacher from ``--export-kd-teacher-load`` (``_teacher_provider``) and wraps both in
ModelOpt's DistillationModel; ``megatron/post_training/loss_func.py`` then gives the
balanced KD loss. Here :func:`distillation_forward_step` is the same seam for
:func:`jmegatron.training.run.build`: it loads the teacher onto the student's mesh and
returns the distillation loss (unpipelined, and as pipeline stages), the teacher's
parameters as the step's extra argument, and the ``kd_projection`` module when the
student's and teacher's hidden sizes differ.
"""

from __future__ import annotations

from jax.sharding import Mesh

from jmegatron.config import JMegatronConfig
from jmegatron.data.tokenizer import build_tokenizer, load_tokenizer
from jmegatron.distill.config import DistillConfigError, load_distill_config
from jmegatron.distill.cross_tokenizer import vocabulary_map
from jmegatron.distill.loss_func import (distillation_loss_fn, distillation_pipeline_stages, projection_aux,
                                        teacher_top_k_prologue)
from jmegatron.distill.teacher import load_teacher
from jmegatron.parallel.rules import make_rules
from jmegatron.data.teacher_logits import KEYS as CACHE_KEYS, CacheMismatchError, read_meta
from jmegatron.training.forward_step import ForwardStep, gpt_forward_step, model_buffers


def distillation_forward_step(cfg: JMegatronConfig, model, mesh: Mesh, padded_vocab_size: int) -> ForwardStep:
    """The ForwardStep of a distillation run (``cfg.kd_teacher_load``; ``cfg.kd_cfg`` the
    YAML of :func:`jmegatron.distill.config.load_distill_config`). ``owner`` is the
    :class:`~jmegatron.distill.teacher.Teacher`. A config without a teacher, or with
    ``kd_finalize`` (conversion to a plain student, no training), gets the language model's.

    Student and teacher may each be dense or MoE (an MoE student's router losses join the
    loss: :mod:`jmegatron.distill.loss_func`; an MoE teacher's experts split over the
    student's ``expert`` axis: :mod:`jmegatron.distill.teacher`).

    Raises ConfigError for a teacher the student's layout cannot run (e.g. uneven stages
    that do not scale to its depth: :func:`jmegatron.distill.teacher.teacher_stage_layers`),
    DistillConfigError for a bad distillation YAML or a layer pair the layout cannot place, CheckpointError
    for a missing teacher or one with another vocabulary.
    """
    if cfg.kd_teacher_logits_path and not cfg.kd_finalize:
        return offline_distillation_forward_step(cfg, model, padded_vocab_size)
    if not cfg.kd_teacher_load or cfg.kd_finalize:
        return gpt_forward_step(cfg, model, mesh, padded_vocab_size)
    pipelined = cfg.pipeline_model_parallel_size > 1
    dcfg = load_distill_config(cfg.kd_cfg)
    if cfg.kd_teacher_use_megatron_fsdp is not None and (dcfg.logit_kl_topk is None or dcfg.intermediate_layer_pairs):
        raise DistillConfigError(
            "config.kd_teacher_use_megatron_fsdp (the teacher on its own layout) gives the student the teacher's top-K "
            "log-probabilities: set logit_kl_topk in the distillation YAML and drop intermediate_layer_pairs, or unset "
            "kd_teacher_use_megatron_fsdp")
    teacher = load_teacher(cfg.kd_teacher_load, cfg, padded_vocab_size, mesh, cfg.kd_teacher_bf16)
    tp = cfg.tensor_model_parallel_size
    if cfg.kd_teacher_use_megatron_fsdp is not None:
        return ForwardStep(loss_fn=distillation_loss_fn(model, None, dcfg, vocab_shards=tp),
                           prepare=teacher_top_k_prologue(teacher.model, make_rules(teacher.cfg), mesh, dcfg.logit_kl_topk,
                                                          tp),
                           extra_args=(teacher.params,), extra_shardings=teacher.shardings, owner=teacher,
                           buffers=model_buffers(cfg, model))
    aux = projection_aux(cfg, teacher.cfg.hidden_size, dcfg)
    return ForwardStep(loss_fn=distillation_loss_fn(model, teacher.model, dcfg, aux, tp),
                       pipeline_stages=distillation_pipeline_stages(model, teacher.model, dcfg, aux, tp,
                                                                    teacher.cfg.pipeline_layout()) if pipelined
                       else None,
                       extra_args=(teacher.params,), extra_shardings=teacher.shardings, aux_modules=aux,
                       owner=teacher, buffers=model_buffers(cfg, model))  # the student's expert bias


def offline_distillation_forward_step(cfg: JMegatronConfig, model, padded_vocab_size: int) -> ForwardStep:
    """Offline distillation (``cfg.kd_teacher_logits_path``): the KD loss of
    :func:`distillation_loss_fn` with the teacher's top-K log-probabilities read from the
    cache (:mod:`jmegatron.data.teacher_logits`, carried in the batch: ``batch_keys``)
    instead of a teacher's forward: the top-K KL over the cache's K tokens
    (:func:`jmegatron.distill.losses.top_k_kl_loss`), the LM loss and the balancer as
    online. A cache built across tokenizers (``cross_tokenizer`` in its meta,
    :mod:`jmegatron.tools.cache_teacher_logits`) gives Universal Logit Distillation
    (:func:`jmegatron.distill.losses.uld_loss`) on the positions it matched, plus with the
    YAML's ``cross_tokenizer_loss: hybrid`` the KL over the teacher's tokens the student's
    vocabulary shares (:func:`jmegatron.distill.losses.matched_top_k_kl_loss`). Raises
    CacheMismatchError when the cache's teacher vocabulary is not the student's (same
    tokenizer), the YAML's ``logit_kl_topk`` is not the cache's K, or a cross-tokenizer
    cache meets ``logit_kl_topk`` / a temperature other than 1, DistillConfigError for
    intermediate pairs (the cache holds logits only), FileNotFoundError without a cache."""
    dcfg = load_distill_config(cfg.kd_cfg)
    meta = read_meta(cfg.kd_teacher_logits_path)
    if meta.get("cross_tokenizer"):
        if dcfg.logit_kl_topk is not None or dcfg.logit_kl_temperature != 1.0:
            raise CacheMismatchError(
                f"config.kd_teacher_logits_path={cfg.kd_teacher_logits_path!r} was built across tokenizers (the "
                f"teacher's tokenizer {meta['teacher_tokenizer']!r}): its loss is Universal Logit Distillation at "
                f"temperature 1; drop logit_kl_topk / logit_kl_temperature from the distillation YAML")
        vocab_map = None
        if dcfg.cross_tokenizer_loss == "hybrid":  # the teacher's ids in the student's vocabulary
            vocab_map = vocabulary_map(load_tokenizer(meta["teacher_tokenizer"]), build_tokenizer(cfg), meta["vocab"])
        return ForwardStep(loss_fn=distillation_loss_fn(model, None, dcfg, cross_tokenizer=True, vocab_map=vocab_map),
                           batch_keys=CACHE_KEYS, buffers=model_buffers(cfg, model))
    if dcfg.cross_tokenizer_loss != "uld":
        raise DistillConfigError(f"cross_tokenizer_loss={dcfg.cross_tokenizer_loss!r} applies to a cache built across "
                                 f"tokenizers; config.kd_teacher_logits_path={cfg.kd_teacher_logits_path!r} was built "
                                 f"with the student's: drop the key")
    if meta["vocab"] != padded_vocab_size:
        raise CacheMismatchError(f"config.kd_teacher_logits_path={cfg.kd_teacher_logits_path!r}: the teacher's padded "
                                 f"vocabulary is {meta['vocab']}, the student's {padded_vocab_size}")
    if dcfg.logit_kl_topk is not None and dcfg.logit_kl_topk != meta["top_k"]:
        raise CacheMismatchError(f"config.kd_teacher_logits_path={cfg.kd_teacher_logits_path!r} holds the teacher's "
                                 f"top {meta['top_k']} tokens; the distillation YAML asks logit_kl_topk="
                                 f"{dcfg.logit_kl_topk}: build a cache of that K or drop the key")
    return ForwardStep(loss_fn=distillation_loss_fn(model, None, dcfg), batch_keys=CACHE_KEYS,
                       buffers=model_buffers(cfg, model))
