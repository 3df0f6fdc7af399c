"""Global batches from a map-style dataset, with a resumable position.

Megatron's ``MegatronPretrainingSampler`` (megatron/legacy/data/data_samplers.py):
samples are read in dataset order starting at ``consumed_samples``; micro-batch ``j``
of an iteration holds the next ``micro_batch_size * dp`` samples, data-parallel rank
``r`` its ``r``-th slice. The dataset's own shuffle index does the shuffling. The
position (``consumed_samples``) is saved in checkpoints.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class BatchLoader:
    """Yields numpy batches ``{key: [num_microbatches, micro_batch_size * dp, seq]}``.

    ``dataset[i]`` must give a dict with :data:`KEYS` (``[seq]`` arrays). Indices wrap
    around the dataset length (a fresh epoch of the same order).
    """

    def __init__(self, dataset: Any, global_batch_size: int, num_microbatches: int,
                 consumed_samples: int = 0):
        if len(dataset) == 0:
            raise ValueError("the dataset is empty; check config.data_path and config.split")
        if global_batch_size % num_microbatches:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                             f"num_microbatches={num_microbatches}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.num_microbatches = num_microbatches
        self.consumed_samples = int(consumed_samples)

    def batch_at(self, consumed_samples: int) -> dict[str, np.ndarray]:
        """The global batch starting at sample ``consumed_samples`` (does not advance)."""
        n = len(self.dataset)
        samples = [self.dataset[(consumed_samples + i) % n] for i in range(self.global_batch_size)]
        return stack_samples(samples, self.num_microbatches)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.consumed_samples)
        self.consumed_samples += self.global_batch_size
        return batch


def stack_samples(samples: list[Mapping[str, np.ndarray]], num_microbatches: int) -> dict[str, np.ndarray]:
    """Stack ``[seq]`` samples into ``[num_microbatches, len(samples) // num_microbatches, seq]``."""
    out = {}
    for key in KEYS:
        arr = np.stack([np.asarray(s[key]) for s in samples])
        dtype = np.float32 if key == "loss_mask" else np.int32
        out[key] = arr.astype(dtype).reshape(num_microbatches, -1, arr.shape[-1])
    return out
