"""Supervised fine-tuning data: chat conversations tokenized with the tokenizer's chat template,
stored as Megatron ``.bin/.idx`` with a per-token loss mask beside them, and packed several to a
``seq_length`` sample.

Follows Megatron-LM ``megatron/training/datasets/sft_dataset.py`` (``SFTDataset``: the
conversations of a sample concatenated, position ids restarting per conversation, the pack
truncated on the right or padded to ``seq_length + 1`` tokens, ``labels`` the pack shifted by
one, ``loss_mask`` 0 on prompts and padding, ``cu_seqlens`` the conversation boundaries) and
Megatron-LM PR #5017 (``megatron/core/datasets/sft_dataset.py``: pre-tokenized conversations
read from ``.bin/.idx`` like pretraining data, packed by a first-fit-decreasing bin packer).
Megatron's ``cu_seqlens`` are ``segment_ids`` here, the form the document mask of
``reset_attention_mask`` takes (:mod:`jmegatron.models.core_attention`).

On disk (written by ``python -m jmegatron.tools.preprocess_data --json-keys messages
--apply-chat-template``): ``P.bin/.idx`` holds one sequence (= one document) per conversation,
the token ids of its chat-template rendering; ``P_loss_mask.bin/.idx`` (:func:`loss_mask_prefix`)
holds uint8 flags with the same sequence lengths, 1 on the tokens the model is trained to
produce: every assistant turn's tokens after the assistant header, its end-of-turn token
included (:class:`ChatTemplateTokenizer`).

A sample: the conversations of one pack (:func:`pack_conversations`) concatenated, ``c`` of
them, ``n <= seq_length + 1`` tokens, padded with ``pad_id`` to ``seq_length + 1``;
``tokens = pack[:-1]``, ``labels = pack[1:]``; ``loss_mask[j]`` is the flag of ``labels[j]``,
0 where ``labels[j]`` is padding or the first token of the next conversation; ``position_ids``
count from 0 in every conversation and run on through the padding; ``segment_ids[j]`` is the
conversation of ``tokens[j]`` (0..c-1; the padding joins the last one, as Megatron's last
``cu_seqlens`` entry), so no conversation attends to another.
"""

from __future__ import annotations

import bisect
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from jmegatron.data.gpt_dataset import build_document_index, build_shuffle_index
from jmegatron.data.indexed_dataset import IndexedDataset

__all__ = [
    "LOSS_MASK_SUFFIX",
    "ROLES",
    "ChatTemplateTokenizer",
    "SFTDataset",
    "loss_mask_prefix",
    "pack_conversations",
    "split_conversations",
]

LOSS_MASK_SUFFIX = "_loss_mask"
ROLES = ("system", "user", "assistant", "tool")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def loss_mask_prefix(prefix: str) -> str:
    """The prefix of the uint8 loss-mask dataset that goes with the SFT token dataset ``prefix``."""
    return f"{os.fspath(prefix)}{LOSS_MASK_SUFFIX}"


def split_conversations(messages: Sequence[dict], where: str = "messages") -> List[List[dict]]:
    """Cut a message list into conversations, a new one at every ``system`` message (Megatron's
    ``SFTDataset._split_conversations``: one JSONL line may hold several conversations).
    Raises ValueError naming ``where`` for anything but a non-empty list of ``{"role",
    "content"}`` messages."""
    _check_messages(messages, where)
    out: List[List[dict]] = []
    for msg in messages:
        if msg["role"] == "system" or not out:
            out.append([msg])
        else:
            out[-1].append(msg)
    return out


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects, "
                         f"got {type(messages).__name__}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {k} must be {{'role': one of {list(ROLES)}, 'content': str}}, "
                             f"got {str(m)[:80]}")
        if m["role"] == "assistant" and not m["content"]:
            raise ValueError(f"{where}: message {k} is an empty assistant turn (Megatron refuses those too)")


