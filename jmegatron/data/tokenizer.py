"""Tokenizers with Megatron's interface, chosen by Megatron's ``tokenizer_type`` names.

Megatron-LM's tokenizers (``megatron/training/tokenizer/tokenizer.py``, ``build_tokenizer``)
expose ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``;
this module offers the same surface for

* ``HuggingFaceTokenizer``: a ``tokenizer.json`` or a transformers ``save_pretrained`` folder
  (``tokenizer_model``; its end-of-document token is the folder's ``eos_token``);
* ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab_file`` (``vocab.json``) and
  ``merge_file`` (``merges.txt``), end of document ``<|endoftext|>`` (Megatron's
  ``_GPT2BPETokenizer``; built on ``tokenizers``' BPE with GPT-2's byte-level split, held to
  transformers' ``GPT2Tokenizer`` by tests/test_tokenizer.py);
* ``NullTokenizer``: ids written as space-separated integers, end of document = ``vocab_size``
  (Megatron's ``_NullTokenizer``, for mock and pre-tokenized data; ``vocab_size + 1`` ids);
* ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``: a
  ``sentencepiece`` model file (``tokenizer_model``), Megatron's three wrappers of it;
* ``TikTokenizer``: Megatron's JSON rank file (``tokenizer_model``) through ``tiktoken``;

plus a small trainer for a byte-level BPE ``tokenizer.json``. Megatron's BERT word-piece and
multimodal types are refused by name (a transformers ``save_pretrained`` folder of the same
tokenizer loads as ``HuggingFaceTokenizer``). Each type's vocabulary follows its own rule
(:func:`jmegatron.config.tokenizer_vocab_size` for those ``vocab_size`` decides).
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, List, Optional, Sequence, Union

from jmegatron.config import TOKENIZER_TYPES, tokenizer_type_of, tokenizer_vocab_size

__all__ = ["EOD_TOKEN", "GPTSentencePieceTokenizer", "HFTokenizer", "Llama2Tokenizer", "NullTokenizer",
           "SentencePieceTokenizer", "TikTokenizer", "TOKENIZER_FILES", "build_tokenizer",
           "gpt2_bpe_tokenizer", "load_tokenizer", "special_tokens", "train_bpe_tokenizer", "iter_documents"]

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


class NullTokenizer:
    """Megatron's ``_NullTokenizer`` (megatron/training/tokenizer/tokenizer.py): text is a
    space-separated list of integer ids; ``vocab_size`` ids plus the end-of-document id
    ``vocab_size`` itself, so ``.vocab_size`` is ``vocab_size + 1``.

    Raises:
        ValueError: ``tokenize`` of a word that is not an integer in ``[0, vocab_size]``.
    """

    def __init__(self, vocab_size: int):
        self._n = int(vocab_size)
        self.eod = self._n
        self.bos = None
        self.eod_token = str(self._n)
        self.vocab_size = self._n + 1
        self.path = None

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            if not word.lstrip("-").isdigit() or not 0 <= int(word) <= self._n:
                raise ValueError(f"NullTokenizer: {word[:20]!r} is not a token id in [0, {self._n}] (its text is "
                                 f"space-separated integer ids)")
            ids.append(int(word))
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer:
    """Megatron's ``_SentencePieceTokenizer`` (megatron/training/tokenizer/tokenizer.py) over a
    ``sentencepiece`` model file: the model's pieces, then ``<CLS>``, ``<SEP>``, ``<EOD>``,
    ``<MASK>`` and the pad / bos / eos pieces (``<PAD>`` / ``<BOS>`` / ``<EOS>`` when the model
    has none) appended in that order where the vocabulary lacks them; ``.vocab_size`` counts
    them all, ``.eod`` is ``<EOD>``'s id. ``tokenize`` matches those special tokens inside the
    text (leftmost first) and encodes the pieces between them with the model.

    Raises:
        FileNotFoundError: no such model file.  ImportError: sentencepiece is not installed.
    """

    SPECIAL = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")

    def __init__(self, model_file: Union[str, os.PathLike]):
        import sentencepiece

        self.path = os.fspath(model_file)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"config.tokenizer_model={self.path!r}: no such sentencepiece model file")
        self.sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        self._init_vocab()

    def _init_vocab(self) -> None:
        vocab = {self.sp.id_to_piece(i): i for i in range(len(self.sp))}
        self.special = {}

        def add(token):
            vocab.setdefault(token, len(vocab))
            self.special[token] = vocab[token]
            return vocab[token]

        for token in self.SPECIAL:
            add(token)
        self.eod = self.special["<EOD>"]
        self.eod_token = "<EOD>"
        ids = {}
        for name, sp_id in (("pad", self.sp.pad_id()), ("bos", self.sp.bos_id()), ("eos", self.sp.eos_id())):
            ids[name] = add(self.sp.id_to_piece(sp_id) if 0 <= sp_id < len(self.sp) else f"<{name.upper()}>")
        self.pad, self.bos, self.eos = ids["pad"], ids["bos"], ids["eos"]
        self.vocab_size = len(vocab)
        self._inv_special = {i: t for t, i in self.special.items()}

    def tokenize(self, text: str) -> List[int]:
        ids, idx = [], 0
        while True:
            found = {t: text.find(t, idx) for t in self.special}
            found = {t: i for t, i in found.items() if i >= 0}
            if not found:
                break
            token = min(found, key=found.get)
            ids.extend(self.sp.encode_as_ids(text[idx:found[token]]))
            ids.append(self.special[token])
            idx = found[token] + len(token)
        return ids + self.sp.encode_as_ids(text[idx:])

    def detokenize(self, ids) -> str:
        ids, text, last = [int(i) for i in ids], "", 0
        for i, t in enumerate(ids):
            if t in self._inv_special:
                text += self.sp.decode_ids(ids[last:i]) + " " + self._inv_special[t] + " "
                last = i + 1
        return text + self.sp.decode_ids(ids[last:])

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's ``_GPTSentencePieceTokenizer``: the sentencepiece model's own vocabulary
    (``.vocab_size`` its pieces), no added tokens, end of document = the model's eos id;
    ``tokenize`` is the model's encoding."""

    def _init_vocab(self) -> None:
        self.vocab_size = len(self.sp)
        self.pad, self.bos, self.eos = self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id()
        self.eod = self.eos
        self.eod_token = self.sp.id_to_piece(self.eos) if self.eos >= 0 else None

    def tokenize(self, text: str) -> List[int]:
        return self.sp.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self.sp.decode_ids([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``_Llama2Tokenizer``: :class:`GPTSentencePieceTokenizer` whose ``tokenize``
    starts every text with the bos id (Megatron's ``tokenize(s, bos=True, eos=False)``, what
    ``tools/preprocess_data.py`` writes)."""

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        return [self.bos] * bos + self.sp.encode_as_ids(text) + [self.eos] * eos


# Megatron's --tiktoken-pattern values (megatron/training/tokenizer/tokenizer.py)
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
          r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+",
}


class TikTokenizer:
    """Megatron's ``TikTokenizer`` (``CustomTikTokenizer``) over ``tiktoken``: the rank file is
    Megatron's JSON list of ``{"rank", "token_bytes" (base64), "token_str"}`` (the first 256
    the single bytes); ids ``0 .. num_special_tokens - 1`` are ``<unk>``, ``<s>``, ``</s>`` and
    ``<SPECIAL_i>`` fillers, then the first ``vocab_size - num_special_tokens`` ranks.
    ``.vocab_size`` is ``vocab_size``, ``.eod`` / ``.eos`` the id of ``</s>`` (2), ``.bos`` of
    ``<s>`` (1). ``tokenize`` is tiktoken's ``encode_ordinary`` (special-token text is plain text).

    Raises:
        FileNotFoundError: no rank file.  ValueError: a pattern other than v1 / v2, sizes that
        do not fit (``3 <= num_special_tokens < vocab_size``), or a rank file that is not
        Megatron's format or holds fewer ranks than ``vocab_size - num_special_tokens``.
    """

    SPECIAL = ("<unk>", "<s>", "</s>")

    def __init__(self, path: Union[str, os.PathLike], pattern: str = "v2", vocab_size: int = 2 ** 17,
                 num_special_tokens: int = 1000):
        import base64

        import tiktoken

        self.path, self.pattern = os.fspath(path), pattern
        self.vocab_size, self.num_special_tokens = int(vocab_size), int(num_special_tokens)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"config.tokenizer_model={self.path!r}: no such TikTokenizer rank file")
        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"config.tiktoken_pattern={pattern!r} is not one of {list(TIKTOKEN_PATTERNS)} "
                             f"(Megatron's --tiktoken-pattern)")
        if not len(self.SPECIAL) <= self.num_special_tokens < self.vocab_size:
            raise ValueError(f"TikTokenizer needs {len(self.SPECIAL)} <= config.tiktoken_num_special_tokens="
                             f"{self.num_special_tokens} < its vocabulary {self.vocab_size} (config.vocab_size)")
        inner = self.vocab_size - self.num_special_tokens
        try:
            with open(self.path) as f:
                entries = json.load(f)[:inner]
            ranks = {base64.b64decode(e["token_bytes"]): self.num_special_tokens + e["rank"] for e in entries}
            ok = [e["rank"] for e in entries] == list(range(len(entries)))
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{self.path}: not Megatron's TikTokenizer rank file (a JSON list of "
                             f"{{rank, token_bytes, token_str}}): {err}") from None
        if not ok or len(ranks) != inner:
            raise ValueError(f"{self.path}: {len(ranks)} distinct ranks 0, 1, ... where the vocabulary "
                             f"{self.vocab_size} - {self.num_special_tokens} special tokens needs {inner}; lower "
                             f"config.vocab_size (Megatron's --vocab-size) or give the whole rank file")
        specials = list(self.SPECIAL) + [f"<SPECIAL_{i}>" for i in range(len(self.SPECIAL), self.num_special_tokens)]
        self.bos, self.eos = specials.index("<s>"), specials.index("</s>")
        self.eod, self.eod_token = self.eos, "</s>"
        self._model = tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(self.path))),
                                        pat_str=TIKTOKEN_PATTERNS[pattern], mergeable_ranks=ranks,
                                        special_tokens={t: i for i, t in enumerate(specials)})

    def tokenize(self, text: str) -> List[int]:
        return self._model.encode_ordinary(text)

    def detokenize(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])

    def __getstate__(self):
        return {"path": self.path, "pattern": self.pattern, "vocab_size": self.vocab_size,
                "num_special_tokens": self.num_special_tokens}

    def __setstate__(self, state):
        self.__init__(**state)


def gpt2_bpe_tokenizer(vocab_file: Union[str, os.PathLike], merge_file: Union[str, os.PathLike]) -> HFTokenizer:
    """GPT-2's tokenizer from its ``vocab.json`` and ``merges.txt`` (Megatron's
    ``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file``): byte-level BPE with
    GPT-2's pre-tokenizing regex and no prefix space; ``<|endoftext|>`` (which must be in the
    vocabulary) is the end of document and is not matched inside text, as in Megatron.

    Raises:
        FileNotFoundError: a missing file.  ValueError: files ``tokenizers`` cannot read, or
        no ``<|endoftext|>`` in the vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    for name, path in (("vocab_file", vocab_file), ("merge_file", merge_file)):
        if not path or not os.path.isfile(path):
            raise FileNotFoundError(f"config.{name}={os.fspath(path) if path else path!r}: no such file "
                                    f"(GPT2BPETokenizer reads GPT-2's vocab.json and merges.txt)")
    try:
        bpe = models.BPE.from_file(os.fspath(vocab_file), os.fspath(merge_file))
    except Exception as err:  # tokenizers raises a bare Exception
        raise ValueError(f"{vocab_file} / {merge_file}: not a GPT-2 vocab.json / merges.txt pair ({err})") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return HFTokenizer(tok, eod_token=EOD_TOKEN, path=os.fspath(vocab_file))


