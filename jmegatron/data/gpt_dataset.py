"""GPT pre-training samples over an ``IndexedDataset``, index-for-index as Megatron-LM builds them.

Follows Megatron-LM ``megatron/core/datasets/gpt_dataset.py`` (``GPTDataset``,
``_build_document_index``, ``_build_shuffle_index``, ``_get_ltor_masks_and_position_ids``,
``MockGPTLowLevelDataset``/``MockGPTDataset``) and ``megatron/core/datasets/helpers.cpp``
(``build_sample_idx``, here a vectorised numpy re-implementation giving identical arrays).

How samples are made: the split's documents are repeated for ``num_epochs`` epochs and shuffled
(``document_index``); the shuffled token stream is cut every ``seq_length`` tokens, each sample
reading ``seq_length + 1`` tokens (the extra token gives the last label, and is also the first
token of the next sample) -- ``sample_index`` holds (position in document_index, token offset)
of every cut; the samples are then visited in a random order (``shuffle_index``). All three use
one ``np.random.RandomState(seed)``, consumed in Megatron's order, so the same seed gives the same
samples as Megatron-LM on the same .bin/.idx.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from jmegatron.data.indexed_dataset import normalize_index

__all__ = [
    "GPTDataset",
    "MockGPTDataset",
    "MockGPTLowLevelDataset",
    "build_document_index",
    "build_sample_index",
    "build_shuffle_index",
    "get_num_epochs",
    "get_ltor_masks_and_position_ids",
    "check_token_ids",
]

_PAD_TOKEN_ID = -1
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def check_token_ids(indexed_dataset, vocab_size: int, max_tokens: int = 1 << 24) -> None:
    """Check that ``indexed_dataset`` (an ``IndexedDataset``) holds token ids of a
    ``vocab_size``-token vocabulary, before any sample is built: integer tokens, and ids in
    ``[0, vocab_size)`` among the first and last ``max_tokens // 2`` tokens of its .bin (a
    bounded read: about 32 MB of uint16 tokens, whatever the file's size).

    Data tokenized with another tokenizer has ids the model's embedding does not hold; on an
    accelerator the gather clamps them and the run trains on garbage without an error
    (Megatron does not check either).

    Raises:
        ValueError: naming the .bin file, the offending id and the fix (re-run
            ``preprocess_data`` with the run's ``tokenizer_model``, or a larger ``vocab_size``).
    """
    dtype = np.dtype(indexed_dataset.dtype)
    bin_path = f"{indexed_dataset.path_prefix}.bin"
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{bin_path}: the index says the tokens are {dtype.name}, not integer token ids; "
                         f"rebuild the dataset with `python -m jmegatron.tools.preprocess_data`")
    tokens = indexed_dataset.tokens
    parts = [tokens] if tokens.size <= max_tokens else [tokens[:max_tokens // 2], tokens[-(max_tokens // 2):]]
    if tokens.size == 0:
        return
    low, high = min(int(t.min()) for t in parts), max(int(t.max()) for t in parts)
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise ValueError(
            f"{bin_path}: token id {bad} is outside the vocabulary of {vocab_size} ids (config.tokenizer_model "
            f"or config.vocab_size); the data was tokenized with another tokenizer: re-run "
            f"`python -m jmegatron.tools.preprocess_data --tokenizer-model` with the run's tokenizer, or set "
            f"config.tokenizer_model to the one that made it")


def build_document_index(documents: np.ndarray, num_epochs: int,
                         rng: np.random.RandomState, separate_final_epoch: bool) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times and shuffled with ``rng``.

    With ``separate_final_epoch`` the first ``num_epochs - 1`` epochs are shuffled together and
    the last epoch on its own (so a short last epoch is not blended into the earlier ones).
    Megatron: ``gpt_dataset._build_document_index``.

    Returns:
        int32 [num_epochs * len(documents)].
    """
    documents = np.asarray(documents)
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """A shuffled ``arange(num_samples)`` followed by a separately shuffled
    ``arange(num_samples, total_size)`` (Megatron: ``gpt_dataset._build_shuffle_index``).

    Returns:
        uint32 [total_size] (int64 when total_size >= 2**32 - 2).
    """
    dtype = np.uint32
    if total_size >= np.iinfo(np.uint32).max - 1:
        dtype = np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_epochs: int, tokens_per_epoch: int,
                       drop_last_partial_sequence: bool = True,
                       add_extra_token_to_sequence: bool = True) -> np.ndarray:
    """Vectorised ``build_sample_idx`` of Megatron-LM ``megatron/core/datasets/helpers.cpp``.

    Row ``j`` is ``(k, offset)``: sample ``j`` starts at token ``offset`` of the sequence
    ``document_index[k]`` and sample ``j``'s last token sits at row ``j + 1`` (exclusive of
    the extra token, which is included). Equivalently, cut ``j`` is at global token position
    ``j * seq_length`` of the concatenated stream of ``sizes[document_index]``, assigned to the
    document holding the sample's last read token (position ``j*seq_length + extra - 1``).

    Args:
        sizes: int32 [num_sequences], length of every sequence of the indexed dataset.
        document_index: int32 [n], the shuffled sequence ids (see ``build_document_index``).
        seq_length: tokens per sample (plus one extra when ``add_extra_token_to_sequence``).
        num_epochs, tokens_per_epoch: as in Megatron; ``num_epochs * tokens_per_epoch`` must be
            the number of tokens in ``sizes[document_index]``.
        drop_last_partial_sequence: drop a final sample that would run past the data
            (else it is kept and padded by the reader).

    Returns:
        int32 [num_samples + 1, 2] (int64 if an index or a length exceeds int32).
    """
    sizes = np.asarray(sizes)
    document_index = np.asarray(document_index)
    extra = 1 if add_extra_token_to_sequence else 0
    total = int(num_epochs) * int(tokens_per_epoch)
    if drop_last_partial_sequence:
        num_samples = (total - extra) // seq_length
    else:
        # helpers.cpp computes this ceil in single precision; reproduce it.
        num_samples = int(np.ceil(np.float32(total - extra) / np.float32(seq_length)))
    num_samples = max(num_samples, 0)
    max_value = max(document_index.shape[0], int(sizes.max()) if sizes.size else 0)
    dtype = np.int32 if max_value <= np.iinfo(np.int32).max else np.int64

    doc_lengths = sizes[document_index].astype(np.int64)
    cum = np.zeros(doc_lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=cum[1:])

    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[0] = (0, 0)
    if num_samples == 0:
        return out
    cuts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    last = cuts + extra - 1  # global position of the last token each sample reads
    inside = cuts + extra <= cum[-1]
    k = np.searchsorted(cum, last[inside], side="right") - 1
    out[1:][inside, 0] = k
    out[1:][inside, 1] = cuts[inside] - cum[k]
    if not inside.all():  # only with drop_last_partial_sequence=False
        n = document_index.shape[0] - 1
        out[1:][~inside, 0] = n
        out[1:][~inside, 1] = int(sizes[document_index[n]]) - extra
    return out


