"""``python -m jmegatron.export <command> ...``: the export chain from a jmegatron checkpoint.

Commands (each module registers its own with ``register(subparsers)``):

* ``hf`` / ``import-hf`` (:mod:`jmegatron.export.convert`): Hugging Face folders.
* ``megatron`` / ``import-megatron`` (:mod:`jmegatron.export.megatron`): Megatron-LM checkpoints.
* ``quantize`` (:mod:`jmegatron.export.quantize`): NVIDIA ModelOpt post-training quantization.
* ``check-unified`` (:mod:`jmegatron.export.unified_check`): a unified checkpoint read back and measured.
* ``trtllm`` / ``check-trtllm`` (:mod:`jmegatron.export.trtllm`): TensorRT-LLM checkpoints.

Bad input raises :class:`jmegatron.export.common.ExportError`: the message is printed as
``error: ...`` and the exit status is 2, before any work starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from jmegatron.export.common import ExportError
from jmegatron.checkpoint.checkpointing import CheckpointError

# modules with a ``register(subparsers)`` function; each sets ``func=run(args) -> int``
COMMAND_MODULES = ("jmegatron.export.convert", "jmegatron.export.megatron", "jmegatron.export.quantize", "jmegatron.export.unified_check",
                   "jmegatron.export.trtllm")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every command module's subcommands registered."""
    parser = argparse.ArgumentParser(prog="python -m jmegatron.export",
                                     description="Export a jmegatron checkpoint (Hugging Face, ModelOpt, TensorRT-LLM).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a missing dependency inside the module is a real error
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one export command; returns its exit status (2 for bad input: an ExportError, a corrupt
    dataset or checkpoint; printed as ``error: ...``)."""
    args = build_parser().parse_args(argv)

    try:
        return int(args.func(args) or 0)
    except (ExportError, CheckpointError, FileNotFoundError, ValueError) as e:
        # ExportError is a ValueError; the others come from the layers below (a corrupt dataset given
        # as --calib-data, an unreadable checkpoint): each message names the file and the fix
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
