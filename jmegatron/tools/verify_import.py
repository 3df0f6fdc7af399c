"""``python -m jmegatron.tools.verify_import --hf DIR [--prompt-tokens 8] [--new-tokens 32]
[--seq-length 32] [--seed 0] [--card FILE]``

Runs a Hugging Face folder's model in transformers and in jmegatron side by side, both in
float32, and prints:

* the parts the import uses: each architecture field (:data:`jmegatron.config.MODEL_FIELDS`)
  whose value is not jmegatron's default, beside the sizes;
* the largest logit difference over two sequences of ``--seq-length`` random token ids;
* greedy agreement: ``--new-tokens`` ids generated greedily after ``--prompt-tokens``
  random ids, by transformers (``generate``) and by jmegatron
  (:func:`jmegatron.inference.generate.generate`, its KV cache), and the first position
  where they differ;
* the fields refused: when the import stops, each Hugging Face field it names
  (:func:`jmegatron.conversion.hf.config_fields_from_hf`), and nothing else runs.

``--card FILE`` writes the same as JSON (a verification card: the command, the versions, the
numbers), which anyone can regenerate by running the command it records. transformers runs
with eager attention (its SDPA path drops some families' soft-caps). The weights are read
once per side from the folder's safetensors. Exit status: 0 when the logits agree to
``--tolerance`` (default 1e-4) and every greedy id agrees, 1 otherwise or when the import
refuses the folder, 2 for bad arguments or a folder without ``config.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

import jax
import numpy as np

from jmegatron.checkpoint.hf import read_hf_folder
from jmegatron.config import MODEL_FIELDS, JMegatronConfig
from jmegatron.export.imports import imported_config
from jmegatron.inference.generate import generate
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig

SIZES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
         "vocab_size", "max_position_embeddings", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk")


def parts_of(fields: dict) -> tuple[dict, dict]:
    """(sizes, parts) of imported architecture ``fields``: the size fields (:data:`SIZES`),
    and every other architecture field whose value differs from jmegatron's default."""
    defaults = {f: getattr(JMegatronConfig, f, None) for f in MODEL_FIELDS}
    sizes = {k: fields[k] for k in SIZES if fields.get(k) is not None}
    parts = {k: v for k, v in sorted(fields.items()) if k in MODEL_FIELDS and k not in SIZES
             and _plain(v) != _plain(defaults.get(k))}
    return sizes, parts


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def refused_fields(error: ValueError) -> list[str]:
    """The Hugging Face fields an import refusal names, one entry each (the message of
    :func:`jmegatron.conversion.hf.config_fields_from_hf` lists them after its colon, ``; ``
    apart)."""
    text = str(error)
    head, sep, rest = text.partition(": ")
    return [p.strip() for p in rest.split("; ")] if sep and "cannot be imported" in head else [text]


def verify(folder: str, *, prompt_tokens: int = 8, new_tokens: int = 32, seq_length: int = 32, seed: int = 0,
           tolerance: float = 1e-4) -> dict:
    """The verification card of ``folder`` (see the module docstring) as a dict: ``status``
    "verified", "differs" or "refused", ``architecture``, ``model_type``, ``refused``,
    ``sizes``, ``parts``, ``max_logit_diff``, ``max_abs_logit``, ``greedy_equal`` /
    ``greedy_total`` / ``first_difference``, and the versions. Raises ValueError for a
    folder without ``config.json``."""
    import torch  # the reference side: optional dependencies of jmegatron
    import transformers

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    card: dict[str, Any] = {
        "hf": os.path.abspath(folder), "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type"), "transformers": transformers.__version__, "jax": jax.__version__,
        "tolerance": tolerance,
        "command": f"python -m jmegatron.tools.verify_import --hf {folder} --prompt-tokens {prompt_tokens} "
                   f"--new-tokens {new_tokens} --seq-length {seq_length} --seed {seed}"}
    try:
        hf = read_hf_folder(folder, mtp=False)
    except ValueError as e:
        return dict(card, status="refused", refused=refused_fields(e))
    card["sizes"], card["parts"] = parts_of(hf.fields)
    cfg = imported_config(hf.fields, seq_length=max(seq_length, prompt_tokens + new_tokens),
                          what=f"--hf {folder}")
    model = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
    params = hf.params(cfg, cfg.padded_vocab_size())
    vocab = int(hf.fields["vocab_size"])
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (2, seq_length)).astype(np.int32)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens))[..., :vocab]
    with torch.no_grad():
        theirs = ref(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()[..., :vocab]
    prompt = rng.integers(0, vocab, (1, prompt_tokens)).astype(np.int64)
    our_ids = generate(model, params, prompt.tolist(), new_tokens, greedy=True)[0]
    with torch.no_grad():
        their_ids = ref.generate(torch.from_numpy(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)[0, prompt_tokens:].tolist()
    first = next((i for i, (a, b) in enumerate(zip(our_ids, their_ids)) if a != b), None)
    diff = float(np.max(np.abs(ours - theirs)))
    card.update(max_logit_diff=diff, max_abs_logit=float(np.max(np.abs(theirs))),
                greedy_equal=sum(a == b for a, b in zip(our_ids, their_ids)), greedy_total=new_tokens,
                first_difference=first, refused=[])
    card["status"] = "verified" if diff <= tolerance and first is None and len(our_ids) == len(their_ids) \
        else "differs"
    return card


def format_card(card: dict) -> str:
    """The card as the lines the command prints."""
    lines = [f"{card['hf']}: {card['architecture']} (model_type {card['model_type']!r}): {card['status']}"]
    if card["status"] == "refused":
        lines += ["fields refused:"] + [f"  {r}" for r in card["refused"]]
        return "\n".join(lines)
    lines.append("sizes: " + ", ".join(f"{k}={v}" for k, v in card["sizes"].items()))
    lines.append("parts: " + (", ".join(f"{k}={v!r}" for k, v in card["parts"].items()) or "(all defaults)"))
    lines.append(f"largest logit difference: {card['max_logit_diff']:.3g} (largest |logit| "
                 f"{card['max_abs_logit']:.3g}; tolerance {card['tolerance']:g})")
    first = card["first_difference"]
    lines.append(f"greedy: {card['greedy_equal']}/{card['greedy_total']} ids equal"
                 + ("" if first is None else f", first difference at new token {first}"))
    lines.append("fields refused: none")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jmegatron.tools.verify_import", description=__doc__.split("\n\n")[1])
    p.add_argument("--hf", required=True, help="a Hugging Face folder (config.json + safetensors)")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--card", help="also write the card as JSON to this file")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.hf, "config.json")):
        print(f"error: --hf {args.hf}: no config.json (expected a save_pretrained folder)", file=sys.stderr)
        return 2
    card = verify(args.hf, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                  seq_length=args.seq_length, seed=args.seed, tolerance=args.tolerance)
    print(format_card(card))
    if args.card:
        os.makedirs(os.path.dirname(os.path.abspath(args.card)), exist_ok=True)
        with open(args.card, "w") as f:
            json.dump(card, f, indent=1, default=_plain)
            f.write("\n")
    return 0 if card["status"] == "verified" else 1


if __name__ == "__main__":
    sys.exit(main())
