"""Pipeline-parallel schedules as explicit SPMD programs: GPipe, 1F1B and interleaved 1F1B.

The role of Megatron's megatron/core/pipeline_parallel/schedules.py
(``forward_backward_pipelining_without_interleaving``,
``forward_backward_pipelining_with_interleaving``), written for one SPMD program: every
pipeline stage runs the same ``lax.scan`` over *ticks* inside a ``shard_map`` whose
``pipeline`` axis is manual. In each tick a stage does at most one forward of a
(micro-batch, model chunk) and at most one backward (the chunk's forward recomputed under
``jax.vjp``), each under ``lax.cond`` so an idle slot costs nothing; then activations move one
stage on and their gradients one stage back with ``jax.lax.ppermute`` over a ring (stage
``p - 1``'s output of chunk ``c`` feeds stage 0's chunk ``c + 1``).

**Timing.** Forward *units* ``u = 0 .. m*v - 1`` are taken in Megatron's interleaved order
(groups of ``p`` micro-batches, chunk by chunk inside a group: unit ``u`` is micro-batch
``(u // (p v)) p + u % p`` of chunk ``(u % (p v)) // p``); stage ``s`` runs forward unit
``u`` at tick ``u + s``, so the ring delivers each input exactly when it is needed.
Backward units run the chunks in reverse; stage ``s`` runs backward unit ``u`` at tick
``u + (p - 1 - s) + offset``:

* 1F1B / interleaved 1F1B: ``offset = p v - 1``, the last stage runs the backward of its
  last chunk in the same tick as the forward (forward first). Ticks cost ``(m v + p - 1)``
  chunk forward+backward times: the bubble is Megatron's ``(p - 1) / (v m + p - 1)``.
  Stage ``s`` holds at most ``2 (p - s) - 1`` micro-batches' stage inputs for v = 1,
  independent of ``m`` (Megatron's 1F1B: ``p - s``; a forward and its backward are
  ``2 (p - 1 - s)`` one-tick hops apart here, and the stage runs a forward every tick
  meanwhile; docs/PIPELINE.md).
* GPipe: ``offset = m + p - 1``: every forward first, then every backward; ``m``
  micro-batches of activations per stage, the same bubble as 1F1B.

**Stage function.** ``run_schedule`` is generic over three functions of a micro-batch:
``embed`` (the first stage's input), ``chunk`` (the layers of model chunk ``c`` on this
stage) and ``head`` (the last stage's loss); a forward step's ``pipeline_stages(ctx)``
supplies them from a :class:`StageContext`
(:func:`jmegatron.training.forward_step.lm_pipeline_stages` the GPT ones). A forward keeps only its stage input ``[rows, seq, hidden]`` in one of
``num_slots`` slots; the backward recomputes the chunk's forward under ``jax.vjp``
(Megatron's full activation recomputation at stage granularity: one more chunk forward
per backward). Keeping ``jax.vjp``'s residuals instead is the next step
(docs/PIPELINE.md: their structure must be known before the ``lax.scan`` is traced, and
the parameters among them must not be copied per slot).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.parallel.pipeline_layout import PipelineLayout
from jmegatron.parallel.rules import PIPELINE_AXIS

# The parameters whose leaves are stacked [slots, ...] and split over the pipeline stages
# (each stage holds its own layers); every other parameter is replicated over the stages.
STAGE_LOCAL_KEY = "decoder_layers"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

# columns of PipelineSchedule.table
F_MB, F_CHUNK, F_SLOT, B_MB, B_CHUNK, B_SLOT = range(6)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A static schedule: ``table[t, s]`` (int32 ``[num_ticks, p, 6]``) gives stage ``s``'s
    forward (micro-batch, chunk, slot) and backward (micro-batch, chunk, slot) in tick
    ``t``, -1 where the stage is idle in that half of the tick."""

    name: str
    pipeline_size: int  # p
    num_microbatches: int  # m
    virtual_size: int  # v
    table: np.ndarray
    num_slots: int

    @property
    def num_ticks(self) -> int:
        return self.table.shape[0]

    def busy_slots(self) -> int:
        """Stage-slots doing work (a forward or backward of one chunk): ``2 m v p``."""
        return int((self.table[:, :, F_MB] >= 0).sum() + (self.table[:, :, B_MB] >= 0).sum())

    def time_slots(self) -> int:
        """Length of the schedule in chunk-forward+backward-halves when every tick takes as long as its
        busiest half: ticks with both a forward and a backward somewhere count 2, others 1."""
        f_any = (self.table[:, :, F_MB] >= 0).any(axis=1)
        b_any = (self.table[:, :, B_MB] >= 0).any(axis=1)
        return int(f_any.sum() + b_any.sum())

    def bubble_fraction(self) -> float:
        """Idle stage-slots over all stage-slots, with a forward and a backward half-slot
        each costing one unit (Megatron's assumption t_f = t_b is not needed: the halves
        are counted separately)."""
        total = self.time_slots() * self.pipeline_size
        return 1.0 - self.busy_slots() / total

    def megatron_bubble_fraction(self) -> float:
        """Megatron's analytic bubble: ``(p - 1) / (v m + p - 1)`` (v = 1 for GPipe/1F1B)."""
        p, m, v = self.pipeline_size, self.num_microbatches, self.virtual_size
        return (p - 1) / (v * m + p - 1)

    def peak_live_activations(self) -> list[int]:
        """Per stage, the most (micro-batch, chunk) forwards whose backward has not run
        yet at any point (after a tick's forward, before its backward)."""
        out = []
        for s in range(self.pipeline_size):
            live = peak = 0
            for t in range(self.num_ticks):
                live += int(self.table[t, s, F_MB] >= 0)
                peak = max(peak, live)
                live -= int(self.table[t, s, B_MB] >= 0)
            out.append(peak)
        return out

    def ppermutes_per_step(self) -> int:
        """Collective permutes the program runs: one forward and one backward per tick."""
        return 2 * self.num_ticks