def get_num_epochs(num_tokens_per_epoch: int, num_samples: Optional[int], seq_length: int,
                   add_extra_token_to_sequence: bool = True) -> int:
    """Smallest number of epochs holding ``num_samples * seq_length + extra`` tokens
    (1 when ``num_samples`` is None). Megatron: ``GPTDataset._get_num_epochs``."""
    if num_samples is None:
        return 1
    if num_tokens_per_epoch <= 0:
        raise ValueError("the documents of this split hold no tokens")
    requested = num_samples * seq_length + int(add_extra_token_to_sequence)
    return max(1, -(-requested // num_tokens_per_epoch))


def get_ltor_masks_and_position_ids(tokens: np.ndarray, eod_token: int,
                                    reset_position_ids: bool, reset_attention_mask: bool,
                                    eod_mask_loss: bool):
    """Loss mask and position ids of a left-to-right sample (Megatron:
    ``gpt_dataset._get_ltor_masks_and_position_ids``, without the dense attention mask).

    Args:
        tokens: int [seq_length] input ids.

    Returns:
        (loss_mask float32 [seq_length]: 0 where the input token is EOD if ``eod_mask_loss``;
         position_ids int32 [seq_length]: restart at 0 after every EOD if
         ``reset_position_ids``;
         segment_ids int32 [seq_length] or None: number of EODs before each position, only when
         ``reset_attention_mask`` -- attention is allowed only between equal segment ids, which
         is Megatron's block-diagonal ``attention_mask``).
    """
    n = tokens.shape[0]
    loss_mask = np.ones(n, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    positions = np.arange(n, dtype=np.int32)
    segment_ids = None
    if reset_position_ids or reset_attention_mask:
        is_eod = tokens == eod_token
        if reset_position_ids:
            last_eod = np.maximum.accumulate(np.where(is_eod, positions, -1))
            prev = np.empty(n, dtype=np.int32)
            prev[0] = -1
            prev[1:] = last_eod[:-1]
            positions = positions - prev - 1
        if reset_attention_mask:
            segment_ids = np.zeros(n, dtype=np.int32)
            np.cumsum(is_eod[:-1], out=segment_ids[1:])
    return loss_mask, positions.astype(np.int32), segment_ids


class GPTDataset:
    """GPT samples over (a split of) an indexed dataset, identical to Megatron-LM's GPTDataset.

    Follows ``GPTDataset`` in Megatron-LM ``megatron/core/datasets/gpt_dataset.py`` (index
    building without the on-disk cache).

    Args:
        indexed_dataset: an ``IndexedDataset`` (or any object with ``sequence_lengths`` int32
            [S] and ``get(idx, offset, length) -> 1-D int array``).
        document_ids: 1-D int array, the sequence ids of this split (Megatron's
            ``indexed_indices``; one sequence = one document when preprocessed without
            sentence splitting).
        num_samples: samples wanted; the documents are repeated over as many epochs as needed.
            None gives exactly one epoch. ``len(self) >= num_samples``.
        seq_length: tokens per sample.
        seed: seed of the ``np.random.RandomState`` used for all shuffles.
        eod_id: end-of-document token id.
        reset_position_ids / reset_attention_mask / eod_mask_loss: as Megatron's flags.
        add_extra_token_to_sequence: read ``seq_length + 1`` tokens per sample (Megatron default)
            so tokens and labels are both full; else labels are shifted tokens with the last
            label padded and masked.
        drop_last_partial_sequence: Megatron's default True (False pads the last sample).
        pad_id: id marking padding in the raw sample (-1 like Megatron without a pad token).

    Attributes:
        document_index int32 [num_epochs * len(document_ids)], sample_index int32 [len + 1, 2],
        shuffle_index uint32 [len], num_epochs, num_tokens_per_epoch, separate_final_epoch.

    ``__getitem__(i)`` returns a dict of numpy arrays: ``tokens`` int32 [seq_length],
    ``labels`` int32 [seq_length], ``loss_mask`` float32 [seq_length], ``position_ids`` int32
    [seq_length] and, only when ``reset_attention_mask``, ``segment_ids`` int32 [seq_length].

    Raises:
        ValueError: empty/out-of-range ``document_ids``, no tokens, bad ``seq_length`` or
            ``num_samples``.  IndexError: sample index out of range.
    """

    def __init__(self, indexed_dataset, document_ids, num_samples: Optional[int],
                 seq_length: int, seed: int, eod_id: int, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                 add_extra_token_to_sequence: bool = True,
                 drop_last_partial_sequence: bool = True, pad_id: int = _PAD_TOKEN_ID) -> None:
        self.dataset = indexed_dataset
        sizes = np.asarray(indexed_dataset.sequence_lengths)
        docs = np.asarray(document_ids)
        if docs.ndim != 1 or docs.size == 0 or not np.issubdtype(docs.dtype, np.integer):
            raise ValueError("document_ids must be a non-empty 1-D integer array")
        if docs.min() < 0 or docs.max() >= sizes.shape[0]:
            raise ValueError(
                f"document_ids must lie in [0, {sizes.shape[0]}) (the dataset's sequences), got "
                f"[{docs.min()}, {docs.max()}]"
            )
        if int(seq_length) < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if num_samples is not None and int(num_samples) < 0:
            raise ValueError(f"num_samples must be >= 0 or None, got {num_samples}")
        self.indices = docs.astype(np.int32)
        self.num_samples = None if num_samples is None else int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.eod_id = int(eod_id)
        self.reset_position_ids = bool(reset_position_ids)
        self.reset_attention_mask = bool(reset_attention_mask)
        self.eod_mask_loss = bool(eod_mask_loss)
        self.add_extra_token_to_sequence = bool(add_extra_token_to_sequence)
        self.drop_last_partial_sequence = bool(drop_last_partial_sequence)
        self.pad_id = int(pad_id)
        self.document_index, self.sample_index, self.shuffle_index = self._build_indices(sizes)

    def _build_indices(self, sizes: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Megatron ``GPTDataset._build_document_sample_shuffle_indices``."""
        extra = int(self.add_extra_token_to_sequence)
        L = self.seq_length
        tokens_per_epoch = int(np.sum(sizes[self.indices], dtype=np.int64))
        if tokens_per_epoch <= 0:
            raise ValueError("the documents given to GPTDataset hold no tokens")
        num_epochs = get_num_epochs(tokens_per_epoch, self.num_samples, L,
                                    self.add_extra_token_to_sequence)
        self.num_tokens_per_epoch = tokens_per_epoch
        self.num_epochs = num_epochs
        separate_final_epoch = False
        num_samples_sans_final_epoch = 0
        if num_epochs > 1:
            num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // L
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (tokens_per_epoch - extra) // L
            if not 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1:
                raise RuntimeError("inconsistent epoch arithmetic (Megatron asserts this too)")
            separate_final_epoch = num_samples_from_final_epoch < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch
            )
        self.separate_final_epoch = separate_final_epoch

        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
        sample_index = build_sample_index(sizes, document_index, L, num_epochs, tokens_per_epoch,
                                          self.drop_last_partial_sequence,
                                          self.add_extra_token_to_sequence)
        n = sample_index.shape[0] - 1
        if separate_final_epoch:
            shuffle_index = build_shuffle_index(num_samples_sans_final_epoch, n, rng)
        else:
            shuffle_index = build_shuffle_index(n, n, rng)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def get_raw_sample(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        """Tokens int64 [seq_length + extra] (pad_id-padded) and the sequence ids they come from
        (Megatron ``_query_document_sample_shuffle_indices``)."""
        i = normalize_index(idx, len(self), "sample {idx} out of range for a dataset of {n} samples")
        extra = int(self.add_extra_token_to_sequence)
        j = int(self.shuffle_index[i])
        beg, beg_off = (int(x) for x in self.sample_index[j])
        end, end_off = (int(x) for x in self.sample_index[j + 1])
        get = self.dataset.get
        doc_ids, parts = [], []
        if beg == end:
            d = int(self.document_index[beg])
            doc_ids.append(d)
            parts.append(get(d, offset=beg_off, length=end_off - beg_off + extra))
        else:
            for k in range(beg, end + 1):
                d = int(self.document_index[k])
                doc_ids.append(d)
                offset = beg_off if k == beg else 0
                length = end_off + extra if k == end else None
                parts.append(get(d, offset=offset, length=length))
        want = self.seq_length + extra
        have = sum(len(p) for p in parts)
        if have < want:
            parts.append(np.full(want - have, self.pad_id, dtype=np.int64))
        return (np.concatenate(parts).astype(np.int64, copy=False),
                np.asarray(doc_ids, dtype=np.int64))

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        text, _ = self.get_raw_sample(idx)
        if self.add_extra_token_to_sequence:
            tokens = text[:-1].copy()
            labels = text[1:].copy()
        else:
            tokens = text.copy()
            labels = np.roll(text, -1)
            labels[-1] = self.pad_id
        loss_mask, position_ids, segment_ids = get_ltor_masks_and_position_ids(
            tokens, self.eod_id, self.reset_position_ids, self.reset_attention_mask,
            self.eod_mask_loss)
        loss_mask[labels == self.pad_id] = 0.0
        tokens[tokens == self.pad_id] = 0
        labels[labels == self.pad_id] = 0
        out = {
            "tokens": tokens.astype(np.int32),
            "labels": labels.astype(np.int32),
            "loss_mask": loss_mask,
            "position_ids": position_ids,
        }
        if segment_ids is not None:
            out["segment_ids"] = segment_ids
        return out


class MockGPTLowLevelDataset:
    """Synthetic stand-in for an ``IndexedDataset`` (Megatron ``MockGPTLowLevelDataset``).

    Document ``i`` has ``sequence_lengths[i]`` tokens, lengths drawn with
    ``np.random.default_rng(seed).integers(1, max_document_length)``; its tokens are
    ``1, 2, 3, ...`` (wrapped into ``[1, vocab_size - 1]``) followed by ``eod_id``. With
    ``num_documents=100000, max_document_length=4096, seed=0`` and ``vocab_size >= 4096`` this
    is exactly Megatron's mock data.

    Raises:
        ValueError: vocab_size < 2, num_documents < 1 or max_document_length < 2.
    """

    def __init__(self, vocab_size: int, eod_id: int = 0, num_documents: int = 1000,
                 max_document_length: int = 4096, seed: int = 0) -> None:
        if vocab_size < 2 or num_documents < 1 or max_document_length < 2:
            raise ValueError("MockGPTLowLevelDataset needs vocab_size >= 2, num_documents >= 1, "
                             "max_document_length >= 2")
        self.vocab_size = int(vocab_size)
        self.eod_id = int(eod_id)
        rng = np.random.default_rng(seed=seed)
        self.sequence_lengths = rng.integers(low=1, high=max_document_length,
                                             size=num_documents, dtype=np.int32)

    def __len__(self) -> int:
        return self.sequence_lengths.shape[0]

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        body = np.arange(length - 1, dtype=np.int64) % (self.vocab_size - 1) + 1
        return np.concatenate([body, np.array([self.eod_id], dtype=np.int64)])

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx`` (int64)."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset:offset + length]


class MockGPTDataset(GPTDataset):
    """``GPTDataset`` over ``MockGPTLowLevelDataset`` (Megatron ``MockGPTDataset``): the same
    sample dict, deterministic for a given ``seed``, no files needed.

    Args:
        num_samples, seq_length, seed: as ``GPTDataset``.
        vocab_size: ids stay in ``[0, vocab_size)``.
        eod_id: id ending each mock document (default 0).
        document_ids: mock documents to use (default all).
        num_documents, max_document_length: size of the mock corpus (Megatron: 100000, 4096;
            the default 1000 documents keep index building cheap).
        **kwargs: the remaining ``GPTDataset`` flags.
    """

    def __init__(self, num_samples: Optional[int], seq_length: int, vocab_size: int,
                 seed: int = 1234, eod_id: int = 0, document_ids=None,
                 num_documents: int = 1000, max_document_length: int = 4096, **kwargs) -> None:
        low = MockGPTLowLevelDataset(vocab_size, eod_id, num_documents, max_document_length)
        if document_ids is None:
            document_ids = np.arange(len(low), dtype=np.int32)
        super().__init__(low, document_ids, num_samples, seq_length, seed, eod_id, **kwargs)
