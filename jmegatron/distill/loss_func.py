"""The distillation loss of one micro-batch, for :func:`jmegatron.training.step.make_train_step`.

Megatron's distillation ``loss_func`` (megatron/post_training/loss_func.py): the student's
LM loss (unless ``skip_lm_loss``), the logits KL and the intermediate losses, each a
masked mean over the micro-batch's tokens (0 when no token counts), combined by
``LogitsAndIntermediatesLossBalancer``; reported as ``lm loss``, ``kd loss``,
``logits distillation loss`` and ``intermediate distillation loss``. The teacher runs
forward only, deterministic, under ``stop_gradient``; intermediate outputs come from the
models' ``intermediates`` collection (``sow``), resolved by
:mod:`jmegatron.distill.config`.

MoE student: its router losses (load-balancing / z-loss, coefficients applied) are added
to the balanced total after the balancer, exactly as the LM loss adds them
(:func:`jmegatron.models.moe.moe_layer.add_moe_losses`), and reported beside the KD
losses as ``load_balancing_loss`` / ``seq_load_balancing_loss`` / ``z_loss`` (plus
``moe_tokens_per_expert`` and ``moe_dropped_token_fraction``). This follows Megatron:
there the router losses reach the gradient through ``MoEAuxLossAutoScaler`` on the
student's activations, whatever loss ``loss_func`` returns, so they are added with
``skip_lm_loss`` too, and they are not part of the student loss ``O`` that the
balancer's ``O / kd`` ratio uses (megatron/post_training/loss_func.py passes the
cross-entropy alone as ``student_loss``). ``kd_loss`` stays the balancer's total, as
upstream's "total loss" report; the step's ``loss`` is what was optimised (``kd_loss``
plus the router losses). MoE teacher: applied with ``deterministic=True``, so its router
sows nothing (ModelOpt runs the teacher under ``torch.no_grad()`` in ``eval()``, where
Megatron-Core's router computes no aux loss).

Data parallelism: the balancer runs on each data rank's micro-batch, as Megatron's (its
``loss_func`` hands ModelOpt's balancer that rank's masked token sums, whose ratios are
taken with ``.detach()``): the KL, the intermediate losses and the LM loss it reads are
means over the rank's rows, and the micro-batch's loss and report are the ranks' balanced
values weighted by their shares of the micro-batch's tokens (:func:`over_ranks`). dp with
micro-batches of m rows thus equals one device running micro-batches of m rows
(tests/test_distill_training.py).

Context parallelism: the loss function runs inside the train step's shard_map
with ``context`` manual, so the teacher's attention is the student's context-parallel one
on the same load-balanced slots, and each loss the balancer reads is summed over the
context ranks (``data_sum(x, context_only=True)``): a data rank's ratios are its whole
sequences', so cp equals no cp. Megatron takes them per CP rank (its ``_mask_loss`` does
not reduce over context): docs/DISTILLATION.md. Tested at cp2 and cp2 x dp2 + ZeRO-1 with
ranks holding different token counts (tests/test_cp_compose.py).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jmegatron.distill.balancer import LogitsAndIntermediatesLossBalancer
from jmegatron.distill.config import OUTPUT_LAYER, DistillConfig, DistillConfigError, check_layers, resolve_layer
from jmegatron.data.teacher_logits import IDS_KEY, LOGPROBS_KEY
from jmegatron.distill.losses import (ProjectionLayer, intermediate_loss_from_name, logits_kl_loss,
                                      matched_top_k_kl_loss, teacher_top_k, top_k_kl_loss, top_k_logits_kl_loss,
                                      uld_loss)
from jmegatron.models.gpt import apply_layers, embed_tokens, final_layernorm, output_logits
from jmegatron.models.moe.moe_layer import MOE_COLLECTIONS, add_moe_losses, chunk_moe_losses, chunk_report_zeros
from jmegatron.parallel.pipeline_layout import PipelineLayout
from jmegatron.parallel.schedules import as_varying, manual_axes
from jmegatron.training.losses import masked_cross_entropy


def _pick(intermediates: dict, layer: tuple, scanned: bool) -> jax.Array:
    index, name = layer
    name += "_output"  # what GPTModel sows for the module of that name
    if index is None:
        return intermediates[name][0]
    if scanned:
        return intermediates["decoder_layers"][name][0][index]
    return intermediates[f"decoder_layers_{index}"][name][0]


PROJECTION = "kd_projection"  # the params entry of the shared student -> teacher projection


def over_ranks(values, local_tokens: jax.Array, num_tokens: jax.Array, data_sum: Callable):
    """A micro-batch's loss and report from each data rank's: ``values`` (a pytree of float32
    scalars, each rank's balanced values for its rows, equal on its context ranks) weighted by
    the rank's share ``local_tokens / num_tokens`` of the micro-batch's unmasked tokens
    (``local_tokens``: this device's, ``num_tokens``: over every rank) and summed over the
    data and context ranks (``data_sum``), so that a token mean on every rank gives the
    micro-batch's token mean. Identity on one device."""
    weight = local_tokens / jnp.maximum(num_tokens, 1.0)
    return jax.tree.map(lambda v: data_sum(v * weight), values)


def logits_loss(dcfg: DistillConfig, logits_s: jax.Array, logits_t: jax.Array, vocab_shards: int = 1) -> jax.Array:
    """The per-token logits loss ``[b, s]`` the YAML names: the KL over the whole vocabulary,
    or over the teacher's ``logit_kl_topk`` tokens (ModelOpt's ``TopKLogitsKLLoss``),
    vocabulary-parallel over ``vocab_shards`` tensor ranks."""
    if dcfg.logit_kl_topk is None:
        return logits_kl_loss(logits_s, logits_t, dcfg.logit_kl_temperature)
    return top_k_logits_kl_loss(logits_s, logits_t, dcfg.logit_kl_topk, dcfg.logit_kl_temperature,
                                vocab_shards=vocab_shards)


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


def resolved_pairs(dcfg: DistillConfig, s_cfg, t_cfg, projection) -> list:
    """The YAML's intermediate pairs resolved: ``[(student layer, teacher layer, loss fn,
    pair)]`` (layers as :func:`jmegatron.distill.config.resolve_layer` gives them) for the
    student / teacher ModelConfigs. Raises DistillConfigError for unknown layer names, or for
    a pair between different hidden sizes without the ``kd_projection`` module
    (``projection`` None, see :func:`projection_aux`)."""
    check_layers(dcfg, s_cfg.num_layers, t_cfg.num_layers)
    pairs = []
    for p in dcfg.intermediate_layer_pairs:
        if s_cfg.hidden_size != t_cfg.hidden_size and projection is None:
            raise DistillConfigError(
                f"intermediate pair {p.student} -> {p.teacher}: student hidden {s_cfg.hidden_size} != teacher "
                f"hidden {t_cfg.hidden_size} needs the {PROJECTION} module (see projection_aux)")
        pairs.append((resolve_layer(p.student, s_cfg.num_layers, "student"),
                      resolve_layer(p.teacher, t_cfg.num_layers, "teacher"), intermediate_loss_from_name(p.loss), p))
    return pairs


def balanced_loss(dcfg: DistillConfig, s_cfg, logits_s: jax.Array, kl: jax.Array, pair_sums: list, micro: dict,
                  num_tokens: jax.Array, data_sum: Callable) -> tuple[jax.Array, dict]:
    """Megatron's distillation ``loss_func`` after the forward, pipelined or not: (loss,
    report) of one micro-batch from the student's logits ``logits_s`` (float32 ``[b, s,
    V]``), the per-token logits loss ``kl`` (float32 ``[b, s]``) and ``pair_sums`` (this
    device's masked token sums of the intermediate pairs' losses, float32 scalars in pair
    order). Each loss is this data rank's masked token mean over its context ranks
    (``data_sum(x, context_only=True)``), plus the student's LM loss unless not needed
    (``skip_lm_loss`` without ``kd_loss_alpha``); ``LogitsAndIntermediatesLossBalancer``
    combines them; :func:`over_ranks` weights the ranks by their share of ``num_tokens``
    (the micro-batch's unmasked tokens over every rank). Report: ``lm_loss`` (when computed),
    ``kd_loss``, ``logits_distillation_loss``, ``intermediate_distillation_loss``."""
    need_lm = (not dcfg.skip_lm_loss) or dcfg.kd_loss_alpha is not None
    balancer = LogitsAndIntermediatesLossBalancer(
        kd_loss_scale=dcfg.kd_loss_scale, skip_original_loss=not need_lm, kd_loss_alpha=dcfg.kd_loss_alpha)
    mask = micro["loss_mask"].astype(jnp.float32)
    # the balancer sees this rank's micro-batch, as Megatron's (its rows, whole sequences)
    local_tokens = jnp.sum(mask)
    rank_tokens = jnp.maximum(data_sum(local_tokens, context_only=True), 1.0)

    def rank_mean(local_sum):
        return data_sum(local_sum, context_only=True) / rank_tokens

    losses = {"logits_loss": rank_mean(jnp.sum(kl * mask))}
    for k, pair_sum in enumerate(pair_sums):
        losses[f"intermediate_{k}"] = rank_mean(pair_sum)
    report = {}
    if need_lm:
        total, _ = masked_cross_entropy(logits_s, micro["labels"], mask, s_cfg.backend.cross_entropy)
        losses["student_loss"] = report["lm_loss"] = rank_mean(total)
    total, rep = balancer(losses)
    report.update(kd_loss=rep["kd_loss"], logits_distillation_loss=rep["logits_loss"],
                  intermediate_distillation_loss=rep["intermediate_loss"])
    return over_ranks((total, report), local_tokens, num_tokens, data_sum)


def distillation_loss_fn(student, teacher, dcfg: DistillConfig, aux: Optional[dict] = None,
                         vocab_shards: int = 1, cross_tokenizer: bool = False,
                         vocab_map: Optional[np.ndarray] = None) -> Callable:
    """The ``loss_fn`` for make_train_step; ``extra`` is the teacher's parameters.
    ``vocab_shards``: the tensor ranks the logits' vocabulary is split over (the top-K
    selection's shards, :func:`logits_loss`).

    ``aux`` is :func:`projection_aux`'s result: with a ``kd_projection`` the student's
    intermediate outputs ``[b, s, student_hidden]`` are projected to ``[b, s,
    teacher_hidden]`` by ``params["kd_projection"]`` before the intermediate losses.
    Either model may be an MoE model (module doc): an MoE student's router losses are
    added to the returned float32 scalar loss and its report gains the MoE entries.
    ``teacher`` None: offline distillation; ``micro`` carries the teacher's cached top-K
    (:data:`jmegatron.data.teacher_logits.IDS_KEY` / ``LOGPROBS_KEY``, ``[b, s, K]``) and the
    logits loss is :func:`jmegatron.distill.losses.top_k_kl_loss` over them (no teacher
    parameters: ``extra`` is unused); ``cross_tokenizer``: the cache comes from a teacher
    with another tokenizer (:mod:`jmegatron.distill.cross_tokenizer`), the logits loss is
    :func:`jmegatron.distill.losses.uld_loss` on the positions matched (ids >= 0), still
    divided by the micro-batch's loss-mask tokens; ``vocab_map`` (int32 ``[teacher
    vocab]``, :func:`jmegatron.distill.cross_tokenizer.vocabulary_map`) adds
    :func:`jmegatron.distill.losses.matched_top_k_kl_loss` over the teacher's tokens the
    student's vocabulary has (GOLD's hybrid).
    Raises DistillConfigError for unknown layer names, for intermediate pairs between
    different hidden sizes without a projection in ``aux``, or for intermediate pairs
    offline.
    """
    offline = teacher is None
    if offline and dcfg.intermediate_layer_pairs:
        raise DistillConfigError("intermediate_layer_pairs with offline distillation (config.kd_teacher_logits_path): "
                                 "the cache holds the teacher's top-K log-probabilities only; drop the pairs or "
                                 "distil online (config.kd_teacher_load)")
    s_cfg = student.cfg
    t_cfg = s_cfg if offline else teacher.cfg
    projection = (aux or {}).get(PROJECTION, (None,))[0]
    pairs = resolved_pairs(dcfg, s_cfg, t_cfg, projection)
    moe_student = s_cfg.moe is not None
    # the teacher is deterministic: an MoE teacher's router sows nothing, so it needs no MoE collection
    mutable_s = (["intermediates"] if pairs else []) + (list(MOE_COLLECTIONS) if moe_student else [])
    mutable_t = ["intermediates"] if pairs else False

    def loss_fn(params, micro, rng, num_tokens, teacher_params, data_sum):
        args = (micro["tokens"], micro["position_ids"])
        # document masks (reset_attention_mask) and the slots' sequence positions (cp), both models
        masks = {"segment_ids": micro.get("segment_ids"), "positions": micro.get("positions")}
        out_s = student.apply({"params": params}, *args, deterministic=False, rngs={"dropout": rng},
                              sample_offset=micro["sample_offset"], mutable=mutable_s or False, **masks)
        logits_s, inter_s = out_s if mutable_s else (out_s, {})
        if cross_tokenizer:  # unmatched positions (ids -1) are left out
            ids = micro[IDS_KEY]
            kl = uld_loss(logits_s, micro[LOGPROBS_KEY], vocab_shards)
            if vocab_map is not None:
                student_ids = jnp.where(ids >= 0, jnp.asarray(vocab_map)[jnp.maximum(ids, 0)], -1)
                kl = kl + matched_top_k_kl_loss(logits_s, micro[LOGPROBS_KEY], student_ids)
            kl = kl * (ids[..., 0] >= 0)
            inter_t = {}
        elif offline:
            kl = top_k_kl_loss(logits_s, micro[LOGPROBS_KEY], micro[IDS_KEY], dcfg.logit_kl_temperature)
            inter_t = {}
        else:
            out_t = teacher.apply({"params": teacher_params}, *args, deterministic=True, mutable=mutable_t, **masks)
            logits_t, inter_t = out_t if pairs else (out_t, {})
            kl = logits_loss(dcfg, logits_s, jax.lax.stop_gradient(logits_t.astype(jnp.float32)), vocab_shards)
        mask = micro["loss_mask"].astype(jnp.float32)
        pair_sums = []
        for s_layer, t_layer, fn, _ in pairs:
            hs = _pick(inter_s["intermediates"], s_layer, s_cfg.scan_layers)
            if projection is not None:
                hs = projection.apply({"params": params[PROJECTION]}, hs.astype(jnp.float32))
            ht = jax.lax.stop_gradient(_pick(inter_t["intermediates"], t_layer, t_cfg.scan_layers))
            pair_sums.append(jnp.sum(fn(hs, ht.astype(jnp.float32)) * mask))
        total, report = balanced_loss(dcfg, s_cfg, logits_s, kl, pair_sums, micro, num_tokens, data_sum)
        if moe_student:  # outside the balancer, as Megatron's MoEAuxLossAutoScaler (module doc)
            total, report = add_moe_losses(s_cfg, total, report, inter_s, micro, data_sum)
        return total, report

    return loss_fn


def teacher_top_k_prologue(teacher, rules, mesh, top_k: int, vocab_shards: int = 1) -> Callable:
    """A teacher on its own layout (``kd_teacher_use_megatron_fsdp``), for
    :attr:`jmegatron.training.forward_step.ForwardStep.prepare`: ``(teacher_params, batch)
    -> {IDS_KEY, LOGPROBS_KEY}``, the teacher's ``top_k`` log-probabilities and ids
    ``[num_micro, rows, seq, K]`` of every micro-batch (one after another, ``lax.map``),
    computed before the student's micro-batch loop under GSPMD with the teacher's own
    logical-axis ``rules`` and parameter shardings on ``mesh`` (the model's logical
    constraints are applied: activations keep the batch split over the data ranks, so XLA
    gathers each scanned layer's sharded weights inside the layer loop instead of gathering
    the batch). The train step lays the
    result out as the batch (rows over the data ranks), which is where it meets the
    student's logits: :func:`distillation_loss_fn` then reads it as offline distillation
    reads a cache. Document masks (``segment_ids``) apply."""
    rows = dict(rules)["batch"]  # the mesh axes the batch rows are split over
    manual = {rows} if isinstance(rows, str) else set(rows)

    def local_top_k(logits):
        return teacher_top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), top_k, vocab_shards)

    # each data rank selects from its own rows (GSPMD would gather the rows for the sort)
    select = jax.shard_map(local_top_k, mesh=mesh, in_specs=PartitionSpec(rows), out_specs=PartitionSpec(rows),
                           axis_names=manual)

    def prepare(teacher_params, batch):
        def one(micro):
            with nn.logical_axis_rules(list(rules)), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                logits = teacher.apply({"params": teacher_params}, micro["tokens"], micro["position_ids"],
                                       deterministic=True, segment_ids=micro.get("segment_ids"))
            values, ids = select(logits)
            return {IDS_KEY: ids, LOGPROBS_KEY: values}

        return jax.lax.map(one, {k: v for k, v in batch.items() if k in ("tokens", "position_ids", "segment_ids")})

    return prepare


