"""Fill-in-the-middle samples: GPT samples whose documents are cut into prefix, middle and suffix
and reordered around sentinel tokens (Bavarian et al. 2022, "Efficient Training of Language
Models to Fill in the Middle").

Follows Megatron-LM ``megatron/training/datasets/fim_dataset.py`` (``GPTFIMDataset``) with the
arguments of ``megatron/training/arguments.py`` (``--fim-rate``, ``--fim-spm-rate``,
``--fim-split-sample``, ``--fim-fragment-rate``, ``--fim-no-prefix``, ``--fim-*-token``):

* the raw sample (``seq_length + 1`` tokens of ``GPTDataset``) is cut at every ``eod`` token
  (``fim_extra_tokens["eod"]``) into segments, each transformed on its own, the ``eod`` tokens
  kept between them;
* a segment is transformed with probability ``fim_rate``: its text (special tokens dropped) is
  cut at two character positions drawn uniformly from ``[0, len(text)]`` and sorted, the three
  parts are tokenized again and laid out as PSM ``<prefix> P <suffix> S <middle> M`` or, with
  probability ``fim_spm_rate``, SPM ``<prefix> <suffix> S <middle> P M`` (the paper's SPM variant
  2, Megatron's order); a segment whose text starts with ``fim_no_prefix`` stays as it is;
* with ``fim_split_sample`` (a token) a segment holding that token is transformed as a whole with
  probability ``fim_rate`` and then each fragment between those tokens with probability
  ``fim_fragment_rate`` (e.g. the files of a repository), the split tokens kept in place;
* the result is cut to the raw sample's length or padded at the end with ``fim_extra_tokens["pad"]``,
  whose labels do not count in the loss.

Where this differs from Megatron, on purpose: each sample draws from its own
``np.random.RandomState`` seeded by ``(seed, sample index)``, so a sample is the same whichever
rank, worker or resumed run reads it (Megatron's one generator per dataset depends on the order
samples are read); empty segments and fragments (two ``eod`` tokens in a row) keep their
separators and are not transformed (Megatron drops the ``eod`` of an empty segment and gives an
empty trailing segment three sentinels); padding is left out of the loss (Megatron masks only the
tokenizer's own pad id).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import numpy as np

from jmegatron.data.gpt_dataset import GPTDataset

__all__ = ["FIM_TOKEN_KEYS", "GPTFIMDataset"]

FIM_TOKEN_KEYS = ("prefix", "middle", "suffix", "pad", "eod")
_CONFIG_NAMES = {"prefix": "fim_prefix_token", "middle": "fim_middle_token", "suffix": "fim_suffix_token",
                 "pad": "fim_pad_token", "eod": "fim_eod_token"}


def _check_rate(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"config.{name}={value!r} must be a probability in [0, 1]")
    return float(value)


class GPTFIMDataset(GPTDataset):
    """``GPTDataset`` samples with the fill-in-the-middle transformation (module doc).

    Args:
        indexed_dataset, document_ids, num_samples, seq_length, seed, eod_id, **gpt_kwargs:
            as :class:`~jmegatron.data.gpt_dataset.GPTDataset` (the same sample index).
        tokenizer: an ``HFTokenizer`` (:mod:`jmegatron.data.tokenizer`): the transformation
            decodes a segment to text and tokenizes its parts again.
        fim_rate: probability to transform a segment (Megatron's ``--fim-rate``).
        fim_spm_rate: probability that a transformed segment is SPM rather than PSM.
        fim_extra_tokens: ``{"prefix", "middle", "suffix", "pad", "eod"}`` -> token strings
            (Megatron's ``fim_extra_tokens``; default ``<fim_prefix>``, ``<fim_middle>``,
            ``<fim_suffix>``, ``<fim_pad>``, ``<|endoftext|>``).
        fim_split_sample: a token at which segments are split into fragments, or None.
        fim_fragment_rate: probability to transform each fragment (needed with
            ``fim_split_sample``).
        fim_no_prefix: segments whose text starts with this string are left as they are.

    ``__getitem__(i)`` returns what ``GPTDataset`` returns for the transformed tokens:
    ``tokens``, ``labels``, ``position_ids`` int32 [seq_length], ``loss_mask`` float32
    [seq_length] (0 where the label is the FIM pad token), and ``segment_ids`` with
    ``reset_attention_mask``.

    Raises:
        ValueError: a rate outside [0, 1], ``fim_split_sample`` without ``fim_fragment_rate``, a
            tokenizer without token strings (NullTokenizer), or a FIM token the vocabulary lacks
            (naming the config field).
    """

    def __init__(self, indexed_dataset, document_ids, num_samples: Optional[int], seq_length: int, seed: int,
                 eod_id: int, *, tokenizer, fim_rate: float = 0.5, fim_spm_rate: float = 0.5,
                 fim_extra_tokens: Optional[Mapping[str, str]] = None, fim_split_sample: Optional[str] = None,
                 fim_fragment_rate: Optional[float] = None, fim_no_prefix: Optional[str] = None,
                 **gpt_kwargs) -> None:
        self.fim_rate = _check_rate("fim_rate", fim_rate)
        self.fim_spm_rate = _check_rate("fim_spm_rate", fim_spm_rate)
        if fim_split_sample is not None and fim_fragment_rate is None:
            raise ValueError("config.fim_split_sample is set but config.fim_fragment_rate is not; give the "
                             "probability to transform each fragment")
        self.fim_fragment_rate = None if fim_fragment_rate is None else _check_rate("fim_fragment_rate",
                                                                                    fim_fragment_rate)
        self.fim_no_prefix = fim_no_prefix
        backend = getattr(tokenizer, "tokenizer", None)
        if backend is None or not hasattr(backend, "token_to_id"):
            raise ValueError("config.fim_data=True needs a HuggingFaceTokenizer or GPT2BPETokenizer (the FIM "
                             f"transformation works on text); got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        names = dict(zip(FIM_TOKEN_KEYS, ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>",
                                          "<|endoftext|>")))
        names.update(fim_extra_tokens or {})
        ids = {}
        for key in FIM_TOKEN_KEYS:
            ids[key] = backend.token_to_id(names[key])
            if ids[key] is None:
                raise ValueError(f"config.{_CONFIG_NAMES[key]}={names[key]!r} is not a token of the tokenizer "
                                 f"{getattr(tokenizer, 'path', '') or ''}; add the FIM tokens to it as special "
                                 "tokens or name the ones it has")
        self.prefix_tok_id, self.middle_tok_id, self.suffix_tok_id = ids["prefix"], ids["middle"], ids["suffix"]
        self.pad_tok_id, self.eod_tok_id = ids["pad"], ids["eod"]
        self.fim_split_sample = None
        if fim_split_sample is not None:
            split = backend.token_to_id(fim_split_sample)
            if split is None:
                pieces = tokenizer.tokenize(fim_split_sample)
                if len(pieces) != 1:
                    raise ValueError(f"config.fim_split_sample={fim_split_sample!r} is {len(pieces)} tokens; it "
                                     "must be one token of the tokenizer")
                split = pieces[0]
            self.fim_split_sample = int(split)
        super().__init__(indexed_dataset, document_ids, num_samples, seq_length, seed, eod_id, **gpt_kwargs)

    def sample_rng(self, idx: int) -> np.random.RandomState:
        """The generator of sample ``idx``: ``RandomState(MT19937(SeedSequence([seed, idx])))``."""
        return np.random.RandomState(np.random.MT19937(np.random.SeedSequence([self.seed, int(idx) % len(self)])))

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.tokenize(text), dtype=np.int64)

    def _permute(self, seq: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        """Megatron's ``_permute`` without its per-part truncation (the dataset passes
        ``truncate_or_pad=False``); draws: transform?, two cut points, SPM?"""
        if not rng.binomial(1, rate):
            return seq
        text = self.tokenizer.tokenizer.decode([int(t) for t in seq], skip_special_tokens=True)
        if self.fim_no_prefix is not None and text.startswith(self.fim_no_prefix):
            return seq
        lo, hi = sorted(int(b) for b in rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = self._encode(text[:lo]), self._encode(text[lo:hi]), self._encode(text[hi:])
        if rng.binomial(1, self.fim_spm_rate):
            parts = ([self.prefix_tok_id, self.suffix_tok_id], suffix, [self.middle_tok_id], prefix, middle)
        else:
            parts = ([self.prefix_tok_id], prefix, [self.suffix_tok_id], suffix, [self.middle_tok_id], middle)
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])

    def _split_and_permute(self, seq: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """Megatron's ``_fim_split_and_permute_sequence``."""
        if self.fim_split_sample is None or not np.any(seq == self.fim_split_sample):
            return self._permute(seq, self.fim_rate, rng)
        if not rng.binomial(1, self.fim_rate):
            return seq
        return self._each_part(seq, self.fim_split_sample,
                               lambda part: self._permute(part, self.fim_fragment_rate, rng))

    @staticmethod
    def _each_part(seq: np.ndarray, separator: int, transform) -> np.ndarray:
        """``transform`` applied to every non-empty run between ``separator`` tokens, the
        separators kept in place."""
        out, start = [], 0
        for b in np.flatnonzero(seq == separator).tolist() + [seq.shape[0]]:
            if b > start:
                out.append(transform(seq[start:b]))
            if b < seq.shape[0]:
                out.append(np.asarray([separator], dtype=np.int64))
            start = b + 1
        return np.concatenate(out) if out else seq[:0]

    def get_raw_sample(self, idx: int):
        """The transformed tokens int64 [seq_length + extra] and the sequence ids they come from
        (Megatron ``GPTFIMDataset._query_document_sample_shuffle_indices``)."""
        text, doc_ids = super().get_raw_sample(idx)
        n = int(np.sum(text != self.pad_id)) if self.pad_id < 0 else text.shape[0]  # the reader's own padding stays
        rng = self.sample_rng(idx)
        out = self._each_part(text[:n], self.eod_tok_id, lambda seg: self._split_and_permute(seg, rng))
        if out.shape[0] >= n:
            out = out[:n]
        else:
            out = np.concatenate([out, np.full(n - out.shape[0], self.pad_tok_id, dtype=np.int64)])
        return np.concatenate([out, text[n:]]), doc_ids

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        out = super().__getitem__(idx)
        out["loss_mask"][out["labels"] == self.pad_tok_id] = 0.0
        return out