def _unit(u: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    group, w = divmod(u, p * v)
    chunk = w // p
    return group * p + w % p, (v - 1 - chunk if backward else chunk)


def build_schedule(name: str, pipeline_size: int, num_microbatches: int, virtual_size: int = 1) -> PipelineSchedule:
    """The tick table of schedule ``name`` ("gpipe", "1f1b", "interleaved_1f1b") for ``p``
    stages, ``m`` micro-batches and ``v`` model chunks per stage.

    Raises ValueError for an unknown name, v > 1 with a non-interleaved schedule, or (as
    Megatron) interleaving with ``m`` not a multiple of ``p``."""
    p, m, v = pipeline_size, num_microbatches, virtual_size
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={name!r} must be one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline size {p}, micro-batches {m} and virtual size {v} must be >= 1")
    if (v > 1) != (name == "interleaved_1f1b"):
        raise ValueError(f"pipeline_schedule={name!r} with virtual_pipeline_model_parallel_size={v}: "
                         f"interleaving needs v > 1 and v > 1 needs 'interleaved_1f1b'")
    if v > 1 and m % p:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple "
                         f"of pipeline_model_parallel_size ({p}), as Megatron requires; change global_batch_size")
    units = m * v
    offset = (m + p - 1) if name == "gpipe" else (p * v - 1)
    ticks = units + p - 1 + offset
    table = np.full((ticks, p, 6), -1, np.int32)
    for s in range(p):
        for u in range(units):
            mb, c = _unit(u, p, v, backward=False)
            table[u + s, s, F_MB], table[u + s, s, F_CHUNK] = mb, c
            mb, c = _unit(u, p, v, backward=True)
            t = u + (p - 1 - s) + offset
            table[t, s, B_MB], table[t, s, B_CHUNK] = mb, c
    # residual slots: lowest free slot at each forward, freed by the matching backward
    num_slots = 0
    for s in range(p):
        free, held = [], {}
        for t in range(ticks):
            if table[t, s, F_MB] >= 0:
                key = (int(table[t, s, F_MB]), int(table[t, s, F_CHUNK]))
                slot = min(free) if free else len(held) + len(free)
                if free:
                    free.remove(slot)
                held[key] = slot
                table[t, s, F_SLOT] = slot
                num_slots = max(num_slots, slot + 1)
            if table[t, s, B_MB] >= 0:
                key = (int(table[t, s, B_MB]), int(table[t, s, B_CHUNK]))
                if key not in held:
                    raise AssertionError(f"schedule {name}: backward of {key} on stage {s} before its forward")
                table[t, s, B_SLOT] = held.pop(key)
                free.append(int(table[t, s, B_SLOT]))
    return PipelineSchedule(name, p, m, v, table, num_slots)


