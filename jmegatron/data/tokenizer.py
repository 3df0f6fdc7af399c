"""Tokenizer wrapper over a HuggingFace ``tokenizers`` tokenizer.json, with Megatron's interface.

Megatron-LM's tokenizers (``megatron/core/tokenizers`` / ``megatron/training/tokenizer``) expose
``vocab_size``, ``eod``, ``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``; this
module offers the same surface for a ``tokenizer.json`` or a transformers ``save_pretrained``
folder (the kind ``--tokenizer-type HuggingFaceTokenizer`` loads in Megatron; its end-of-document
token is the folder's ``eos_token``), plus a small trainer for a byte-level BPE one.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, List, Optional, Sequence, Union

__all__ = ["EOD_TOKEN", "HFTokenizer", "TOKENIZER_FILES", "load_tokenizer", "special_tokens",
           "train_bpe_tokenizer", "iter_documents"]

EOD_TOKEN = "<|endoftext|>"


class HFTokenizer:
    """Megatron-style facade over ``tokenizers.Tokenizer``.

    Args:
        tokenizer: a loaded ``tokenizers.Tokenizer``.
        eod_token: the end-of-document special token (default ``"<|endoftext|>"``).
        path: where it was loaded from (for messages / pickling).
        bos_token: the beginning-of-sequence token, if the tokenizer has one.

    Attributes:
        vocab_size (int): number of ids, added special tokens included.
        eod (int): id of ``eod_token``.
        bos (int or None): id of ``bos_token``.

    Raises:
        ValueError: ``eod_token`` (or a given ``bos_token``) is not in the vocabulary.
    """

    def __init__(self, tokenizer, eod_token: str = EOD_TOKEN, path: Optional[str] = None,
                 bos_token: Optional[str] = None):
        self._tok = tokenizer
        self.path = path
        self.eod_token = eod_token
        self.bos_token = bos_token
        self.bos = None if bos_token is None else tokenizer.token_to_id(bos_token)
        if bos_token is not None and self.bos is None:
            raise ValueError(f"tokenizer {path or ''}: its bos_token {bos_token!r} is not in the vocabulary")
        eod = tokenizer.token_to_id(eod_token)
        if eod is None:
            raise ValueError(
                f"tokenizer {path or ''} has no {eod_token!r} token; retrain it with "
                f"`python -m jmegatron.tools.train_tokenizer` or pass eod_token=..."
            )
        self.eod = int(eod)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def tokenizer(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` (list[int]); no special tokens are added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Union[Sequence[int], "object"]) -> str:
        """Text of ``ids`` (any int sequence or 1-D integer array); special tokens are kept."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self):
        return {"json": self._tok.to_str(), "eod_token": self.eod_token, "path": self.path,
                "bos_token": self.bos_token}

    def __setstate__(self, state):
        from tokenizers import Tokenizer

        self.__init__(Tokenizer.from_str(state["json"]), state["eod_token"], state["path"], state.get("bos_token"))


def load_tokenizer(path: Union[str, os.PathLike], eod_token: Optional[str] = None) -> HFTokenizer:
    """Load a HuggingFace tokenizer: a ``tokenizer.json`` file, or a folder holding one (a
    ``save_pretrained`` folder: its ``tokenizer_config.json`` names the special tokens).

    The end-of-document token (Megatron's ``eod``) is ``eod_token`` when given, else the
    ``eos_token`` of the ``tokenizer_config.json`` beside the ``tokenizer.json``, else
    ``"<|endoftext|>"`` when the vocabulary has it; the ``bos_token`` likewise from
    ``tokenizer_config.json``.

    Returns:
        HFTokenizer with ``.vocab_size``, ``.eod``, ``.bos``, ``.tokenize``, ``.detokenize``.

    Raises:
        FileNotFoundError: no such file.  ValueError: unreadable JSON, or no end-of-document
        token (none given, none in tokenizer_config.json, no ``"<|endoftext|>"``).
    """
    from tokenizers import Tokenizer

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"tokenizer file not found: {path} (train one with "
            "`python -m jmegatron.tools.train_tokenizer`)"
        )
    try:
        tok = Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"{path}: not a valid HuggingFace tokenizer.json ({err})") from None
    special = special_tokens(os.path.dirname(path))
    if eod_token is None:
        eod_token = special.get("eos_token")
    if eod_token is None:
        if tok.token_to_id(EOD_TOKEN) is None:
            raise ValueError(
                f"tokenizer {path} has no end-of-document token: no tokenizer_config.json beside it names an "
                f"eos_token and it has no {EOD_TOKEN!r}; give its save_pretrained folder (whose "
                f"tokenizer_config.json names eos_token), or retrain it with `python -m jmegatron.tools.train_tokenizer`"
            )
        eod_token = EOD_TOKEN
    return HFTokenizer(tok, eod_token=eod_token, path=path, bos_token=special.get("bos_token"))


