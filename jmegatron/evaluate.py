"""``python -m jmegatron.evaluate --load CKPT [--eval-iters N] [--split valid|test]``

Loss (nats per token) and perplexity of a checkpoint on the validation or test split
of its own config's data (Megatron's ``evaluate_and_print_results``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence


def _positive_int(text: str) -> int:
    """argparse type of --eval-iters: an integer >= 1 (argparse names the flag on error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1 (global batches to evaluate)")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jmegatron.evaluate", description=__doc__.split("\n\n")[1])
    p.add_argument("--load", required=True, help="checkpoint directory (config.save of the run)")
    p.add_argument("--split", choices=("valid", "test"), default="test")
    p.add_argument("--eval-iters", type=_positive_int, default=None, help="global batches (default: config.eval_iters)")
    args = p.parse_args(argv)

    from jmegatron.training.checkpointing import CheckpointError
    from jmegatron.training.loop import build_datasets, evaluate
    from jmegatron.training.run import restore_run

    try:
        run, state, meta = restore_run(args.load, hidden_dropout=0.0, attention_dropout=0.0)
    except CheckpointError as e:
        print(f"error: {e} (--load takes a training run's config.save directory)", file=sys.stderr)
        return 2
    cfg = run.cfg
    iters = args.eval_iters or cfg.eval_iters
    try:
        _, valid, test = build_datasets(cfg.replace(eval_iters=iters), run.global_batch_size)
    except (FileNotFoundError, ValueError) as e:  # the checkpoint's data moved or is corrupt
        print(f"error: {e} (the data of the checkpoint's config; the files must be where training read them)",
              file=sys.stderr)
        return 2
    ds = valid if args.split == "valid" else test
    if ds is None or len(ds) == 0:
        print(f"error: the {args.split} split of {cfg.data_path!r} is empty (config.split={cfg.split!r})",
              file=sys.stderr)
        return 2
    loss = evaluate(run, state.params, ds, iters)
    result = {"iteration": meta["iteration"], "split": args.split, "loss": loss,
              "ppl": math.exp(min(loss, 700.0)), "tokens": iters * run.global_batch_size * cfg.seq_length}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
