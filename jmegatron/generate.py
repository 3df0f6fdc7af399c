"""``python -m jmegatron.generate --load CKPT --prompt TEXT [--prompt TEXT ...]
[--max-new-tokens N] [--temperature T] [--top-k K | --top-p P] [--greedy] [--seed S]
[--max-length L] [--tokenizer-model PATH]``: text from a checkpoint with the KV-cache
generator (jmegatron.inference.generate), all prompts in one batch.

Sampling defaults are Megatron's (temperature 1, no top-k, no top-p); top-k and top-p
cannot be combined (Megatron's rule). Each sample is printed as the prompt followed by
its continuation, generation stops per prompt at the tokenizer's EOD. ``--load`` may be a
Hugging Face folder (imported into a temporary checkpoint, ``import-hf``). A missing
checkpoint, an unknown tokenizer or bad settings exit with status 2 and a one-line
``error: ...`` message.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from jmegatron.export.imports import checkpoint_of
from jmegatron.inference.generate import generate_text
from jmegatron.checkpoint.checkpointing import CheckpointError


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit status (2 with ``error: ...`` for bad input)."""
    p = argparse.ArgumentParser(prog="python -m jmegatron.generate",
                                description="Generate text from a jmegatron checkpoint (KV cache).")
    p.add_argument("--load", required=True, help="checkpoint directory (a training run's save dir)")
    p.add_argument("--prompt", action="append", required=True, help="may be given several times (one batch)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    p.add_argument("--greedy", action="store_true", help="argmax instead of sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=None,
                   help="prompt + new tokens (the cache length); default: longest prompt + "
                        "max-new-tokens, capped at max_position_embeddings")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer.json; default: the checkpoint config's")
    args = p.parse_args(argv)

    try:
        with checkpoint_of(args.load) as load:  # a Hugging Face folder: imported for the run
            outs = generate_text(load, args.prompt, args.max_new_tokens, tokenizer_model=args.tokenizer_model,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 greedy=args.greedy, seed=args.seed, max_length=args.max_length)
    except (CheckpointError, ValueError, FileNotFoundError) as e:  # GenerateError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text, new in zip(args.prompt, outs):
        print("=" * 30 + " sample " + "=" * 30)
        print(text + new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
