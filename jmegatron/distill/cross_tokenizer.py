"""Distillation across tokenizers: the student's positions matched to the teacher's by text.

A teacher with another tokenizer reads the same text as the student, tokenized its own
way, so position ``t`` of the student and position ``t`` of the teacher are not the same
prefix. Universal Logit Distillation (Boizard et al. 2024, arXiv 2402.12030) compares
the two next-token distributions by their sorted probabilities
(:func:`jmegatron.distill.losses.uld_loss`) and pairs positions by index inside an
answer; on running text the pairs must come from the text itself. Here, as TRL's GOLD
trainer aligns the two token sequences by their character spans, student position ``t``
(its input token ``t``, predicting token ``t + 1``) is paired with the teacher position
whose token ends at the same character: both models then predict the continuation of
the same text prefix. Positions where the teacher has no token boundary are left out of
the loss.

The text of a student sample is its tokens decoded (special tokens, e.g. the
end-of-document token between documents, decode to their text); prefix ends come from
decoding every prefix (one ``decode_batch`` call), so any tokenizer works; a prefix
whose decoded text is not a prefix of the whole (a character cut inside its bytes) has
no end and is left out.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def token_end_offsets(tokenizer: Any, ids: np.ndarray) -> tuple[str, np.ndarray]:
    """(the text of ``ids``, int64 ``[n]``: the character where each token's prefix text
    ends, -1 where the prefix's text is not a prefix of the whole). ``tokenizer``: an
    :class:`jmegatron.data.tokenizer.HFTokenizer`."""
    ids = [int(i) for i in ids]
    tok = tokenizer.tokenizer
    text = tok.decode(ids, skip_special_tokens=False)
    prefixes = tok.decode_batch([ids[:k + 1] for k in range(len(ids))], skip_special_tokens=False)
    ends = np.array([len(p) if text.startswith(p) else -1 for p in prefixes], np.int64)
    return text, ends


def vocabulary_map(teacher_tokenizer: Any, student_tokenizer: Any, size: int) -> np.ndarray:
    """int32 ``[size]`` (the teacher's padded vocabulary): each teacher token's id in the
    student's vocabulary where a token of the same string exists (byte-level BPEs share
    the byte alphabet, so equal strings are equal bytes), -1 elsewhere and for padding
    ids: what TRL's GOLD matches tokens by."""
    student = student_tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    out = np.full(size, -1, np.int32)
    for token, i in teacher_tokenizer.tokenizer.get_vocab(with_added_tokens=True).items():
        if i < size and token in student:
            out[i] = student[token]
    return out


def align_positions(student_tokenizer: Any, teacher_tokenizer: Any, student_ids: np.ndarray,
                    teacher_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The teacher's input for a student sample and the position pairing.

    Returns ``(teacher_ids, index)``: ``teacher_ids`` int32 ``[teacher_length]``, the
    sample's text tokenized by the teacher (no special tokens added), cut to
    ``teacher_length`` or padded with the teacher's end-of-document id after it (causal:
    padding changes no earlier position); ``index`` int32 ``[len(student_ids)]``, for each
    student position the teacher position whose token ends at the same character of the
    text (-1: none, or beyond ``teacher_length``)."""
    text, ends = token_end_offsets(student_tokenizer, student_ids)
    enc = teacher_tokenizer.tokenizer.encode(text, add_special_tokens=False)
    t_ids = np.asarray(enc.ids[:teacher_length], np.int32)
    where = {}
    for j, (_, end) in enumerate(enc.offsets[:teacher_length]):
        where.setdefault(int(end), j)  # the first teacher token ending there (zero-width tokens follow it)
    index = np.array([where.get(int(e), -1) if e >= 0 else -1 for e in ends], np.int32)
    padded = np.full(teacher_length, teacher_tokenizer.eod, np.int32)
    padded[:len(t_ids)] = t_ids
    return padded, index