def _chunk_of(layout: PipelineLayout, layer: int) -> tuple[int, int, int]:
    """(stage, chunk, index inside the chunk) of model layer ``layer`` under ``layout``."""
    first, count = layout.chunk_first_layer(), layout.chunk_layers()
    stage, chunk = np.nonzero((first <= layer) & (layer < first + count))
    return int(stage[0]), int(chunk[0]), int(layer - first[stage[0], chunk[0]])


def distillation_pipeline_stages(student, teacher, dcfg: DistillConfig, aux: Optional[dict] = None,
                                 vocab_shards: int = 1, teacher_layout: Optional[PipelineLayout] = None) -> Callable:
    """The pipelined counterpart of :func:`distillation_loss_fn`: a stage provider for
    :func:`jmegatron.training.step.make_train_step` (``pipeline_stages``).

    The teacher is split into the same pipeline stages and chunks as the student and runs
    beside it on every stage (forward only, deterministic): what a stage sends on is the
    student's hidden ``[b, s, h_s]``, the teacher's ``[b, s, h_t]`` (Megatron's upstream
    approach of widening the tensors between stages by the teacher's hidden size) and, with
    intermediate pairs, their running masked token sums (float32 ``[pairs]``). The logits
    loss, the LM loss and the balancer run on the last stage.

    Intermediate pairs on any stage, interleaved chunks included (Megatron and ModelOpt
    compute them on the last pipeline stage only): a pair of decoder layers is computed
    in the model chunk that holds both (``teacher_layout``: the teacher's
    :class:`~jmegatron.parallel.pipeline_layout.PipelineLayout`, the student's scaled to
    its depth, :func:`jmegatron.distill.teacher.teacher_stage_layers`; default the even
    one), its masked token sum added to the sums the stages send on; the last stage's
    balancer reads them (its ratios ``O / kd`` and ``logits / intermediate`` are taken from
    values, ``stop_gradient``), and the backward carries each pair's coefficient back to
    its chunk through the activations' gradients, so loss and gradients equal the
    unpipelined step's. ``decoder.final_layernorm`` pairs are computed on the last stage.
    A pair whose layers sit in different chunks, or that names ``output_layer``, raises
    DistillConfigError naming the chunks. Uneven stages (the student's
    ``decoder_first/last_pipeline_num_layers``) skip the padding slots of both models.

    Under data (and context) parallelism the last stage's balancer reads each data rank's
    losses, summed over its context ranks, as :func:`distillation_loss_fn` (inside the
    stage's conditional: every rank of a stage takes the same branch), and the ranks'
    balanced values are combined by :func:`over_ranks`.
    An MoE student's chunks return their layers' router losses as chunk losses
    (:func:`jmegatron.models.moe.moe_layer.chunk_moe_losses`, each data rank's share) on
    every stage, added outside the balancer as :func:`distillation_loss_fn` adds them; an
    MoE teacher runs its layers deterministic (its router sows nothing). Document masks
    (``segment_ids`` in the batch) apply to both models.
    """

    projection = (aux or {}).get(PROJECTION, (None,))[0]
    pairs = resolved_pairs(dcfg, student.cfg, teacher.cfg, projection)
    return functools.partial(_distillation_stages, student.cfg, teacher.cfg, dcfg, projection, pairs, vocab_shards,
                             teacher_layout)


