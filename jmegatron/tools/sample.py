"""``python -m jmegatron.tools.sample --load CKPT --prompt TEXT [--max-new-tokens N]
[--temperature T] [--top-k K] [--greedy] [--seed S]``: text from a checkpoint with the
plain (no KV cache) sampler."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from jmegatron.data.tokenizer import load_tokenizer
from jmegatron.inference.sample import sample
from jmegatron.checkpoint.checkpointing import CheckpointError
from jmegatron.training.run import restore_run_params


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jmegatron.tools.sample")
    p.add_argument("--load", required=True)
    p.add_argument("--prompt", action="append", required=True, help="may be given several times")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-model", default=None, help="default: the checkpoint config's")
    args = p.parse_args(argv)

    try:
        run, params, _ = restore_run_params(args.load)  # parameters only
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok_path = args.tokenizer_model or run.cfg.tokenizer_model
    if not tok_path:
        print("error: the checkpoint's config has no tokenizer_model; pass --tokenizer-model", file=sys.stderr)
        return 2
    tok = load_tokenizer(tok_path)
    prompts = [tok.tokenize(t) for t in args.prompt]
    outs = sample(run.model, params, prompts, args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, greedy=args.greedy, seed=args.seed, eod_id=tok.eod,
                  max_length=run.cfg.max_position_embeddings)
    for text, new in zip(args.prompt, outs):
        print("=" * 30 + " sample " + "=" * 30)
        print(text + tok.detokenize(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
