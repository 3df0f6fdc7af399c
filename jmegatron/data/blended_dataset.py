"""Weighted blends of GPT datasets and the train/valid/test builder behind ``--data-path``.

Follows Megatron-LM:
  * ``megatron/core/datasets/blended_dataset.py`` (``BlendedDataset``),
  * ``megatron/core/datasets/helpers.cpp`` (``build_blending_indices``: greedy, exact),
  * ``megatron/core/datasets/utils.py`` (``normalize``, ``get_blend_from_list``),
  * ``megatron/core/datasets/blended_megatron_dataset_config.py``
    (``parse_and_normalize_split``, ``convert_split_vector_to_split_matrix``),
  * ``megatron/core/datasets/blended_megatron_dataset_builder.py`` (per-prefix splits, per-dataset
    sample counts ``ceil(ceil(size * weight) * 1.005)``, blend sizes).

For the same files, split, sizes and seed the datasets built here yield the same samples in the
same order as Megatron-LM's ``BlendedMegatronDatasetBuilder(GPTDataset, ...)``.
"""

from __future__ import annotations

import math
import os
import re
from array import array
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from jmegatron.data.fim_dataset import GPTFIMDataset
from jmegatron.data.gpt_dataset import GPTDataset, MockGPTDataset, MockGPTLowLevelDataset, check_token_ids
from jmegatron.data.indexed_dataset import IndexedDataset
from jmegatron.data.sft_dataset import SFTDataset

__all__ = [
    "BlendedDataset",
    "build_blending_indices",
    "build_train_valid_test_datasets",
    "convert_split_vector_to_split_matrix",
    "get_blend_from_list",
    "get_size_per_split_per_dataset",
    "normalize",
    "parse_and_normalize_split",
]

MID_LEVEL_DATASET_SURPLUS = 0.005
_SPLIT_NAMES = ("train", "valid", "test")


def normalize(weights: Sequence[float]) -> List[float]:
    """``weights / sum(weights)`` in float64, as a list (Megatron ``utils.normalize``)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend (``helpers.cpp: build_blending_indices``).

    For each sample ``s`` pick the dataset ``i`` with the largest
    ``weights[i] * max(s, 1) - drawn[i]`` (first one on ties) and take its next sample.
    Plain float64 arithmetic, so the result is bit-identical to the C++ helper. Runs as a tight
    Python loop (about 0.5 us per sample and dataset).

    Args:
        weights: normalised weights (float64), one per dataset.  size: number of samples.

    Returns:
        (dataset_index int16 [size], dataset_sample_index int64 [size]).
    """
    w = [float(x) for x in weights]
    n = len(w)
    size = int(size)
    if n == 1:
        return np.zeros(size, dtype=np.int16), np.arange(size, dtype=np.int64)
    counts = [0] * n
    ds_index = array("h", bytes(2 * size))
    ds_sample = array("q", bytes(8 * size))
    rest = range(1, n)
    w0 = w[0]
    for s in range(size):
        sd = float(s) if s > 1 else 1.0
        best = 0
        best_err = w0 * sd - counts[0]
        for i in rest:
            err = w[i] * sd - counts[i]
            if err > best_err:
                best_err = err
                best = i
        ds_index[s] = best
        ds_sample[s] = counts[best]
        counts[best] += 1
    return (np.frombuffer(ds_index, dtype=np.int16).copy(),
            np.frombuffer(ds_sample, dtype=np.int64).copy())


