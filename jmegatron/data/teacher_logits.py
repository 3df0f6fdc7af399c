"""A teacher's cached top-K log-probabilities per training sample (offline distillation).

The cache (written by ``python -m jmegatron.tools.cache_teacher_logits``) is a directory:

* ``ids.npy`` int32 and ``logprobs.npy`` float32, both ``[N, seq_length, K]``
  (``numpy.lib.format``, read memory-mapped): for training sample ``i`` (the index
  :class:`jmegatron.data.loader.BatchLoader` reads at ``consumed_samples + row``, blends
  included) and position ``t``, the teacher's K most likely next tokens and their
  log-probabilities, largest first;
* ``meta.json``: :data:`FORMAT_VERSION`, ``top_k``, ``num_samples``, ``seq_length``,
  ``vocab`` (the teacher's padded vocabulary), ``teacher`` (its path and iteration) and
  ``data`` (:func:`data_fingerprint`);
* ``progress.json``: ``{"samples_done": n}``, replaced atomically after the arrays up to
  ``n`` are flushed.

A cache built across tokenizers (``cache_teacher_logits --teacher-tokenizer``) adds
``"cross_tokenizer": true`` and ``teacher_tokenizer`` to the meta; ``vocab`` is then the
teacher's own, the ids are the teacher's token ids, and a position the text matching left
unpaired has every id -1 (:mod:`jmegatron.distill.cross_tokenizer`).

:class:`TeacherLogitsDataset` adds sample ``i``'s rows to the sample under
:data:`IDS_KEY` / :data:`LOGPROBS_KEY` after checking the cache against the run
(:func:`check_cache`: another dataset, sequence length or too few samples are refused,
naming the field).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import numpy as np

FORMAT_VERSION = 1
IDS_KEY = "teacher_topk_ids"
LOGPROBS_KEY = "teacher_topk_logprobs"
KEYS = (IDS_KEY, LOGPROBS_KEY)
# the config fields that define the training samples (jmegatron.data.builder.build_datasets)
DATA_FIELDS = ("data_path", "split", "seq_length", "seed", "mock_data", "tokenizer_type", "tokenizer_model",
               "vocab_size", "eod_mask_loss", "reset_position_ids", "reset_attention_mask")
FINGERPRINT_SAMPLES = 8  # samples whose tokens the data hash covers


class CacheMismatchError(ValueError):
    """A teacher-logits cache built for other data, another teacher or another K: the
    message names each field, the cache's value and the run's."""


def data_fingerprint(cfg: Any, dataset: Any) -> dict:
    """The config's :data:`DATA_FIELDS` and a SHA-256 of the tokens of the dataset's first
    :data:`FINGERPRINT_SAMPLES` samples (another seed, blend or corpus changes it)."""
    digest = hashlib.sha256()
    for i in range(min(FINGERPRINT_SAMPLES, len(dataset))):
        digest.update(np.ascontiguousarray(np.asarray(dataset[i]["tokens"], np.int64)).tobytes())
    return {**{f: getattr(cfg, f) for f in DATA_FIELDS}, "tokens_sha256": digest.hexdigest()}


def read_meta(directory: str) -> dict:
    """``directory``'s meta.json; FileNotFoundError naming the tool without one."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory!r} holds no teacher-logits cache (no meta.json): build it with "
                                f"python -m jmegatron.tools.cache_teacher_logits")
    with open(path) as f:
        return json.load(f)


def samples_done(directory: str) -> int:
    """The samples a cache holds completely (0 for a new one)."""
    path = os.path.join(directory, "progress.json")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        return int(json.load(f)["samples_done"])


def _differences(have: dict, want: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(want):
        a, b = have.get(key), want[key]
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: the cache has {a!r}, this run {b!r}")
    return out


def check_cache(directory: str, expected: dict, need_samples: Optional[int] = None) -> dict:
    """``directory``'s meta if every entry of ``expected`` (a subset of the meta, nested
    dicts compared entry by entry) matches and, with ``need_samples``, it holds that many
    complete samples. Raises CacheMismatchError naming every field that differs,
    FileNotFoundError without a cache."""
    meta = read_meta(directory)
    diff = _differences(meta, expected)
    if diff:
        raise CacheMismatchError(f"teacher-logits cache {directory!r} was built for another run: " + "; ".join(diff)
                                 + ". Build one for this run (python -m jmegatron.tools.cache_teacher_logits "
                                 "with this config, another --output).")
    if need_samples is not None:
        done = samples_done(directory)
        if done < need_samples:
            raise CacheMismatchError(f"teacher-logits cache {directory!r} holds {done} complete samples of "
                                     f"{meta['num_samples']}; this run reads {need_samples}: run "
                                     f"cache_teacher_logits again to finish it, or train for fewer samples")
    return meta


class TeacherLogitsDataset:
    """``base`` (a training split) with each sample's cached teacher top-K:
    ``dataset[i]`` is ``base[i]`` plus ``teacher_topk_ids`` int32 and
    ``teacher_topk_logprobs`` float32, both ``[seq_length, K]``. ``len`` is ``base``'s.

    Raises (at construction) CacheMismatchError when the cache was built for other data (its
    :func:`data_fingerprint` differs) or holds fewer than ``num_samples`` complete samples,
    FileNotFoundError without a cache."""

    def __init__(self, base: Any, directory: str, cfg: Any, num_samples: int):
        self.base = base
        self.meta = check_cache(directory, {"format_version": FORMAT_VERSION, "seq_length": int(cfg.seq_length),
                                            "data": data_fingerprint(cfg, base)}, need_samples=num_samples)
        self.ids = np.load(os.path.join(directory, "ids.npy"), mmap_mode="r")
        self.logprobs = np.load(os.path.join(directory, "logprobs.npy"), mmap_mode="r")

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        if i >= len(self.ids):
            raise IndexError(f"sample {i} is past the teacher-logits cache's {len(self.ids)} samples")
        return dict(self.base[i], **{IDS_KEY: np.asarray(self.ids[i]), LOGPROBS_KEY: np.asarray(self.logprobs[i])})
