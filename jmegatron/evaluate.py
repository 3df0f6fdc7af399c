"""``python -m jmegatron.evaluate --load CKPT [--eval-iters N] [--split valid|test]
[--params model|main] [--devices N] [--batch-size B [--micro-batch-size M]]
[--data-path PREFIX [--data-split S] [--tokenizer-model T]]``

Loss (nats per token) and perplexity of a checkpoint on the validation or test split
of its own config's data, or of ``--data-path`` (a preprocess_data prefix, split by
``--data-split``, Megatron's ``--split``; default the checkpoint's) (Megatron's
``evaluate_and_print_results``). A checkpoint whose config names no data (``mock_data``:
an ``import-hf`` checkpoint, a mock-data run) needs ``--data-path``, or ``--mock-data`` to
measure those random tokens on purpose (smoke tests): they are never measured silently.
``--load`` may also be a Hugging Face folder: it is imported into a temporary checkpoint
(``import-hf``) for the evaluation.

Only the checkpoint's parameters are restored (no optimizer state:
:func:`jmegatron.training.run.restore_run_params`), straight into the evaluation mesh's
shardings: one device by default, or ``--devices N`` devices in the checkpoint's own
parallel layout (its tensor / pipeline / context / expert sizes, data parallel over the
rest), no parameter gathered onto one device. ``--params main`` evaluates a bf16 / fp16
checkpoint's float32 main parameters in a float32 model (default ``model``: the
parameters training computed with, as its own validation did).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence

from jmegatron.checkpoint.checkpointing import CheckpointError
from jmegatron.checkpoint.metadata import read_meta
from jmegatron.checkpoint.views import checkpoint_view
from jmegatron.config import ConfigError, from_configdict, tokenizer_type_of
from jmegatron.data.builder import build_datasets
from jmegatron.export.common import ExportError
from jmegatron.export.imports import checkpoint_of
from jmegatron.parallel.mesh import create_mesh
from jmegatron.parallel.rules import data_parallel_size
from jmegatron.training.loop import evaluate
from jmegatron.training.run import restore_run_params


def _positive_int(text: str) -> int:
    """argparse type of --eval-iters and --devices: an integer >= 1 (argparse names the flag on error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def evaluation_mesh(load_dir: str, num_devices: int):
    """None for one device, else the mesh of the checkpoint's saved parallel layout over the
    first ``num_devices`` devices. Raises CheckpointError (no checkpoint) or ConfigError
    (the saved parallel sizes do not divide ``num_devices``: the message names them)."""
    if num_devices == 1:
        return None
    import jax

    if num_devices < 1 or num_devices > len(jax.devices()):
        raise ValueError(f"--devices {num_devices}: choose 1..{len(jax.devices())} (the devices this process sees)")
    saved = saved_config(load_dir)
    saved.update(checkpoint_view("read"))
    return create_mesh(from_configdict(saved), jax.devices()[:num_devices])


def saved_config(load_dir: str) -> dict:
    """The resolved config a checkpoint was saved with (a dict). Raises CheckpointError
    when ``load_dir`` holds no checkpoint."""
    return dict(read_meta(load_dir)["config"])


def data_overrides(saved: dict, data_path: Optional[str], data_split: Optional[str],
                   tokenizer_model: Optional[str], mock_data: bool = False) -> dict:
    """The config fields that point the evaluation at ``data_path`` (None: the checkpoint's
    own data). Raises ConfigError when neither names data (``mock_data`` in the checkpoint's
    config, unless ``mock_data`` here says to measure it), or when ``--data-split`` /
    ``--tokenizer-model`` come without ``--data-path``."""
    if data_path is None:
        if data_split is not None or tokenizer_model is not None:
            raise ConfigError("--data-split / --tokenizer-model go with --data-path (the checkpoint's own data "
                              "keeps its split and tokenizer)")
        if saved.get("mock_data") and not mock_data:
            raise ConfigError("the checkpoint's config measures no data (mock_data=True, as an import-hf checkpoint "
                              "or a mock-data run has): give --data-path PREFIX (a preprocess_data output), or "
                              "--mock-data to measure random tokens on purpose")
        return {}
    out = {"data_path": data_path, "mock_data": False}
    if data_split is not None:
        out["split"] = data_split
    if tokenizer_model is not None:
        out["tokenizer_model"] = tokenizer_model
    elif tokenizer_type_of(saved) is None:
        raise ConfigError("--data-path needs the tokenizer the data was preprocessed with: the checkpoint names "
                          "none, so give --tokenizer-model (its end-of-document id separates documents)")
    return out


def batch_overrides(batch_size: Optional[int], micro_batch_size: Optional[int], mesh) -> dict:
    """The batch fields of ``--batch-size`` (the global batch, samples per evaluation
    iteration; Megatron's ``--global-batch-size``) and ``--micro-batch-size`` (per
    data-parallel rank; default: the batch over the ranks of ``mesh``, one micro-batch
    each; None: one device). Empty when neither is given (the checkpoint's). Raises
    ConfigError when the batch does not split into the ranks' micro-batches."""
    if batch_size is None and micro_batch_size is None:
        return {}
    out = {"rampup_batch_size": None}
    if batch_size is not None:
        dp = 1 if mesh is None else data_parallel_size(mesh)
        if micro_batch_size is None and batch_size % dp:
            raise ConfigError(f"--batch-size {batch_size} does not split over the {dp} data-parallel ranks; "
                              f"give a multiple of {dp}")
        out.update(global_batch_size=batch_size, micro_batch_size=micro_batch_size or batch_size // dp)
    else:
        out["micro_batch_size"] = micro_batch_size
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jmegatron.evaluate", description=__doc__.split("\n\n")[1])
    p.add_argument("--load", required=True, help="checkpoint directory (config.save of the run)")
    p.add_argument("--split", choices=("valid", "test"), default="test")
    p.add_argument("--eval-iters", type=_positive_int, default=None, help="global batches (default: config.eval_iters)")
    p.add_argument("--params", choices=("model", "main"), default="model",
                   help="model: the parameters training computed with (bf16 under bf16); main: a bf16 / fp16 "
                        "checkpoint's float32 main parameters, in a float32 model")
    p.add_argument("--devices", type=_positive_int, default=1,
                   help="devices to evaluate on (>1: the checkpoint's own parallel layout, data over the rest)")
    p.add_argument("--data-path", default=None,
                   help="a preprocess_data prefix to evaluate on (default: the checkpoint's config.data_path)")
    p.add_argument("--data-split", default=None,
                   help="train,valid,test weights of --data-path, Megatron's --split (default: the checkpoint's)")
    p.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer --data-path was preprocessed with (default: the checkpoint's)")
    p.add_argument("--mock-data", action="store_true",
                   help="measure a mock-data checkpoint's random tokens (a smoke test; refused otherwise)")
    p.add_argument("--batch-size", "--global-batch-size", type=_positive_int, default=None, dest="batch_size",
                   help="samples per evaluation batch (default: the checkpoint's global_batch_size)")
    p.add_argument("--micro-batch-size", type=_positive_int, default=None,
                   help="samples per data-parallel rank and micro-batch (default: --batch-size over the "
                        "data-parallel ranks, one micro-batch each)")
    args = p.parse_args(argv)
    try:
        with checkpoint_of(args.load) as load:
            return _evaluate(args, load)
    except ExportError as e:  # an HF folder that does not import
        print(f"error: {e}", file=sys.stderr)
        return 2


def _evaluate(args: argparse.Namespace, load: str) -> int:
    """``main`` on the jmegatron checkpoint ``load`` (``args.load`` or its import)."""
    try:
        data = data_overrides(saved_config(load), args.data_path, args.data_split, args.tokenizer_model,
                              args.mock_data)
        mesh = evaluation_mesh(load, args.devices)
        data.update(batch_overrides(args.batch_size, args.micro_batch_size, mesh))
        run, params, meta = restore_run_params(load, mesh, source=args.params, hidden_dropout=0.0,
                                               attention_dropout=0.0, **data)
    except CheckpointError as e:
        print(f"error: {e} (--load takes a training run's config.save directory)", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = run.cfg
    iters = args.eval_iters or cfg.eval_iters
    try:
        _, valid, test = build_datasets(cfg.replace(eval_iters=iters), run.global_batch_size)
    except (FileNotFoundError, ValueError) as e:  # the data moved or is corrupt
        where = "--data-path" if args.data_path else "the data of the checkpoint's config; the files must be where training read them"
        print(f"error: {e} ({where})", file=sys.stderr)
        return 2
    ds = valid if args.split == "valid" else test
    if ds is None or len(ds) == 0:
        print(f"error: the {args.split} split of {cfg.data_path!r} is empty (config.split={cfg.split!r})",
              file=sys.stderr)
        return 2
    loss = evaluate(run, params, ds, iters)
    result = {"iteration": meta["iteration"], "split": args.split, "loss": loss,
              "ppl": math.exp(min(loss, 700.0)), "tokens": iters * run.global_batch_size * cfg.seq_length,
              "params": args.params}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
