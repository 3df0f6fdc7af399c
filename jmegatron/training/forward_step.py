"""Megatron's ``forward_step_func`` seam: what one micro-batch computes.

Megatron's ``pretrain(train_valid_test_dataset_provider, model_provider, model_type,
forward_step_func)`` (megatron/training/training.py) takes the model and its loss from the
caller; the training loop never imports them (pretrain_gpt.py passes GPT's ``forward_step``
and ``loss_func``, megatron/post_training its distillation model and loss). Here the same
seam is a *forward step provider*: ``provider(cfg, model, mesh, padded_vocab_size) ->``
:class:`ForwardStep`, called once by :func:`jmegatron.training.run.build`. A ForwardStep
gives both forms of the per-micro-batch computation, the unpipelined ``loss_fn`` and the
pipelined ``pipeline_stages``, plus the extra inputs (a frozen teacher's parameters) and
trainable side modules (distillation's projection) they need.

Providers: :func:`gpt_forward_step` (the language model, here), and
:func:`jmegatron.distill.model_provider.distillation_forward_step`;
:func:`jmegatron.pretrain_gpt.forward_step_provider` picks one for a config.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jmegatron.config import ConfigError, JMegatronConfig
from jmegatron.models import fp8 as fp8_lib
from jmegatron.models.gpt import apply_layers, embed_tokens, embedding_dropout_rng, post_process_logits
from jmegatron.models.moe.moe_layer import chunk_moe_losses, chunk_report_zeros, update_expert_bias
from jmegatron.models.moe.router import EXPERT_BIAS
from jmegatron.parallel.schedules import StageContext
from jmegatron.training.losses import lm_loss, lm_loss_fn
from jmegatron.training.state import stored_layer_index


@dataclasses.dataclass(frozen=True)
class ForwardStep:
    """One kind of training's per-micro-batch computation (Megatron's ``forward_step_func``
    with its ``loss_func``), for :func:`jmegatron.training.step.make_train_step`.

    ``loss_fn(params, micro, rng, num_tokens, extra, data_sum) -> (loss, report)``: the
    unpipelined micro-batch loss (interface in ``make_train_step``; ``micro`` holds
    ``segment_ids`` under ``reset_attention_mask`` and ``positions`` under context
    parallelism, which the model must receive). Every
    scalar of ``report`` is logged under its key (the console line, ``metrics.jsonl``,
    TensorBoard, W&B: :func:`jmegatron.training.logging.reported_keys`); the loop never
    names them (examples/custom_loss.py).
    ``pipeline_stages(ctx:`` :class:`~jmegatron.parallel.schedules.StageContext` ``) -> {"embed",
    "chunk", "head", "activation", "report_zeros"}``: the same computation cut into pipeline stages
    (:func:`jmegatron.parallel.schedules.run_schedule`); None when the provider cannot
    pipeline (``build`` then refuses pipeline_model_parallel_size > 1).
    ``extra_args``: passed after the batch to the train step (untouched, no gradient), laid
    out by ``extra_shardings``. ``aux_modules``: trainable Flax modules stored beside the
    model's parameters (name -> (module, example input shape)), saved in checkpoints.
    ``owner``: whatever the provider wants kept alive with the run (e.g. the teacher).
    ``buffers``: the model's :class:`ModelBuffers` (None: it has none), see
    :func:`model_buffers`. ``batch_keys``: per-sample arrays beyond the language model's
    the loss reads from ``micro`` (each sample ``[seq, ...]``, a batch ``[num_micro, rows,
    seq, ...]``, split over the data ranks like the tokens): the training dataset must carry
    them (e.g. offline distillation's cached teacher top-K). ``prepare(extra, batch) ->
    dict``: arrays ``[num_micro, rows, seq, K]`` computed from the whole step's batch
    before the micro-batch loop, in the step's program but outside its ``shard_map``
    (GSPMD over the whole mesh: the extra input keeps its own layout there), added to the
    batch the loss reads (e.g. a teacher on its own layout: its top-K); None: nothing.

    ``loss_key``: the ``report`` key of the loss the run's summary gives (each logged
    iteration's value, the closing line's final loss), shown as ``loss_name`` (Megatron's
    ``lm loss``); when a step's report lacks it, the optimised ``loss`` (named "loss").
    """

    loss_fn: Callable
    pipeline_stages: Optional[Callable] = None
    extra_args: tuple = ()
    extra_shardings: Any = None
    aux_modules: dict = dataclasses.field(default_factory=dict)
    owner: Any = None
    buffers: Optional["ModelBuffers"] = None
    batch_keys: tuple = ()
    prepare: Optional[Callable] = None
    loss_key: str = "lm_loss"
    loss_name: str = "lm loss"


@dataclasses.dataclass(frozen=True)
class ModelBuffers:
    """Non-trainable values stored among the parameters (Megatron's module buffers, e.g. the
    routers' ``expert_bias``, FP8's ``fp8_meta``), which the train step replaces after each
    optimizer step.

    ``is_buffer(path) -> bool`` (a ``jax.tree_util`` key path into the parameters) marks
    them (left out of ``num_zeros`` and ``grad_norm``); ``update(params, metrics, grads) ->
    params`` gives the new parameters from the updated ones, the step's metrics and its
    reduced gradients (Megatron does this in ``finalize_model_grads``; FP8's amax update
    after the optimizer step). A buffer read behind ``stop_gradient`` (``expert_bias``) has
    zero gradients; ``is_max(path)`` marks leaves whose "gradient" is an observation
    instead (FP8's amaxes, :func:`jmegatron.models.fp8.fp8_dot_general`): the step combines
    those with **max** over micro-batches and data / expert / context ranks (and pipeline
    stages), never a sum or a mean, and the optimizer must leave them alone
    (:func:`jmegatron.training.optimizer.make_optimizer`)."""

    is_buffer: Callable[[tuple], bool]
    update: Callable[[Any, dict, Any], Any]
    is_max: Callable[[tuple], bool] = lambda path: False


def combine_buffers(parts: list) -> Optional[ModelBuffers]:
    """One :class:`ModelBuffers` for several (None for none): a leaf is a buffer / max leaf
    of any part; the updates run in order."""
    parts = [b for b in parts if b is not None]
    if len(parts) <= 1:
        return parts[0] if parts else None

    def update(params, metrics, grads):
        for b in parts:
            params = b.update(params, metrics, grads)
        return params

    return ModelBuffers(is_buffer=lambda path: any(b.is_buffer(path) for b in parts), update=update,
                        is_max=lambda path: any(b.is_max(path) for b in parts))


def lm_pipeline_stages(ctx: StageContext, cross_entropy_impl: str = "xla") -> dict:
    """The GPT language model's stages for :func:`jmegatron.parallel.schedules.run_schedule`
    (Megatron's GPTModel pre_process / decoder chunk / post_process with pretrain_gpt's
    ``loss_func``): ``{"embed", "chunk", "head", "activation", "report_zeros"}``. The head
    is the unpipelined forward's post-process and loss (:func:`jmegatron.models.gpt.post_process_logits`,
    the multi-token prediction depths included, and
    :func:`jmegatron.training.losses.lm_loss`, this data rank's share;
    ``cross_entropy_impl``: :func:`jmegatron.training.losses.token_cross_entropy`).

    An MoE model's chunks run their layers with the router's sown collections mutable and
    add those layers' router losses to the stage's loss
    (:func:`jmegatron.models.moe.moe_layer.chunk_moe_losses`: each data rank's share, padding
    slots left out), Megatron's ``MoEAuxLossAutoScaler`` on every pipeline rank; the report
    gets the same MoE entries as :func:`lm_loss_fn`'s, assembled by the step's psum over
    the data and pipeline axes."""
    c = ctx.cfg
    dot_general = c.dense_dot_general()
    moe = c.moe is not None
    report_zeros = dict({"lm_loss": jnp.float32(0.0)}, **(chunk_report_zeros(c) if moe else {}),
                        **{f"mtp_{k}_loss": jnp.float32(0.0) for k in range(1, (c.mtp_num_layers or 0) + 1)})

    def embed(prm, micro):
        return embed_tokens(c, prm, micro["tokens"], micro["position_ids"], deterministic=False,
                            rng=embedding_dropout_rng(ctx.rng, c.num_layers), sample_offset=ctx.sample_offset(micro),
                            positions=micro.get("positions"))

    def chunk(prm, x, micro, ci):
        layers, first, count = ctx.chunk_layers(prm["decoder_layers"], ci, c.num_layers)
        out = apply_layers(c, layers, x, micro["position_ids"], first_layer=first, num_valid=count,
                           deterministic=False, rng=ctx.rng, sample_offset=ctx.sample_offset(micro),
                           dot_general=dot_general, moe_sown=moe, segment_ids=micro.get("segment_ids"),
                           positions=micro.get("positions"))
        if not moe:
            return out, None
        y, sown = out
        return y, None, chunk_moe_losses(c, sown, first, count, 1.0 / ctx.data_parallel_size)

    def head(prm, y, side, micro):
        logits, sown = post_process_logits(c, prm, y, micro, rng=ctx.rng, sample_offset=ctx.sample_offset(micro),
                                           dot_general=dot_general)
        loss, report = lm_loss(c, logits, sown, micro, ctx.tokens[micro["microbatch"]], ctx.data_sum,
                               cross_entropy_impl, rank_share=True)
        return loss, dict(report_zeros, **report)

    activation = jax.ShapeDtypeStruct((ctx.local_rows, ctx.seq_length, c.hidden_size), c.dtype)
    return dict(embed=embed, chunk=chunk, head=head, activation=activation, report_zeros=report_zeros)


def model_buffers(cfg: JMegatronConfig, model) -> Optional[ModelBuffers]:
    """The GPT model's buffers, for a provider's :attr:`ForwardStep.buffers`: with
    ``moe_router_enable_expert_bias`` every router's ``expert_bias`` ``[E]`` (stacked
    ``[slots, E]`` under ``scan_layers``), advanced after each optimizer step from the step's
    ``moe_tokens_per_expert`` (:func:`jmegatron.models.moe.moe_layer.update_expert_bias`);
    with ``fp8`` every FP8 layer's ``fp8_meta`` (max-combined observed amaxes, then
    :func:`jmegatron.models.fp8.update_fp8_meta`). None for a model without buffers."""
    parts = []
    if cfg.moe_router_enable_expert_bias:
        index, pattern, rate = stored_layer_index(cfg), model.cfg.moe_layers(), cfg.moe_router_bias_update_rate

        def update(params, metrics, grads):
            return update_expert_bias(params, metrics["moe_tokens_per_expert"], rate, pattern, index)

        parts.append(ModelBuffers(is_buffer=lambda path: getattr(path[-1], "key", None) == EXPERT_BIAS,
                                  update=update))
    if cfg.fp8 is not None:
        def update_fp8(params, metrics, grads):
            return fp8_lib.update_fp8_meta(params, grads, fp8=cfg.fp8, margin=cfg.fp8_margin,
                                           amax_compute_algo=cfg.fp8_amax_compute_algo)

        parts.append(ModelBuffers(is_buffer=fp8_lib.is_fp8_meta, update=update_fp8, is_max=fp8_lib.is_fp8_meta))
    return combine_buffers(parts)


def gpt_forward_step(cfg: JMegatronConfig, model, mesh: Mesh, padded_vocab_size: int) -> ForwardStep:
    """The GPT language model's forward step (pretrain_gpt.py's ``forward_step`` and
    ``loss_func``): :func:`lm_loss_fn` and :func:`lm_pipeline_stages`, their cross-entropy
    the model config's resolved backend (``model.cfg.backend.cross_entropy``). The default
    provider of :func:`jmegatron.training.run.build`.

    Raises ConfigError for a distillation config (``kd_teacher_load`` without
    ``kd_finalize``): that run needs the distillation provider, which
    :func:`jmegatron.pretrain_gpt.pretrain` and ``python -m jmegatron.train`` choose.
    """
    del mesh, padded_vocab_size
    if (cfg.kd_teacher_load or cfg.kd_teacher_logits_path) and not cfg.kd_finalize:
        raise ConfigError(
            "config.kd_teacher_load / kd_teacher_logits_path is set but this run was built with the plain language-model forward step: "
            "train it with python -m jmegatron.train or jmegatron.pretrain_gpt.pretrain(cfg), or pass "
            "forward_step_provider=jmegatron.distill.model_provider.distillation_forward_step")
    ce = model.cfg.backend.cross_entropy
    stages = lm_pipeline_stages if ce == "xla" else functools.partial(lm_pipeline_stages, cross_entropy_impl=ce)
    return ForwardStep(loss_fn=lm_loss_fn(model, ce), pipeline_stages=stages, buffers=model_buffers(cfg, model))
