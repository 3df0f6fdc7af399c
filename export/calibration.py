"""Calibration and evaluation data for post-training quantization: a split portion of a
tokenized dataset prefix (:func:`portion_dataset`, Megatron's ``BlendedMegatronDatasetBuilder``
split rule), its batches (:func:`make_batches`), the calibration forward loop ModelOpt's
``mtq.quantize`` takes (:func:`calibration_loop`) and held-out perplexity
(:func:`perplexity`) of a ``transformers`` model. Used by the ``quantize`` and
``check-unified`` commands; torch is imported lazily.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import numpy as np

from jmegatron.data.blended_dataset import convert_split_vector_to_split_matrix, parse_and_normalize_split
from jmegatron.data.gpt_dataset import GPTDataset
from jmegatron.data.indexed_dataset import IndexedDataset
from jmegatron.export.common import ExportError

SPLIT_INDEX = {"train": 0, "valid": 1, "test": 2}  # a portion name -> its row of the split matrix


@dataclasses.dataclass
class Portion:
    """One split portion of a dataset prefix: its GPTDataset and where it lies."""

    dataset: Any          # jmegatron.data.gpt_dataset.GPTDataset
    prefix: str
    split: str
    name: str             # "train" | "valid" | "test"
    sequences: tuple      # [begin, end) sequence ids of the portion
    num_sequences: int    # sequences in the prefix
    tokens: int           # tokens in the portion


def portion_dataset(prefix: str, split: str, name: str, num_samples: Optional[int], seq_length: int,
                    seed: int, eod_id: int, *, reset_position_ids: bool = False,
                    eod_mask_loss: bool = False) -> Portion:
    """The :class:`jmegatron.data.gpt_dataset.GPTDataset` over the ``name`` portion of ``prefix``.

    The portion is the contiguous sequence range ``[round(begin * N), round(end * N))`` that
    ``split`` (``"949,50,1"`` style) gives ``name`` among the prefix's ``N`` sequences, the
    rule of Megatron's ``BlendedMegatronDatasetBuilder`` (so the train portion is what
    training read and the test portion is text it never saw). ``num_samples`` None gives one
    epoch (no repeated text); otherwise the documents repeat over as many epochs as needed.
    Samples: ``tokens``/``labels``/``position_ids`` int32 [seq_length], ``loss_mask`` float32.

    Raises ExportError for a bad ``split`` or an empty portion (message suggests ``--split``).
    """
    try:
        bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[SPLIT_INDEX[name]]
    except ValueError as e:
        raise ExportError(f"--split: {e}") from e
    low = IndexedDataset(prefix)
    n = int(low.sequence_lengths.shape[0])
    lo, hi = (0, 0) if bounds is None else (int(round(bounds[0] * float(n))), int(round(bounds[1] * float(n))))
    tokens = int(np.sum(low.sequence_lengths[lo:hi], dtype=np.int64))
    if hi <= lo or tokens == 0:
        raise ExportError(f"split={split!r} gives the {name} portion of {prefix} no text ({n} sequences in all); "
                          f"pass --split with a larger {name} share (e.g. --split 90,5,5) or a dataset with more "
                          "documents")
    ds = GPTDataset(low, np.arange(lo, hi, dtype=np.int32), num_samples, seq_length, seed, eod_id,
                    reset_position_ids=reset_position_ids, eod_mask_loss=eod_mask_loss)
    return Portion(ds, prefix, split, name, (lo, hi), n, tokens)


def make_batches(dataset, num_samples: int, batch_size: int, vocab_size: int) -> list[dict]:
    """The first ``num_samples`` samples of ``dataset`` (in its shuffled order) as batches of
    ``batch_size`` (the last may be smaller): dicts of int64 ``np.ndarray`` ``tokens``,
    ``labels``, ``position_ids`` [b, seq] and float32 ``loss_mask`` [b, seq].
    Raises ExportError when a token id is >= ``vocab_size`` (data tokenized with another
    tokenizer)."""
    n = min(int(num_samples), len(dataset))
    batches = []
    for start in range(0, n, batch_size):
        samples = [dataset[i] for i in range(start, min(start + batch_size, n))]
        batch = {k: np.stack([s[k] for s in samples]).astype(np.float32 if k == "loss_mask" else np.int64)
                 for k in ("tokens", "labels", "loss_mask", "position_ids")}
        top = int(max(batch["tokens"].max(), batch["labels"].max()))
        if top >= vocab_size:
            raise ExportError(f"{dataset.dataset.path_prefix}: token id {top} >= the model's vocabulary "
                              f"{vocab_size}; the data was tokenized with another tokenizer")
        batches.append(batch)
    return batches


def _forward_logits(model, batch: dict, device):
    import torch

    ids = torch.from_numpy(batch["tokens"]).to(device)
    pos = torch.from_numpy(batch["position_ids"]).to(device)
    return model(input_ids=ids, position_ids=pos, use_cache=False).logits


def calibration_loop(batches: Sequence[dict], device="cpu"):
    """The ``forward_loop(model)`` handed to ``mtq.quantize``: one no-grad forward pass per
    calibration batch (``input_ids``/``position_ids`` [b, seq])."""
    import torch

    def forward_loop(model) -> None:
        with torch.no_grad():
            for batch in batches:
                _forward_logits(model, batch, device)

    return forward_loop


def perplexity(model, batches: Sequence[dict], device="cpu") -> dict:
    """Token-mean cross-entropy (nats) of ``model`` over ``batches`` (labels weighted by
    ``loss_mask``, summed in float64) and its exponential: ``{"loss", "ppl", "tokens"}``.
    Raises ValueError when the batches hold no counted token."""
    import torch

    total, count = 0.0, 0.0
    with torch.no_grad():
        for batch in batches:
            logits = _forward_logits(model, batch, device).float()
            labels = torch.from_numpy(batch["labels"]).to(device)
            mask = torch.from_numpy(batch["loss_mask"]).to(device)
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                    reduction="none")
            total += float((nll * mask.reshape(-1)).double().sum())
            count += float(mask.double().sum())
    if count == 0:
        raise ValueError("perplexity: the evaluation batches hold no token with loss_mask > 0")
    loss = total / count
    return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else float("inf"), "tokens": int(count)}