def manual_axes(x) -> frozenset:
    """The manual mesh axes array ``x`` varies over (empty outside shard_map's type checking)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def as_varying(tree, axes: frozenset):
    """``tree`` with every leaf varying over the manual mesh ``axes`` (shard_map's type
    check: both branches of a ``lax.cond`` must agree)."""
    def cast(x):
        missing = tuple(sorted(axes - manual_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)



def _add_grads(acc: Any, d: Any) -> Any:
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, d)


def run_schedule(schedule: PipelineSchedule, params: Any, batch: Any, *,
                 embed: Callable, chunk: Callable, head: Callable, activation: Any,
                 report_zeros: dict, loss_scale: Any = None, grad_zeros: Optional[Callable] = None,
                 combine: Optional[Callable] = None) -> tuple[Any, jax.Array, dict]:
    """Run ``schedule`` on this stage (inside a ``shard_map`` with :data:`PIPELINE_AXIS`
    manual). Returns ``(grads, loss_sum, report_sums)``: the gradients of the summed
    micro-batch losses with respect to ``params`` as this stage sees them (layer
    parameters: its own; parameters replicated over stages: this stage's partial sum, to
    be ``psum``-ed over the pipeline axis), and this stage's sums over micro-batches of
    the loss and of each report entry (the head's on the last stage, chunk losses wherever
    they arise, zeros elsewhere; the caller ``psum``-s them over the pipeline axis).

    ``batch``: pytree of ``[m, ...]`` arrays (every stage gets all of it).
    ``activation``: a pytree of ShapeDtypeStructs, what one stage sends the next (for
    distillation the student's and the teacher's hidden states).
    ``embed(params, micro) -> x`` (``activation``'s structure) for chunk 0 on stage 0;
    ``chunk(params, x, micro, c) -> (x, side)`` the layers of this stage's chunk ``c``
    (traced int) and anything the head needs that is not sent on (e.g. intermediate
    outputs; None if nothing); a chunk whose layers add to the loss (an MoE model's router
    losses) returns ``(x, side, (loss, report))`` instead: a float32 scalar added to the
    micro-batch's loss on every stage and chunk, and entries added to the report's (a
    subset of ``report_zeros``' keys). ``head(params, x, side, micro) -> (loss, report)`` on
    the last chunk of the last stage, float32 (``report_zeros`` gives the report's
    structure). ``micro`` is ``batch`` at one micro-batch, plus ``"microbatch"`` (its int32
    index). ``loss_scale`` (float32 [], optional): the backward starts from d loss =
    ``loss_scale`` instead of 1 (fp16 loss scaling; the returned losses are unscaled).
    ``grad_zeros(p)``: the gradient accumulator of parameter ``p`` (default zeros like
    ``p``; float32 for bf16 parameters under ``accumulate_allreduce_grads_in_fp32``).
    ``combine(grads, dparams)`` accumulates a backward's parameter gradients (default the
    sum in the accumulator's dtype; the train step's takes the max of FP8's observed amaxes).
    """
    combine = combine or (lambda a, b: jax.tree.map(jnp.add, a, b))
    p, v = schedule.pipeline_size, schedule.virtual_size
    stage = jax.lax.axis_index(PIPELINE_AXIS)
    table = jnp.asarray(schedule.table)
    fwd_perm = [(i, (i + 1) % p) for i in range(p)]
    bwd_perm = [(i, (i - 1) % p) for i in range(p)]
    axes = frozenset().union(*(manual_axes(a) for a in jax.tree.leaves(params)))  # the manual axes in play
    zeros_x = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), activation)

    def micro_at(mb):
        micro = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, mb, keepdims=False), batch)
        return dict(micro, microbatch=mb)

    def stage_fn(prm, x_in, mb, c):
        micro = micro_at(mb)
        first = (stage == 0) & (c == 0)
        last = (stage == p - 1) & (c == v - 1)
        # under cond: the other stages neither gather nor scatter-add into the embedding
        x = jax.lax.cond(first,
                         lambda: as_varying(jax.tree.map(lambda e, a: e.astype(a.dtype), embed(prm, micro), x_in), axes),
                         lambda: as_varying(x_in, axes))
        out = chunk(prm, x, micro, c)
        y, side = out[:2]
        loss, report = jax.lax.cond(last, lambda: as_varying(head(prm, y, side, micro), axes),
                                    lambda: as_varying((jnp.float32(0.0), report_zeros), axes))
        if len(out) == 3:  # the chunk's own loss terms (every stage)
            chunk_loss, chunk_report = out[2]
            loss = loss + chunk_loss
            report = {k: (r + chunk_report[k] if k in chunk_report else r) for k, r in report.items()}
        return (y, loss), report

    # A forward keeps its stage input; the backward recomputes the stage's forward under
    # jax.vjp (Megatron's full recomputation, at stage granularity): see the module docstring.
    stash0 = jax.tree.map(lambda a: jnp.zeros((schedule.num_slots,) + a.shape, a.dtype), activation)

    def tick(carry, t):
        act_in, grad_in, stash, grads, loss_sum, report_sum = carry
        row = table[t, stage]
        f_mb, f_c, f_slot, b_mb, b_c, b_slot = (row[i] for i in range(6))

        def do_forward(operands):
            x_in, stash, prm = operands
            (y, loss), report = stage_fn(prm, x_in, f_mb, f_c)
            stash = jax.tree.map(
                lambda buf, a: jax.lax.dynamic_update_index_in_dim(buf, as_varying(a, manual_axes(buf)), f_slot, 0), stash, x_in)
            return as_varying((y, loss, report, stash), axes)

        def skip_forward(operands):
            return as_varying((zeros_x, jnp.float32(0.0), report_zeros, operands[1]), axes)

        y, loss, report, stash = jax.lax.cond(f_mb >= 0, do_forward, skip_forward, (act_in, stash, params))
        loss_sum = loss_sum + loss
        report_sum = jax.tree.map(jnp.add, report_sum, report)

        def do_backward(operands):
            g_in, stash, grads, prm = operands
            x_in = jax.tree.map(lambda buf: jax.lax.dynamic_index_in_dim(buf, b_slot, keepdims=False), stash)
            _, vjp_fn, _ = jax.vjp(lambda a, b: stage_fn(a, b, b_mb, b_c), prm, x_in, has_aux=True)
            last = (stage == p - 1) & (b_c == v - 1)
            dy = jax.tree.map(lambda g: jnp.where(last, jnp.zeros_like(g), g), g_in)
            # d loss = 1 on every stage: chunk losses (router losses) count wherever they arise;
            # elsewhere than the last chunk the head's loss is the constant 0 of its cond
            seed = jnp.float32(1.0) if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
            dparams, dx = vjp_fn((dy, as_varying(seed, axes)))
            dx = jax.tree.map(lambda d, g: d.astype(g.dtype), dx, g_in)
            return as_varying((dx, (combine or _add_grads)(grads, dparams)), axes)

        def skip_backward(operands):
            return as_varying((zeros_x, operands[2]), axes)

        dx, grads = jax.lax.cond(b_mb >= 0, do_backward, skip_backward, (grad_in, stash, grads, params))
        act_next = jax.tree.map(lambda a: jax.lax.ppermute(a, PIPELINE_AXIS, fwd_perm), y)
        grad_next = jax.tree.map(lambda a: jax.lax.ppermute(a, PIPELINE_AXIS, bwd_perm), dx)
        return (act_next, grad_next, stash, grads, loss_sum, report_sum), None

    grads0 = jax.tree.map(grad_zeros or jnp.zeros_like, params)
    carry = as_varying((zeros_x, zeros_x, stash0, grads0, jnp.float32(0.0), report_zeros), axes)
    (_, _, _, grads, loss_sum, report_sum), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.num_ticks))
    return grads, loss_sum, report_sum


@dataclasses.dataclass(frozen=True)
class StageContext:
    """What a pipeline stage provider (a forward step's ``pipeline_stages(ctx)``) gets,
    inside the train step's shard_map: ``cfg`` (the student's ModelConfig),
    ``pipeline_size`` / ``virtual_size``, ``stage`` (traced int32: this device's pipeline
    rank), ``rng`` (the step's dropout key), ``tokens`` (float32 ``[m]``: unmasked tokens of
    each micro-batch over all data ranks), ``sample_offset(micro)`` (int32: the global
    sample number of the micro-batch's first local row), ``local_rows`` / ``seq_length`` (a
    micro-batch's shape on this rank) and ``extra`` (the train step's extra argument, e.g.
    the teacher's parameters); ``data_sum(x, context_only=False)`` (the psum over the ranks
    that split the batch, or over the context ranks alone; identity with one); ``layout`` (the student's :class:`PipelineLayout`; None: the even
    one); ``data_parallel_size`` (the ranks that split the batch, data x expert, and x
    context under context parallelism (each holds its slots of every sequence): a rank's
    share of a mean over ranks is its value over this)."""

    cfg: Any
    pipeline_size: int
    virtual_size: int
    stage: Any
    rng: Any
    tokens: Any
    sample_offset: Callable
    local_rows: int
    seq_length: int
    extra: Any = None
    data_sum: Callable = None
    layout: Any = None
    data_parallel_size: int = 1

    def chunk_layers(self, stacked: Any, chunk: Any, num_layers: int,
                     layout: Any = None) -> tuple[Any, Any, Optional[Any]]:
        """(this stage's chunk ``chunk`` (traced int) of the stacked layers ``stacked`` (this
        stage's slots, leaves ``[v * K, ...]``) as leaves ``[K, ...]``, the model index of its
        first layer (traced int32), the number of its real layers (traced int32; None when
        every chunk is full, no padding slots)) for a model of ``num_layers`` layers laid out
        by ``layout`` (default: ``self.layout`` for the student's ``num_layers``, else the
        even layout)."""
        if layout is None:
            own = self.layout
            layout = own if own is not None and own.num_layers == num_layers else \
                PipelineLayout(num_layers, self.pipeline_size, self.virtual_size)
        k = layout.slots_per_chunk
        layers = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, chunk * k, k), stacked)
        first = jnp.asarray(layout.chunk_first_layer(), jnp.int32)[self.stage, chunk]
        count = jnp.asarray(layout.chunk_layers(), jnp.int32)[self.stage, chunk] if layout.uneven else None
        return layers, first, count


def forward_backward_no_pipelining(grad_fn: Callable, params: Any, batch: Any, *, sample_offset: Callable,
                                   data_sum: Callable, grad_zeros: Callable,
                                   combine: Callable) -> tuple[Any, dict, jax.Array]:
    """Megatron's ``forward_backward_no_pipelining``: the micro-batches one after another in
    a ``lax.scan``, gradients accumulated without communication (Megatron's ``no_sync``).

    ``batch``: this rank's arrays ``[m, local_rows, ...]``. ``grad_fn(params, micro,
    num_tokens) -> ((scaled_loss, (report, loss)), grads)`` for one micro-batch: ``micro``
    is ``batch`` at one micro-batch plus ``sample_offset`` (int32, ``sample_offset(i,
    local_rows)`` of micro-batch ``i``), ``num_tokens`` (float32) its unmasked tokens over
    every rank (``data_sum`` of this rank's). ``grad_zeros(p)`` gives each accumulator,
    ``combine(acc, grads)`` adds a micro-batch's gradients into them.

    Returns ``(grads, report, tokens)``: sums over micro-batches (``report`` with ``loss``
    added; float32 scalars) and the step's unmasked tokens (float32)."""
    num_micro, local_rows = batch["tokens"].shape[:2]

    def with_offset(micro, i):
        return dict(micro, sample_offset=sample_offset(i, local_rows))

    def accumulate(carry, xs):
        grads_acc, report_acc, tokens_acc = carry
        i, micro = xs
        tokens = data_sum(jnp.sum(micro["loss_mask"].astype(jnp.float32)))
        (_, (report, loss)), grads = grad_fn(params, with_offset(micro, i), tokens)
        report = dict(report, loss=loss)
        return (combine(grads_acc, grads), jax.tree.map(jnp.add, report_acc, report), tokens_acc + tokens), None

    zeros = jax.tree.map(grad_zeros, params)
    first = with_offset(jax.tree.map(lambda b: b[0], batch), 0)
    report_shape = jax.eval_shape(lambda: grad_fn(params, first, jnp.float32(1.0))[0][1][0])
    report0 = dict(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), report_shape), loss=jnp.float32(0.0))
    (grads, report, tokens), _ = jax.lax.scan(accumulate, (zeros, report0, jnp.float32(0.0)),
                                              (jnp.arange(num_micro), batch))
    return grads, report, tokens


def forward_backward_pipelining(schedule: PipelineSchedule, stages_fn: Callable, params: Any, batch: Any, *,
                                model_cfg: Any, rng: Any, extra: Any, sample_offset: Callable,
                                data_sum: Callable, data_parallel_size: int, layout: Any = None,
                                loss_scale: Any = None, grad_zeros: Optional[Callable] = None,
                                combine: Optional[Callable] = None) -> tuple[Any, dict, jax.Array]:
    """One data-parallel rank's pipelined ``(grads, report, tokens)`` as
    :func:`forward_backward_no_pipelining` returns them (sums over micro-batches), inside a
    shard_map with :data:`PIPELINE_AXIS` manual (Megatron's
    ``forward_backward_pipelining_with/without_interleaving``).

    ``stages_fn(ctx: StageContext)`` gives the stages (:func:`run_schedule`'s ``embed`` /
    ``chunk`` / ``head`` / ``activation`` / ``report_zeros``). ``params`` as this rank sees
    them; the parameters replicated over stages (all but :data:`STAGE_LOCAL_KEY`) get this
    stage's partial gradients, which the caller sums over the stages
    (:meth:`jmegatron.parallel.grad_sync.GradSync.reduce`). ``sample_offset(microbatch,
    local_rows)``, ``data_sum`` and ``data_parallel_size`` as :class:`StageContext` takes
    them; ``loss_scale`` / ``grad_zeros`` / ``combine``: :func:`run_schedule`. The report
    (with ``loss``) is summed over the data ranks and the stages."""
    num_micro, local_rows, seq = batch["tokens"].shape
    params = {k: (val if k == STAGE_LOCAL_KEY else
                  jax.tree.map(lambda a: jax.lax.pcast(a, PIPELINE_AXIS, to="varying"), val))
              for k, val in params.items()}
    tokens = data_sum(jnp.sum(batch["loss_mask"].astype(jnp.float32), axis=(1, 2)))  # [m]
    ctx = StageContext(cfg=model_cfg, pipeline_size=schedule.pipeline_size, virtual_size=schedule.virtual_size,
                       stage=jax.lax.axis_index(PIPELINE_AXIS), rng=rng, tokens=tokens,
                       sample_offset=lambda micro: sample_offset(micro["microbatch"], local_rows),
                       local_rows=local_rows, seq_length=seq, extra=extra, data_sum=data_sum, layout=layout,
                       data_parallel_size=data_parallel_size)
    grads, loss, report = run_schedule(schedule, params, batch, **stages_fn(ctx), loss_scale=loss_scale,
                                       grad_zeros=grad_zeros, combine=combine)
    total = lambda x: jax.lax.psum(data_sum(x), PIPELINE_AXIS)  # noqa: E731
    return grads, dict(jax.tree.map(total, report), loss=total(loss)), jnp.sum(tokens)
