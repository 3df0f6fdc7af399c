"""The jitted train and eval steps: pure functions of (state, batch).

A batch is a dict of arrays ``[num_microbatches, micro_batch_size * dp, seq_length]``
(``tokens``, ``labels``, ``position_ids`` int32; ``loss_mask`` float32; under
``reset_attention_mask`` also ``segment_ids`` int32, the document of each token; under
context parallelism also ``positions`` int32, each slot's original sequence position), laid out
by :func:`jmegatron.parallel.rules.batch_shardings`. The train step composes, as
Megatron's ``train_step`` (megatron/training/training.py): the micro-batch loop
(:mod:`jmegatron.parallel.schedules`: ``forward_backward_no_pipelining`` or a pipeline
schedule) -> gradient synchronisation (:mod:`jmegatron.parallel.grad_sync`, Megatron's
``finalize_model_grads``) -> the optimizer -> metrics. Nothing in the step synchronises
with the host; what a micro-batch computes comes from a forward step
(:class:`jmegatron.training.forward_step.ForwardStep`).

Loss: per micro-batch, the forward step's (for the language model the token mean of the
masked cross-entropy over the whole micro-batch, all data-parallel ranks together, which
makes the loss independent of the device layout); the step's loss and gradient are the
mean over micro-batches (megatron/training/training.py, ``loss_func`` in pretrain_gpt.py).

Dropout: one key per step (``fold_in(base, step)``), the same on every rank and
micro-batch; each micro-batch carries ``sample_offset``, the global number of its first
local row in the step's batch (:meth:`jmegatron.parallel.grad_sync.GradSync.sample_offset`),
and masks are drawn from (key, global sample, position) (:mod:`jmegatron.models.dropout`),
so any data/tensor/sequence-parallel, ZeRO-1 or FSDP layout of the same global batch draws
the same masks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jmegatron.compilation import AnnouncedJit, shape_text
from jmegatron.parallel import rules as rules_lib
from jmegatron.parallel.grad_sync import GradSync, StepLayout
from jmegatron.parallel.rules import batch_shardings, stop_flag_sharding
from jmegatron.parallel.schedules import (STAGE_LOCAL_KEY, build_schedule, forward_backward_no_pipelining,
                                          forward_backward_pipelining)
from jmegatron.training import float16_optimizer
from jmegatron.training.float16_optimizer import Float16Optimizer
from jmegatron.training.optimizer import optimizer_steps
from jmegatron.training.state import TrainState

Batch = dict[str, jax.Array]


def make_train_step(model: nn.Module, forward_step: Any, tx: optax.GradientTransformation,
                    lr_schedule: Callable, layout: StepLayout, log_num_zeros_in_grad: bool = False,
                    check_for_nan_in_loss_and_grad: bool = True) -> Callable[..., tuple[TrainState, dict]]:
    """The un-jitted train step ``(state, batch[, extra[, stop]]) -> (state, metrics)``:
    micro-batch loop -> gradient sync -> optimizer -> metrics (Megatron's ``train_step``).

    ``forward_step`` (:class:`jmegatron.training.forward_step.ForwardStep`, required): its
    ``loss_fn(params, micro, rng, num_tokens, extra, data_sum) -> (loss, report)`` gives one
    micro-batch's loss (float32 scalar, the same on every rank: local sums go through
    ``data_sum`` and are divided by ``num_tokens``, the micro-batch's unmasked tokens over
    all ranks; ``data_sum(x, context_only=True)`` sums over the context ranks alone:
    :meth:`jmegatron.parallel.grad_sync.GradSync.data_sum`) and a dict of scalars to report; ``micro`` holds this rank's rows and
    ``sample_offset`` (int32), which the model's dropout must receive with ``rng`` (the
    step's key). Under pipeline parallelism (``layout.pipeline``) its ``pipeline_stages(ctx)``
    (:class:`jmegatron.parallel.schedules.StageContext`) gives the same computation as
    stages; ``model.cfg`` is the context's ``cfg``. Its ``buffers``
    (:class:`~jmegatron.training.forward_step.ModelBuffers` or None): untrained leaves,
    replaced after the update by ``buffers.update(params, metrics, grads)``, left out of
    ``num_zeros`` / ``grad_norm``; ``is_max`` leaves combine with max
    (:func:`jmegatron.parallel.grad_sync.combine_grads`). ``extra`` (laid out by
    ``layout.extra_shardings``) is passed to the loss untouched and gets no gradient.

    ``tx``: optax or :class:`~jmegatron.training.float16_optimizer.Float16Optimizer`
    (bf16 / fp16 parameters, float32 main parameters; fp16 scales the loss before the
    backward and unscales after the reduction); ``lr_schedule(step) -> rate``;
    ``layout``: :class:`jmegatron.parallel.grad_sync.StepLayout`.
    ``check_for_nan_in_loss_and_grad`` and the skip rule: :func:`_apply_gradients`;
    ``stop`` and the metrics: :func:`_metrics`.
    """
    if layout.pipeline is not None and forward_step.pipeline_stages is None:
        raise ValueError("make_train_step: layout.pipeline is set but the forward step has no pipeline_stages")
    mixed = isinstance(tx, Float16Optimizer)
    buffers = forward_step.buffers
    # with a prepare step the extra input is used there only: it does not enter the shard_map
    prepared = forward_step.prepare is not None
    sync = GradSync(dataclasses.replace(layout, extra_shardings=None) if prepared else layout,
                    buffers.is_max if buffers is not None else (lambda path: False))

    def micro_loss(local_params, micro, rng, num_tokens, extra, loss_scale):
        params, extra = sync.gather(local_params, extra)
        with nn.logical_axis_rules(sync.inner_rules):
            loss, report = forward_step.loss_fn(params, micro, rng, num_tokens, extra, sync.data_sum)
        # fp16: the backward starts from the scaled loss (Megatron's scaled_loss.backward())
        return (loss if loss_scale is None else loss * loss_scale), (report, loss)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def local_grads(local_params, batch, rng, extra, loss_scale):
        params = sync.varying(local_params)
        if layout.pipeline is None:
            grads, report, tokens = forward_backward_no_pipelining(
                lambda p, micro, n: grad_fn(p, micro, rng, n, extra, loss_scale), params, batch,
                sample_offset=sync.sample_offset, data_sum=sync.data_sum, grad_zeros=sync.accumulator,
                combine=sync.combine)
        else:
            name, p, v = layout.pipeline
            with nn.logical_axis_rules(sync.inner_rules):
                grads, report, tokens = forward_backward_pipelining(
                    build_schedule(name, p, batch["tokens"].shape[0], v), forward_step.pipeline_stages, params,
                    batch, model_cfg=model.cfg, rng=rng, extra=extra, sample_offset=sync.sample_offset,
                    data_sum=sync.data_sum, data_parallel_size=sync.dp * sync.cp, layout=layout.pipeline_layout,
                    loss_scale=loss_scale, grad_zeros=sync.accumulator, combine=sync.combine)
        grads, report = sync.reduce(grads, report, batch["tokens"].shape[0])
        return grads, report, tokens

    sharded_grads = sync.shard_map(local_grads)

    def compute_grads(state: TrainState, batch: Batch, extra: Any = None):
        """(grads, report, tokens); under fp16 the gradients are still multiplied by the loss scale."""
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        loss_scale = tx.loss_scale(state.opt_state) if mixed else None
        if forward_step.prepare is not None:  # before the micro-batch loop, GSPMD over the whole mesh
            added = forward_step.prepare(extra, batch)  # [m, rows, seq, K] arrays, laid out as batch_keys are
            shardings = batch_shardings(layout.mesh, extra_keys=tuple(added))
            batch = dict(batch, **jax.lax.with_sharding_constraint(added, {k: shardings[k] for k in added}))
        grads, report, tokens = sharded_grads(state.params, batch, step_rng, None if prepared else extra, loss_scale)
        return sync.reduce_scatter(grads), report, tokens

    def step(state: TrainState, batch: Batch, extra: Any = None, stop: Any = None):
        grads, report, tokens = compute_grads(state, batch, extra)
        grads = jax.lax.with_sharding_constraint(grads, layout.grad_shardings)
        new_params, opt_state, grads, skipped, extras = _apply_gradients(
            tx, state, grads, report, layout, buffers, check_for_nan_in_loss_and_grad)
        metrics = _metrics(report, grads, tokens, lr_schedule(optimizer_steps(
            state.opt_state.inner if mixed else state.opt_state, state.step)), extras, stop, buffers,
            layout.pipeline_layout, log_num_zeros_in_grad)
        if buffers is not None and not mixed:  # (mixed: applied to the main parameters)
            new_params = buffers.update(new_params, metrics, grads)
        if check_for_nan_in_loss_and_grad and not mixed:  # a skipped iteration: all unchanged
            params = jax.lax.with_sharding_constraint(state.params, layout.grad_shardings)
            new_params = float16_optimizer.keep_if(skipped, new_params, params)
            opt_state = float16_optimizer.keep_if(skipped, opt_state, state.opt_state)
        return state.replace(step=state.step + 1, params=new_params, opt_state=opt_state), metrics

    step.compute_grads = compute_grads  # (state, batch[, extra]) -> (grads, report, tokens)
    return step


def _apply_gradients(tx, state: TrainState, grads: Any, report: dict, layout: StepLayout, buffers: Any,
                     check: bool) -> tuple[Any, Any, Any, jax.Array, dict]:
    """The optimizer's part of the step: ``(new_params, opt_state, grads, skipped, extras)``,
    ``grads`` unscaled (fp16: divided by the loss scale; what the metrics report).

    Mixed precision (``tx`` a :class:`Float16Optimizer`): the optimizer updates the float32
    main parameters and the model's are cast from them; buffers are updated on the main
    parameters; an iteration with non-finite (unscaled) gradients or, with ``check``, loss is
    skipped inside :func:`jmegatron.training.float16_optimizer.apply_gradients` (fp16: the
    scale backs off). Otherwise ``tx.update`` on the parameters in the gradient layout, and
    ``skipped`` is True when, with ``check`` (Megatron's ``check_for_nan_in_loss_and_grad``),
    the loss or a gradient is not finite; the caller then keeps parameters, moments and the
    schedule's count (``state.step`` still advances, the learning-rate schedule does not:
    Megatron). ``extras``: float32 ``skipped`` / ``nan`` (the loss is not finite, Megatron's
    nan iteration), and ``loss_scale`` under mixed precision (1 without fp16 scaling)."""
    nan = jnp.logical_not(jnp.isfinite(report["loss"]))
    is_max = buffers.is_max if buffers is not None else (lambda path: False)
    if isinstance(tx, Float16Optimizer):
        finalize = None if buffers is None else (lambda main, g: buffers.update(main, report, g))
        new_params, opt_state, grads, skipped = float16_optimizer.apply_gradients(
            tx, grads, state.opt_state, finalize, observed=is_max, check_finite=check, skip=nan if check else None)
        new_params = jax.lax.with_sharding_constraint(new_params, layout.param_shardings)
        extras = {"loss_scale": (jnp.float32(1.0) if state.opt_state.grad_scaler is None
                                 else state.opt_state.grad_scaler.scale)}
    else:
        params = jax.lax.with_sharding_constraint(state.params, layout.grad_shardings)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        new_params, extras = optax.apply_updates(params, updates), {}
        skipped = (jnp.logical_or(nan, jnp.logical_not(float16_optimizer.all_finite(grads, is_max)))
                   if check else jnp.bool_(False))
    extras.update(skipped=skipped.astype(jnp.float32), nan=nan.astype(jnp.float32))
    return new_params, opt_state, grads, skipped, extras


def _metrics(report: dict, grads: Any, tokens: jax.Array, lr: Any, extras: dict, stop: Any, buffers: Any,
             pipeline_layout: Any, log_num_zeros_in_grad: bool) -> dict:
    """The step's metrics (float32 scalars): ``loss`` (what was optimised) and the report's
    entries (``lm_loss`` for the language model), each a mean over micro-batches;
    ``grad_norm`` (before clipping, buffers left out); ``lr`` (the rate this step applied);
    ``num_tokens`` (unmasked tokens of the whole step); ``extras`` (:func:`_apply_gradients`);
    with ``log_num_zeros_in_grad`` ``num_zeros`` (zero entries of the reduced gradients
    before clipping, buffers and an uneven ``pipeline_layout``'s padding slots left out:
    Megatron's ``count_zeros_fp32``); with ``stop`` (float32 ``[mesh size]``, laid out by
    :func:`jmegatron.parallel.rules.stop_flag_sharding`: each process's devices hold its
    0/1 stop request) ``stop``, the maximum over all processes, so the ranks agree to stop
    inside the step's program (:mod:`jmegatron.training.loop`)."""
    def trained(path):
        return buffers is None or not buffers.is_buffer(path)

    masked = jax.tree_util.tree_map_with_path(lambda path, g: g if trained(path) else jnp.zeros((), g.dtype), grads)
    metrics = dict(report, grad_norm=optax.tree.norm(masked), lr=jnp.asarray(lr, jnp.float32),
                   num_tokens=tokens, **extras)
    if stop is not None:  # every process's request: the max is one all-reduce inside the step
        metrics["stop"] = jnp.max(stop).astype(jnp.float32)
    if log_num_zeros_in_grad:  # int32 per tensor, float32 over tensors, as Megatron's float count
        metrics["num_zeros"] = sum(jnp.sum(g == 0, dtype=jnp.int32).astype(jnp.float32)
                                   for path, g in jax.tree_util.tree_leaves_with_path(grads) if trained(path))
        if pipeline_layout is not None and pipeline_layout.uneven:  # not the padding slots' zeros
            pads = int((pipeline_layout.order() < 0).sum())
            metrics["num_zeros"] -= float(sum(pads * np.prod(g.shape[1:]) for path, g in
                                              jax.tree_util.tree_leaves_with_path(grads[STAGE_LOCAL_KEY])
                                              if trained(path)))
    return metrics