def build_tokenizer(cfg) -> Union[HFTokenizer, NullTokenizer]:
    """The tokenizer of a run (Megatron's ``build_tokenizer(args)``), from
    :func:`jmegatron.config.tokenizer_type_of` (``cfg.tokenizer_type``; not set:
    ``HuggingFaceTokenizer`` for ``tokenizer_model``, else ``GPT2BPETokenizer`` for ``vocab_file``
    and ``merge_file``) and its files:
    ``tokenizer_model`` (HuggingFaceTokenizer), ``vocab_file`` + ``merge_file``
    (GPT2BPETokenizer) or ``vocab_size`` (NullTokenizer).

    ``cfg.vocab_size`` is Megatron's ``--vocab-size``: a NullTokenizer has the ids
    ``0 .. vocab_size - 1`` and the end of document ``vocab_size``, ``vocab_size + 1`` in all
    (:func:`jmegatron.config.tokenizer_vocab_size`, the rule the model's vocabulary follows too).

    Raises:
        ValueError: an unknown or unsupported type (the config refuses those first), or its
        file missing from the config.  FileNotFoundError: a file that does not exist.
    """
    kind = tokenizer_type_of(cfg)
    if kind == "HuggingFaceTokenizer":
        if not cfg.tokenizer_model:
            raise ValueError("config.tokenizer_type='HuggingFaceTokenizer' needs config.tokenizer_model (a "
                             "tokenizer.json or a save_pretrained folder)")
        return load_tokenizer(cfg.tokenizer_model)
    if kind == "GPT2BPETokenizer":
        return gpt2_bpe_tokenizer(cfg.vocab_file, cfg.merge_file)
    if kind == "NullTokenizer":
        if cfg.vocab_size is None:
            raise ValueError("config.tokenizer_type='NullTokenizer' needs config.vocab_size")
        return NullTokenizer(cfg.vocab_size)
    sentencepiece_types = {"SentencePieceTokenizer": SentencePieceTokenizer, "Llama2Tokenizer": Llama2Tokenizer,
                           "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer}
    if kind in sentencepiece_types or kind == "TikTokenizer":
        if not cfg.tokenizer_model:
            raise ValueError(f"config.tokenizer_type={kind!r} needs config.tokenizer_model (Megatron's "
                             f"--tokenizer-model: {'the rank file' if kind == 'TikTokenizer' else 'the .model file'})")
        if kind != "TikTokenizer":
            return sentencepiece_types[kind](cfg.tokenizer_model)
        return TikTokenizer(cfg.tokenizer_model, getattr(cfg, "tiktoken_pattern", None) or "v2",
                            tokenizer_vocab_size(kind, cfg.vocab_size),
                            getattr(cfg, "tiktoken_num_special_tokens", 1000))
    raise ValueError(f"config.tokenizer_type={kind!r} is not one of {TOKENIZER_TYPES} (a transformers "
                     f"save_pretrained folder of any tokenizer loads as HuggingFaceTokenizer)"
                     if kind else "no tokenizer: set config.tokenizer_model (or tokenizer_type with its files)")


def vocab_size_of(cfg) -> int:
    """The unpadded vocabulary of a run (int): the config's
    (``JMegatronConfig.unpadded_vocab_size``, Megatron's rule of each tokenizer type: a
    NullTokenizer's ``vocab_size + 1``) or, when the config gives none, the size of
    :func:`build_tokenizer`'s tokenizer (raising as it does)."""
    v = cfg.unpadded_vocab_size()
    return v if v is not None else build_tokenizer(cfg).vocab_size


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
