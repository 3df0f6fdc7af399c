"""Variable-length GPT samples: ByteMLPerf's ``GPTVariableDataset`` (``--variable-data``).

Follows ByteMLPerf ``byte_train_perf/Megatron-LM/megatron/core/datasets/gpt_dataset.py``
(``GPTVariableDataset.__getitem__``) and the padding of its ``batch_pad`` collate function
(``megatron/legacy/data/data_samplers.py``):

* sample ``i`` keeps the first ``L = seq_length - k * seq_length_step`` tokens of the full
  sample, ``k`` in 1..9 (``_get_rand_var_seq_length``), and appends EOD: ``tokens`` are the
  ``L`` tokens, ``labels`` the next ``L - 1`` tokens and then EOD; loss mask and position ids
  are Megatron's (``_get_ltor_masks_and_position_ids``) over those ``L`` tokens;
* ByteMLPerf draws ``k`` with ``numpy.random.randint(1, 10)`` from the process-global numpy
  state (so its lengths depend on worker scheduling); here ``k`` is a hash of (``seed``,
  ``i``), uniform on 1..9, so a resumed or re-run job sees the same lengths;
* ``--seq-length-min`` (``seq_length_min``): ByteMLPerf stores it on the dataset and draws
  without it; here it is the bound the shortest length, ``seq_length - 9 * seq_length_step``,
  must reach (checked once), so the lengths drawn are ByteMLPerf's;
* a batch is padded to its longest sample (:func:`jmegatron.data.loader.stack_samples`):
  tokens and labels 0, loss mask 0 (padding never counts), position ids continuing the
  sample's own (ByteMLPerf copies the longest sample's position ids, the same values
  without ``reset_position_ids``). ByteMLPerf pads each data-parallel rank's micro-batch on
  its own; jmegatron's step takes the global batch as one array, so it pads to the global
  batch's longest: the same losses (padding is masked and attention is causal), more
  padded FLOPs.

Every padded length is one of :attr:`GPTVariableDataset.lengths` (at most 9), so the
jitted step compiles at most once per length.
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele et al. 2014), on Python ints."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class GPTVariableDataset:
    """Wraps a GPT dataset of ``seq_length``-token samples (``GPTDataset``, ``MockGPTDataset``,
    ``BlendedDataset``) and cuts each sample to a drawn length.

    Args:
        dataset: ``dataset[i]`` gives ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
            (``[seq_length]``), as :class:`jmegatron.data.gpt_dataset.GPTDataset`.
        seq_length: tokens of the wrapped samples.
        seq_length_step: the length step (ByteMLPerf's ``--seq-length-step``).
        seq_length_min: the shortest length allowed (ByteMLPerf's ``--seq-length-min``; 1: any).
        seed: seeds the length draw.
        eod_id: end-of-document id appended as the last label.
        eod_mask_loss: as Megatron's flag (the last token's loss is masked if it is EOD).

    ``self[i]``: the wrapped sample's dict, every array cut to ``[sample_length(i)]``.

    Raises:
        ValueError: ``seq_length_step < 1``, or ``seq_length - 9 * seq_length_step`` below
            ``max(seq_length_min, 1)``.
    """

    MAX_STEPS = 9  # ByteMLPerf: numpy.random.randint(1, 10)

    def __init__(self, dataset: Any, seq_length: int, seq_length_step: int, seed: int, eod_id: int,
                 eod_mask_loss: bool = False, seq_length_min: int = 1) -> None:
        if seq_length_step < 1 or seq_length - self.MAX_STEPS * seq_length_step < 1:
            raise ValueError(f"seq_length_step={seq_length_step} must be >= 1 with seq_length - 9 x "
                             f"seq_length_step >= 1 (seq_length={seq_length})")
        if seq_length - self.MAX_STEPS * seq_length_step < seq_length_min:
            raise ValueError(f"seq_length_min={seq_length_min} exceeds the shortest length seq_length - 9 x "
                             f"seq_length_step = {seq_length - self.MAX_STEPS * seq_length_step}")
        self.dataset = dataset
        self.seq_length = int(seq_length)
        self.seq_length_step = int(seq_length_step)
        self.seq_length_min = int(seq_length_min)
        self.eod_id = int(eod_id)
        self.eod_mask_loss = bool(eod_mask_loss)
        self._key = _splitmix64(int(seed) & _MASK64)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Every length a sample (hence a padded batch) can have, longest first."""
        return tuple(self.seq_length - k * self.seq_length_step for k in range(1, self.MAX_STEPS + 1))

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_length(self, idx: int) -> int:
        """``seq_length - k * seq_length_step`` with ``k = 1 + hash(seed, idx) mod 9``."""
        k = 1 + _splitmix64(self._key ^ (int(idx) & _MASK64)) % self.MAX_STEPS
        return self.seq_length - k * self.seq_length_step

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        sample = self.dataset[idx]
        n = self.sample_length(idx)
        out = {key: np.asarray(value)[:n].copy() for key, value in sample.items()}
        out["labels"][n - 1] = self.eod_id
        # the last label is the appended EOD, never padding: its loss counts unless the
        # input token is EOD under eod_mask_loss (Megatron's mask on the tokens)
        masked = self.eod_mask_loss and int(out["tokens"][n - 1]) == self.eod_id
        out["loss_mask"][n - 1] = 0.0 if masked else 1.0
        return out