def special_tokens(folder: Union[str, os.PathLike]) -> dict:
    """``{"eos_token": str, "bos_token": str}`` (those present) of the ``tokenizer_config.json``
    in ``folder`` (a transformers ``save_pretrained`` folder); ``{}`` without one. Tokens given
    as ``{"content": ...}`` dicts are read as their content."""
    config = os.path.join(os.fspath(folder), "tokenizer_config.json")
    if not os.path.isfile(config):
        return {}
    with open(config) as f:
        conf = json.load(f)
    out = {}
    for key in ("eos_token", "bos_token"):
        value = conf.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


# The files of a transformers tokenizer folder that import-hf carries and export hf writes back.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def iter_documents(path: Union[str, os.PathLike], json_key: str = "text") -> Iterator[str]:
    """Documents of one input file: a .jsonl/.json file gives ``json_key`` of every non-blank
    line; any other file is one document (its whole UTF-8 text). Same reading rules as
    ``jmegatron.tools.preprocess_data`` (Megatron-LM ``tools/preprocess_data.py`` reads only
    JSON lines).

    Yields:
        str documents, in file order.

    Raises:
        ValueError: a JSON line is malformed or lacks ``json_key`` (message names file:line).
    """
    path = os.fspath(path)
    if path.endswith((".jsonl", ".json")):
        with open(path, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({err})") from None
                if not isinstance(obj, dict) or json_key not in obj:
                    raise ValueError(f"{path}:{lineno}: no {json_key!r} key")
                yield str(obj[json_key])
    else:
        with open(path, "r", encoding="utf-8") as f:
            yield f.read()


def train_bpe_tokenizer(
    files: Iterable[Union[str, os.PathLike]],
    vocab_size: int,
    out_path: Union[str, os.PathLike],
    min_frequency: int = 2,
    json_key: str = "text",
) -> HFTokenizer:
    """Train a GPT-2 style byte-level BPE tokenizer and save it as ``out_path`` (tokenizer.json).

    ByteLevel pre-tokenizer (no prefix space) and decoder, the 256 byte symbols as initial
    alphabet, and one special token ``"<|endoftext|>"`` (id 0). Plain-text files are one
    document each; .jsonl/.json files contribute ``json_key`` of each line. Training is
    deterministic for a given input.

    Args:
        files: input paths.  vocab_size: target size, special token included (>= 257).
        out_path: where to write the tokenizer.json.  min_frequency: minimum pair count to merge.

    Returns:
        The trained tokenizer as ``HFTokenizer`` (its vocab_size may be below the target when
        the corpus has too few distinct pairs).

    Raises:
        ValueError: ``vocab_size`` < 257 or no input files.  FileNotFoundError: missing input.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = [os.fspath(f) for f in files]
    if not files:
        raise ValueError("train_bpe_tokenizer: no input files")
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"tokenizer training input not found: {f}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least "
            f"{len(alphabet) + 1} (256 bytes + {EOD_TOKEN})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )

    def _texts():
        for f in files:
            yield from iter_documents(f, json_key)

    tok.train_from_iterator(_texts(), trainer=trainer)
    out_path = os.fspath(out_path)
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    tok.save(out_path)
    return HFTokenizer(tok, path=out_path)
