"""Global batches from a map-style dataset, with a resumable position.

Megatron's ``MegatronPretrainingSampler`` (megatron/legacy/data/data_samplers.py):
samples are read in dataset order starting at ``consumed_samples``; micro-batch ``j``
of an iteration holds the next ``micro_batch_size * dp`` samples, data-parallel rank
``r`` its ``r``-th slice. The dataset's own shuffle index does the shuffling. The
position (``consumed_samples``) is saved in checkpoints.

With Megatron's batch-size ramp-up the global batch of each iteration comes from a
micro-batch calculator (:mod:`jmegatron.training.num_microbatches_calculator`) updated
with the samples consumed so far, as Megatron's training loop calls
``update_num_microbatches(consumed_train_samples)`` before each step; samples are still
read in order, so the position alone resumes the ramp.

Samples of different lengths (ByteMLPerf's variable data) are right-padded to the batch's
longest (:func:`stack_samples`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

KEYS = ("tokens", "labels", "loss_mask", "position_ids")
SEGMENT_KEY = "segment_ids"  # only in samples built with reset_attention_mask (document masking)


class BatchLoader:
    """Yields numpy batches ``{key: [num_microbatches, micro_batch_size * dp, seq]}``.

    ``dataset[i]`` must give a dict with :data:`KEYS` (``[seq]`` arrays; and
    :data:`SEGMENT_KEY`, int32, when built with ``reset_attention_mask``). Indices wrap
    around the dataset length (a fresh epoch of the same order).

    ``num_microbatches_calculator`` (optional, e.g. Megatron's ramp-up): each ``next()``
    first updates it with ``consumed_samples`` and takes its current global batch and
    number of micro-batches; ``last_global_batch_size`` is the size of the batch just
    returned. Without it every batch is ``global_batch_size`` samples.
    """

    def __init__(self, dataset: Any, global_batch_size: int, num_microbatches: int,
                 consumed_samples: int = 0, num_microbatches_calculator: Any = None):
        if len(dataset) == 0:
            raise ValueError("the dataset is empty; check config.data_path and config.split")
        if global_batch_size % num_microbatches:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                             f"num_microbatches={num_microbatches}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.num_microbatches = num_microbatches
        self.consumed_samples = int(consumed_samples)
        self.calculator = num_microbatches_calculator
        self.last_global_batch_size: Optional[int] = None

    def batch_at(self, consumed_samples: int, global_batch_size: Optional[int] = None,
                 num_microbatches: Optional[int] = None) -> dict[str, np.ndarray]:
        """The global batch of ``global_batch_size`` samples (default: the loader's) starting
        at sample ``consumed_samples``, in ``num_microbatches`` micro-batches (does not advance)."""
        n = len(self.dataset)
        size = global_batch_size or self.global_batch_size
        samples = [self.dataset[(consumed_samples + i) % n] for i in range(size)]
        return stack_samples(samples, num_microbatches or self.num_microbatches)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        size, num_micro = self.global_batch_size, self.num_microbatches
        if self.calculator is not None:
            self.calculator.update(self.consumed_samples)
            size, num_micro = self.calculator.get_current_global_batch_size(), self.calculator.get()
        batch = self.batch_at(self.consumed_samples, size, num_micro)
        self.consumed_samples += size
        self.last_global_batch_size = size
        return batch


def stack_samples(samples: list[Mapping[str, np.ndarray]], num_microbatches: int) -> dict[str, np.ndarray]:
    """Stack ``[len_i]`` samples into ``[num_microbatches, len(samples) // num_microbatches, seq]``,
    ``seq = max_i len_i``. Shorter samples are right-padded as ByteMLPerf's ``batch_pad``:
    tokens and labels 0, loss mask 0, position ids continuing ``len_i, len_i + 1, ...``, and
    segment ids (when the samples carry them) one past the sample's last, so padding is a
    document of its own."""
    longest = max(len(s["tokens"]) for s in samples)
    out = {}
    for key in KEYS + ((SEGMENT_KEY,) if SEGMENT_KEY in samples[0] else ()):
        dtype = np.float32 if key == "loss_mask" else np.int32
        arr = np.zeros((len(samples), longest), dtype)
        for i, s in enumerate(samples):
            value = np.asarray(s[key])
            arr[i, :len(value)] = value
            if key == "position_ids" and len(value) < longest:
                arr[i, len(value):] = np.arange(len(value), longest)
            if key == SEGMENT_KEY and len(value) < longest:
                arr[i, len(value):] = value[-1] + 1 if len(value) else 0
        out[key] = arr.reshape(num_microbatches, -1, longest)
    return out
