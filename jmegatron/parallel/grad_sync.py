"""Gradient synchronisation of the train step: the role of Megatron-Core's
``distributed/finalize_model_grads.py`` with the ``DistributedDataParallel`` gradient
buffers it finishes, written for one ``shard_map``.

The train step runs its micro-batch loop inside a ``shard_map`` whose *manual* axes are
the ones that split the batch or the model's stages (:meth:`GradSync.manual_axes`):
``data``; ``expert`` under expert parallelism (Megatron carves it out of data
parallelism: the batch splits over data x expert); ``context`` under context parallelism
(each rank holds its load-balanced slots of every sequence); ``pipeline`` under pipeline
parallelism. ``tensor`` stays automatic (GSPMD, driven by the logical-axis rules).

Inside, each rank accumulates its own gradients over the micro-batches with no
communication (Megatron's ``no_sync``); :meth:`GradSync.reduce` then reduces them once:

* parameters replicated over pipeline stages (all but the stacked decoder layers: the
  embeddings, final norm) sum their stages' partial gradients (Megatron's
  ``_allreduce_embedding_grads`` for the tied word embeddings, generalised);
* every parameter is replicated over the context ranks: its gradient sums over
  ``context`` (Megatron's DP x CP gradient group);
* a dense parameter sums over ``expert`` too (the expert ranks are data ranks for it), an
  expert's weight over ``data`` only (Megatron's expert-data-parallel group);
* over ``data``: an all-reduce (``psum``), or, under the distributed optimizer (ZeRO-1,
  :mod:`jmegatron.parallel.distributed_optimizer`), a reduce-scatter into the gradient
  shardings (:meth:`GradSync.reduce_scatter`, outside the data-only shard_map with every
  mesh axis manual: inside it XLA replicates tensor-sharded operands of a
  ``psum_scatter`` first). Its axes come from ``distributed_optimizer.zero1_axes``, the
  rule that laid the state out;
* FSDP (parameters sharded over data, x context under context parallelism): each
  micro-batch all-gathers the parameters (:meth:`GradSync.gather`), whose transpose
  reduce-scatters their gradients: nothing is left to reduce;
* leaves marked ``is_max`` (FP8's observed amaxes) combine with ``max`` over micro-batches,
  stages and ranks (:func:`combine_grads`), never a sum or mean.

Gradients and the report are means over micro-batches. With one data-parallel rank every
data collective is the identity and is skipped, not emitted: XLA's SPMD partitioner
rejects an all-reduce over a size-1 manual axis while other mesh axes stay automatic.

Dropout draws from global sample numbers: :meth:`GradSync.sample_offset` is the one formula
for the first row of a rank's micro-batch, used by the unpipelined loop and the pipeline
stages alike (:mod:`jmegatron.parallel.schedules`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jmegatron.parallel import rules as rules_lib
from jmegatron.parallel.distributed_optimizer import data_dim, is_expert_sharding, zero1_axes
from jmegatron.parallel.rules import CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS, PIPELINE_AXIS
from jmegatron.parallel.schedules import STAGE_LOCAL_KEY


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a train step is laid out on the mesh (Megatron's DistributedDataParallelConfig
    and parallel sizes, as shardings).

    ``param_shardings`` / ``grad_shardings``: NamedSharding trees of the parameters and of
    the gradients the optimizer takes (the same, or ZeRO-1's,
    :func:`jmegatron.parallel.distributed_optimizer.zero1_shardings`); ``rules``: the
    logical-axis rules (:func:`jmegatron.parallel.rules.make_rules`); ``extra_shardings``:
    the layout of the step's untrained extra input (a teacher's parameters; None: none);
    ``pipeline``: (schedule name, pipeline size p, chunks per stage v) or None;
    ``pipeline_layout``: the decoder layers' placement on the stages
    (:class:`jmegatron.parallel.pipeline_layout.PipelineLayout`; None: the even one);
    ``accumulate_grads_in_fp32``: float32 gradient accumulators and reductions for
    bf16 / fp16 parameters (Megatron's ``accumulate_allreduce_grads_in_fp32``), else the
    parameters' dtype."""

    mesh: Mesh
    param_shardings: Any
    grad_shardings: Any
    rules: Sequence = rules_lib.DEFAULT_RULES
    extra_shardings: Any = None
    pipeline: Optional[tuple[str, int, int]] = None
    pipeline_layout: Any = None
    accumulate_grads_in_fp32: bool = True