class ChatTemplateTokenizer:
    """A Hugging Face tokenizer's chat template turned into token ids plus assistant flags.

    ``tokenize_conversation(messages)`` renders the messages with the template
    (transformers' ``apply_chat_template``) and finds each assistant turn's tokens:

    * a template with ``{% generation %}`` blocks: transformers' ``return_assistant_tokens_mask``
      (the template's author marks what the model generates);
    * any other template: by rendering prefixes. For assistant message ``i`` the text rendered
      from ``messages[:i]`` with the generation prompt ends where its reply starts and the text of
      ``messages[:i + 1]`` ends where it stops (its end-of-turn token and whatever the template puts
      after the reply included); a token is an assistant token when its characters overlap that
      span (tokens from one ``tokenizers`` encoding of the whole text, with offsets).

    Megatron's ``SFTTokenizer.tokenize_conversation`` (megatron/core/tokenizers/text/libraries/
    sft_tokenizer.py) renders each turn alone and masks the system and user turns; the prefix
    rendering gives the same split for templates that render turns independently and also handles
    those that do not (a first-turn BOS, a default system prompt).

    Args:
        tokenizer_model: a transformers ``save_pretrained`` folder or a ``tokenizer.json`` (the
            ``HuggingFaceTokenizer`` of :mod:`jmegatron.data.tokenizer`).
        chat_template: path of a Jinja template file, or the template text, used instead of the
            tokenizer's own ``chat_template``.

    Raises:
        ImportError: transformers is not installed (``pip install transformers``; the ``export``
            and ``test`` extras have it).
        ValueError: the tokenizer has no chat template and none is given.
    """

    def __init__(self, tokenizer_model: str, chat_template: Optional[str] = None) -> None:
        self.tokenizer_model = os.fspath(tokenizer_model)
        self.chat_template_arg = chat_template
        try:
            import transformers
        except ImportError as err:  # optional dependency: only the chat mode of preprocess_data needs it
            raise ImportError("the chat template needs transformers: pip install 'transformers>=4.45' "
                              f"(or the project's 'export' extra) ({err})") from None
        path = self.tokenizer_model
        if os.path.isdir(path):
            tok = transformers.AutoTokenizer.from_pretrained(path)
        elif os.path.isfile(path):
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        else:
            raise FileNotFoundError(f"--tokenizer-model {path}: no such file or folder")
        template = chat_template
        if template is not None and os.path.isfile(template):
            with open(template) as f:
                template = f.read()
        template = template or tok.chat_template
        if not template:
            raise ValueError(f"tokenizer {path} has no chat template (its tokenizer_config.json or "
                             "chat_template.jinja holds none); give one with --chat-template FILE")
        self._hf = tok
        self.chat_template = template
        self.uses_generation_tags = bool(_GENERATION_TAG.search(template))
        self.vocab_size = len(tok)

    def __getstate__(self):
        return {"tokenizer_model": self.tokenizer_model, "chat_template": self.chat_template_arg}

    def __setstate__(self, state):
        self.__init__(state["tokenizer_model"], state["chat_template"])

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self._hf.apply_chat_template(messages, tokenize=False, chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt)

    def tokenize_conversation(self, messages: Sequence[dict], where: str = "conversation"
                              ) -> Tuple[np.ndarray, np.ndarray]:
        """Token ids int64 [n] of ``messages`` rendered by the chat template and their loss flags
        uint8 [n] (1 on assistant tokens, see the class doc). ``where`` names the input in errors.

        Raises:
            ValueError: malformed messages (roles outside :data:`ROLES`, non-string content, an
                empty assistant turn), or a template whose rendering of a prefix of the
                conversation is not a prefix of the whole rendering (give a template with
                ``{% generation %}`` blocks).
        """
        messages = list(messages)
        _check_messages(messages, where)
        if self.uses_generation_tags:
            out = self._hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True,
                                               chat_template=self.chat_template)
            return (np.asarray(out["input_ids"], dtype=np.int64),
                    np.asarray(out["assistant_masks"], dtype=np.uint8))
        text = self._render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self._render(messages[:i], True) if i else ""
            end = self._render(messages[:i + 1], False)
            if not text.startswith(start) or not text.startswith(end) or len(end) < len(start):
                raise ValueError(
                    f"{where}: the chat template renders the conversation up to message {i} as text that "
                    "is not a prefix of the whole conversation's text, so the assistant tokens cannot be "
                    "found by rendering prefixes; use a template with {% generation %} blocks "
                    "(--chat-template FILE)")
            spans.append((len(start), len(end)))
        enc = self._hf.backend_tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(ids.shape[0], dtype=np.uint8)
        lo, hi = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)  # empty spans count at their start
        for a, b in spans:
            mask[(lo < b) & (hi > a)] = 1
        return ids, mask


