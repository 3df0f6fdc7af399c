"""Global batches from a map-style dataset, with a resumable position.

Megatron's ``MegatronPretrainingSampler`` (megatron/training/datasets/data_samplers.py):
samples are read in dataset order starting at ``consumed_samples``; micro-batch ``j``
of an iteration holds the next ``micro_batch_size * dp`` samples, data-parallel rank
``r`` its ``r``-th slice. The dataset's own shuffle index does the shuffling. The
position (``consumed_samples``) is saved in checkpoints.

**Process-local reads.** A batch is ``[num_micro, R, seq]`` with ``R = micro_batch_size
* dp`` rows per micro-batch, the rows sharded over the data axes. Given ``rows`` (the rows
this process's devices hold: :meth:`jmegatron.training.run.Run.batch_rows`) the loader
reads only those samples, ``[num_micro, len(rows), seq]``, as Megatron's sampler gives
each data-parallel rank its slice; :meth:`~jmegatron.training.run.Run.put_batch` builds
the global array from them. Variable-length samples are padded to the *global* batch's
longest, which every process computes from ``dataset.sample_length(i)`` without reading
tokens (:class:`~jmegatron.data.gpt_variable_dataset.GPTVariableDataset`); a dataset of
unequal lengths without ``sample_length`` is refused for process-local reads.

**Prefetch.** With ``num_workers > 0`` a background thread
(:class:`~jmegatron.data.prefetch.Prefetcher`) keeps up to ``num_workers`` batches
ready; ``consumed_samples`` counts the batches handed out, never the prefetched ones, so
a checkpoint's position is exact. Close the loader (``close()`` / ``with``) when done.

**End of the data** (Megatron's ``dataloader_type``): ``"single"`` (Megatron's default)
reads each sample of the split once; a batch that would read past ``len(dataset)``
raises :class:`DataExhaustedError` (Megatron's single iterator raises StopIteration
there; its datasets are built for ``train_iters * global_batch_size`` samples, so a
correctly sized run never gets there). ``"cyclic"`` starts the same order again (sample
``i`` is ``dataset[i % len]``; Megatron's cyclic sampler also reshuffles each epoch with
``torch.randperm``, which this does not reproduce). Nothing wraps silently.

With Megatron's batch-size ramp-up the global batch of each iteration comes from a
micro-batch calculator (:mod:`jmegatron.num_microbatches_calculator`) at the
samples consumed so far, as Megatron's training loop calls
``update_num_microbatches(consumed_train_samples)`` before each step; samples are still
read in order, so the position alone resumes the ramp.

Samples of different lengths (ByteMLPerf's variable data) are right-padded to the batch's
longest (:func:`stack_samples`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jmegatron.data.prefetch import Prefetcher

KEYS = ("tokens", "labels", "loss_mask", "position_ids")
SEGMENT_KEY = "segment_ids"  # only in samples built with reset_attention_mask (document masking)
DATALOADER_TYPES = ("single", "cyclic")  # Megatron's --dataloader-type (its "external" is not built)

# how each split is sized (jmegatron.data.builder.get_train_valid_test_num_samples), for the error
_SPLIT_SIZES = {
    "train": "config.train_iters x global_batch_size samples (config.train_samples with a ramp-up)",
    "valid": "(config.train_iters // config.eval_interval + 1) x config.eval_iters x global_batch_size samples",
    "test": "config.eval_iters x global_batch_size samples",
}


class DataExhaustedError(ValueError):
    """A batch would read past the end of a split under ``dataloader_type="single"``. A
    ValueError: the run asks for more data than its datasets were built with (the CLIs
    report it as bad input, exit status 2)."""


class BatchLoader:
    """Yields numpy batches ``{key: [num_microbatches, rows, seq]}``: ``rows = micro_batch_size
    * dp`` (``global_batch_size // num_microbatches``), or ``len(rows)`` with process-local rows.

    Args:
        dataset: ``dataset[i]`` gives a dict with :data:`KEYS` (``[seq]`` arrays; and
            :data:`SEGMENT_KEY`, int32, when built with ``reset_attention_mask``); optional
            ``dataset.sample_length(i)`` (tokens of sample ``i``, without reading it).
        global_batch_size, num_microbatches: the (final) global batch and its micro-batches.
        consumed_samples: the position (samples handed out before the first batch).
        num_microbatches_calculator: optional (e.g. Megatron's ramp-up): each batch's size is
            its ``global_batch_size_at(consumed_samples)``; ``update()`` is called as each
            batch is handed out. ``last_global_batch_size`` is the size of the batch just
            returned. Without it every batch is ``global_batch_size`` samples.
        rows: the rows ``[0, R)`` of each micro-batch this process reads (any order, no
            repeats); None reads them all.
        dataloader_type: ``"single"`` or ``"cyclic"`` (module docstring).
        num_workers: batches a background thread keeps ready (Megatron's ``--num-workers``;
            0 reads in the calling thread).
        split: ``"train"``, ``"valid"`` or ``"test"``: named in :class:`DataExhaustedError`.

    Raises:
        ValueError: an empty dataset, a global batch not divisible by ``num_microbatches``,
            rows outside ``[0, R)`` or repeated, an unknown ``dataloader_type``,
            ``num_workers < 0``.
    """

    def __init__(self, dataset: Any, global_batch_size: int, num_microbatches: int,
                 consumed_samples: int = 0, num_microbatches_calculator: Any = None, *,
                 rows: Optional[Sequence[int]] = None, dataloader_type: str = "single",
                 num_workers: int = 0, split: str = "train"):
        if len(dataset) == 0:
            raise ValueError("the dataset is empty; check config.data_path and config.split")
        if global_batch_size % num_microbatches:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                             f"num_microbatches={num_microbatches}")
        if dataloader_type not in DATALOADER_TYPES:
            raise ValueError(f"config.dataloader_type={dataloader_type!r} must be one of {DATALOADER_TYPES}")
        if num_workers < 0:
            raise ValueError(f"config.num_workers={num_workers} must be >= 0 (0: no prefetch thread)")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.num_microbatches = num_microbatches
        self.rows_per_microbatch = global_batch_size // num_microbatches
        self.consumed_samples = int(consumed_samples)
        self.calculator = num_microbatches_calculator
        self.dataloader_type = dataloader_type
        self.num_workers = int(num_workers)
        self.split = split
        self.last_global_batch_size: Optional[int] = None
        self.rows: Optional[np.ndarray] = None
        if rows is not None:
            r = np.asarray(rows, dtype=np.int64).reshape(-1)
            if r.size == 0 or r.min() < 0 or r.max() >= self.rows_per_microbatch or len(np.unique(r)) != r.size:
                raise ValueError(f"rows={r.tolist()} must be distinct rows of [0, {self.rows_per_microbatch}) "
                                 f"(micro_batch_size x data-parallel size)")
            if r.size < self.rows_per_microbatch:
                self.rows = r
        self._prefetcher: Optional[Prefetcher] = None
        self._read_position: Optional[int] = None

    # --- what a batch holds ---

    def sample_indices(self, consumed_samples: int, global_batch_size: Optional[int] = None) -> np.ndarray:
        """int64 ``[num_micro, rows]``: the dataset index of each sample this process reads in
        the batch of ``global_batch_size`` samples (default: the loader's) starting at
        ``consumed_samples``. Raises :class:`DataExhaustedError` past the end (``single``)."""
        size = global_batch_size or self.global_batch_size
        if size % self.rows_per_microbatch:
            raise ValueError(f"a global batch of {size} is not a multiple of {self.rows_per_microbatch} rows "
                             f"(micro_batch_size x data-parallel size)")
        n = len(self.dataset)
        end = consumed_samples + size
        if self.dataloader_type == "single" and end > n:
            raise DataExhaustedError(
                f"the {self.split} data ends: the batch of samples [{consumed_samples}, {end}) reads past the "
                f"{n} samples of the {self.split} split. Its size follows "
                f"{_SPLIT_SIZES.get(self.split, 'the run length')} (jmegatron.data.builder.build_datasets); "
                "Megatron's 'single' dataloader stops here too. Train for fewer samples, rebuild the datasets "
                "for this length, or set config.dataloader_type='cyclic' to start the data again.")
        rows = np.arange(self.rows_per_microbatch) if self.rows is None else self.rows
        micro = np.arange(size // self.rows_per_microbatch)[:, None] * self.rows_per_microbatch
        index = consumed_samples + micro + rows[None, :]
        return index % n if self.dataloader_type == "cyclic" else index

    def padded_length(self, consumed_samples: int, global_batch_size: Optional[int] = None) -> Optional[int]:
        """The longest sample of the whole global batch from ``dataset.sample_length`` (no
        tokens read), or None when the dataset has no ``sample_length``."""
        length_of = getattr(self.dataset, "sample_length", None)
        if length_of is None:
            return None
        size = global_batch_size or self.global_batch_size
        n = len(self.dataset)
        return max(length_of((consumed_samples + i) % n) for i in range(size))

    def batch_at(self, consumed_samples: int, global_batch_size: Optional[int] = None,
                 num_microbatches: Optional[int] = None) -> dict[str, np.ndarray]:
        """The batch of ``global_batch_size`` samples (default: the loader's) starting at
        sample ``consumed_samples``: this process's rows of each micro-batch
        (``[num_micro, rows, seq]``; does not advance). ``num_microbatches`` is accepted for
        the old signature and must equal ``global_batch_size / rows_per_microbatch``.

        Raises:
            DataExhaustedError: past the end of the split (``dataloader_type="single"``).
            ValueError: samples of unequal lengths read process-locally from a dataset
                without ``sample_length`` (the processes could pad differently).
        """
        size = global_batch_size or self.global_batch_size
        index = self.sample_indices(consumed_samples, size)
        if num_microbatches is not None and num_microbatches != index.shape[0]:
            raise ValueError(f"num_microbatches={num_microbatches} does not match a global batch of {size} in "
                             f"micro-batches of {self.rows_per_microbatch} rows")
        samples = [self.dataset[int(i)] for i in index.reshape(-1)]
        length = self.padded_length(consumed_samples, size)
        if length is None and self.rows is not None:
            lengths = {len(s["tokens"]) for s in samples}
            if len(lengths) > 1:
                raise ValueError(
                    f"samples of lengths {sorted(lengths)} read process-locally from {type(self.dataset).__name__}, "
                    "which has no sample_length(i): every process must pad to the global batch's longest; give "
                    "the dataset a sample_length method (as GPTVariableDataset) or read whole batches (rows=None)")
        return stack_samples(samples, index.shape[0], length)

    # --- iteration ---

    def _size_at(self, consumed_samples: int) -> int:
        if self.calculator is None:
            return self.global_batch_size
        return int(self.calculator.global_batch_size_at(consumed_samples))

    def _produce(self) -> tuple[int, int, dict[str, np.ndarray]]:
        start = self._read_position
        size = self._size_at(start)
        batch = self.batch_at(start, size)
        self._read_position = start + size
        return start, size, batch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._read_position is None:
            self._read_position = self.consumed_samples
            if self.num_workers > 0:
                self._prefetcher = Prefetcher(self._produce, self.num_workers, f"jmegatron-{self.split}-data")
        start, size, batch = self._prefetcher.get() if self._prefetcher is not None else self._produce()
        if start != self.consumed_samples:
            raise RuntimeError(f"the loader's position moved from {start} to {self.consumed_samples} while "
                               "reading ahead; set consumed_samples before the first next() only")
        if self.calculator is not None:  # Megatron: update_num_microbatches(consumed) before the step
            self.calculator.update(start)
        self.consumed_samples = start + size
        self.last_global_batch_size = size
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (if any) and join it; ``next()`` may start a new one."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self._read_position = None

    def __enter__(self) -> "BatchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stack_samples(samples: list[Mapping[str, np.ndarray]], num_microbatches: int,
                  length: Optional[int] = None) -> dict[str, np.ndarray]:
    """Stack ``[len_i]`` samples into ``[num_microbatches, len(samples) // num_microbatches, seq]``,
    ``seq = length`` or ``max_i len_i``. Shorter samples are right-padded as ByteMLPerf's
    ``batch_pad``: tokens and labels 0, loss mask 0, position ids continuing ``len_i, len_i
    + 1, ...``, and segment ids (when the samples carry them) one past the sample's last,
    so padding is a document of its own. Any other key (a forward step's ``batch_keys``,
    e.g. cached teacher top-K ``[len_i, K]``) is stacked the same way with its trailing axes,
    padding positions 0. Raises ValueError when a sample is longer than ``length``."""
    longest = max(len(s["tokens"]) for s in samples)
    if length is not None:
        if longest > length:
            raise ValueError(f"a sample of {longest} tokens is longer than the padded length {length} "
                             "(the dataset's sample_length disagrees with its samples)")
        longest = int(length)
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
    for key in (k for k in samples[0] if k not in KEYS and k != SEGMENT_KEY):
        first = np.asarray(samples[0][key])
        arr = np.zeros((len(samples), longest) + first.shape[1:], first.dtype)
        for i, s in enumerate(samples):
            value = np.asarray(s[key])
            arr[i, :len(value)] = value
        out[key] = arr.reshape((num_microbatches, -1, longest) + first.shape[1:])
    return out