class BlendedDataset:
    """Samples drawn from several datasets in proportion to ``weights`` (Megatron
    ``BlendedDataset``).

    Args:
        datasets: the datasets (e.g. ``GPTDataset``) to blend.
        weights: positive weights, one per dataset (normalised here).
        size: number of samples of the blend.
        seed: kept for the record; the blend order is the deterministic greedy of Megatron and
            uses no randomness (the member datasets carry their own seeds).

    Attributes:
        dataset_index int16 [size]: which dataset serves sample i.
        dataset_sample_index int64 [size]: which sample of that dataset.

    ``__getitem__(i)`` returns the member dataset's sample dict unchanged (for ``GPTDataset``:
    ``tokens``/``labels``/``position_ids`` int32 [seq_length], ``loss_mask`` float32).

    Raises:
        ValueError: length mismatch, non-positive / non-finite weights, negative size.
        RuntimeError: a member dataset is too short for the samples the blend draws from it.
        IndexError: sample index out of range.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int,
                 seed: Optional[int] = None) -> None:
        if len(datasets) == 0 or len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset needs as many weights ({len(weights)}) as datasets "
                             f"({len(datasets)}), at least one")
        if len(datasets) >= 32767:
            raise ValueError("BlendedDataset supports at most 32766 datasets")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"BlendedDataset weights must be finite and > 0, got {list(weights)}")
        if int(size) < 0:
            raise ValueError(f"BlendedDataset size must be >= 0, got {size}")
        self.datasets = list(datasets)
        self.weights = normalize(w)
        self.size = int(size)
        self.seed = seed
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            self.weights, self.size)
        drawn = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (d, need) in enumerate(zip(self.datasets, drawn)):
            if need > len(d):
                raise RuntimeError(
                    f"BlendedDataset draws {need} samples from dataset {i} which has only "
                    f"{len(d)}; build it with more samples (Megatron's mid-level surplus)"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        i = int(idx)
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


# --------------------------------------------------------------------------- parsing helpers
def parse_and_normalize_split(split: str) -> List[float]:
    """Parse ``"949,50,1"`` (``,`` or ``/`` separated, 1 to 3 non-negative numbers, missing
    ones are 0) into normalised train/valid/test ratios (Megatron
    ``parse_and_normalize_split``).

    Raises:
        ValueError: naming ``split``, on anything else.
    """
    example = 'e.g. split="949,50,1" (train,valid,test weights)'
    if not isinstance(split, str) or not split.strip():
        raise ValueError(f"split must be a non-empty string, {example}; got {split!r}")
    fields = [f.strip() for f in re.split(r"[,/]", split.strip())]
    if len(fields) > 3:
        raise ValueError(f"split={split!r} has {len(fields)} parts, at most 3 allowed; {example}")
    values = []
    for f in fields:
        if not re.fullmatch(r"[0-9]*\.?[0-9]+|[0-9]+\.", f):
            raise ValueError(f"split={split!r}: {f!r} is not a non-negative number; {example}")
        values.append(float(f))
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        raise ValueError(f"split={split!r} gives every split weight 0; {example}")
    return normalize(values)


def convert_split_vector_to_split_matrix(vector: Sequence[float]
                                         ) -> List[Optional[Tuple[float, float]]]:
    """``[0.9, 0.1, 0.0] -> [(0, 0.9), (0.9, 1.0), None]``: the [begin, end) fraction of the
    documents of each split, None for an empty split (Megatron, single-vector case)."""
    bounds = [0]
    for v in vector:
        bounds.append(bounds[-1] + v)
    matrix: List[Optional[Tuple[float, float]]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        matrix.append(None if hi <= lo else (lo, hi))
    return matrix


def get_blend_from_list(data_path: Union[str, Sequence[str]]
                        ) -> Tuple[List[str], Optional[List[float]]]:
    """Parse ``--data-path``: ``["p"]``, ``["p1", "p2", ...]`` or ``["w1", "p1", "w2", "p2"]``
    (a single whitespace-separated string is split first). Megatron ``get_blend_from_list``.

    Returns:
        (prefixes, raw weights or None).

    Raises:
        ValueError: naming ``data_path``, on an empty list, mixed weights/prefixes,
            non-positive or non-finite weights.
    """
    if isinstance(data_path, (str, os.PathLike)):
        data_path = os.fspath(data_path).split()
    items = [os.fspath(x).strip() for x in data_path]
    if not items or any(not x for x in items):
        raise ValueError(f"data_path must list dataset prefixes, optionally weighted as "
                         f"['0.3', 'prefixA', '0.7', 'prefixB']; got {list(data_path)!r}")
    def as_float(x):
        try:
            return float(x)
        except ValueError:
            return None

    if len(items) % 2 == 1:
        numbers = [x for x in items if as_float(x) is not None and not IndexedDataset.exists(x)]
        if numbers:  # a weight without its prefix (or a prefix without its weight)
            raise ValueError(f"data_path={items!r}: {numbers[0]!r} looks like a weight, but the list has an odd "
                             "number of entries; give 'weight prefix' pairs for every dataset, or only prefixes")
        return items, None

    weights = [as_float(items[i]) for i in range(0, len(items), 2)]
    if all(w is None for w in weights):
        return items, None  # an even number of unweighted prefixes
    if any(w is None for w in weights):
        raise ValueError(
            f"data_path={items!r} mixes weighted and unweighted entries; give either only "
            "prefixes or 'weight prefix' pairs for every dataset"
        )
    prefixes = items[1::2]
    bad = [p for p in prefixes if as_float(p) is not None]
    if bad:
        raise ValueError(f"data_path={items!r}: {bad[0]!r} stands where a prefix is expected; "
                         "write it as 'weight prefix' pairs")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"data_path={items!r}: weights must be finite and > 0 (drop a dataset "
                         "instead of giving it weight 0)")
    return prefixes, weights


def get_size_per_split_per_dataset(normalized_weights: Sequence[float],
                                   target_size_per_split: Sequence[int],
                                   surplus: float = 0.0) -> List[List[int]]:
    """``ceil(ceil(size * weight) * (1 + surplus))`` per dataset (rows) and split (columns)
    (Megatron ``_get_size_per_split_per_dataset``)."""
    return [[int(math.ceil(math.ceil(size * w) * (1 + surplus))) for size in
             target_size_per_split] for w in normalized_weights]


def _check_prefixes(prefixes: Sequence[str]) -> None:
    problems = []
    for p in prefixes:
        if IndexedDataset.exists(p):
            continue
        hint = ""
        if p.endswith((".bin", ".idx")) and IndexedDataset.exists(p[:-4]):
            hint = f" (drop the suffix: {p[:-4]!r})"
        elif IndexedDataset.exists(p + "_text_document"):
            hint = f" (did you mean {p + '_text_document'!r}?)"
        problems.append(f"{p!r}: no {p}.bin/{p}.idx{hint}")
    if problems:
        raise ValueError(
            "data_path: dataset prefix not found: " + "; ".join(problems)
            + ". A prefix is the path without .bin/.idx, as printed by "
            "`python -m jmegatron.tools.preprocess_data`."
        )


# --------------------------------------------------------------------------- the builder
def build_train_valid_test_datasets(
    data_path: Optional[Union[str, Sequence[str]]],
    split: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    eod_id: Optional[int],
    mock: bool = False,
    vocab_size: Optional[int] = None,
    *,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    add_extra_token_to_sequence: bool = True,
    mid_level_dataset_surplus: float = MID_LEVEL_DATASET_SURPLUS,
    sft: bool = False,
    fim: Optional[Mapping[str, Any]] = None,
):
    """Build the train, valid and test datasets of Megatron's ``--data-path``/``--split``.

    Follows ``BlendedMegatronDatasetBuilder`` (``blended_megatron_dataset_builder.py``) with
    ``GPTDataset``:

    * each prefix's sequences are cut into contiguous train/valid/test ranges,
      ``[round(begin * N), round(end * N))`` of its N sequences, per ``split``;
    * one unweighted prefix: ``GPTDataset(num_samples=train_valid_test_num_samples[i])``;
    * weighted prefixes: dataset j of split i is built with
      ``ceil(ceil(n_i * w_j) * 1.005)`` samples (the 0.5 % surplus) and the blend has
      ``sum_j ceil(n_i * w_j)`` samples (may exceed n_i by up to one per dataset);
    * several unweighted prefixes: each is one epoch, blended in proportion to their lengths,
      ``min(n_i, total)`` samples;
    * ``mock=True``: ``MockGPTDataset`` split "1,1,1" like Megatron (needs ``vocab_size``).

    Args:
        data_path: list like Megatron's ``--data-path`` (``["prefix"]`` or
            ``["w1", "p1", "w2", "p2"]``) or one whitespace-separated string.
        split: ``"949,50,1"``-style string.
        train_valid_test_num_samples: samples wanted per split (3 ints >= 0).
        seq_length, seed, eod_id: as ``GPTDataset``.
        mock, vocab_size: synthetic data instead of files; with files, ``vocab_size`` (the
            unpadded vocabulary) also checks every prefix's token ids
            (:func:`~jmegatron.data.gpt_dataset.check_token_ids`).
        reset_position_ids, reset_attention_mask, eod_mask_loss,
        add_extra_token_to_sequence: passed to every ``GPTDataset``.
        mid_level_dataset_surplus: Megatron's 0.005.
        sft: each prefix's splits are :class:`~jmegatron.data.sft_dataset.SFTDataset` (packed
            chat conversations, padded with ``eod_id``; the GPT flags do not apply) instead of
            ``GPTDataset`` (Megatron's ``SFTDataset`` as the builder's ``cls``).
        fim: keyword arguments of :class:`~jmegatron.data.fim_dataset.GPTFIMDataset`
            (``tokenizer``, ``fim_rate``, ...): fill-in-the-middle samples instead of
            ``GPTDataset`` (Megatron's ``GPTFIMDataset`` as the builder's ``cls``).

    Returns:
        (train, valid, test): ``GPTDataset`` / ``BlendedDataset`` / ``MockGPTDataset``, or None
        for a split whose ratio is 0 (or whose blend would have 0 samples).

    Raises:
        ValueError: naming the field (``data_path``, ``split``,
            ``train_valid_test_num_samples``, ``seq_length``, ``vocab_size``, ``eod_id``) and
            the fix: bad weights, missing prefixes, bad split string, a split that gets no
            documents but is asked for samples.
    """
    sizes = _check_sizes(train_valid_test_num_samples, seq_length)
    flags = dict(reset_position_ids=reset_position_ids,
                 reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
                 add_extra_token_to_sequence=add_extra_token_to_sequence)
    if mock:
        if sft or fim is not None:
            raise ValueError("mock=True builds MockGPTDataset only; SFT and FIM samples need data_path")
        return _build_mock_datasets(sizes, seq_length, seed, eod_id, vocab_size, flags)

    if data_path is None:
        raise ValueError("data_path is required unless mock=True (e.g. ['my_text_document'])")
    if eod_id is None:
        raise ValueError("eod_id is required (the tokenizer's <|endoftext|> id)")
    prefixes, weights = get_blend_from_list(data_path)
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    _check_prefixes(prefixes)
    if weights is not None:
        weights = normalize(weights)
    datasets = _PrefixSplits(matrix, split, seq_length, seed, eod_id, vocab_size, sft, fim, flags)

    # one prefix, no weights: plain GPTDatasets
    if len(prefixes) == 1 and weights is None:
        return tuple(None if matrix[i] is None else datasets.make(prefixes[0], i, sizes[i])
                     for i in range(3))

    if weights is not None:
        target = get_size_per_split_per_dataset(weights, sizes)
        buffer = get_size_per_split_per_dataset(weights, sizes, mid_level_dataset_surplus)
    out = []
    for i in range(3):
        if matrix[i] is None:
            out.append(None)
        elif weights is not None:
            size_i = sum(target[j][i] for j in range(len(prefixes)))
            mids = [datasets.make(p, i, buffer[j][i]) for j, p in enumerate(prefixes)] if size_i else []
            out.append(BlendedDataset(mids, weights, size_i, seed) if size_i else None)
        else:
            out.append(_blend_epochs(datasets, prefixes, i, sizes[i], seed))
    return tuple(out)


def _check_sizes(train_valid_test_num_samples: Optional[Sequence[int]], seq_length: int) -> List[int]:
    """The three sample counts as ints; raises ValueError for anything but 3 ints >= 0, or a
    ``seq_length`` below 1."""
    sizes = list(train_valid_test_num_samples) if train_valid_test_num_samples is not None \
        else []
    if len(sizes) != 3 or any(isinstance(s, bool) or not isinstance(s, (int, np.integer))
                              or s < 0 for s in sizes):
        raise ValueError("train_valid_test_num_samples must be 3 integers >= 0 (train, valid, "
                         f"test sample counts); got {train_valid_test_num_samples!r}")
    if int(seq_length) < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    return [int(s) for s in sizes]


def _build_mock_datasets(sizes: Sequence[int], seq_length: int, seed: int, eod_id: Optional[int],
                         vocab_size: Optional[int], flags: Mapping[str, bool]) -> Tuple[MockGPTDataset, ...]:
    """Megatron's mock data: ``MockGPTDataset`` per split over the "1,1,1" split of the
    synthetic documents. Raises ValueError without ``vocab_size`` >= 2."""
    if vocab_size is None or int(vocab_size) < 2:
        raise ValueError("vocab_size is required (>= 2) when mock=True")
    eod = 0 if eod_id is None else int(eod_id)
    low = MockGPTLowLevelDataset(int(vocab_size), eod)
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split("1,1,1"))
    n = len(low)
    out = []
    for i, bounds in enumerate(matrix):
        docs = np.arange(int(round(bounds[0] * n)), int(round(bounds[1] * n)),
                         dtype=np.int32)
        out.append(MockGPTDataset(sizes[i], seq_length, int(vocab_size), seed, eod,
                                  document_ids=docs, **flags))
    return tuple(out)


class _PrefixSplits:
    """The mid-level datasets of Megatron's builder: each prefix's ``IndexedDataset`` (opened
    once, its token ids checked against ``vocab_size``) cut into the split ranges of
    ``matrix``, as ``GPTDataset`` / ``SFTDataset`` / ``GPTFIMDataset``."""

    def __init__(self, matrix, split: str, seq_length: int, seed: int, eod_id: int,
                 vocab_size: Optional[int], sft: bool, fim: Optional[Mapping[str, Any]], flags: Mapping[str, bool]):
        self.matrix, self.split, self.seq_length, self.seed, self.eod_id = matrix, split, seq_length, seed, eod_id
        self.vocab_size, self.sft, self.fim, self.flags = vocab_size, sft, fim, flags
        self.low_level: Dict[str, IndexedDataset] = {}

    def split_docs(self, prefix: str, i: int) -> np.ndarray:
        """int32 document ids of split ``i`` of ``prefix``."""
        if prefix not in self.low_level:
            self.low_level[prefix] = IndexedDataset(prefix)
            if self.vocab_size is not None:  # another tokenizer's data fails here, before any sample
                check_token_ids(self.low_level[prefix], int(self.vocab_size))
        n = self.low_level[prefix].sequence_lengths.shape[0]
        lo, hi = self.matrix[i]
        return np.arange(int(round(lo * float(n))), int(round(hi * float(n))), dtype=np.int32)

    def make(self, prefix: str, i: int, num_samples: Optional[int]) -> Optional[GPTDataset]:
        """Split ``i`` of ``prefix`` with ``num_samples`` samples (None: one epoch); None when
        it has no documents and none are asked for. Raises ValueError when samples are asked
        of a split without documents, or its documents hold no tokens."""
        docs = self.split_docs(prefix, i)
        low = self.low_level[prefix]
        if docs.size == 0:
            if num_samples == 0:
                return None
            raise ValueError(
                f"split={self.split!r} gives the {_SPLIT_NAMES[i]} split of {prefix!r} no documents "
                f"({low.sequence_lengths.shape[0]} in all) but "
                f"{_SPLIT_NAMES[i]} samples are requested; use more documents or give that "
                "split a larger share"
            )
        if int(np.sum(low.sequence_lengths[docs], dtype=np.int64)) == 0:
            raise ValueError(f"the {_SPLIT_NAMES[i]} documents of {prefix!r} hold no tokens")
        if self.sft:  # the conversations bring their own loss mask, position and segment ids
            return SFTDataset(low, docs, num_samples, self.seq_length, self.seed, pad_id=self.eod_id)
        if self.fim is not None:
            return GPTFIMDataset(low, docs, num_samples, self.seq_length, self.seed, self.eod_id,
                                 **self.fim, **self.flags)
        return GPTDataset(low, docs, num_samples, self.seq_length, self.seed, self.eod_id, **self.flags)


def _blend_epochs(datasets: _PrefixSplits, prefixes: Sequence[str], i: int, num_samples: int,
                  seed: int) -> Optional[BlendedDataset]:
    """Split ``i`` of several unweighted prefixes: one epoch of each, blended in proportion
    to their lengths, ``min(num_samples, total)`` samples (None: no samples)."""
    mids = [m for m in (datasets.make(p, i, None) if datasets.split_docs(p, i).size else None
                        for p in prefixes) if m is not None]
    lengths = [len(m) for m in mids]
    keep = [m for m, n in zip(mids, lengths) if n > 0]
    size_i = min(num_samples, sum(lengths))
    if not keep or size_i == 0:
        return None
    return BlendedDataset(keep, [len(m) for m in keep], size_i, seed)
