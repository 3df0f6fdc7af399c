"""``python -m jmegatron.export hf`` and ``import-hf``: jmegatron checkpoints <-> Hugging Face folders.

``hf --load CKPT --out DIR [--dtype float32|bfloat16|float16]`` writes what
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads: ``config.json``,
``generation_config.json``, ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards
of ``--max-shard-size`` with ``model.safetensors.index.json``, written layer by layer:
:mod:`jmegatron.export.stream`) (``GPT2LMHeadModel`` for the GPT variant,
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` for the Llama-style variants,
``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` for mixture-of-experts models; the weight mapping is :mod:`jmegatron.conversion.hf` and
:mod:`jmegatron.conversion.hf_moe`,
held to 1e-4 logits by the golden tests), the tokenizer (``tokenizer.json`` +
``tokenizer_config.json`` via ``PreTrainedTokenizerFast``, end-of-document as bos/eos) and
``jmegatron_export.json`` (source checkpoint, iteration, vocabulary sizes). Any parallel
layout loads (the shards are read from the checkpoint on the host); a distillation checkpoint exports
its student only. Megatron's vocabulary padding rows are dropped. Only parameters are read
(no optimizer state), one decoder layer at a time.

``import-hf --hf DIR --out CKPT [--config FILE] [--seq-length N]`` reads such a folder
(``*.safetensors``, sharded or not) and writes a jmegatron checkpoint at iteration 0 (fresh
optimizer state) that trains, evaluates and exports like any other; the architecture comes
from the HF ``config.json``, training settings from ``--config`` (default: jmegatron's
defaults). JAX -> HF -> JAX gives identical arrays (tests/test_export_hf.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

from jmegatron.conversion.hf import ARCHITECTURES, hf_architecture
from jmegatron.export.common import ExportError, check_out_dir, checkpoint_config, write_hf_tokenizer
from jmegatron.export.imports import import_hf
from jmegatron.export.stream import export_hf_streaming, parse_size

__all__ = ["register", "export_hf"]

TORCH_DTYPES = ("float32", "bfloat16", "float16")


def register(sub) -> None:
    """Add the ``hf`` and ``import-hf`` subcommands to an argparse subparsers object."""
    p = sub.add_parser("hf", help=f"write a Hugging Face folder ({' / '.join(ARCHITECTURES)})")
    p.add_argument("--load", required=True, help="jmegatron checkpoint directory")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    p.add_argument("--dtype", choices=TORCH_DTYPES, default="float32")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file (e.g. 5GB, 500MB); the weights stream layer by layer either way")
    p.set_defaults(func=_run_hf)

    q = sub.add_parser("import-hf", help="a Hugging Face folder -> a jmegatron checkpoint")
    q.add_argument("--hf", required=True, help="folder with config.json and *.safetensors")
    q.add_argument("--out", required=True, help="jmegatron checkpoint directory to create (must hold none)")
    q.add_argument("--config", default=None, help="config file for the training settings (architecture from HF)")
    q.add_argument("--seq-length", type=int, default=None,
                   help="training sequence length (default: the config's, capped at max_position_embeddings)")
    q.set_defaults(func=_run_import_hf)


def _run_hf(args) -> int:
    export_hf(args.load, args.out, args.dtype, args.iteration, args.max_shard_size)
    return 0


def _run_import_hf(args) -> int:
    import_hf(args.hf, args.out, args.config, args.seq_length)
    return 0


def export_hf(load: str, out: str, dtype: str = "float32", iteration: int | None = None,
              max_shard_size: Any = "5GB") -> dict[str, Any]:
    """Write the Hugging Face folder of checkpoint ``load`` to ``out`` in ``dtype``.

    The weights stream layer by layer (:func:`jmegatron.export.stream.export_hf_streaming`:
    parameters only, one decoder layer in host memory at a time) into safetensors files
    of at most ``max_shard_size`` (bytes or "5GB"-style; several files get
    ``model.safetensors.index.json``).

    Returns the summary written to ``out/jmegatron_export.json``. Raises ExportError for a
    missing checkpoint, an architecture with no HF target (fields named), or a non-empty
    ``out``; all before any array is restored.
    """
    if dtype not in TORCH_DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {TORCH_DTYPES}")
    check_out_dir(out)
    try:
        arch = hf_architecture(checkpoint_config(load, iteration))
    except ValueError as e:
        if isinstance(e, ExportError):
            raise
        raise ExportError(f"--load {load}: {e}") from e

    parse_size(max_shard_size)  # bad input refused before any work
    os.makedirs(out, exist_ok=True)
    src = export_hf_streaming(load, out, dtype, iteration, max_shard_size)
    if src["tokenizer"]:
        write_hf_tokenizer(src["tokenizer"], out, src["cfg"].max_position_embeddings)
    summary = {"architecture": arch, "source": src["source"], "iteration": src["iteration"], "dtype": dtype,
               "vocab_size": src["vocab_size"], "padded_vocab_size": src["padded_vocab_size"],
               "tokenizer": src["tokenizer"], "files": src["files"]}
    with open(os.path.join(out, "jmegatron_export.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"[jmegatron.export hf] {arch} ({dtype}, vocab {src['vocab_size']}) of {src['source']} "
          f"iteration {src['iteration']} -> {os.path.abspath(out)} ({len(src['files'])} safetensors file(s), "
          f"streamed layer by layer)")
    return summary