def make_eval_step(model: nn.Module, masked_loss: Callable, rules: Sequence = rules_lib.DEFAULT_RULES,
                   layer_order: Any = None):
    """The un-jitted eval step ``(params, batch) -> (loss_sum, token_count)`` (float32), the
    sums over micro-batches of ``masked_loss(logits, labels, loss_mask) -> (sum of masked
    token losses, unmasked tokens)`` (float32 scalars;
    :func:`jmegatron.training.losses.masked_cross_entropy` for the language model) of the
    model run deterministically. ``layer_order`` (int ``[num_layers]``, optional): the stacked decoder layers are taken in
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
            total, count = masked_loss(logits, micro["labels"], micro["loss_mask"])
            return (carry[0] + total, carry[1] + count), None

        (total, count), _ = jax.lax.scan(body, (jnp.float32(0.0), jnp.float32(0.0)), batch)
        return total, count

    return step


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
    processes comes back as metric ``stop``; None passes "no request". ``lower`` and
    ``compiled`` (the kept program for these arguments:
    :meth:`jmegatron.compilation.AnnouncedJit.compiled`) take the same arguments; other
    attributes (``_cache_size``, ``compile_seconds``, ``programs``, ...) are the
    :class:`jmegatron.compilation.AnnouncedJit`'s: one program per batch shape, each
    compilation announced with its time."""

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

    def compiled(self, state, batch, *extra, stop: Optional[bool] = None):
        return self.jitted.compiled(state, batch, *extra, self.flags(bool(stop)))

    def __getattr__(self, name):  # (only for names not set above: _cache_size, eval_shape, ...)
        if name in ("jitted", "mesh", "_flags"):
            raise AttributeError(name)
        return getattr(self.jitted, name)