def pack_conversations(lengths: np.ndarray, capacity: int) -> Tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing bin packing of conversations into packs of ``capacity`` tokens.

    The conversations are visited longest first (ties in the given order, a stable sort); each
    goes into the open pack with the least room that still holds it, or opens a new pack. A
    conversation longer than ``capacity`` counts as ``capacity`` (it is truncated on the right and
    fills a pack alone). This is the first-fit-decreasing family of Megatron-LM PR #5017's
    Modified First-Fit Decreasing packer (at most 11/9 of the optimal number of packs, plus one).

    Args:
        lengths: int [n] tokens of each conversation.  capacity: tokens per pack (>= 1).

    Returns:
        (offsets int64 [packs + 1], members int64 [n]): pack ``p`` holds the conversations
        ``members[offsets[p]:offsets[p + 1]]`` (positions into ``lengths``), longest first;
        packs in the order they were opened.

    Raises:
        ValueError: ``capacity < 1`` or a negative length.
    """
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), int(capacity))
    if int(capacity) < 1:
        raise ValueError(f"pack capacity must be >= 1 token, got {capacity}")
    if lengths.size and lengths.min() < 0:
        raise ValueError("conversation lengths must be >= 0")
    order = np.argsort(-lengths, kind="stable")
    free: List[Tuple[int, int]] = []  # (room left, pack id), sorted
    packs: List[List[int]] = []
    for i in order.tolist():
        need = int(lengths[i])
        k = bisect.bisect_left(free, (need, -1))
        if k < len(free):
            room, p = free.pop(k)
        else:
            room, p = int(capacity), len(packs)
            packs.append([])
        packs[p].append(i)
        if room - need > 0:
            bisect.insort(free, (room - need, p))
    offsets = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in packs], out=offsets[1:])
    members = np.fromiter((i for p in packs for i in p), dtype=np.int64, count=int(offsets[-1]))
    return offsets, members


class SFTDataset:
    """Packed SFT samples over (a split of) a chat dataset and its loss mask (module doc).

    Index building: for every epoch the split's conversations are shuffled with the run's
    ``np.random.RandomState(seed)`` (Megatron's ``_build_document_index``, one epoch at a time)
    and packed by :func:`pack_conversations` into packs of ``seq_length + 1`` tokens (the extra
    token gives the last label, as ``GPTDataset``'s ``add_extra_token_to_sequence``); epochs are
    added until there are ``num_samples`` packs; the packs are then visited in the order of
    Megatron's ``_build_shuffle_index`` drawn from the same generator. The same seed and files
    give the same samples on every rank and after a restart.

    Args:
        indexed_dataset: the token ``IndexedDataset`` (one conversation per sequence).
        document_ids: int [k], the conversations (sequence ids) of this split.
        num_samples: packs wanted (None: one epoch). ``len(self) >= num_samples``.
        seq_length: tokens per sample.  seed: the shuffles' seed.
        pad_id: the token id written into padding (its labels never count).
        loss_mask_dataset: the uint8 flags (default: opened at :func:`loss_mask_prefix` of
            ``indexed_dataset.path_prefix``).

    Attributes:
        pack_offsets int64 [packs + 1], pack_documents int32 (sequence ids of every pack, pack
        after pack), shuffle_index, num_epochs, num_truncated (conversations longer than
        ``seq_length + 1`` tokens, cut on the right, counted once per epoch).

    ``__getitem__(i)`` returns numpy arrays: ``tokens``, ``labels``, ``position_ids``,
    ``segment_ids`` int32 [seq_length] and ``loss_mask`` float32 [seq_length].

    Raises:
        ValueError: bad ``document_ids`` / ``seq_length`` / ``num_samples``, an empty split, or a
            loss mask that does not match the tokens.  FileNotFoundError: no loss-mask files.
        IndexError: sample index out of range.
    """

    def __init__(self, indexed_dataset, document_ids, num_samples: Optional[int], seq_length: int,
                 seed: int, pad_id: int, loss_mask_dataset=None) -> None:
        if loss_mask_dataset is None:
            loss_mask_dataset = self.open_loss_mask(indexed_dataset)
        sizes = np.asarray(indexed_dataset.sequence_lengths)
        mask_sizes = np.asarray(loss_mask_dataset.sequence_lengths)
        where = getattr(indexed_dataset, "path_prefix", "the SFT dataset")
        if mask_sizes.shape != sizes.shape or not np.array_equal(mask_sizes, sizes):
            raise ValueError(f"{where}: its loss mask has other sequence lengths than its tokens; "
                             "rebuild both with `python -m jmegatron.tools.preprocess_data --apply-chat-template`")
        docs = np.asarray(document_ids)
        if docs.ndim != 1 or docs.size == 0 or not np.issubdtype(docs.dtype, np.integer):
            raise ValueError("document_ids must be a non-empty 1-D integer array")
        if docs.min() < 0 or docs.max() >= sizes.shape[0]:
            raise ValueError(f"document_ids must lie in [0, {sizes.shape[0]}) (the dataset's conversations)")
        if int(seq_length) < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if num_samples is not None and int(num_samples) < 0:
            raise ValueError(f"num_samples must be >= 0 or None, got {num_samples}")
        if int(np.sum(sizes[docs], dtype=np.int64)) == 0:
            raise ValueError(f"{where}: the conversations of this split hold no tokens")
        self.dataset, self.loss_mask_dataset = indexed_dataset, loss_mask_dataset
        self.indices = docs.astype(np.int32)
        self.num_samples = None if num_samples is None else int(num_samples)
        self.seq_length, self.seed, self.pad_id = int(seq_length), int(seed), int(pad_id)
        self._build_indices(sizes)

    @staticmethod
    def open_loss_mask(indexed_dataset) -> IndexedDataset:
        """The loss-mask ``IndexedDataset`` beside ``indexed_dataset`` (:func:`loss_mask_prefix`).

        Raises:
            FileNotFoundError: naming the missing files and the command that writes them.
        """
        prefix = loss_mask_prefix(indexed_dataset.path_prefix)
        if not IndexedDataset.exists(prefix):
            raise FileNotFoundError(
                f"config.sft=True: {indexed_dataset.path_prefix} has no loss mask ({prefix}.bin/.idx); SFT data "
                "is written by `python -m jmegatron.tools.preprocess_data --json-keys messages --apply-chat-template`")
        return IndexedDataset(prefix)

    def _build_indices(self, sizes: np.ndarray) -> None:
        capacity = self.seq_length + 1
        rng = np.random.RandomState(self.seed)
        offsets, members, epochs = [np.zeros(1, dtype=np.int64)], [], 0
        num_packs = 0
        while epochs == 0 or (self.num_samples is not None and num_packs < self.num_samples):
            order = build_document_index(self.indices, 1, rng, False)
            off, mem = pack_conversations(sizes[order], capacity)
            offsets.append(off[1:] + offsets[-1][-1])
            members.append(order[mem])
            num_packs += off.shape[0] - 1
            epochs += 1
        self.num_epochs = epochs
        self.num_truncated = int(np.sum(sizes[self.indices] > capacity)) * epochs
        self.pack_offsets = np.concatenate(offsets)
        self.pack_documents = np.concatenate(members).astype(np.int32)
        self.shuffle_index = build_shuffle_index(num_packs, num_packs, rng)

    def __len__(self) -> int:
        return self.pack_offsets.shape[0] - 1

    def pack(self, idx: int) -> np.ndarray:
        """The sequence ids (int32) of the conversations of sample ``idx``, in sample order."""
        n = len(self)
        i = int(idx) + (n if int(idx) < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"sample {idx} out of range for an SFT dataset of {n} samples")
        p = int(self.shuffle_index[i])
        return self.pack_documents[self.pack_offsets[p]:self.pack_offsets[p + 1]]

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        S = self.seq_length
        capacity = S + 1
        tokens = np.full(capacity, self.pad_id, dtype=np.int64)
        flags = np.zeros(capacity, dtype=np.float32)
        positions = np.empty(capacity, dtype=np.int32)
        segments = np.empty(capacity, dtype=np.int32)
        used = 0
        for k, d in enumerate(self.pack(idx).tolist()):
            n = min(int(self.dataset.sequence_lengths[d]), capacity - used)
            tokens[used:used + n] = self.dataset.get(d, 0, n)
            flags[used:used + n] = self.loss_mask_dataset.get(d, 0, n)
            flags[used] = 0.0  # a conversation's first token is never predicted from the previous one
            positions[used:used + n] = np.arange(n, dtype=np.int32)
            segments[used:used + n] = k
            used += n
        if used < capacity:  # padding continues the last conversation (Megatron's last cu_seqlens entry)
            start = int(positions[used - 1]) + 1 if used else 0
            positions[used:] = np.arange(start, start + capacity - used, dtype=np.int32)
            segments[used:] = segments[used - 1] if used else 0
        return {
            "tokens": tokens[:S].astype(np.int32),
            "labels": tokens[1:].astype(np.int32),
            "loss_mask": flags[1:].copy(),
            "position_ids": positions[:S].copy(),
            "segment_ids": segments[:S].copy(),
        }
