"""Train a byte-level BPE ``tokenizer.json`` (GPT-2 style, ``<|endoftext|>`` special token).

Megatron-LM itself ships no tokenizer trainer; the result is the kind of file Megatron loads with
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json`` and that
``jmegatron.tools.preprocess_data`` consumes.

Usage::

    python -m jmegatron.tools.train_tokenizer --input data/ --vocab-size 8192 \\
        --output tokenizer.json

``--input`` takes files, directories (their .txt/.jsonl files, sorted) or glob patterns,
exactly like ``preprocess_data``; .jsonl/.json lines contribute their ``--json-key`` value.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from jmegatron.data.corpus import resolve_inputs
from jmegatron.data.tokenizer import train_bpe_tokenizer

__all__ = ["main", "get_args"]


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (no Megatron-LM counterpart).

    Raises:
        SystemExit: argparse errors.
    """
    parser = argparse.ArgumentParser(
        prog="python -m jmegatron.tools.train_tokenizer",
        description="Train a byte-level BPE tokenizer.json with an <|endoftext|> token.",
    )
    parser.add_argument("--input", nargs="+", required=True,
                        help="files, directories (.txt/.jsonl inside, sorted) or globs")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="target vocabulary size, special token included (>= 257)")
    parser.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="minimum count of a pair to be merged (default 2)")
    parser.add_argument("--json-key", default="text",
                        help="key to read from .jsonl/.json lines (default: text)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> str:
    """CLI entry point; prints and returns the output path (str).

    Raises:
        SystemExit: with a one-line ``train_tokenizer: error: ...`` message on bad input.
    """
    args = get_args(argv)

    try:
        files = resolve_inputs(args.input)
        tok = train_bpe_tokenizer(files, args.vocab_size, args.output,
                                  min_frequency=args.min_frequency, json_key=args.json_key)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"train_tokenizer: error: {err}")
    print(f"train_tokenizer: {len(files)} files -> vocab_size {tok.vocab_size}, "
          f"eod id {tok.eod}", file=sys.stderr)
    print(os.fspath(args.output))
    return os.fspath(args.output)


if __name__ == "__main__":
    main()