def jit_train_step(step_fn, mesh: Mesh, state_shardings: TrainState, extra_shardings: Any = None,
                   segment_ids: bool = False, batch_keys: tuple = ()) -> TrainStep:
    """jit with the state donated and laid out by ``state_shardings``; ``segment_ids``: the
    batch has that key, ``batch_keys`` the forward step's own ones
    (:func:`jmegatron.parallel.rules.batch_shardings`). The stop flags (:class:`TrainStep`) go
    in last, laid out by :func:`jmegatron.parallel.rules.stop_flag_sharding`."""
    in_shardings = (state_shardings, batch_shardings(mesh, segment_ids, batch_keys))
    if extra_shardings is not None:
        in_shardings += (extra_shardings,)
        fn = step_fn
    else:
        fn = lambda state, batch, stop: step_fn(state, batch, None, stop)  # noqa: E731
    in_shardings += (stop_flag_sharding(mesh),)
    jitted = jax.jit(fn, in_shardings=in_shardings,
                     out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())), donate_argnums=(0,))
    return TrainStep(AnnouncedJit(jitted, functools.partial(_batch_program, "the train step")), mesh)


def _batch_program(name: str, arguments: dict) -> str:
    """``<name> for tokens [num_micro, rows, seq]`` (a step's announcement: jmegatron.compilation)."""
    return f"{name} for tokens {shape_text(arguments['batch']['tokens'])}"


def jit_eval_step(step_fn, mesh: Mesh, param_shardings: Any, segment_ids: bool = False):
    """jit the eval step with the parameters laid out by ``param_shardings``; ``segment_ids``:
    the batch has that key (:func:`jmegatron.parallel.rules.batch_shardings`)."""
    return AnnouncedJit(jax.jit(step_fn, in_shardings=(param_shardings, batch_shardings(mesh, segment_ids)),
                                out_shardings=NamedSharding(mesh, PartitionSpec())),
                        functools.partial(_batch_program, "the evaluation step"))
