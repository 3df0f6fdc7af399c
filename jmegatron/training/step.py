"""The jitted train and eval steps: pure functions of (state, batch).

A batch is a dict of arrays ``[num_microbatches, micro_batch_size * dp, seq_length]``
(``tokens``, ``labels``, ``position_ids`` int32; ``loss_mask`` float32; under
``reset_attention_mask`` also ``segment_ids`` int32, the document of each token), the batch
axis sharded over the data axis. Gradients accumulate over micro-batches in a
``lax.scan`` inside the jit (Megatron's forward_backward_no_pipelining); nothing in the
step synchronises with the host.

Loss: per micro-batch, the token mean of the masked cross-entropy over the whole
micro-batch (all data-parallel ranks together, which makes the loss independent of
the device layout); the step's loss and gradient are the mean over micro-batches
(megatron/training/training.py, ``loss_func`` in pretrain_gpt.py).

Dropout: one key per step (``fold_in(base, step)``), the same on every rank and
micro-batch; each micro-batch carries ``sample_offset``, the global number of its first
local row in the step's batch, and masks are drawn from (key, global sample, position)
(:mod:`jmegatron.models.dropout`), so any data/tensor/sequence-parallel, ZeRO-1 or FSDP
layout of the same global batch draws the same masks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jmegatron.parallel import rules as rules_lib
from jmegatron.parallel.distributed_optimizer import data_dim
from jmegatron.parallel.schedules import PIPELINE_AXIS, PipelineSchedule, build_schedule, run_schedule
from jmegatron.training import float16_optimizer
from jmegatron.training.float16_optimizer import Float16Optimizer
from jmegatron.training.forward_step import StageContext, lm_loss_fn, lm_pipeline_stages, masked_cross_entropy
from jmegatron.training.optimizer import optimizer_steps
from jmegatron.training.state import TrainState

Batch = dict[str, jax.Array]


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, schedule: Callable,
                    mesh: Mesh, param_shardings: Any, grad_shardings: Any,
                    rules: Sequence = rules_lib.DEFAULT_RULES, loss_fn: Optional[Callable] = None,
                    extra_shardings: Any = None, log_num_zeros_in_grad: bool = False,
                    pipeline: Optional[tuple[str, int, int]] = None, pipeline_stages: Optional[Callable] = None,
                    pipeline_layout: Any = None, buffers: Any = None,
                    accumulate_grads_in_fp32: bool = True,
                    check_for_nan_in_loss_and_grad: bool = True) -> Callable[..., tuple[TrainState, dict]]:
    """The un-jitted train step ``(state, batch[, extra[, stop]]) -> (state, metrics)``.

    Data parallelism is explicit, as in Megatron's DDP: a ``shard_map`` makes the data
    axis manual, each data-parallel rank accumulates its own gradients over the
    micro-batches (no communication inside the loop, Megatron's ``no_sync``), and
    after the loop the gradients are reduced once: an all-reduce (``psum``), or a
    reduce-scatter (``psum_scatter``) into ``grad_shardings`` under the distributed
    optimizer. Under FSDP (parameters sharded over data) each micro-batch all-gathers
    the parameters and reduce-scatters their gradients (the all-gather's transpose).
    Under context parallelism the context ranks are data-parallel ranks for the
    parameters (Megatron's DP x CP group): gradients sum over them, and ZeRO-1 / FSDP
    shard over data x context.
    The tensor axis stays automatic (GSPMD), driven by the logical-axis ``rules``.

    ``loss_fn(params, micro, rng, num_tokens, extra, data_sum) -> (loss, report)`` gives
    one micro-batch's loss (float32 scalar, the same on every data-parallel rank: local
    sums go through ``data_sum``, the psum over data, and are divided by ``num_tokens``,
    the micro-batch's unmasked tokens over all ranks) and a dict of scalars to report.
    ``micro`` holds this rank's rows of the batch's arrays and ``sample_offset`` (int32
    scalar, ``(micro_batch * data_parallel_size + rank) * local_rows``: the global sample
    number of its first row), which the model's dropout must receive with ``rng`` (the
    step's key, the same on every rank).
    Default: :func:`lm_loss_fn`. ``extra`` (e.g. a frozen teacher's parameters, laid
    out by ``extra_shardings``) is passed through untouched and gets no gradient.

    Pipeline parallelism (``pipeline`` = (schedule name, pipeline size p, chunks per stage
    v), :func:`jmegatron.parallel.schedules.build_schedule` for the batch's number of
    micro-batches): the shard_map makes the mesh's ``pipeline`` axis manual too and the
    micro-batch loop is the schedule's program (:func:`_pipelined_grads`); the layers'
    gradients stay on their stage, the parameters replicated over stages (embeddings,
    final norm) get theirs summed over stages (Megatron's embedding-group all-reduce for
    the tied word embeddings). The stages come from ``pipeline_stages(ctx)``
    (:class:`StageContext` -> embed / chunk / head, default :func:`lm_pipeline_stages`;
    distillation gives its own), the pipelined counterpart of ``loss_fn``; ``pipeline_layout``
    (:class:`jmegatron.parallel.pipeline_layout.PipelineLayout`, default the even split)
    places the layers on the stages.

    ``buffers`` (:class:`jmegatron.training.forward_step.ModelBuffers`, optional): parameters
    that are not trained (the routers' ``expert_bias``); after the optimizer's update they are
    replaced by ``buffers.update(params, metrics, grads)`` and ``num_zeros`` / ``grad_norm``
    leave them out; the gradients of its ``is_max`` leaves (FP8's observed amaxes) combine
    with max over micro-batches and ranks (:func:`combine_grads`), not summed or averaged.

    Mixed precision (``tx`` a :class:`~jmegatron.training.float16_optimizer.Float16Optimizer`:
    bf16 / fp16 model parameters, float32 main parameters in the optimizer state): each
    micro-batch's gradients (in the parameters' dtype) accumulate over micro-batches and
    are all-reduced in float32 when ``accumulate_grads_in_fp32`` (Megatron's
    ``accumulate_allreduce_grads_in_fp32``), else in the parameters' dtype; the optimizer
    updates the main parameters and the model's are cast from them. Under fp16 the loss is
    multiplied by the loss scale before the backward, the gradients divided by it after
    the reduction; an iteration with non-finite gradients is skipped (``skipped`` = 1,
    parameters and moments unchanged, the scale backs off) and counts as an iteration
    (``state.step`` advances, the learning-rate schedule does not: Megatron).

    Non-finite values (``check_for_nan_in_loss_and_grad``, Megatron's flag, every precision):
    every step the loss and the reduced (fp16: unscaled) gradients are checked inside the
    step; when either is not finite the update is skipped as fp16's overflow is (parameters,
    main parameters, moments, the schedule's count and the buffers (expert bias, FP8 meta)
    unchanged, ``state.step`` advances; ``float16_optimizer.keep_if``). ``skipped`` = 1 for
    such an iteration and ``nan`` = 1 when its loss is not finite (Megatron's training_log:
    a skipped iteration whose loss is inf/nan counts as a nan iteration, one with non-finite
    gradients only as a skipped one). Without the check (False) only fp16's scaler skips,
    and ``nan`` still reports a non-finite loss.

    ``stop`` (float32 ``[mesh size]``, optional, laid out over every device by
    :func:`stop_flag_sharding`: each process's devices hold its own 0/1 stop request) adds
    metric ``stop``, the maximum over all processes: the ranks agree to stop inside the
    step's program, without a collective of their own (:mod:`jmegatron.training.loop`).

    metrics (float32 scalars): ``loss`` (what was optimised) and the report's entries
    (``lm_loss`` by default), each a mean over micro-batches; ``grad_norm`` (before
    clipping); ``lr`` (the rate this step applied); ``num_tokens`` (unmasked tokens of
    the whole step, summed); ``skipped`` (1.0 for a skipped iteration) and ``nan`` (1.0
    when the loss is not finite); with ``log_num_zeros_in_grad``, ``num_zeros`` (zero
    entries of the reduced gradients, before clipping: Megatron's ``count_zeros_fp32``);
    under bf16 / fp16 ``loss_scale`` (1 without fp16 scaling); with ``stop``, ``stop``.
    """
    mixed = isinstance(tx, Float16Optimizer)
    axis = rules_lib.DATA_AXIS
    expert = rules_lib.EXPERT_AXIS
    context = rules_lib.CONTEXT_AXIS
    ep = mesh.shape.get(expert, 1)
    cp = mesh.shape.get(context, 1)
    # Expert parallelism is carved out of data parallelism (Megatron): the batch splits over
    # data x expert, dense gradients reduce over both, the experts' (split over expert)
    # over data only: Megatron's expert-data-parallel group.
    dp = rules_lib.data_parallel_size(mesh)
    manual = ((axis,) + ((expert,) if ep > 1 else ()) + ((context,) if cp > 1 else ())
              + ((PIPELINE_AXIS,) if pipeline is not None else ()))
    inner_rules = rules
    for name in manual:
        inner_rules = rules_lib.rules_without(inner_rules, name)
    if pipeline is not None and loss_fn is not None:
        raise ValueError("make_train_step: under pipeline parallelism the loss comes from pipeline_stages "
                         "(a stage provider, see lm_pipeline_stages), not loss_fn")
    loss_fn = loss_fn or lm_loss_fn(model)
    is_max = buffers.is_max if buffers is not None else (lambda path: False)
    max_leaves = jax.tree_util.tree_map_with_path(lambda path, _: is_max(path), param_shardings)
    combine = functools.partial(combine_grads, max_leaves)
    param_dims = jax.tree.map(data_dim, param_shardings)
    grad_dims = jax.tree.map(data_dim, grad_shardings)
    param_specs = jax.tree.map(lambda s: rules_lib.spec_only(s.spec, manual), param_shardings)
    grad_specs = jax.tree.map(lambda s: rules_lib.spec_only(s.spec, manual), grad_shardings)
    extra_dims = jax.tree.map(data_dim, extra_shardings)
    extra_specs = jax.tree.map(lambda s: rules_lib.spec_only(s.spec, manual), extra_shardings)
    # the batch's axes of size > 1: a size-1 manual axis takes no collective (below), so no
    # value may vary over it either
    # Context parallelism splits each sequence (already in Megatron's load-balanced order,
    # Run.put_batch) over "context": token sums and parameter gradients add over it too.
    split = tuple(a for a in ((axis, expert) if ep > 1 else (axis,)) if mesh.shape[a] > 1)
    live = split + ((context,) if cp > 1 else ())
    batch_spec = PartitionSpec(None, (split if len(split) > 1 else split[0]) if split else
                               (None if cp > 1 else axis), context if cp > 1 else None)
    is_none = lambda x: x is None  # noqa: E731
    is_expert = jax.tree.map(lambda s: expert in {a for e in s.spec for a in rules_lib.entry_axes(e)},
                             param_shardings)
    # ZeRO-1: the manual axes of size > 1 a gradient is reduce-scattered over (data, expert
    # for dense leaves under expert parallelism, context under context parallelism: Megatron's
    # data-parallel group with context parallelism; parallel/distributed_optimizer.py)
    def zero_group(s):  # the data / expert / context axes of the dimension ZeRO-1 added
        d = data_dim(s)
        on = set() if d is None else set(rules_lib.entry_axes(s.spec[d]))
        return tuple(a for a in (axis, expert, context) if a in on and mesh.shape.get(a, 1) > 1)

    zero_axes = jax.tree.map(zero_group, grad_shardings)
    # FSDP: the axes a parameter's shards are gathered over (data, and context under context
    # parallelism: Megatron-FSDP's data-parallel group with context parallelism)
    param_groups = jax.tree.map(zero_group, param_shardings)
    extra_groups = jax.tree.map(zero_group, extra_shardings)

    # With one data-parallel rank every data collective is the identity. It is skipped,
    # not emitted: XLA's SPMD partitioner rejects an all-reduce over a size-1 manual axis
    # when other mesh axes (tensor) stay automatic.
    single = dp * cp == 1

    def psum(x):  # over every rank that splits the batch
        return x if single else jax.lax.psum(x, live)

    def psum_over(x, name):
        return x if mesh.shape[name] == 1 else jax.lax.psum(x, name)

    def gather(p, d, group):
        if d is None or not group:
            return p
        return jax.lax.all_gather(p, group[0] if len(group) == 1 else group, axis=d, tiled=True)

    def data_sum(x):
        return psum(x)

    def micro_loss(local_params, micro, rng, num_tokens, extra, loss_scale):
        params = jax.tree.map(gather, local_params, param_dims, param_groups, is_leaf=is_none)
        extra = jax.tree.map(gather, extra, extra_dims, extra_groups, is_leaf=is_none)
        with nn.logical_axis_rules(inner_rules):
            loss, report = loss_fn(params, micro, rng, num_tokens, extra, data_sum)
        # fp16: the backward starts from the scaled loss (Megatron's scaled_loss.backward())
        return (loss if loss_scale is None else loss * loss_scale), (report, loss)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def accum_zeros(p):  # the gradient accumulator (Megatron's main_grad buffer)
        dtype = jnp.float32 if accumulate_grads_in_fp32 and jnp.issubdtype(p.dtype, jnp.floating) else p.dtype
        return jnp.zeros_like(p, dtype=dtype)  # (keeps p's varying manual axes)

    def accum_add(acc, g):
        return acc + g.astype(acc.dtype)

    def local_grads(local_params, batch, rng, extra, loss_scale):
        # Gradients w.r.t. data-replicated parameters are taken on a "varying" copy, so
        # autodiff leaves them as this rank's partial sums; the one reduction is below.
        def make_varying(p, d, ex):
            over = tuple(a for a in live if not (ex and a == expert))
            return p if d is not None or not over else jax.lax.pcast(p, over, to="varying")

        varying = jax.tree.map(make_varying, local_params, param_dims, is_expert, is_leaf=is_none)
        num_micro, local_rows = batch["tokens"].shape[:2]

        def with_offset(micro, i):
            # Dropout draws from global sample numbers, never from the rank: see the docstring.
            # (the rank over the batch's axes of size > 1: a size-1 axis adds 0 to the index,
            # and its axis_index would make the offset vary over an axis no value varies on)
            rank = (jax.lax.axis_index(split) if len(split) > 1 else jax.lax.axis_index(split[0])) if split else 0
            first = (i * dp + rank) * local_rows
            return dict(micro, sample_offset=jnp.asarray(first, jnp.int32))

        def accumulate(carry, xs):
            grads_acc, report_acc, tokens_acc = carry
            i, micro = xs
            tokens = psum(jnp.sum(micro["loss_mask"].astype(jnp.float32)))
            (_, (report, loss)), grads = grad_fn(varying, with_offset(micro, i), rng, tokens, extra, loss_scale)
            report = dict(report, loss=loss)
            return (combine(grads_acc, grads), jax.tree.map(jnp.add, report_acc, report),
                    tokens_acc + tokens), None

        if pipeline is not None:
            with nn.logical_axis_rules(inner_rules):
                schedule = build_schedule(pipeline[0], pipeline[1], num_micro, pipeline[2])
                grads, report, tokens = _pipelined_grads(model.cfg, schedule, pipeline_stages or lm_pipeline_stages,
                                                         varying, batch, rng, extra, psum, dp,
                                                         pipeline_layout, context_parallel_size=cp,
                                                         loss_scale=loss_scale, grad_zeros=accum_zeros,
                                                         max_leaves=max_leaves)
        else:
            zeros = jax.tree.map(accum_zeros, varying)
            first = with_offset(jax.tree.map(lambda b: b[0], batch), 0)
            report_shape = jax.eval_shape(lambda: grad_fn(varying, first, rng, jnp.float32(1.0), extra,
                                                          loss_scale)[0][1][0])
            report0 = dict(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), report_shape),
                           loss=jnp.float32(0.0))
            (grads, report, tokens), _ = jax.lax.scan(
                accumulate, (zeros, report0, jnp.float32(0.0)), (jnp.arange(num_micro), batch))

        def reduce(g, pd, gd, ex, zax, mx):
            if mx:  # an observation (FP8 amax): the max over every rank that splits the batch
                return g if single or not live else jax.lax.pmax(g, live)
            if cp > 1 and context not in zax:  # every parameter is replicated over the context ranks
                g = jax.lax.psum(g, context)  # (ZeRO-1 over context: in the reduce-scatter below)
            if pd is not None:  # FSDP: already reduce-scattered by the all-gather's transpose (over context too)
                return g
            if not ex and ep > 1 and expert not in zax:  # dense: the expert ranks are data ranks too
                g = psum_over(g, expert)
            if gd is None:
                return psum_over(g, axis)
            return g[None]  # ZeRO-1: this rank's partial sum, reduce-scattered below

        grads = jax.tree.map(reduce, grads, param_dims, grad_dims, is_expert, zero_axes, max_leaves,
                             is_leaf=is_none)
        grads = jax.tree.map(lambda g, mx: g if mx else g / num_micro, grads, max_leaves)
        return grads, jax.tree.map(lambda r: r / num_micro, report), tokens

    zero1 = jax.tree.map(lambda pd, gd: pd is None and gd is not None, param_dims, grad_dims,
                         is_leaf=is_none)
    # ZeRO-1 leaves leave the shard_map stacked [data, ...] (each rank's partial sum), their
    # other axes laid out as the parameter over the pipeline axis (a stage's layers).
    def stacked_entry(zax):
        return (zax[0] if len(zax) == 1 else zax) if zax else axis

    out_grad_specs = jax.tree.map(
        lambda z, spec, ps, zax: PartitionSpec(stacked_entry(zax), *rules_lib.spec_only(ps.spec, (PIPELINE_AXIS, expert)))
        if z else spec, zero1, grad_specs, param_shardings, zero_axes, is_leaf=lambda x: isinstance(x, tuple))
    sharded_grads = jax.shard_map(
        local_grads, mesh=mesh, axis_names=set(manual), check_vma=not single,
        in_specs=(param_specs, batch_spec, PartitionSpec(), extra_specs, PartitionSpec()),  # batch_spec: every key
        out_specs=(out_grad_specs, PartitionSpec(), PartitionSpec()))

    # The ZeRO-1 reduce-scatter runs with every mesh axis manual: inside the data-only
    # shard_map above, XLA replicates tensor-sharded operands of a psum_scatter first.
    def scatter(stacked, gd, zax):
        if not zax:
            return stacked[0]
        return jax.lax.psum_scatter(stacked[0], zax, scatter_dimension=gd, tiled=True)

    def reduce_scatter_zero1(grads):
        leaves, treedef = jax.tree.flatten(grads)
        flags, dims = jax.tree.leaves(zero1), jax.tree.leaves(grad_dims, is_leaf=is_none)
        p_sh, g_sh = jax.tree.leaves(param_shardings), jax.tree.leaves(grad_shardings)
        zaxes = jax.tree.leaves(zero_axes, is_leaf=lambda x: isinstance(x, tuple))
        out = []
        for leaf, z, gd, ps, gs, zax in zip(leaves, flags, dims, p_sh, g_sh, zaxes):
            if z:
                leaf = jax.shard_map(functools.partial(scatter, gd=gd, zax=zax), mesh=mesh,
                                     in_specs=PartitionSpec(stacked_entry(zax), *ps.spec), out_specs=gs.spec)(leaf)
            out.append(leaf)
        return jax.tree.unflatten(treedef, out)

    def compute_grads(state: TrainState, batch: Batch, extra: Any = None):
        """(grads, report, tokens); under fp16 the gradients are still multiplied by the loss scale."""
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        loss_scale = tx.loss_scale(state.opt_state) if mixed else None
        grads, report, tokens = sharded_grads(state.params, batch, step_rng, extra, loss_scale)
        return reduce_scatter_zero1(grads), report, tokens

    check = check_for_nan_in_loss_and_grad

    def step(state: TrainState, batch: Batch, extra: Any = None, stop: Any = None):
        grads, report, tokens = compute_grads(state, batch, extra)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        nan = jnp.logical_not(jnp.isfinite(report["loss"]))
        if mixed:
            finalize = None if buffers is None else (lambda main, g: buffers.update(main, report, g))
            new_params, opt_state, grads, skipped = float16_optimizer.apply_gradients(
                tx, grads, state.opt_state, finalize, observed=is_max, check_finite=check,
                skip=nan if check else None)
            new_params = jax.lax.with_sharding_constraint(new_params, param_shardings)
            lr_step = optimizer_steps(state.opt_state.inner, state.step)
            extras = {"loss_scale": (jnp.float32(1.0) if state.opt_state.grad_scaler is None
                                     else state.opt_state.grad_scaler.scale)}
        else:
            params = jax.lax.with_sharding_constraint(state.params, grad_shardings)
            updates, opt_state = tx.update(grads, state.opt_state, params)
            new_params = optax.apply_updates(params, updates)
            lr_step, extras = optimizer_steps(state.opt_state, state.step), {}
            skipped = (jnp.logical_or(nan, jnp.logical_not(float16_optimizer.all_finite(grads, is_max)))
                       if check else jnp.bool_(False))
        extras.update(skipped=skipped.astype(jnp.float32), nan=nan.astype(jnp.float32))
        if stop is not None:  # every process's request: the max is one all-reduce inside the step
            extras["stop"] = jnp.max(stop).astype(jnp.float32)
        trained = jax.tree_util.tree_map_with_path(  # what the optimizer sees (not the buffers)
            lambda path, g: g if buffers is None or not buffers.is_buffer(path) else jnp.zeros((), g.dtype), grads)
        metrics = dict(report, grad_norm=optax.tree.norm(trained),
                       lr=jnp.asarray(schedule(lr_step), jnp.float32), num_tokens=tokens, **extras)
        if log_num_zeros_in_grad:  # int32 per tensor, float32 over tensors, as Megatron's float count
            metrics["num_zeros"] = sum(jnp.sum(g == 0, dtype=jnp.int32).astype(jnp.float32)
                                       for path, g in jax.tree_util.tree_leaves_with_path(grads)
                                       if buffers is None or not buffers.is_buffer(path))
            if pipeline_layout is not None and pipeline_layout.uneven:  # not the padding slots' zeros
                pads = int((pipeline_layout.order() < 0).sum())
                metrics["num_zeros"] -= float(sum(pads * np.prod(g.shape[1:]) for path, g in
                                                  jax.tree_util.tree_leaves_with_path(grads["decoder_layers"])
                                                  if buffers is None or not buffers.is_buffer(path)))
        if buffers is not None and not mixed:  # (mixed: applied to the main parameters above)
            new_params = buffers.update(new_params, metrics, grads)
        if check and not mixed:  # a skipped iteration: parameters, buffers, moments, count unchanged
            new_params = float16_optimizer.keep_if(skipped, new_params, params)
            opt_state = float16_optimizer.keep_if(skipped, opt_state, state.opt_state)
        new_state = state.replace(step=state.step + 1, params=new_params, opt_state=opt_state)
        return new_state, metrics

    step.compute_grads = compute_grads  # (state, batch[, extra]) -> (grads, report, tokens)
    return step


def combine_grads(max_leaves: Any, a: Any, b: Any) -> Any:
    """Two gradient trees accumulated: ``max`` where ``max_leaves`` (a tree of bools of the
    same structure) is True (observations such as FP8's amaxes), ``a + b`` elsewhere; in
    ``a``'s dtype (the accumulator's)."""
    return jax.tree.map(lambda m, x, y: jnp.maximum(x, y.astype(x.dtype)) if m else x + y.astype(x.dtype),
                        max_leaves, a, b)


def _pipelined_grads(c, schedule: PipelineSchedule, stages_fn: Callable, params, batch: Batch, rng, extra,
                     data_sum: Callable, dp: int, layout: Any = None, context_parallel_size: int = 1,
                     loss_scale: Any = None, grad_zeros: Optional[Callable] = None, max_leaves: Any = None):
    """One data-parallel rank's pipelined (grads, report, tokens), as the micro-batch loop
    of :func:`make_train_step` returns them (sums over micro-batches); ``params`` as that
    loop sees them (data-replicated ones already varying over data); ``stages_fn(ctx)``
    gives the stages (:func:`lm_pipeline_stages` or distillation's). Under context
    parallelism (``context_parallel_size`` ranks, each its slots of every sequence) a
    rank's share of a mean over ranks (``StageContext.data_parallel_size``) is over the
    ``dp x cp`` ranks that ``data_sum`` adds. ``loss_scale`` (float32 [] or None) seeds the
    backward (fp16); ``grad_zeros(p)`` gives each gradient accumulator (default zeros like p).
    ``max_leaves`` (bools, ``params``' structure; None: none): leaves whose gradients combine
    with max (:func:`combine_grads`)."""
    num_micro, local_rows, seq = batch["tokens"].shape
    if max_leaves is None:
        max_leaves = jax.tree.map(lambda _: False, params)
    data_rank = jax.lax.axis_index(rules_lib.DATA_AXIS)
    # Parameters replicated over stages get per-stage partial gradients, summed below.
    params = {k: (val if k == "decoder_layers" else
                  jax.tree.map(lambda a: jax.lax.pcast(a, PIPELINE_AXIS, to="varying"), val))
              for k, val in params.items()}
    tokens = data_sum(jnp.sum(batch["loss_mask"].astype(jnp.float32), axis=(1, 2)))  # [m]
    ctx = StageContext(cfg=c, pipeline_size=schedule.pipeline_size, virtual_size=schedule.virtual_size,
                       stage=jax.lax.axis_index(PIPELINE_AXIS), rng=rng, tokens=tokens,
                       sample_offset=lambda micro: (micro["microbatch"] * dp + data_rank) * local_rows,
                       local_rows=local_rows, seq_length=seq, extra=extra, data_sum=data_sum, layout=layout,
                       data_parallel_size=dp * context_parallel_size)
    stages = stages_fn(ctx)
    grads, loss, report = run_schedule(schedule, params, batch, **stages, loss_scale=loss_scale, grad_zeros=grad_zeros,
                                       combine=functools.partial(combine_grads, max_leaves))
    over_stages = lambda a, m: jax.lax.pmax(a, PIPELINE_AXIS) if m else jax.lax.psum(a, PIPELINE_AXIS)  # noqa: E731
    grads = {k: (g if k == "decoder_layers" else jax.tree.map(over_stages, g, max_leaves[k]))
             for k, g in grads.items()}
    total = lambda x: jax.lax.psum(data_sum(x), PIPELINE_AXIS)  # noqa: E731
    report = dict(jax.tree.map(total, report), loss=total(loss))
    return grads, report, jnp.sum(tokens)


def make_eval_step(model: nn.Module, rules: Sequence = rules_lib.DEFAULT_RULES, layer_order: Any = None):
    """The un-jitted eval step ``(params, batch) -> (loss_sum, token_count)`` (float32).
    ``layer_order`` (int ``[num_layers]``, optional): the stacked decoder layers are taken in
    this order first (interleaved pipeline stages store them in stage order)."""

    def step(params, batch: Batch):
        stored = jax.tree.leaves(params.get("decoder_layers", {}))
        identity = layer_order is None or not stored or (
            len(layer_order) == stored[0].shape[0] and (np.asarray(layer_order) == np.arange(len(layer_order))).all())
        if not identity:
            params = dict(params, decoder_layers=jax.tree.map(lambda a: a[layer_order], params["decoder_layers"]))
        def body(carry, micro):
            with nn.logical_axis_rules(list(rules)):
                logits = model.apply({"params": params}, micro["tokens"], micro["position_ids"],
                                     deterministic=True, segment_ids=micro.get("segment_ids"))
            total, count = masked_cross_entropy(logits, micro["labels"], micro["loss_mask"])
            return (carry[0] + total, carry[1] + count), None

        (total, count), _ = jax.lax.scan(body, (jnp.float32(0.0), jnp.float32(0.0)), batch)
        return total, count

    return step


def batch_shardings(mesh: Mesh, segment_ids: bool = False) -> Batch:
    """NamedShardings for a batch: ``[num_micro, batch, seq]`` with batch over data (and
    expert, under expert parallelism: :func:`jmegatron.parallel.rules.batch_axes`), the
    sequence over context under context parallelism. ``segment_ids``: the batch carries
    that key too (``reset_attention_mask``)."""
    cp = mesh.shape.get(rules_lib.CONTEXT_AXIS, 1)
    spec = PartitionSpec(None, rules_lib.batch_axes(mesh.shape.get(rules_lib.EXPERT_AXIS, 1)),
                         rules_lib.CONTEXT_AXIS if cp > 1 else None)
    s = NamedSharding(mesh, spec)
    out = {"tokens": s, "labels": s, "loss_mask": s, "position_ids": s}
    return dict(out, segment_ids=s) if segment_ids else out


def stop_flag_sharding(mesh: Mesh) -> NamedSharding:
    """The layout of the train step's ``stop`` input: float32 ``[mesh size]``, one entry per
    device, split over every mesh axis (each process fills its own devices' entries)."""
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def stop_flags(mesh: Mesh, requested: bool) -> jax.Array:
    """The train step's ``stop`` input for this process: its devices' entries 1.0 if
    ``requested`` else 0.0 (every process calls it with its own flag; no communication)."""
    n = mesh.devices.size
    return jax.make_array_from_callback((n,), stop_flag_sharding(mesh),
                                        lambda index: np.full((len(range(n)[index[0]]),), float(requested), np.float32))


class TrainStep:
    """The jitted train step: ``step(state, batch, *extra, stop=None) -> (state, metrics)``.

    ``stop`` (bool or None): this process's stop request, passed to the program as a tiny
    input (:func:`stop_flags`, the two possible arrays built once) whose maximum over all
    processes comes back as metric ``stop``; None passes "no request". ``lower`` takes the
    same arguments; other attributes (``_cache_size``, ...) are the jitted function's."""

    def __init__(self, jitted, mesh: Mesh):
        self.jitted = jitted
        self.mesh = mesh
        self._flags = {}

    def flags(self, requested: bool) -> jax.Array:
        if requested not in self._flags:
            self._flags[requested] = stop_flags(self.mesh, requested)
        return self._flags[requested]

    def __call__(self, state, batch, *extra, stop: Optional[bool] = None):
        return self.jitted(state, batch, *extra, self.flags(bool(stop)))

    def lower(self, state, batch, *extra, stop: Optional[bool] = None):
        return self.jitted.lower(state, batch, *extra, self.flags(bool(stop)))

    def __getattr__(self, name):  # (only for names not set above: _cache_size, eval_shape, ...)
        if name in ("jitted", "mesh", "_flags"):
            raise AttributeError(name)
        return getattr(self.jitted, name)


def jit_train_step(step_fn, mesh: Mesh, state_shardings: TrainState, extra_shardings: Any = None,
                   segment_ids: bool = False) -> TrainStep:
    """jit with the state donated and laid out by ``state_shardings``; ``segment_ids``: the
    batch has that key (:func:`batch_shardings`). The stop flags (:class:`TrainStep`) go
    in last, laid out by :func:`stop_flag_sharding`."""
    in_shardings = (state_shardings, batch_shardings(mesh, segment_ids))
    if extra_shardings is not None:
        in_shardings += (extra_shardings,)
        fn = step_fn
    else:
        fn = lambda state, batch, stop: step_fn(state, batch, None, stop)  # noqa: E731
    in_shardings += (stop_flag_sharding(mesh),)
    return TrainStep(jax.jit(fn, in_shardings=in_shardings,
                             out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
                             donate_argnums=(0,)), mesh)


def jit_eval_step(step_fn, mesh: Mesh, param_shardings: Any, segment_ids: bool = False):
    """jit the eval step with the parameters laid out by ``param_shardings``; ``segment_ids``:
    the batch has that key (:func:`batch_shardings`)."""
    return jax.jit(step_fn, in_shardings=(param_shardings, batch_shardings(mesh, segment_ids)),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))