def combine_grads(max_leaves: Any, a: Any, b: Any) -> Any:
    """Two gradient trees accumulated: ``max`` where ``max_leaves`` (a tree of bools of the
    same structure) is True (observations such as FP8's amaxes), ``a + b`` elsewhere; in
    ``a``'s dtype (the accumulator's)."""
    return jax.tree.map(lambda m, x, y: jnp.maximum(x, y.astype(x.dtype)) if m else x + y.astype(x.dtype),
                        max_leaves, a, b)


def _is_none(x) -> bool:
    return x is None


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


class GradSync:
    """The collectives of one train step's layout (see the module docstring).

    ``layout``: :class:`StepLayout`; ``is_max(path)`` marks the parameter leaves (by
    ``jax.tree_util`` key path) whose gradients are observations combined with max.
    Methods named "inside" run in the shard_map of :meth:`shard_map`."""

    def __init__(self, layout: StepLayout, is_max: Callable[[tuple], bool] = lambda path: False):
        mesh = layout.mesh
        self.layout = layout
        self.mesh = mesh
        self.ep = mesh.shape.get(EXPERT_AXIS, 1)
        self.cp = mesh.shape.get(CONTEXT_AXIS, 1)
        self.dp = rules_lib.data_parallel_size(mesh)  # data x expert: Megatron's data-parallel size
        self.manual = self.manual_axes(mesh, layout.pipeline is not None)
        inner = layout.rules
        for name in self.manual:
            inner = rules_lib.rules_without(inner, name)
        self.inner_rules = inner  # the logical-axis rules inside the shard_map
        # the batch's axes of size > 1: a size-1 manual axis takes no collective, so no value
        # may vary over it either; the context ranks hold slots of the same rows
        self.split = tuple(a for a in ((DATA_AXIS, EXPERT_AXIS) if self.ep > 1 else (DATA_AXIS,))
                           if mesh.shape[a] > 1)
        self.live = self.split + ((CONTEXT_AXIS,) if self.cp > 1 else ())
        self.single = self.dp * self.cp == 1
        ps, gs, xs = layout.param_shardings, layout.grad_shardings, layout.extra_shardings
        self.max_leaves = jax.tree_util.tree_map_with_path(lambda path, _: is_max(path), ps)
        self.is_expert = jax.tree.map(is_expert_sharding, ps)
        self.param_dims, self.grad_dims = jax.tree.map(data_dim, ps), jax.tree.map(data_dim, gs)
        self.extra_dims = jax.tree.map(data_dim, xs)
        self.param_groups = jax.tree.map(zero1_axes, ps, self.is_expert)  # FSDP gathers
        self.zero_axes = jax.tree.map(zero1_axes, gs, self.is_expert)  # ZeRO-1 reduce-scatters
        self.extra_groups = jax.tree.map(lambda s: zero1_axes(s, is_expert_sharding(s)), xs)
        self.zero1 = jax.tree.map(lambda pd, gd: pd is None and gd is not None, self.param_dims, self.grad_dims,
                                  is_leaf=_is_none)

    @staticmethod
    def manual_axes(mesh: Mesh, pipeline: bool) -> tuple[str, ...]:
        """The shard_map's manual axes: data; expert / context where they have size > 1;
        pipeline under pipeline parallelism."""
        return ((DATA_AXIS,) + ((EXPERT_AXIS,) if mesh.shape.get(EXPERT_AXIS, 1) > 1 else ())
                + ((CONTEXT_AXIS,) if mesh.shape.get(CONTEXT_AXIS, 1) > 1 else ())
                + ((PIPELINE_AXIS,) if pipeline else ()))

    # ----------------------------------------------------------------- inside the shard_map
    def data_sum(self, x: Any, context_only: bool = False) -> Any:
        """Inside: ``x`` summed over every rank that splits the batch (data, expert, context);
        identity with one. ``context_only``: over the context ranks alone, the ranks that
        hold the slots of this rank's rows (one Megatron micro-batch on one data rank)."""
        if context_only:
            return jax.lax.psum(x, CONTEXT_AXIS) if self.cp > 1 else x
        return x if self.single else jax.lax.psum(x, self.live)

    def sample_offset(self, microbatch: Any, local_rows: int) -> jax.Array:
        """Inside: int32 scalar, the global sample number of this rank's first row of
        micro-batch ``microbatch`` (int or traced int32): ``(microbatch * dp + rank) *
        local_rows``, ``rank`` this rank's index over data x expert (data-major, as
        :func:`jmegatron.parallel.rules.batch_axes` splits the batch). Dropout masks drawn
        from it (:mod:`jmegatron.models.dropout`) are the same in every layout."""
        split = self.split
        rank = (jax.lax.axis_index(split if len(split) > 1 else split[0])) if split else 0
        return jnp.asarray((microbatch * self.dp + rank) * local_rows, jnp.int32)

    def varying(self, params: Any) -> Any:
        """Inside: the data-replicated parameters cast to "varying" over the ranks that split
        the batch, so autodiff leaves their gradients as this rank's partial sums (the one
        reduction is :meth:`reduce`); an expert's weight is not cast over ``expert``."""
        def cast(p, d, expert_leaf):
            over = tuple(a for a in self.live if not (expert_leaf and a == EXPERT_AXIS))
            return p if d is not None or not over else jax.lax.pcast(p, over, to="varying")

        return jax.tree.map(cast, params, self.param_dims, self.is_expert, is_leaf=_is_none)

    @staticmethod
    def _gather(p, d, group):
        if d is None or not group:
            return p
        return jax.lax.all_gather(p, group[0] if len(group) == 1 else group, axis=d, tiled=True)

    def gather(self, params: Any, extra: Any) -> tuple[Any, Any]:
        """Inside: FSDP's all-gather of this rank's parameter (and extra input) shards into
        whole leaves; leaves not split over data pass unchanged."""
        params = jax.tree.map(self._gather, params, self.param_dims, self.param_groups, is_leaf=_is_none)
        return params, jax.tree.map(self._gather, extra, self.extra_dims, self.extra_groups, is_leaf=_is_none)

    def accumulator(self, p: jax.Array) -> jax.Array:
        """Inside: zeros for parameter ``p``'s gradient accumulator (Megatron's ``main_grad``
        buffer): float32 for floating parameters under ``accumulate_grads_in_fp32``, else
        ``p``'s dtype; it keeps ``p``'s varying manual axes."""
        fp32 = self.layout.accumulate_grads_in_fp32 and jnp.issubdtype(p.dtype, jnp.floating)
        return jnp.zeros_like(p, dtype=jnp.float32 if fp32 else p.dtype)

    def combine(self, a: Any, b: Any) -> Any:
        """:func:`combine_grads` with this step's max leaves."""
        return combine_grads(self.max_leaves, a, b)

    def _psum_over(self, x, name):
        return x if self.mesh.shape[name] == 1 else jax.lax.psum(x, name)

    def _reduce_leaf(self, g, pd, gd, expert_leaf, zax, mx):
        if mx:  # an observation (FP8 amax): the max over every rank that splits the batch
            return g if self.single or not self.live else jax.lax.pmax(g, self.live)
        if self.cp > 1 and CONTEXT_AXIS not in zax:  # every parameter is replicated over the context ranks
            g = jax.lax.psum(g, CONTEXT_AXIS)  # (ZeRO-1 over context: in the reduce-scatter)
        if pd is not None:  # FSDP: reduce-scattered by the all-gather's transpose (over context too)
            return g
        if not expert_leaf and self.ep > 1 and EXPERT_AXIS not in zax:  # dense: the expert ranks are data ranks
            g = self._psum_over(g, EXPERT_AXIS)
        if gd is None:
            return self._psum_over(g, DATA_AXIS)
        return g[None]  # ZeRO-1: this rank's partial sum, reduce-scattered by reduce_scatter

    def reduce(self, grads: Any, report: dict, num_micro: int) -> tuple[Any, dict]:
        """Inside: (gradients, report) of a rank's micro-batch loop (sums over its
        ``num_micro`` micro-batches) reduced over stages and ranks and turned into means
        over micro-batches. ZeRO-1 leaves come out stacked ``[1, ...]`` (this rank's partial
        sum) for :meth:`reduce_scatter`."""
        mx = self.max_leaves
        if self.layout.pipeline is not None:  # the parameters replicated over stages
            over = lambda a, m: jax.lax.pmax(a, PIPELINE_AXIS) if m else jax.lax.psum(a, PIPELINE_AXIS)  # noqa: E731
            grads = {k: (g if k == STAGE_LOCAL_KEY else jax.tree.map(over, g, mx[k])) for k, g in grads.items()}
        grads = jax.tree.map(self._reduce_leaf, grads, self.param_dims, self.grad_dims, self.is_expert,
                             self.zero_axes, mx, is_leaf=_is_none)
        grads = jax.tree.map(lambda g, m: g if m else g / num_micro, grads, mx)
        return grads, jax.tree.map(lambda r: r / num_micro, report)

    # ----------------------------------------------------------------- around the shard_map
    def _stacked_entry(self, zax):
        return (zax[0] if len(zax) == 1 else zax) if zax else DATA_AXIS

    def shard_map(self, fn: Callable) -> Callable:
        """``fn(params, batch, rng, extra, loss_scale) -> (grads, report, tokens)`` as a
        ``shard_map`` over the manual axes: params / extra laid out by the layout's
        shardings, the batch ``[m, rows, seq]`` with rows over the split axes and the
        sequence over context; grads come out in the gradient layout (ZeRO-1 leaves stacked
        ``[ranks, ...]``: :meth:`reduce_scatter` finishes them), report and tokens
        replicated."""
        lay, manual = self.layout, self.manual
        only = lambda s: rules_lib.spec_only(s.spec, manual)  # noqa: E731
        split, cp = self.split, self.cp
        rows = (split if len(split) > 1 else split[0]) if split else (None if cp > 1 else DATA_AXIS)
        batch_spec = PartitionSpec(None, rows, CONTEXT_AXIS if cp > 1 else None)
        out_grads = jax.tree.map(
            lambda z, gs, ps, zax: PartitionSpec(self._stacked_entry(zax),
                                                 *rules_lib.spec_only(ps.spec, (PIPELINE_AXIS, EXPERT_AXIS)))
            if z else only(gs), self.zero1, lay.grad_shardings, lay.param_shardings, self.zero_axes, is_leaf=_is_axes)
        return jax.shard_map(
            fn, mesh=self.mesh, axis_names=set(manual), check_vma=not self.single,
            in_specs=(jax.tree.map(only, lay.param_shardings), batch_spec, PartitionSpec(),
                      jax.tree.map(only, lay.extra_shardings), PartitionSpec()),  # batch_spec: every key
            out_specs=(out_grads, PartitionSpec(), PartitionSpec()))

    @staticmethod
    def _scatter(stacked, gd, zax):
        if not zax:
            return stacked[0]
        return jax.lax.psum_scatter(stacked[0], zax, scatter_dimension=gd, tiled=True)

    def reduce_scatter(self, grads: Any) -> Any:
        """ZeRO-1's reduce-scatter of the stacked partial sums :meth:`shard_map` returns into
        the gradient shardings (each leaf in its own shard_map with every mesh axis manual);
        other leaves unchanged."""
        lay = self.layout
        leaves, treedef = jax.tree.flatten(grads)
        flags, dims = jax.tree.leaves(self.zero1), jax.tree.leaves(self.grad_dims, is_leaf=_is_none)
        p_sh, g_sh = jax.tree.leaves(lay.param_shardings), jax.tree.leaves(lay.grad_shardings)
        zaxes = jax.tree.leaves(self.zero_axes, is_leaf=_is_axes)
        out = []
        for leaf, z, gd, ps, gs, zax in zip(leaves, flags, dims, p_sh, g_sh, zaxes):
            if z:
                leaf = jax.shard_map(functools.partial(self._scatter, gd=gd, zax=zax), mesh=self.mesh,
                                     in_specs=PartitionSpec(self._stacked_entry(zax), *ps.spec),
                                     out_specs=gs.spec)(leaf)
            out.append(leaf)
        return jax.tree.unflatten(treedef, out)