def _stage_pairs(pairs: list, s_layout: PipelineLayout, t_layout: PipelineLayout) -> tuple[list, list]:
    """Where each of :func:`resolved_pairs`' ``pairs`` is computed under pipeline parallelism:
    (in a model chunk: ``[(k, fn, student (stage, chunk, index), teacher (stage, chunk, index),
    student sown name, teacher sown name)]``, on the last stage's head (both
    ``decoder.final_layernorm``): ``[(k, fn)]``). Raises DistillConfigError for a pair naming
    ``output_layer`` or whose layers sit in different chunks (naming the chunks)."""
    in_chunk, in_head = [], []
    for k, (s_layer, t_layer, fn, pair) in enumerate(pairs):
        if OUTPUT_LAYER in (s_layer[1], t_layer[1]):
            raise DistillConfigError(f"intermediate pair {pair.student} -> {pair.teacher}: {OUTPUT_LAYER} is "
                                     f"not an intermediate layer under pipeline parallelism")
        if s_layer[0] is None and t_layer[0] is None:
            in_head.append((k, fn))
            continue
        where_s = _chunk_of(s_layout, s_layer[0]) if s_layer[0] is not None else "the last stage's head"
        where_t = _chunk_of(t_layout, t_layer[0]) if t_layer[0] is not None else "the last stage's head"
        if s_layer[0] is None or t_layer[0] is None or where_s[:2] != where_t[:2]:
            def name(w):
                return w if isinstance(w, str) else f"stage {w[0]} chunk {w[1]}"
            raise DistillConfigError(
                f"intermediate pair {pair.student} -> {pair.teacher}: under pipeline parallelism a pair is "
                f"computed in the model chunk that holds both layers, but the student's is in "
                f"{name(where_s)} and the teacher's in {name(where_t)} (student chunks hold layers "
                f"{_chunk_ranges(s_layout)}, teacher chunks {_chunk_ranges(t_layout)}); pair layers of the "
                f"same chunk")
        in_chunk.append((k, fn, where_s, where_t, s_layer[1] + "_output", t_layer[1] + "_output"))
    return in_chunk, in_head


