"""Tokenize raw text into Megatron ``.bin``/``.idx`` files.

Follows Megatron-LM ``tools/preprocess_data.py`` (no sentence splitting): every document is
tokenized, optionally followed by the end-of-document token (``--append-eod``), and stored as
one sequence of one document in ``{output_prefix}_{key}_document.bin/.idx`` with the token dtype
Megatron picks (uint16 if the vocabulary has fewer than 65500 ids, else int32).

Usage::

    python -m jmegatron.tools.preprocess_data --input data/ --output-prefix out/corpus \\
        --tokenizer-model tokenizer.json --append-eod --workers 2

Chat mode (``--json-keys messages --apply-chat-template``, Megatron's SFT data): each key holds
a list of ``{"role": "system"|"user"|"assistant"|"tool", "content": str}`` messages, cut into
conversations at every ``system`` message (Megatron's ``SFTDataset._split_conversations``); each
conversation is rendered by the tokenizer's chat template (or ``--chat-template FILE``) and
stored as one document, and the flags of its assistant tokens go into the uint8 dataset
``{output_prefix}_{key}_document_loss_mask`` beside it
(:class:`jmegatron.data.sft_dataset.ChatTemplateTokenizer`; needs transformers).

Inputs (``--input``, one or more): a ``.jsonl``/``.json`` file (one JSON object per line; each
``--json-keys`` key is a document), any other file (the whole file is one ``text`` document), a
directory (its ``*.txt`` and ``*.jsonl`` files, sorted by name, not recursive), or a glob
pattern. Documents keep the order of the inputs.

Parallelism: the input byte stream is cut into line-aligned shards, the shards are tokenized by
``--workers`` processes into temporary part files, and the parts are merged in order with
``IndexedDatasetBuilder.add_index``; the output bytes do not depend on the worker count.
The final prefix of each key is printed on stdout (progress goes to stderr). Workers are
started with the ``spawn`` method (safe when the caller has JAX or tokenizer threads running), so
a script calling ``preprocess(..., workers>1)`` needs the usual ``if __name__ == "__main__"``
guard.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import types
from typing import List, Optional, Sequence, Tuple

import numpy as np

from jmegatron.data.corpus import resolve_inputs
from jmegatron.data.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from jmegatron.data.sft_dataset import ChatTemplateTokenizer, loss_mask_prefix, split_conversations
from jmegatron.config import TOKENIZER_TYPES
from jmegatron.data.tokenizer import build_tokenizer

__all__ = ["main", "preprocess", "get_args"]

def _is_json(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


# ---------------------------------------------------------------- worker side
_WORKER = {}


def _init_worker(tokenizer, chat=None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER["tokenizer"] = tokenizer  # pickled by the pool (HFTokenizer: its tokenizer.json)
    _WORKER["chat"] = chat  # ChatTemplateTokenizer (pickled as its paths) in chat mode


def _iter_shard_docs(files: Sequence[Tuple[str, int, int]], lo: int, hi: int):
    """Yield (path, lineno or 0, raw text) of every document starting in global bytes [lo, hi).

    ``files`` is [(path, global_base, size)]. A JSON line belongs to the shard containing its
    first byte; a plain-text file to the shard containing the file's first byte.
    """
    for path, base, size in files:
        start, end = max(lo, base), min(hi, base + size)
        if _is_json(path):
            if start >= end:
                continue
            with open(path, "rb") as f:
                pos = start - base
                if pos > 0:
                    f.seek(pos - 1)
                    pos += len(f.readline()) - 1  # skip to the next line start
                while pos < end - base:
                    line = f.readline()
                    if not line:
                        break
                    pos += len(line)
                    yield path, pos, line
        elif lo <= base < hi:
            with open(path, "rb") as f:
                yield path, 0, f.read()


def _encode_shard(task) -> Tuple[int, int]:
    """Tokenize one shard into per-key part files; returns (documents, tokens)."""
    files, lo, hi, part_prefixes, json_keys, append_eod = task
    tok, chat = _WORKER["tokenizer"], _WORKER.get("chat")
    dtype = DType.optimal_dtype(tok.vocab_size)
    builders = {k: IndexedDatasetBuilder(get_bin_path(p), dtype=dtype)
                for k, p in part_prefixes.items()}
    masks = {} if chat is None else {k: IndexedDatasetBuilder(get_bin_path(loss_mask_prefix(p)), dtype=np.uint8)
                                     for k, p in part_prefixes.items()}
    n_docs = n_tokens = 0
    try:
        for path, where, raw in _iter_shard_docs(files, lo, hi):
            try:
                text_raw = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}: not UTF-8 text ({err})") from None
            if _is_json(path):
                if not text_raw.strip():
                    continue
                try:
                    record = json.loads(text_raw)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path} (line ending at byte {where}): invalid JSON "
                                     f"({err}); fix or remove that line (every line of a .jsonl "
                                     f"file is one JSON object)") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path} (line ending at byte {where}): not a JSON object")
            else:
                record = {"text": text_raw}
            for key in json_keys:
                if key not in record:
                    raise ValueError(
                        f"{path}" + (f" (line ending at byte {where})" if where else "")
                        + f": no {key!r} key (plain-text files only provide 'text'; "
                        "check --json-keys)"
                    )
                if chat is not None:
                    line = f"{path} (line ending at byte {where})"
                    for conversation in split_conversations(record[key], where=line):
                        ids, flags = chat.tokenize_conversation(conversation, where=line)
                        builders[key].add_document(ids, [len(ids)])
                        masks[key].add_document(flags, [len(flags)])
                        n_tokens += len(ids)
                    continue
                ids = tok.tokenize(str(record[key]))
                if ids and append_eod:
                    ids.append(tok.eod)
                builders[key].add_document(np.asarray(ids, dtype=np.int64),
                                           [len(ids)] if ids else [])
                n_tokens += len(ids)
            n_docs += 1
    finally:
        for key, b in builders.items():
            b.finalize(get_idx_path(part_prefixes[key]))
        for key, b in masks.items():
            b.finalize(get_idx_path(loss_mask_prefix(part_prefixes[key])))
    return n_docs, n_tokens


# ---------------------------------------------------------------- driver side
def _shard_bounds(files: Sequence[Tuple[str, int, int]], num_shards: int) -> List[int]:
    total = sum(size for _, _, size in files)
    bounds = [round(total * k / num_shards) for k in range(num_shards + 1)]
    bounds[-1] = total + 1  # make the last shard include everything
    return bounds


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_model: Optional[str] = None,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False,
               workers: int = 1, log=sys.stderr, *, tokenizer_type: Optional[str] = None,
               vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
               vocab_size: Optional[int] = None, apply_chat_template: bool = False,
               chat_template: Optional[str] = None) -> List[str]:
    """Library entry point of the tool (Megatron ``tools/preprocess_data.py: main`` without
    sentence splitting or partitions); returns the output prefixes
    ``{output_prefix}_{key}_document``, one per json key, in ``json_keys`` order. The
    tokenizer is Megatron's ``tokenizer_type`` (default HuggingFaceTokenizer with
    ``tokenizer_model``; GPT2BPETokenizer with ``vocab_file`` / ``merge_file``; NullTokenizer
    with ``vocab_size``; :func:`jmegatron.data.tokenizer.build_tokenizer`).
    ``apply_chat_template``: chat mode (module doc; ``chat_template`` a Jinja file replacing the
    tokenizer's template); each prefix then has its ``_loss_mask`` dataset beside it.

    Raises:
        FileNotFoundError: missing input/tokenizer.  ValueError: bad JSON, missing keys,
        non-UTF-8 input, workers < 1, a tokenizer type without its files, chat mode with
        another tokenizer type than HuggingFaceTokenizer or with ``append_eod``, malformed messages.
        ImportError: chat mode without transformers.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if chat_template is not None and not apply_chat_template:
        raise ValueError("--chat-template goes with --apply-chat-template")
    chat = None
    if apply_chat_template:
        if tokenizer_type not in (None, "HuggingFaceTokenizer") or not tokenizer_model:
            raise ValueError("--apply-chat-template needs a HuggingFaceTokenizer (--tokenizer-model, a "
                             "save_pretrained folder with a chat template or a tokenizer.json with --chat-template)")
        if append_eod:
            raise ValueError("--apply-chat-template with --append-eod: the chat template renders the end of every "
                             "turn; drop --append-eod")
        chat = ChatTemplateTokenizer(tokenizer_model, chat_template)
    paths = resolve_inputs(inputs)
    spec = types.SimpleNamespace(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model,
                                 vocab_file=vocab_file, merge_file=merge_file, vocab_size=vocab_size)
    tok = build_tokenizer(spec)  # fail early, and pick the dtype
    dtype = DType.optimal_dtype(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    made_dir = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    finals = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    # written under a temporary prefix and renamed at the end: bad input (a broken JSON line, a
    # missing key) leaves an existing dataset at the output prefix untouched
    outs = {k: f"{finals[k]}.partial{os.getpid()}" for k in json_keys}
    written = [(outs[k], finals[k]) for k in json_keys]
    if chat is not None:
        written += [(loss_mask_prefix(outs[k]), loss_mask_prefix(finals[k])) for k in json_keys]
    t0 = time.time()
    try:
        n_docs, n_tokens = _preprocess_into(_files_of(paths), outs, tok, dtype, json_keys, append_eod,
                                            workers, chat)
    except BaseException:
        for prefix, _ in written:
            for f in (get_bin_path(prefix), get_idx_path(prefix)):
                if os.path.exists(f):
                    os.remove(f)
        if made_dir and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise
    for temporary, final in written:
        for path_of in (get_bin_path, get_idx_path):
            os.replace(path_of(temporary), path_of(final))
    if log is not None:
        print(f"preprocess_data: {len(paths)} files, {n_docs} documents, {n_tokens} tokens "
              f"({len(json_keys)} key(s)), dtype {dtype.__name__}, {time.time() - t0:.2f}s",
              file=log)
    return [finals[k] for k in json_keys]


def _files_of(paths: Sequence[str]) -> List[Tuple[str, int, int]]:
    """(path, first byte in the concatenated input stream, size) of every input file."""
    files, base = [], 0
    for p in paths:
        size = os.path.getsize(p)
        files.append((p, base, size))
        base += size
    return files


def _preprocess_into(files, finals, tok, dtype, json_keys, append_eod, workers, chat=None) -> Tuple[int, int]:
    """Tokenize ``files`` (:func:`_files_of`) into the prefixes ``finals`` (json key -> prefix;
    with ``chat`` also their loss masks); returns (documents, tokens)."""
    base = sum(size for _, _, size in files)
    if workers == 1:
        # one shard, written straight to the output prefixes
        _WORKER["tokenizer"], _WORKER["chat"] = tok, chat
        n_docs, n_tokens = _encode_shard((files, 0, base + 1, finals, list(json_keys),
                                          append_eod))
    else:
        num_shards = workers * 4
        bounds = _shard_bounds(files, num_shards)
        parts = [{k: f"{finals[k]}.part{i:05d}" for k in json_keys} for i in range(num_shards)]
        tasks = [(files, bounds[i], bounds[i + 1], parts[i], list(json_keys), append_eod)
                 for i in range(num_shards)]
        try:
            # spawn, not fork: the parent may hold JAX / tokenizers threads.
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(workers, initializer=_init_worker, initargs=(tok, chat)) as pool:
                results = pool.map(_encode_shard, tasks, chunksize=1)
            n_docs = sum(r[0] for r in results)
            n_tokens = sum(r[1] for r in results)
            outputs = [(finals[k], [part[k] for part in parts], dtype) for k in json_keys]
            if chat is not None:
                outputs += [(loss_mask_prefix(finals[k]), [loss_mask_prefix(part[k]) for part in parts], np.uint8)
                            for k in json_keys]
            for final, part_prefixes, out_dtype in outputs:
                builder = IndexedDatasetBuilder(get_bin_path(final), dtype=out_dtype)
                for part in part_prefixes:
                    builder.add_index(part)
                builder.finalize(get_idx_path(final))
        finally:
            for part in parts:
                for p in [*part.values(), *(loss_mask_prefix(q) for q in part.values())]:
                    for f in (get_bin_path(p), get_idx_path(p)):
                        if os.path.exists(f):
                            os.remove(f)
    return n_docs, n_tokens


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (flag names of Megatron ``tools/preprocess_data.py``).

    Raises:
        SystemExit: argparse errors.
    """
    parser = argparse.ArgumentParser(
        prog="python -m jmegatron.tools.preprocess_data",
        description="Tokenize text/jsonl into Megatron .bin/.idx files.",
    )
    g = parser.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True,
                   help="files, directories (their .txt/.jsonl files, sorted) or glob patterns")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON line (default: text)")
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", choices=TOKENIZER_TYPES,
                   help="Megatron's names: HuggingFaceTokenizer (--tokenizer-model), GPT2BPETokenizer "
                        "(--vocab-file, --merge-file), NullTokenizer (--vocab-size)")
    g.add_argument("--tokenizer-model", default=None, help="a tokenizer.json or a save_pretrained folder")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: Megatron's --vocab-size (ids 0 .. N-1, the end of document N)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the <|endoftext|> id to every non-empty document")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="SFT data: each --json-keys value is a list of chat messages, rendered by the "
                        "tokenizer's chat template, with a _loss_mask dataset of the assistant tokens beside it")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file used instead of the tokenizer's (with --apply-chat-template)")
    g = parser.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx")
    g = parser.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    args = parser.parse_args(argv)
    uses = {"HuggingFaceTokenizer": {"tokenizer_model"}, "GPT2BPETokenizer": {"vocab_file", "merge_file"},
            "NullTokenizer": {"vocab_size"}}
    for name in ("tokenizer_model", "vocab_file", "merge_file", "vocab_size"):
        if getattr(args, name) is not None and name not in uses[args.tokenizer_type]:
            owner = next(t for t, names in uses.items() if name in names)
            parser.error(f"--{name.replace('_', '-')} is {owner}'s; --tokenizer-type is {args.tokenizer_type} "
                         f"(give --tokenizer-type {owner}, or drop --{name.replace('_', '-')})")
    return args


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
    """CLI entry point; prints each output prefix on stdout and returns them (list[str]).

    Raises:
        SystemExit: with a one-line ``preprocess_data: error: ...`` message on bad input.
    """
    args = get_args(argv)
    try:
        prefixes = preprocess(args.input, args.output_prefix, args.tokenizer_model,
                              args.json_keys, args.append_eod, args.workers, tokenizer_type=args.tokenizer_type,
                              vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
                              apply_chat_template=args.apply_chat_template, chat_template=args.chat_template)
    except (FileNotFoundError, ValueError, ImportError) as err:
        raise SystemExit(f"preprocess_data: error: {err}")
    for p in prefixes:
        print(p)
    return prefixes


if __name__ == "__main__":
    main()
