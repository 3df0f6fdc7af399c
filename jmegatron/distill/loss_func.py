"""The distillation loss of one micro-batch, for :func:`jmegatron.training.step.make_train_step`.

Megatron's distillation ``loss_func`` (megatron/post_training/loss_func.py): the student's
LM loss (unless ``skip_lm_loss``), the logits KL and the intermediate losses, each a
masked mean over the micro-batch's tokens (0 when no token counts), combined by
``LogitsAndIntermediatesLossBalancer``; reported as ``lm loss``, ``kd loss``,
``logits distillation loss`` and ``intermediate distillation loss``. The teacher runs
forward only, deterministic, under ``stop_gradient``; intermediate outputs come from the
models' ``intermediates`` collection (``sow``), resolved by
:mod:`jmegatron.distill.config`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jmegatron.distill.balancer import LogitsAndIntermediatesLossBalancer
from jmegatron.distill.config import DistillConfig, DistillConfigError, check_layers, resolve_layer
from jmegatron.distill.losses import ProjectionLayer, intermediate_loss_from_name, logits_kl_loss
from jmegatron.training.step import masked_cross_entropy


def _pick(intermediates: dict, layer: tuple, scanned: bool) -> jax.Array:
    index, name = layer
    name += "_output"  # what GPTModel sows for the module of that name
    if index is None:
        return intermediates[name][0]
    if scanned:
        return intermediates["decoder_layers"][name][0][index]
    return intermediates[f"decoder_layers_{index}"][name][0]


PROJECTION = "kd_projection"  # the params entry of the shared student -> teacher projection


def projection_aux(student_cfg, teacher_hidden_size: int, dcfg: DistillConfig) -> dict:
    """The auxiliary trainable modules of a distillation run, for
    :func:`jmegatron.training.state.param_logical_specs`: ``{"kd_projection":
    (ProjectionLayer, example input shape)}`` when there are intermediate pairs and the
    hidden sizes differ (one projection shared by every pair, as Megatron's
    ``load_distillation_config`` in megatron/post_training/algos/distillation.py), else {}.
    The projection is trained with the student and saved in its checkpoints (exact
    resume); kd_finalize, evaluation and export drop it."""
    if not dcfg.intermediate_layer_pairs or student_cfg.hidden_size == teacher_hidden_size:
        return {}
    return {PROJECTION: (ProjectionLayer(student_cfg.hidden_size, teacher_hidden_size),
                         (1, 1, student_cfg.hidden_size))}


def distillation_loss_fn(student, teacher, dcfg: DistillConfig, aux: Optional[dict] = None) -> Callable:
    """The ``loss_fn`` for make_train_step; ``extra`` is the teacher's parameters.

    ``aux`` is :func:`projection_aux`'s result: with a ``kd_projection`` the student's
    intermediate outputs ``[b, s, student_hidden]`` are projected to ``[b, s,
    teacher_hidden]`` by ``params["kd_projection"]`` before the intermediate losses.
    Raises DistillConfigError for unknown layer names, or for intermediate pairs between
    different hidden sizes without a projection in ``aux``.
    """
    s_cfg, t_cfg = student.cfg, teacher.cfg
    check_layers(dcfg, s_cfg.num_layers, t_cfg.num_layers)
    projection = (aux or {}).get(PROJECTION, (None,))[0]
    pairs = []
    for p in dcfg.intermediate_layer_pairs:
        if s_cfg.hidden_size != t_cfg.hidden_size and projection is None:
            raise DistillConfigError(
                f"intermediate pair {p.student} -> {p.teacher}: student hidden {s_cfg.hidden_size} != teacher "
                f"hidden {t_cfg.hidden_size} needs the {PROJECTION} module (see projection_aux)")
        pairs.append((resolve_layer(p.student, s_cfg.num_layers, "student"),
                      resolve_layer(p.teacher, t_cfg.num_layers, "teacher"), intermediate_loss_from_name(p.loss)))
    need_lm = (not dcfg.skip_lm_loss) or dcfg.kd_loss_alpha is not None
    balancer = LogitsAndIntermediatesLossBalancer(
        kd_loss_scale=dcfg.kd_loss_scale, skip_original_loss=not need_lm, kd_loss_alpha=dcfg.kd_loss_alpha)
    mutable = ["intermediates"] if pairs else False

    def loss_fn(params, micro, rng, num_tokens, teacher_params, data_sum):
        args = (micro["tokens"], micro["position_ids"])
        out_s = student.apply({"params": params}, *args, deterministic=False, rngs={"dropout": rng},
                              sample_offset=micro["sample_offset"], mutable=mutable)
        out_t = teacher.apply({"params": teacher_params}, *args, deterministic=True, mutable=mutable)
        (logits_s, inter_s), (logits_t, inter_t) = (out_s, out_t) if pairs else ((out_s, {}), (out_t, {}))
        logits_t = jax.lax.stop_gradient(logits_t.astype(jnp.float32))
        mask = micro["loss_mask"].astype(jnp.float32)

        def masked_mean(per_token):
            return data_sum(jnp.sum(per_token * mask)) / jnp.maximum(num_tokens, 1.0)

        losses = {"logits_loss": masked_mean(logits_kl_loss(logits_s, logits_t, dcfg.logit_kl_temperature))}
        for k, (s_layer, t_layer, fn) in enumerate(pairs):
            hs = _pick(inter_s["intermediates"], s_layer, s_cfg.scan_layers)
            if projection is not None:
                hs = projection.apply({"params": params[PROJECTION]}, hs.astype(jnp.float32))
            ht = jax.lax.stop_gradient(_pick(inter_t["intermediates"], t_layer, t_cfg.scan_layers))
            losses[f"intermediate_{k}"] = masked_mean(fn(hs, ht.astype(jnp.float32)))
        report = {}
        if need_lm:
            total, _ = masked_cross_entropy(logits_s, micro["labels"], mask)
            losses["student_loss"] = report["lm_loss"] = data_sum(total) / jnp.maximum(num_tokens, 1.0)
        total, rep = balancer(losses)
        report.update(kd_loss=rep["kd_loss"], logits_distillation_loss=rep["logits_loss"],
                      intermediate_distillation_loss=rep["intermediate_loss"])
        return total, report

    return loss_fn