def _distillation_chunk(ctx, s_cfg, t_cfg, layouts: tuple, in_chunk: list, projection) -> Callable:
    """The ``chunk`` stage of :func:`distillation_pipeline_stages` for ``ctx``: the student's
    and the teacher's layers of model chunk ``ci`` side by side, the running pair sums
    (``x[2]``, float32 ``[len(in_chunk)]``) gaining the pairs computed in this chunk, an MoE
    student's router losses as chunk losses. ``layouts``: (student's, teacher's)
    :class:`PipelineLayout`; ``in_chunk``: :func:`_stage_pairs`' first list."""
    s_layout, t_layout = layouts
    s_sow = tuple(sorted({c[4] for c in in_chunk}))
    t_sow = tuple(sorted({c[5] for c in in_chunk}))
    s_dot, t_dot = s_cfg.dense_dot_general(), t_cfg.dense_dot_general()
    teacher_params, moe_student = ctx.extra, s_cfg.moe is not None

    def chunk(prm, x, micro, ci):
        xs, xt = x[:2]
        masks = {"segment_ids": micro.get("segment_ids"), "positions": micro.get("positions")}
        layers, first, count = ctx.chunk_layers(prm["decoder_layers"], ci, s_cfg.num_layers, s_layout)
        out_s = apply_layers(s_cfg, layers, xs, micro["position_ids"], first_layer=first, num_valid=count,
                             deterministic=False, rng=ctx.rng, sample_offset=ctx.sample_offset(micro),
                             dot_general=s_dot, sow=s_sow, moe_sown=moe_student, **masks)
        t_layers, t_first, t_count = ctx.chunk_layers(teacher_params["decoder_layers"], ci, t_cfg.num_layers,
                                                      t_layout)
        out_t = apply_layers(t_cfg, t_layers, jax.lax.stop_gradient(xt), micro["position_ids"],
                             first_layer=t_first, num_valid=t_count, deterministic=True, rng=None,
                             sample_offset=0, dot_general=t_dot, sow=t_sow, **masks)
        (ys, side_s), (yt, side_t) = (out_s if s_sow or moe_student else (out_s, {})), (out_t if t_sow else (out_t, {}))
        sown = {k: side_s.pop(k) for k in MOE_COLLECTIONS if k in side_s}
        y = (ys, jax.lax.stop_gradient(yt))
        if in_chunk:
            axes = manual_axes(ys)
            mask = micro["loss_mask"].astype(jnp.float32)

            def pair_sum(fn, i, j, s_name, t_name):
                hs = side_s[s_name][i]
                if projection is not None:
                    hs = projection.apply({"params": prm[PROJECTION]}, hs.astype(jnp.float32))
                ht = jax.lax.stop_gradient(side_t[t_name][j]).astype(jnp.float32)
                return as_varying(jnp.sum(fn(hs, ht) * mask), axes)

            sums = x[2]
            for slot, (_, fn, (st, c, i), (_, _, j), s_name, t_name) in enumerate(in_chunk):
                here = (ctx.stage == st) & (ci == c)
                add = jax.lax.cond(here, lambda: pair_sum(fn, i, j, s_name, t_name),
                                   lambda: as_varying(jnp.float32(0.0), axes))
                sums = sums.at[slot].add(add)
            y = y + (sums,)
        if not moe_student:
            return y, None
        return y, None, chunk_moe_losses(s_cfg, sown, first, count, 1.0 / ctx.data_parallel_size)

    return chunk


