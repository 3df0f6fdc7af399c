"""``python -m jmegatron.export check-unified``: a unified checkpoint read back and measured.

    python -m jmegatron.export check-unified --load FOLDER [--reference HF_FOLDER|CKPT]
        [--data PREFIX --split 949,50,1 --samples 32 --seq-length 128] [--json OUT.json]

``FOLDER`` is ModelOpt's unified Hugging Face checkpoint (``export quantize``'s
``<cfg>/unified_hf``). The command prints, and writes with ``--json``:

* ``problems``: what :func:`jmegatron.export.unified.check_unified` finds wrong with the folder
  as a server would load it (missing or malformed scales, codes that do not decode,
  unquantized linears ``exclude_modules`` does not name, a ``quantization_config`` that
  disagrees with ``hf_quant_config.json``);
* with ``--reference`` (the unquantized model: a Hugging Face folder or a jmegatron
  checkpoint), per-token agreement of the folder read back as a server computes it
  (:func:`jmegatron.export.unified.unified_model`) with the reference: the share of positions
  whose greedy next token is the same, and the largest logit difference;
* with ``--data`` (a ``preprocess_data`` prefix), the perplexity of both on the **test**
  portion of ``--split`` (the quantize command's held-out text, :func:`jmegatron.export.
  calibration.portion_dataset`); without it, the agreement is measured on ``--samples`` random
  token sequences (seed 0) and no perplexity is given.

Exit status 0 when the folder has no problem, 1 when it has, 2 for bad input (a folder this
reader refuses names its ``quant_algo``). Requires torch, transformers and, for NVFP4,
nvidia-modelopt.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Optional

import numpy as np

from jmegatron.checkpoint.hf import is_hf_folder
from jmegatron.export.calibration import make_batches, perplexity, portion_dataset
from jmegatron.export.common import ExportError, hf_model, load_checkpoint
from jmegatron.export.unified import check_unified, unified_model

__all__ = ["register", "run", "check_unified_folder"]


def register(sub) -> None:
    """Add ``check-unified`` to an argparse subparsers object."""
    p = sub.add_parser("check-unified", help="check a ModelOpt unified checkpoint: format problems, per-token "
                                             "agreement with the unquantized model, perplexity")
    p.add_argument("--load", required=True, help="the unified checkpoint folder (quantize's <cfg>/unified_hf)")
    p.add_argument("--reference", default=None, help="the unquantized model: a Hugging Face folder or a jmegatron "
                                                      "checkpoint")
    p.add_argument("--data", default=None, help="preprocess_data prefix; its test portion is measured")
    p.add_argument("--split", default="949,50,1", help="train,valid,test weights of --data (Megatron's --split)")
    p.add_argument("--samples", type=int, default=32, help="sequences measured")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sequence (capped at the model's positions)")
    p.add_argument("--json", default=None, help="also write the result to this file")
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the result of :func:`check_unified_folder` as JSON; 0 without problems, 1 with."""
    result = check_unified_folder(args.load, args.reference, args.data, args.split, args.samples, args.seq_length)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 1 if result["problems"] else 0


def _reference_model(reference: str):
    import torch
    import transformers

    if is_hf_folder(reference):
        return transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    return hf_model(load_checkpoint(reference))


def check_unified_folder(folder: str, reference: Optional[str] = None, data: Optional[str] = None,
                         split: str = "949,50,1", samples: int = 32, seq_length: int = 128) -> dict:
    """``{"folder", "quant_algo", "problems", ...}`` for the unified checkpoint ``folder``
    (module docstring): with ``reference``, ``agreement`` (share of positions with the same
    greedy token, in [0, 1]) and ``max_logit_diff`` (largest |logit difference|, float32
    logits over the true vocabulary); with ``data``, ``ppl`` / ``loss`` (nats per token) and
    ``reference_ppl`` / ``reference_loss``. Raises ExportError for an unreadable folder, a
    refused ``quant_algo``, ``samples`` or ``seq_length`` below 1, or data the test portion
    of ``split`` leaves empty."""
    import torch

    if samples < 1 or seq_length < 1:
        raise ExportError(f"--samples {samples} and --seq-length {seq_length} must be >= 1")
    problems = check_unified(folder)
    model, ckpt = unified_model(folder)
    out = {"folder": folder, "quant_algo": ckpt.algo, "problems": problems,
           "quantized_linears": len(ckpt.input_quant)}
    vocab = int(model.config.vocab_size)
    seq = min(seq_length, int(getattr(model.config, "max_position_embeddings", None)
                              or getattr(model.config, "n_positions", seq_length)))
    if data:
        eod = int(model.config.eos_token_id) if isinstance(model.config.eos_token_id, int) else 0
        portion = portion_dataset(data, split, "test", None, seq, 0, eod)
        batches = make_batches(portion.dataset, min(samples, len(portion.dataset)), 4, vocab)
        out.update(data=data, split=split, tokens=sum(int(b["loss_mask"].sum()) for b in batches))
    else:
        rs = np.random.RandomState(0)
        toks = rs.randint(0, vocab, (samples, seq)).astype(np.int64)
        batches = [{"tokens": toks[i:i + 4], "position_ids": np.broadcast_to(np.arange(seq), toks[i:i + 4].shape)}
                   for i in range(0, samples, 4)]
    if data:
        q = perplexity(model, batches)
        out.update(loss=q["loss"], ppl=q["ppl"])
    if reference:
        ref = _reference_model(reference)
        same, count, diff = 0, 0, 0.0
        with torch.no_grad():
            for b in batches:
                ids, pos = torch.from_numpy(b["tokens"]).long(), torch.from_numpy(np.ascontiguousarray(b["position_ids"])).long()
                a = model(input_ids=ids, position_ids=pos, use_cache=False).logits[..., :vocab].float()
                r = ref(input_ids=ids, position_ids=pos, use_cache=False).logits[..., :vocab].float()
                same += int((a.argmax(-1) == r.argmax(-1)).sum())
                count += a.shape[0] * a.shape[1]
                diff = max(diff, float((a - r).abs().max()))
        out.update(agreement=same / count, max_logit_diff=diff, reference=reference)
        if data:
            r = perplexity(ref, batches)
            out.update(reference_loss=r["loss"], reference_ppl=r["ppl"])
    for k in ("ppl", "reference_ppl"):
        if k in out and not math.isfinite(out[k]):
            out["problems"] = out["problems"] + [f"{k} is {out[k]}"]
    return out


