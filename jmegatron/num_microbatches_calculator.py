"""Number of micro-batches per iteration: constant, or ramped up with the consumed samples.

Follows Megatron-LM ``megatron/core/num_microbatches_calculator.py``
(``ConstantNumMicroBatchesCalculator``, ``RampupBatchsizeNumMicroBatchesCalculator``) and
``update_train_iters`` in ``megatron/training/training.py``, without Megatron's global
calculator: a run builds one with :func:`build_num_microbatches_calculator` and passes it
around. ``decrease_batch_size_if_needed`` is not built (a global batch that does not divide
is a ConfigError instead).

Ramp-up (``rampup_batch_size = (start, increment, ramp_samples)``): the global batch starts
at ``start`` and grows by ``increment`` every ``ramp_samples / num_increments`` consumed
samples (a float, as in Megatron) until it reaches ``global_batch_size``; after
``ramp_samples`` consumed samples it is ``global_batch_size``. The global batch of an
iteration depends only on the samples consumed before it, so a resumed run (which restores
``consumed_train_samples``) continues the ramp exactly.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence


class NumMicroBatchesCalculatorError(ValueError):
    """Batch sizes that cannot be split into micro-batches; the message names the fields."""


class ConstantNumMicroBatchesCalculator:
    """``global_batch_size / (micro_batch_size * data_parallel_size)`` micro-batches always.

    Raises NumMicroBatchesCalculatorError when the global batch is not a positive multiple
    of ``micro_batch_size * data_parallel_size``.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        rows = micro_batch_size * data_parallel_size
        if global_batch_size <= 0 or global_batch_size % rows:
            raise NumMicroBatchesCalculatorError(
                f"config.global_batch_size={global_batch_size} is not a positive multiple of "
                f"config.micro_batch_size={micro_batch_size} x data_parallel_size={data_parallel_size}.")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.current_global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // rows

    def update(self, consumed_samples: int) -> None:
        """Nothing changes with a constant batch."""

    def get(self) -> int:
        """Number of micro-batches of the current iteration."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """Samples of the current iteration."""
        return self.current_global_batch_size

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples``."""
        return self.global_batch_size

    def stages(self) -> list[tuple[int, int, int]]:
        """``[(first iteration index, consumed samples before it, global batch)]``, one row per
        run of equal global batches (one row here)."""
        return [(0, 0, self.global_batch_size)]