def _distillation_stages(s_cfg, t_cfg, dcfg: DistillConfig, projection, pairs: list, vocab_shards: int,
                         teacher_layout: Optional[PipelineLayout], ctx) -> dict:
    """:func:`distillation_pipeline_stages`' stages for the StageContext ``ctx``."""
    p, v = ctx.pipeline_size, ctx.virtual_size
    s_layout = ctx.layout or PipelineLayout(s_cfg.num_layers, p, v)
    t_layout = teacher_layout or PipelineLayout(t_cfg.num_layers, p, v)
    if (t_layout.num_layers, t_layout.pipeline_size, t_layout.virtual_size) != (t_cfg.num_layers, p, v):
        raise DistillConfigError(f"teacher layout {t_layout} does not split the teacher's {t_cfg.num_layers} "
                                 f"layers into the student's {p} x {v} pipeline chunks")
    in_chunk, in_head = _stage_pairs(pairs, s_layout, t_layout)
    s_dot, t_dot = s_cfg.dense_dot_general(), t_cfg.dense_dot_general()
    teacher_params = ctx.extra
    n_sums = len(in_chunk)
    need_lm = (not dcfg.skip_lm_loss) or dcfg.kd_loss_alpha is not None
    report_zeros = {k: jnp.float32(0.0) for k in (["lm_loss"] if need_lm else []) + [
        "kd_loss", "logits_distillation_loss", "intermediate_distillation_loss"]}
    if s_cfg.moe is not None:
        report_zeros.update(chunk_report_zeros(s_cfg))

    def embed(prm, micro):
        xs = embed_tokens(s_cfg, prm, micro["tokens"], micro["position_ids"], deterministic=False,
                          rng=jax.random.fold_in(ctx.rng, s_cfg.num_layers), sample_offset=ctx.sample_offset(micro),
                          positions=micro.get("positions"))
        xt = embed_tokens(t_cfg, teacher_params, micro["tokens"], micro["position_ids"], deterministic=True,
                          rng=None, sample_offset=0)
        x = (xs, jax.lax.stop_gradient(xt))
        return x + (jnp.zeros((n_sums,), jnp.float32),) if n_sums else x

    def head(prm, y, side, micro):
        ys, yt = y[:2]
        normed_s, normed_t = final_layernorm(s_cfg, prm, ys), final_layernorm(t_cfg, teacher_params, yt)
        logits_s = output_logits(s_cfg, prm, normed_s, s_dot, normed=True)
        logits_t = jax.lax.stop_gradient(output_logits(t_cfg, teacher_params, normed_t, t_dot, normed=True))
        mask = micro["loss_mask"].astype(jnp.float32)
        sums = {k: y[2][slot] for slot, (k, *_rest) in enumerate(in_chunk)}
        for k, fn in in_head:  # decoder.final_layernorm
            hs = normed_s
            if projection is not None:
                hs = projection.apply({"params": prm[PROJECTION]}, hs.astype(jnp.float32))
            sums[k] = jnp.sum(fn(hs, jax.lax.stop_gradient(normed_t).astype(jnp.float32)) * mask)
        kl = logits_loss(dcfg, logits_s, logits_t, vocab_shards)
        total, report = balanced_loss(dcfg, s_cfg, logits_s, kl, [sums[k] for k in range(len(pairs))], micro,
                                      ctx.tokens[micro["microbatch"]], ctx.data_sum)
        # every data rank holds the global values; the schedule sums the head's loss and report
        # over the data ranks and seeds each rank's backward with 1 (summed over the ranks by the
        # transpose of the data sum): a share of 1 / dp gives the global value and gradient once
        share = 1.0 / ctx.data_parallel_size
        return total * share, dict(report_zeros, **{k: r * share for k, r in report.items()})

    activation = (jax.ShapeDtypeStruct((ctx.local_rows, ctx.seq_length, s_cfg.hidden_size), s_cfg.dtype),
                  jax.ShapeDtypeStruct((ctx.local_rows, ctx.seq_length, t_cfg.hidden_size), t_cfg.dtype))
    if n_sums:
        activation += (jax.ShapeDtypeStruct((n_sums,), jnp.float32),)
    chunk = _distillation_chunk(ctx, s_cfg, t_cfg, (s_layout, t_layout), in_chunk, projection)
    return dict(embed=embed, chunk=chunk, head=head, activation=activation, report_zeros=report_zeros)


def _chunk_ranges(layout: PipelineLayout) -> str:
    """``"s0c0: 0-1, s1c0: 2-3"``: the model layers of each (stage, chunk)."""
    first, count = layout.chunk_first_layer(), layout.chunk_layers()
    return ", ".join(f"s{st}c{c}: {first[st, c]}-{first[st, c] + count[st, c] - 1}"
                     for st in range(layout.pipeline_size) for c in range(layout.virtual_size))