class RampupBatchsizeNumMicroBatchesCalculator(ConstantNumMicroBatchesCalculator):
    """Megatron's batch-size ramp-up (``--rampup-batch-size start increment ramp_samples``).

    ``update(consumed_samples)`` sets the current global batch: ``global_batch_size`` once
    ``consumed_samples > ramp_samples``, else ``start + int(consumed_samples /
    (ramp_samples / num_increments)) * increment`` with ``num_increments = (global_batch_size
    - start) / increment``. Every batch of the ramp must divide into micro-batches
    (Megatron's consistency check), checked here up front.

    Raises NumMicroBatchesCalculatorError (naming ``rampup_batch_size``) for a start above the
    final batch, an increment that does not divide the difference, no increments at all, or
    ramp batches not divisible by ``micro_batch_size * data_parallel_size``.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 start_global_batch_size: int, batch_size_increment: int, rampup_samples: int):
        super().__init__(global_batch_size, micro_batch_size, data_parallel_size)
        start, inc = int(start_global_batch_size), int(batch_size_increment)
        check_rampup(global_batch_size, (start, inc, rampup_samples))
        rows = micro_batch_size * data_parallel_size
        if start % rows or inc % rows:
            raise NumMicroBatchesCalculatorError(
                f"config.rampup_batch_size=({start}, {inc}, {rampup_samples}): the start batch and the "
                f"increment must be multiples of config.micro_batch_size={micro_batch_size} x "
                f"data_parallel_size={data_parallel_size} = {rows} (every batch of the ramp is split "
                "into micro-batches).")
        self.start_global_batch_size = start
        self.batch_size_increment = inc
        self.rampup_samples = int(rampup_samples)
        self.rampup_samples_per_increment = self.rampup_samples / ((global_batch_size - start) // inc)
        self._gbs_at = _rampup_gbs_at(global_batch_size, (start, inc, rampup_samples))
        self.update(0)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        return self._gbs_at(consumed_samples)

    def update(self, consumed_samples: int) -> None:
        """Set the current global batch and number of micro-batches for ``consumed_samples``."""
        self.current_global_batch_size = self.global_batch_size_at(consumed_samples)
        self.num_micro_batches = self.current_global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def stages(self) -> list[tuple[int, int, int]]:
        return global_batch_stages(self.global_batch_size,
                                   (self.start_global_batch_size, self.batch_size_increment, self.rampup_samples))


def check_rampup(global_batch_size: int, rampup_batch_size: Sequence[int]) -> None:
    """Validate ``(start, increment, ramp_samples)`` against the final global batch (no
    data-parallel size needed). Raises NumMicroBatchesCalculatorError naming the field."""
    if len(rampup_batch_size) != 3 or any(isinstance(v, bool) or int(v) != v for v in rampup_batch_size):
        raise NumMicroBatchesCalculatorError(
            f"config.rampup_batch_size={tuple(rampup_batch_size)} must be three integers "
            "(start global batch, increment, ramp-up samples), e.g. (16, 8, 300000).")
    start, inc, samples = (int(v) for v in rampup_batch_size)
    if start <= 0 or inc <= 0 or samples <= 0:
        raise NumMicroBatchesCalculatorError(
            f"config.rampup_batch_size={tuple(rampup_batch_size)}: start, increment and ramp-up "
            "samples must be > 0 (Megatron divides by the samples per increment).")
    diff = global_batch_size - start
    if diff <= 0:
        raise NumMicroBatchesCalculatorError(
            f"config.rampup_batch_size starts at {start}, not below config.global_batch_size="
            f"{global_batch_size}: nothing to ramp; lower the start or drop rampup_batch_size.")
    if diff % inc:
        raise NumMicroBatchesCalculatorError(
            f"config.rampup_batch_size: global_batch_size - start = {diff} is not divisible by the "
            f"increment {inc}.")


def rampup_stages(gbs_at, rampup_samples: int, global_batch_size: int) -> list[tuple[int, int, int]]:
    """Runs of equal global batches ``[(first iteration index, consumed samples before it,
    global batch)]`` by simulating the ramp iteration by iteration (the loop of Megatron's
    ``update_train_iters``); the last row is the final global batch, for ever after."""
    rows: list[tuple[int, int, int]] = []
    iteration, consumed = 0, 0
    while True:
        gbs = gbs_at(consumed)
        if not rows or rows[-1][2] != gbs:
            rows.append((iteration, consumed, gbs))
        if consumed > rampup_samples:
            return rows
        consumed += gbs
        iteration += 1


def consumed_samples_at(stages: Sequence[tuple[int, int, int]], iteration: int) -> int:
    """Samples consumed before iteration index ``iteration`` (0-based), exact (Python ints)."""
    i = bisect.bisect_right([s[0] for s in stages], iteration) - 1
    first, consumed, gbs = stages[i]
    return consumed + (iteration - first) * gbs


def _rampup_gbs_at(global_batch_size: int, rampup_batch_size: Sequence[int]):
    """``consumed_samples -> global batch`` of Megatron's ramp-up calculator."""
    check_rampup(global_batch_size, rampup_batch_size)
    start, inc, ramp = (int(v) for v in rampup_batch_size)
    per_increment = ramp / ((global_batch_size - start) // inc)

    def gbs_at(consumed: int) -> int:
        if consumed > ramp:
            return global_batch_size
        return start + int(consumed / per_increment) * inc

    return gbs_at


def global_batch_stages(global_batch_size: int,
                        rampup_batch_size: Optional[Sequence[int]] = None) -> list[tuple[int, int, int]]:
    """:meth:`ConstantNumMicroBatchesCalculator.stages` without a data-parallel size: the
    sequence of global batches does not depend on it (the learning-rate schedule uses this)."""
    if rampup_batch_size is None:
        return [(0, 0, int(global_batch_size))]
    return rampup_stages(_rampup_gbs_at(global_batch_size, rampup_batch_size),
                         int(rampup_batch_size[2]), global_batch_size)


def update_train_iters(train_samples: int, global_batch_size: int,
                       rampup_batch_size: Optional[Sequence[int]] = None) -> int:
    """Iterations of a sample-based run (Megatron ``update_train_iters``): during the ramp, one
    iteration per batch while ``consumed <= ramp_samples`` and ``consumed <= train_samples``;
    then ``(train_samples - consumed) // global_batch_size`` more (a partial last batch is
    dropped)."""
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    gbs_at = _rampup_gbs_at(global_batch_size, rampup_batch_size)
    ramp = int(rampup_batch_size[2])
    iterations, consumed = 0, 0
    while consumed <= ramp and consumed <= train_samples:
        consumed += gbs_at(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations


def build_num_microbatches_calculator(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                                      rampup_batch_size: Optional[Sequence[int]] = None):
    """The constant calculator, or the ramp-up one when ``rampup_batch_size`` is given
    (Megatron ``_build_num_microbatches_calculator``)."""
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size)
    return RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                    *rampup_batch_size)
