"""``python -m jmegatron.export quantize``: NVIDIA ModelOpt post-training quantization (PTQ).

    python -m jmegatron.export quantize --load CKPT --quant-cfg int8_sq,fp8,int4_awq,w4a8_awq \\
        --calib-data PREFIX [--calib-size 512 --calib-batch-size 4 --calib-seq-length 512] \\
        [--eval-data PREFIX --eval-samples 256] [--kv-cache-quant fp8] --out DIR

The checkpoint becomes the float32 ``transformers`` model of :func:`jmegatron.export.common.hf_model`
(``GPT2LMHeadModel`` / ``LlamaForCausalLM``); for every ``--quant-cfg`` a copy of it is quantized
with ``mtq.quantize`` (fake quantization: quantizers inserted around every linear layer,
calibrated by a forward loop), the output layer left unquantized as Megatron-LM does
(``*lm_head*``/``*output_layer*`` disabled), and saved. Follows Megatron-LM
``examples/export/ptq_and_trtllm_export/text_generation_ptq.py`` (config names, the output
layer rule, export dtype bf16 if the run trained in bf16 else fp16) and ModelOpt
``examples/llm_ptq/hf_ptq.py`` (KV-cache config merge, greedy sample before/after PTQ, unified
Hugging Face export).

Mixture-of-experts checkpoints become ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM``
(:mod:`jmegatron.conversion.hf_moe`); ModelOpt quantizes each expert (``_QuantFusedExperts``:
one weight quantizer per expert and projection) and the attention, and the routers stay
unquantized: ModelOpt's default ``*block_sparse_moe.gate*`` / ``*mlp.gate.*`` /
``*router*`` rules (``modelopt_recipes/configs/ptq/units/default_disabled_quantizers.yaml``)
disable Linear routers, and transformers 5's ``MixtralTopKRouter`` is not wrapped at all;
the command raises if a router (:func:`moe_router_modules`) has an enabled quantizer. Weight
blocks (int4_awq, w4a8_awq) must fit ``moe_ffn_hidden_size`` too (:func:`check_block_sizes`).
Tested (tests/test_trtllm_moe.py): Mixtral end to end; Qwen2-MoE's router and
shared-expert gate stay unquantized.

Data. Calibration and evaluation use the project's own tokenized MMIDIDX data
(``PREFIX.bin``/``PREFIX.idx``), never a hub dataset, cut with the checkpoint config's ``split``
exactly as training cut it (``jmegatron.data.blended_dataset``: contiguous sequence ranges
``[round(begin * N), round(end * N))``): calibration samples are :class:`GPTDataset` samples of
the **train** portion of ``--calib-data``, perplexity is measured on the **test** portion of
``--eval-data`` (default: the same prefix), which training never read (it only evaluates on
valid) and calibration never reads, so the quality figures are held-out figures. Evaluation
takes the first ``--eval-samples`` samples of one epoch of the test portion (fewer if the
portion is smaller; never repeated text).

Output (``--out DIR``, which must be empty or absent)::

    DIR/quantize.json           source checkpoint, configs, data, timings (manifest)
    DIR/quality.json, .md       held-out perplexity: fp32 row + one row per config
    DIR/<cfg>/modelopt_state.pth    ``mto.save`` of the fake-quantized model (architecture
                                    changes, quantizer amax/scales, smoothed weights)
    DIR/<cfg>/quant_summary.txt     ModelOpt's quantizer table (``mtq.print_quant_summary``'s
                                    lines: every TensorQuantizer, enabled or not, with its amax)
    DIR/<cfg>/quantize_info.json    what :func:`jmegatron.export.quantized.load_quantized` needs (source checkpoint,
                                    iteration, ModelOpt config, KV-cache quant, perplexity)
    DIR/<cfg>/unified_hf/       ModelOpt's unified Hugging Face checkpoint
                                (``export_hf_checkpoint``): config.json with
                                ``quantization_config``, model.safetensors (quantized weights
                                and scales), hf_quant_config.json (``quant_algo``,
                                ``kv_cache_quant_algo``, ``exclude_modules``), and the tokenizer
                                (tokenizer.json, tokenizer_config.json) when the checkpoint has one.
                                This is the format TensorRT-LLM's ``LLM(model=...)`` and vLLM
                                read (not run here: no GPU). Caveat from hf_ptq.py: it still
                                sends ``int8_sq`` to the legacy TRT-LLM exporter, as the
                                TensorRT-LLM torch runtime lacks W8A8 SmoothQuant.

Calibration and evaluation run the float32 model (fake quantization); the export then casts
it to ``--export-dtype`` (default bf16 if the run trained in bf16, else fp16, as Megatron),
so the unquantized tensors are half precision as from a model loaded in that dtype. ModelOpt
turns GPT-2's ``Conv1D`` ([in, out] weights) into ``nn.Linear``, so the exported GPT-2
weights are ``[out, in]``. ``quant_algo`` names are ModelOpt's (``W8A8_SQ_PER_CHANNEL``,
``FP8``, ``W4A16_AWQ``, ``W4A8_AWQ``, ...). On a CPU shared with other jobs, torch's OpenMP
threads spin: ``OMP_NUM_THREADS=1`` ran 5 to 35 times faster on the shared 2-core test machine.

Requires ``torch`` and ``nvidia-modelopt`` (the ``export`` extra); on CPU ModelOpt 0.47 runs
the six configs offered here (NVFP4 / MXFP8 need CUDA).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from jmegatron.config import moe_layer_pattern, tokenizer_type_of
from jmegatron.data.indexed_dataset import IndexedDataset
from jmegatron.data.tokenizer import build_tokenizer
from jmegatron.conversion.hf import hf_architecture, to_hf_state_dict
from jmegatron.export.common import (ExportError, ExportSource, check_out_dir, checkpoint_config, hf_model, load_checkpoint,
                                     open_checkpoint, write_hf_tokenizer)
from jmegatron.export.calibration import Portion, calibration_loop, make_batches, perplexity, portion_dataset
from jmegatron.export.fp8_scales import (FP8_E4M3_MAX, WEIGHT_SCALES, check_fp8_exportable, checkpoint_fp8_scales,
                                         quantize_weight, saved_fp8_meta_paths, strip_fp8_meta,
                                         unified_modules)
from jmegatron.export.quantized import INFO_FILE, MANIFEST, MODELOPT_STATE, UNIFIED_HF_DIR
from jmegatron.export.unified import check_unified, unified_model
from jmegatron.inference.generate import generate_text

__all__ = [
    "QUANT_CFG_CHOICES", "KV_CACHE_QUANT_CHOICES", "register", "run", "quantize", "parse_quant_cfgs",
    "build_quant_config", "quantize_model",
    "enabled_quantizers", "moe_router_modules", "greedy_continuation", "save_quantized", "weight_block_size",
    "check_block_sizes", "SCALES", "QUANT_SUMMARY", "quantizer_table",
    "checkpoint_scaled_model", "reloaded_perplexity",
]

# --quant-cfg name -> ModelOpt config (names as Megatron-LM's text_generation_ptq.py / hf_ptq.py)
QUANT_CFG_CHOICES = {
    "int8": "INT8_DEFAULT_CFG",          # W8A8 per-channel weights, per-tensor activations (max)
    "int8_sq": "INT8_SMOOTHQUANT_CFG",   # W8A8 with SmoothQuant (arXiv:2211.10438)
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",   # W8A16
    "fp8": "FP8_DEFAULT_CFG",            # E4M3 weights and activations, per tensor
    "int4_awq": "INT4_AWQ_CFG",          # W4A16, groups of 128, AWQ-lite (arXiv:2306.00978)
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",     # INT4 AWQ weights, FP8 activations
}
KV_CACHE_QUANT_CHOICES = {"none": None, "fp8": "FP8_KV_CFG"}
# Megatron keeps the output layer in high precision (text_generation_ptq.py disables it)
UNQUANTIZED_PATTERNS = ("*lm_head*", "*output_layer*")
# ModelOpt 0.47 wraps nn.LayerNorm (GPT-2's ln_1 / ln_2 / ln_f) with an input quantizer that
# "*input_quantizer" enables (modelopt/torch/quantization/nn/modules/quant_layernorm.py, for
# its ONNX attention fusion); the unified and TensorRT-LLM exports write no scale for it, and
# jmegatron's FP8 training leaves norms unquantized, so it is disabled: the fake-quantized
# model then computes what the exported checkpoint computes
UNQUANTIZED_PARENT_CLASSES = ("nn.LayerNorm",)
OUTPUT_LAYER = "lm_head"

QUANT_SUMMARY = "quant_summary.txt"
EXPORT_DTYPES = ("float16", "bfloat16", "float32")
SCALES = ("calibrate", "from-checkpoint")


# ----------------------------------------------------------------------------- CLI
def register(sub) -> None:
    """Add the ``quantize`` subcommand to an argparse subparsers object."""
    p = sub.add_parser("quantize", help="ModelOpt post-training quantization + unified HF export + quality report",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="jmegatron checkpoint directory")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    p.add_argument("--quant-cfg", required=True,
                   help="one or a comma list of: " + ", ".join(QUANT_CFG_CHOICES))
    p.add_argument("--kv-cache-quant", default="none", help="KV-cache quantization: none (default) or fp8")
    p.add_argument("--calib-data", required=True, help="dataset prefix (PREFIX.bin/.idx); its train portion calibrates")
    p.add_argument("--calib-size", type=int, default=512, help="calibration samples (default 512)")
    p.add_argument("--calib-batch-size", type=int, default=4,
                   help="samples per forward pass, for calibration and evaluation (default 4)")
    p.add_argument("--calib-seq-length", type=int, default=512,
                   help="tokens per calibration sample (default 512; clamped to max_position_embeddings)")
    p.add_argument("--eval-data", default=None, help="dataset prefix whose test portion measures perplexity "
                   "(default: --calib-data)")
    p.add_argument("--eval-samples", type=int, default=256,
                   help="held-out samples for perplexity (default 256, at most one epoch of the test portion)")
    p.add_argument("--eval-seq-length", type=int, default=None,
                   help="tokens per evaluation sample (default: the checkpoint's seq_length)")
    p.add_argument("--split", default=None, help="train,valid,test weights (default: the checkpoint config's split)")
    p.add_argument("--prompt", default=None, help="sanity prompt for greedy continuations "
                   "(default: the first 16 tokens of the first held-out sample)")
    p.add_argument("--max-new-tokens", type=int, default=24,
                   help="tokens of the sanity continuations (default 24; 0 skips them)")
    p.add_argument("--export-dtype", choices=EXPORT_DTYPES, default=None,
                   help="dtype of the unquantized tensors in the unified HF checkpoint "
                        "(default: bfloat16 if the run trained in bf16, else float16, as Megatron)")
    p.add_argument("--scales", choices=SCALES, default="calibrate",
                   help="where the fp8 config's scales come from: calibrate (ModelOpt's PTQ, default) or "
                        "from-checkpoint (an FP8-trained checkpoint's own delayed-scaling scales, no calibration)")
    p.add_argument("--weight-scales", choices=WEIGHT_SCALES, default="checkpoint",
                   help="with --scales from-checkpoint: the weights' scale, the training's kernel_scale (checkpoint, "
                        "default: the training forward's FP8 codes) or amax(w)/448 (amax, ModelOpt's rule)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    p.set_defaults(func=run)


def run(args) -> int:
    """The ``quantize`` command: :func:`quantize` with the parsed arguments; returns 0."""
    quantize(load=args.load, quant_cfgs=args.quant_cfg, calib_data=args.calib_data, out=args.out,
             iteration=args.iteration, kv_cache_quant=args.kv_cache_quant, calib_size=args.calib_size,
             calib_batch_size=args.calib_batch_size, calib_seq_length=args.calib_seq_length,
             eval_data=args.eval_data, eval_samples=args.eval_samples, eval_seq_length=args.eval_seq_length,
             split=args.split, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
             export_dtype=args.export_dtype, device=args.device, scales=args.scales, weight_scales=args.weight_scales)
    return 0


# ----------------------------------------------------------------------------- configs
def parse_quant_cfgs(text: str) -> list[str]:
    """``"int8_sq,fp8"`` -> ``["int8_sq", "fp8"]``. Raises ExportError naming ``--quant-cfg``
    for an empty list, an unknown name (the choices are listed) or a repeated one."""
    names = [n.strip() for n in str(text or "").split(",") if n.strip()]
    if not names:
        raise ExportError(f"--quant-cfg is empty; give one or a comma list of: {', '.join(QUANT_CFG_CHOICES)}")
    unknown = [n for n in names if n not in QUANT_CFG_CHOICES]
    if unknown:
        raise ExportError(f"--quant-cfg: unknown config(s) {unknown}; choose from {', '.join(QUANT_CFG_CHOICES)} "
                          "(NVFP4/MXFP8 need CUDA and are not offered)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ExportError(f"--quant-cfg lists {repeated} more than once")
    return names


def _check_kv_cache_quant(kv_cache_quant: Optional[str]) -> str:
    kv = kv_cache_quant or "none"
    if kv not in KV_CACHE_QUANT_CHOICES:
        raise ExportError(f"--kv-cache-quant {kv!r}: choose from {', '.join(KV_CACHE_QUANT_CHOICES)}")
    return kv


def _append_entries(quant_cfg, entries: Sequence[tuple[str, dict]]):
    """Add (pattern, settings) entries after the existing ones (later entries win). ModelOpt
    0.47 keeps ``quant_cfg`` as a list of ``{"quantizer_name": ..., ...}``; older releases as a
    pattern -> settings dict; both are handled."""
    if isinstance(quant_cfg, list):
        return quant_cfg + [{"quantizer_name": pattern, **settings} for pattern, settings in entries]
    out = dict(quant_cfg)
    for pattern, settings in entries:
        out[pattern] = settings
    return out


def _disable_parent_classes(quant_cfg, classes: Sequence[str]):
    """Disable every quantizer of modules of ``classes`` (ModelOpt names, e.g. ``"nn.LayerNorm"``):
    ``{"quantizer_name": "*", "parent_class": C, "enable": False}`` entries (0.47's list), or
    ``{C: {"*": {"enable": False}}}`` in the older dict form."""
    if isinstance(quant_cfg, list):
        return quant_cfg + [{"quantizer_name": "*", "parent_class": c, "enable": False} for c in classes]
    return {**quant_cfg, **{c: {"*": {"enable": False}} for c in classes}}


def build_quant_config(name: str, kv_cache_quant: str = "none") -> dict:
    """The ModelOpt config dict (``{"quant_cfg": ..., "algorithm": ...}``) for ``--quant-cfg name``:
    a deep copy of ``mtq.<QUANT_CFG_CHOICES[name]>`` with the quantizers ModelOpt puts on
    ``nn.LayerNorm`` inputs disabled (:data:`UNQUANTIZED_PARENT_CLASSES`: no export writes their
    scale), then the output layer (``*lm_head*``, ``*output_layer*``) and, for
    ``kv_cache_quant="fp8"``, ``mtq.FP8_KV_CFG``'s ``*[kv]_bmm_quantizer`` entries appended
    (as hf_ptq.py merges them).
    Raises ExportError for an unknown name or KV-cache choice."""
    import modelopt.torch.quantization as mtq

    parse_quant_cfgs(name)
    kv = _check_kv_cache_quant(kv_cache_quant)
    cfg = copy.deepcopy(getattr(mtq, QUANT_CFG_CHOICES[name]))
    cfg["quant_cfg"] = _disable_parent_classes(cfg["quant_cfg"], UNQUANTIZED_PARENT_CLASSES)
    cfg["quant_cfg"] = _append_entries(cfg["quant_cfg"], [(p, {"enable": False}) for p in UNQUANTIZED_PATTERNS])
    if KV_CACHE_QUANT_CHOICES[kv] is not None:
        kv_cfg = copy.deepcopy(getattr(mtq, KV_CACHE_QUANT_CHOICES[kv])["quant_cfg"])
        if isinstance(kv_cfg, list):
            entries = [(e["quantizer_name"], {k: v for k, v in e.items() if k != "quantizer_name"}) for e in kv_cfg]
        else:
            entries = list(kv_cfg.items())
        cfg["quant_cfg"] = _append_entries(cfg["quant_cfg"], entries)
    return cfg


def weight_block_size(name: str) -> Optional[int]:
    """Input features per block of the weight quantizer of ``--quant-cfg name`` (128 for the
    INT4 AWQ configs), or None for per-channel / per-tensor weights."""
    for entry in build_quant_config(name)["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer":
            settings = entry.get("cfg")
            for s in settings if isinstance(settings, list) else [settings or {}]:
                if s.get("block_sizes"):
                    return int(s["block_sizes"][-1])
    return None


def check_block_sizes(name: str, cfg) -> None:
    """Raise ExportError when a linear layer's input features are not a multiple of the
    weight block size of ``name``: ModelOpt fake-quantizes partial blocks but refuses to pack
    them at export (``NotImplementedError``), so this is caught before any work."""
    block = weight_block_size(name)
    if not block:
        return
    inputs = {"hidden_size (linear_qkv / linear_fc1 input)": cfg.hidden_size,
              "num_attention_heads * kv_channels (linear_proj input)": cfg.num_attention_heads * cfg.kv_channels}
    if cfg.num_moe_experts is None or not all(_moe_pattern(cfg)):
        inputs["ffn_hidden_size (linear_fc2 input)"] = cfg.ffn_hidden_size
    if cfg.num_moe_experts is not None:
        inputs["moe_ffn_hidden_size (the experts' linear_fc2 input)"] = cfg.moe_ffn_hidden_size
        if cfg.moe_shared_expert_intermediate_size is not None:
            inputs["moe_shared_expert_intermediate_size (shared linear_fc2 input)"] = \
                cfg.moe_shared_expert_intermediate_size
    bad = [f"{k} = {v}" for k, v in inputs.items() if v % block]
    if bad:
        raise ExportError(f"--quant-cfg {name}: ModelOpt packs the weights in blocks of {block} input features and "
                          f"cannot export partial blocks, but {'; '.join(bad)} is not a multiple of {block}; "
                          "leave this config out (int8_sq, int8_wo and fp8 have no blocks)")


def _moe_pattern(cfg) -> tuple:
    return moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)


# ----------------------------------------------------------------------------- data
def _check_prefix(prefix: Optional[str], flag: str) -> str:
    if not prefix:
        raise ExportError(f"{flag} is required: a tokenized dataset prefix (PREFIX.bin/PREFIX.idx)")
    p = os.fspath(prefix)
    if IndexedDataset.exists(p):
        return p
    hint = ""
    if p.endswith((".bin", ".idx")) and IndexedDataset.exists(p[:-4]):
        hint = f"; drop the suffix: {p[:-4]}"
    elif IndexedDataset.exists(p + "_text_document"):
        hint = f"; did you mean {p}_text_document?"
    raise ExportError(f"{flag} {p}: no {p}.bin/{p}.idx{hint} (a prefix is the path without .bin/.idx, "
                      "as printed by `python -m jmegatron.tools.preprocess_data`)")


def quantize_model(model, name: str, kv_cache_quant: str, calib_batches: Sequence[dict], device="cpu"):
    """``mtq.quantize`` ``model`` in place with :func:`build_quant_config` ``(name, kv_cache_quant)``,
    calibrated on ``calib_batches``; returns the fake-quantized model."""
    import modelopt.torch.quantization as mtq

    return mtq.quantize(model, build_quant_config(name, kv_cache_quant), forward_loop=calibration_loop(
        calib_batches, device))


def checkpoint_scaled_model(model, params, cfg, kv_cache_quant: str = "none", weight_scales: str = "checkpoint"):
    """``(model, provenance)``: ``model`` (the float32 transformers model of ``params``)
    quantized with the ``fp8`` config and **no calibration**, its quantizers holding the
    FP8-trained checkpoint's own scales (:func:`jmegatron.export.fp8_scales.checkpoint_fp8_scales`):
    each HF linear's input amax is ``activation_scaling_factor * 448`` of the jmegatron linear
    whose input it sees (q/k/v share linear_qkv's, gate/up linear_fc1's), its weight amax
    ``448 / kernel_scale`` (``weight_scales="checkpoint"``) or ModelOpt's ``amax(w)`` of the
    weight (``"amax"``). ``provenance``: the rule, margin, amax algorithm, history length,
    where the activation scales came from, and per module the float32 ``(weight_scale,
    input_scale)`` written. Raises ExportError as ``checkpoint_fp8_scales`` (no FP8 meta, MoE),
    RuntimeError if an enabled input quantizer is left without an amax (the export would
    silently drop its ``input_scale``)."""
    import modelopt.torch.quantization as mtq
    import torch

    scales = checkpoint_fp8_scales(params, cfg, weight_scales)
    model = mtq.quantize(model, build_quant_config("fp8", kv_cache_quant), forward_loop=None)  # weight amax only
    written = {}
    for i, linears in scales.items():
        for path, sc in linears.items():
            for name in unified_modules(cfg, i, path):
                module = model.get_submodule(name)
                module.input_quantizer.amax = torch.tensor(float(sc.activation_scaling_factor) * FP8_E4M3_MAX)
                if weight_scales == "checkpoint":
                    module.weight_quantizer.amax = torch.tensor(float(sc.weights_scaling_factor) * FP8_E4M3_MAX)
                written[name] = {"path": f"decoder_layers_{i}/{path}", "kernel_scale": float(sc.kernel_scale)}
    unset = [n for n, m in model.named_modules() if n.endswith("input_quantizer") and m.is_enabled
             and getattr(m, "amax", None) is None and not n.endswith(("k_bmm_quantizer", "v_bmm_quantizer"))]
    if unset:
        raise RuntimeError(f"--scales from-checkpoint: no training scale for {unset[:4]} (the unified export would "
                           f"drop their input_scale)")
    provenance = {"scales": "from-checkpoint", "weight_scales": weight_scales, "fp8": cfg.fp8,
                  "fp8_margin": int(cfg.fp8_margin), "fp8_amax_compute_algo": cfg.fp8_amax_compute_algo,
                  "fp8_amax_history_len": int(cfg.fp8_amax_history_len),
                  "activation_scales_from": sorted({s.activation_source for layer in scales.values()
                                                    for s in layer.values()}), "modules": written}
    return model, provenance


def _amaxes(model) -> dict:
    """Every ModelOpt quantizer's amax (float32 copies), by quantizer."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {m: m._amax.detach().float().clone() for m in model.modules()
            if isinstance(m, TensorQuantizer) and getattr(m, "_amax", None) is not None}


def _restore_amaxes(amaxes: dict) -> None:
    """Re-register the amaxes of :func:`_amaxes` in float32 after the model's cast to the export
    dtype, so ``weight_scale`` / ``input_scale`` are the float32 scales, not rounded to bf16 / fp16."""
    for quantizer, value in amaxes.items():
        del quantizer._amax
        quantizer.amax = value


def _rewrite_fp8_weights(hf_dir: str, params, cfg, vocab_size: int, modules: dict) -> int:
    """Replace the float8 weights of ``modules`` (name -> its record with ``kernel_scale``) in
    ``hf_dir``'s safetensors by the training forward's codes ``cast(clip(w * kernel_scale))`` of
    the float32 weights (GPT-2's ``[in, out]`` Conv1D weights transposed to the exported
    ``[out, in]``); returns the count of values clipped at +-448."""
    import glob

    from safetensors.torch import load_file, save_file

    weights = to_hf_state_dict(strip_fp8_meta(params), cfg, vocab_size)
    gpt2 = cfg.position_embedding_type == "learned_absolute"
    saturated = 0
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        tensors = load_file(path)
        hit = False
        for name, record in modules.items():
            key = f"{name}.weight"
            if key in tensors:
                w = weights[key].T if gpt2 else weights[key]
                codes, sat = quantize_weight(w, None, np.float32(record["kernel_scale"]))
                if tuple(codes.shape) != tuple(tensors[key].shape):
                    raise RuntimeError(f"{key}: codes {tuple(codes.shape)} vs exported {tuple(tensors[key].shape)}")
                tensors[key], hit = codes, True
                saturated += sat
        if hit:
            save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    return saturated


def reloaded_perplexity(hf_dir: str, batches, device="cpu") -> Optional[dict]:
    """Perplexity of the unified checkpoint ``hf_dir`` as a server computes it
    (:func:`jmegatron.export.unified.unified_model`: dequantized weights, inputs cast to E4M3
    at their ``input_scale``), or None for a ``quant_algo`` that reader does not dequantize.
    Raises RuntimeError listing what :func:`jmegatron.export.unified.check_unified` finds wrong."""
    with open(os.path.join(hf_dir, "hf_quant_config.json")) as f:
        if json.load(f)["quantization"].get("quant_algo") != "FP8":
            return None
    problems = check_unified(hf_dir)
    if problems:
        raise RuntimeError(f"{hf_dir}: the unified checkpoint would not load as written: " + "; ".join(problems[:6]))
    model, _ = unified_model(hf_dir)
    return perplexity(model.to(device), batches, device)


def quantizer_table(model) -> tuple[str, dict]:
    """``(table, counts)`` of a ModelOpt-quantized model: ``table`` holds the lines
    ``mtq.print_quant_summary`` prints (each ``TensorQuantizer``'s name and repr, then the
    count); ``counts``: ``total``, ``enabled`` and ``enabled_by_kind`` (``weight`` / ``input``
    / ``output`` / ``bmm`` (attention's q/k/v/p) -> number enabled)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    quantizers = [(n, m) for n, m in model.named_modules() if isinstance(m, TensorQuantizer)]
    lines = [f"{n:80} {m}" for n, m in quantizers] + [f"{len(quantizers)} TensorQuantizers found in model"]
    by_kind: dict[str, int] = {}
    for n, m in quantizers:
        if m.is_enabled:
            kind = n.rsplit(".", 1)[-1].removesuffix("_quantizer")
            kind = "bmm" if kind.endswith("_bmm") else kind
            by_kind[kind] = by_kind.get(kind, 0) + 1
    return "\n".join(lines) + "\n", {"total": len(quantizers), "enabled": sum(by_kind.values()),
                                      "enabled_by_kind": dict(sorted(by_kind.items()))}


def enabled_quantizers(model, prefix: str) -> list[str]:
    """Names of the enabled ModelOpt ``TensorQuantizer`` s under module ``prefix`` (e.g.
    ``"lm_head"``); [] means that module runs unquantized."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    return [n for n, m in model.named_modules()
            if (n == prefix or n.startswith(prefix + ".")) and isinstance(m, TensorQuantizer) and m.is_enabled]


def moe_router_modules(model) -> list[str]:
    """Names of the MoE routers of a ``transformers`` model: the ``gate`` (and Qwen2-MoE's
    ``shared_expert_gate``) of every sparse MoE block (a module with ``experts`` and ``gate``
    children: ``model.layers.{i}.mlp`` in transformers 5, ``block_sparse_moe`` in 4.x).
    [] for a dense model."""
    names = []
    for name, module in model.named_modules():
        if hasattr(module, "experts") and hasattr(module, "gate"):
            names.append(f"{name}.gate")
            if hasattr(module, "shared_expert_gate"):
                names.append(f"{name}.shared_expert_gate")
    return names


def greedy_continuation(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_id: Optional[int],
                        device="cpu") -> list[int]:
    """Greedy ``model.generate`` continuation (new token ids only) of ``prompt_ids``."""
    import torch

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id if eos_token_id is not None else 0)
    return out[0, ids.shape[1]:].tolist()


# ----------------------------------------------------------------------------- save / load
def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _save_tokenizer(src: ExportSource, folder: str) -> bool:
    if not src.tokenizer_path:
        return False
    write_hf_tokenizer(src.tokenizer_path, folder, src.cfg.max_position_embeddings)
    return True


# ----------------------------------------------------------------------------- the command
def _log(msg: str) -> None:
    print(f"[jmegatron.export quantize] {msg}", flush=True)


def _warn(msg: str) -> None:
    print(f"[jmegatron.export quantize] warning: {msg}", file=sys.stderr, flush=True)


def _positive(value: Optional[int], flag: str) -> None:
    if value is not None and (isinstance(value, bool) or int(value) < 1):
        raise ExportError(f"{flag} must be an integer >= 1, got {value}")


def _clamp_length(value: int, flag: str, cfg) -> int:
    limit = int(cfg.max_position_embeddings)
    if value > limit:
        _warn(f"{flag} {value} > the model's max_position_embeddings {limit}; using {limit}")
        return limit
    return int(value)


def _jmegatron_continuation(load: str, prompt: str, max_new_tokens: int) -> tuple[Optional[str], str]:
    """(text, note): the fp32 greedy continuation from jmegatron's own KV-cache generator
    (``jmegatron.inference.generate.generate_text``), or (None, why there is none). Only a
    sanity print: a failure here is reported, not raised."""
    try:
        return generate_text(load, [prompt], max_new_tokens, greedy=True)[0], "ok"
    except Exception as e:  # noqa: BLE001 - reported next to the torch continuations
        return None, f"failed: {type(e).__name__}: {e}"


def _quality_markdown(report: dict) -> str:
    ev, cal = report["eval"], report["calibration"]
    lines = [
        f"# Post-training quantization quality: {report['source']['load_dir']} (iteration "
        f"{report['source']['iteration']})",
        "",
        f"Held-out perplexity on the **test** portion (sequences {ev['sequences'][0]}..{ev['sequences'][1] - 1} "
        f"of {ev['num_sequences']}, split {ev['split']!r}) of `{ev['prefix']}`: {ev['samples']} samples x "
        f"{ev['seq_length']} tokens = {ev['tokens']} tokens. Calibration: {cal['samples']} samples x "
        f"{cal['seq_length']} tokens of the **train** portion (sequences {cal['sequences'][0]}.."
        f"{cal['sequences'][1] - 1}) of `{cal['prefix']}`, batch {cal['batch_size']}. KV cache: "
        f"{report['kv_cache_quant']}. Quantized rows are ModelOpt fake quantization (simulated in "
        "float32), the output layer unquantized.",
        "",
        "| model | ModelOpt config | quant_algo | scales | loss (nats) | perplexity | relative change | "
        "unified checkpoint read back | calibrate (s) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        rel = "" if row["relative_change"] is None else f"{100 * row['relative_change']:+.2f}%"
        cal_s = "" if row.get("calibration_seconds") is None else f"{row['calibration_seconds']:.1f}"
        back = "" if row.get("reloaded_ppl") is None else f"{row['reloaded_ppl']:.3f}"
        lines.append(f"| {row['name']} | {row.get('modelopt_config') or '-'} | {row.get('quant_algo') or '-'} | "
                     f"{row.get('scales') or '-'} | {row['loss']:.4f} | {row['ppl']:.3f} | {rel} | {back} | {cal_s} |")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class _Plan:
    """Everything checked before any array is restored."""

    names: list
    kv: str
    scales: str
    weight_scales: str
    cfg: Any
    arch: str
    split: str
    calib: Portion
    held_out: Portion
    tokenizer: Any        # jmegatron.data.tokenizer.HFTokenizer or None
    eod: int
    export_dtype: str
    saved: Any            # jmegatron.checkpoint.metadata.SavedStep: the checkpoint step, its metadata read once


def _plan(load, quant_cfgs, calib_data, out, iteration, kv_cache_quant, calib_size, calib_batch_size,
          calib_seq_length, eval_data, eval_samples, eval_seq_length, split, prompt, max_new_tokens,
          export_dtype, scales="calibrate", weight_scales="checkpoint") -> _Plan:
    names = parse_quant_cfgs(",".join(quant_cfgs) if isinstance(quant_cfgs, (list, tuple)) else quant_cfgs)
    kv = _check_kv_cache_quant(kv_cache_quant)
    if scales not in SCALES:
        raise ExportError(f"--scales {scales!r}: choose from {', '.join(SCALES)}")
    if weight_scales not in WEIGHT_SCALES:
        raise ExportError(f"--weight-scales {weight_scales!r}: choose from {', '.join(WEIGHT_SCALES)}")
    if scales == "from-checkpoint":
        if "fp8" not in names:
            raise ExportError(f"--scales from-checkpoint sets the fp8 config's scales, but --quant-cfg is {names}; "
                              "add fp8")
        if kv != "none":
            raise ExportError("--scales from-checkpoint with --kv-cache-quant fp8: training keeps no KV-cache amax "
                              "(jmegatron's attention is not FP8); drop --kv-cache-quant or calibrate (--scales "
                              "calibrate)")
    for value, flag in ((calib_size, "--calib-size"), (calib_batch_size, "--calib-batch-size"),
                        (calib_seq_length, "--calib-seq-length"), (eval_samples, "--eval-samples"),
                        (eval_seq_length, "--eval-seq-length")):
        _positive(value, flag)
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) < 0:
        raise ExportError(f"--max-new-tokens must be >= 0 (0: no sanity continuations), got {max_new_tokens}")
    if export_dtype is not None and export_dtype not in EXPORT_DTYPES:
        raise ExportError(f"--export-dtype {export_dtype!r}: choose from {', '.join(EXPORT_DTYPES)}")
    check_out_dir(out)
    calib_prefix = _check_prefix(calib_data, "--calib-data")
    eval_prefix = _check_prefix(eval_data or calib_data, "--eval-data" if eval_data else "--calib-data")
    saved = open_checkpoint(load, iteration)
    cfg = checkpoint_config(load, iteration, saved)
    try:
        arch = hf_architecture(cfg)
    except ValueError as e:
        raise ExportError(f"--load {load}: {e}") from e
    if scales == "from-checkpoint":
        check_fp8_exportable(cfg)  # refuses MoE by name: the experts carry no FP8 scales
        if not saved_fp8_meta_paths(load, iteration, saved):
            raise ExportError(f"--scales from-checkpoint: {os.path.abspath(load)} holds no FP8 scales (no fp8_meta: "
                              f"it was trained without config.fp8, fp8={cfg.fp8!r}); use --scales calibrate")
    for name in names:
        check_block_sizes(name, cfg)
    tokenizer = None
    if (cfg.tokenizer_model and os.path.exists(cfg.tokenizer_model)) or \
            (tokenizer_type_of(cfg) == "GPT2BPETokenizer" and all(os.path.exists(f or "") for f in (cfg.vocab_file,
                                                                                              cfg.merge_file))):
        tokenizer = build_tokenizer(cfg)
    elif cfg.eod_mask_loss or cfg.reset_position_ids or prompt is not None:
        raise ExportError(f"--load {load}: the checkpoint's tokenizer_model {cfg.tokenizer_model!r} is missing; "
                          "--prompt, eod_mask_loss and reset_position_ids need it")
    eod = tokenizer.eod if tokenizer is not None else 0  # only read by the two flags above
    split = split or cfg.split
    calib_len = _clamp_length(calib_seq_length, "--calib-seq-length", cfg)
    eval_len = _clamp_length(eval_seq_length or cfg.seq_length, "--eval-seq-length", cfg)
    flags = dict(reset_position_ids=cfg.reset_position_ids, eod_mask_loss=cfg.eod_mask_loss)
    calib = portion_dataset(calib_prefix, split, "train", calib_size, calib_len, cfg.seed, eod, **flags)
    held_out = portion_dataset(eval_prefix, split, "test", None, eval_len, cfg.seed, eod, **flags)
    if len(held_out.dataset) < eval_samples:
        _warn(f"the test portion of {eval_prefix} holds {len(held_out.dataset)} samples of {eval_len} tokens; "
              f"evaluating on those instead of --eval-samples {eval_samples}")
    return _Plan(names, kv, scales, weight_scales, cfg, arch, split, calib, held_out, tokenizer, eod,
                 export_dtype or ("bfloat16" if cfg.bf16 else "float16"), saved)


def _portion_record(portion: Portion, batches: Sequence[dict], **extra) -> dict:
    ds = portion.dataset
    return {"prefix": os.path.realpath(portion.prefix), "portion": portion.name, "split": portion.split,
            "sequences": list(portion.sequences), "num_sequences": portion.num_sequences,
            "samples": sum(len(b["tokens"]) for b in batches), "seq_length": ds.seq_length, "seed": ds.seed, **extra}


def save_quantized(model, cfg_dir: str, src: ExportSource, export_dtype: str, info: dict,
                   fp8_codes: Optional[dict] = None) -> dict:
    """Write one quantized model: ``cfg_dir/modelopt_state.pth`` (``mto.save``), then the
    unified HF checkpoint ``cfg_dir/unified_hf`` (``export_hf_checkpoint``; the unquantized
    tensors in ``export_dtype``, plus the tokenizer when ``src`` has one), then
    ``cfg_dir/quantize_info.json`` = ``info`` + ``quant_algo``/``kv_cache_quant_algo``/
    ``exclude_modules`` from ``hf_quant_config.json``. Returns that info. The export casts
    ``model`` to ``export_dtype`` and packs its weights: use the model no further.

    ``fp8_codes`` (``--scales from-checkpoint``: :func:`checkpoint_scaled_model`'s
    ``provenance["modules"]`` when the weight scales are the checkpoint's): the amaxes stay
    float32 through the cast, and those modules' float8 weights are rewritten as the
    training forward's codes (``info["saturated_weight_values"]``)."""
    import modelopt.torch.opt as mto
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    os.makedirs(cfg_dir)
    mto.save(model, os.path.join(cfg_dir, MODELOPT_STATE))
    hf_dir = os.path.join(cfg_dir, UNIFIED_HF_DIR)
    dtype = getattr(torch, export_dtype)
    # as from a model loaded in that dtype (hf_ptq.py); a few quantized codes can move by one
    # step against the float32 fake quantization
    amaxes = _amaxes(model) if fp8_codes is not None else {}
    model.to(dtype)
    model.config.dtype = dtype
    _restore_amaxes(amaxes)
    with torch.inference_mode():
        export_hf_checkpoint(model, dtype=dtype, export_dir=hf_dir)
    if fp8_codes:
        info = {**info, "saturated_weight_values": _rewrite_fp8_weights(hf_dir, src.params, src.cfg, src.vocab_size,
                                                                        fp8_codes)}
    with open(os.path.join(hf_dir, "hf_quant_config.json")) as f:
        hf_quant = json.load(f)["quantization"]
    info = {**info, "quant_algo": hf_quant.get("quant_algo"),
            "kv_cache_quant_algo": hf_quant.get("kv_cache_quant_algo"),
            "exclude_modules": hf_quant.get("exclude_modules"), "export_dtype": export_dtype,
            "unified_hf_dir": UNIFIED_HF_DIR, "modelopt_state": MODELOPT_STATE,
            "tokenizer": _save_tokenizer(src, hf_dir)}
    _write_json(os.path.join(cfg_dir, INFO_FILE), info)
    return info


class _Sanity:
    """Greedy continuations of one prompt, printed side by side (hf_ptq.py's before/after PTQ)."""

    def __init__(self, plan: _Plan, prompt: Optional[str], first_held_out: np.ndarray, max_new_tokens: int, device):
        self.tok, self.device = plan.tokenizer, device
        self.ids = self.tok.tokenize(prompt) if prompt is not None else first_held_out[:16].tolist()
        self.max_new = max(0, min(int(max_new_tokens), plan.cfg.max_position_embeddings - len(self.ids)))
        self.eos = plan.eod if self.tok is not None else None
        self.samples: dict[str, Any] = {"prompt": self.text(self.ids) if self.tok else list(self.ids)}

    def text(self, ids) -> str:
        return self.tok.detokenize(ids) if self.tok is not None else str(list(ids))

    def add(self, name: str, model) -> None:
        if self.max_new:
            self.samples[name] = self.text(greedy_continuation(model, self.ids, self.max_new, self.eos, self.device))
            if name != "fp32":
                _log(f"  {'fp32 (torch)':<16} -> {self.samples['fp32']!r}")
            _log(f"  {name if name != 'fp32' else 'fp32 (torch)':<16} -> {self.samples[name]!r}")

    def add_jmegatron(self, load_dir: str, latest: bool) -> None:
        """``samples["fp32_jmegatron"]`` (text) or ``samples["fp32_jmegatron_note"]`` (why not)."""
        if not self.max_new:
            return
        text, note = None, "skipped: no tokenizer"
        if self.tok is not None:
            text, note = (_jmegatron_continuation(load_dir, self.samples["prompt"], self.max_new) if latest
                          else (None, "skipped: generate_text restores the latest iteration only"))
        if text is None:
            self.samples["fp32_jmegatron_note"] = note
        else:
            self.samples["fp32_jmegatron"] = text
        _log(f"  {'fp32 (jmegatron)':<16} -> {note if text is None else repr(text)}")


def _quantize_one(name: str, plan: _Plan, base, src: ExportSource, out: str, calib_batches, eval_batches,
                  fp32: dict, sanity: _Sanity, device, source: dict, data: dict) -> dict:
    """Quantize a copy of ``base`` with config ``name`` (calibrated, or the checkpoint's own FP8
    scales), check its output layer and MoE routers stayed unquantized, evaluate it, save it
    under ``out/name`` (:func:`save_quantized`) with its quantizer table, read the unified
    checkpoint back, and return its row of the quality report."""
    t0 = time.time()
    provenance = None
    if name == "fp8" and plan.scales == "from-checkpoint":
        model, provenance = checkpoint_scaled_model(copy.deepcopy(base), src.params, src.cfg, plan.kv,
                                                    plan.weight_scales)
        _log(f"{name} ({QUANT_CFG_CHOICES[name]}): the checkpoint's own FP8 scales (weights: "
             f"{plan.weight_scales}), no calibration")
    else:
        model = quantize_model(copy.deepcopy(base), name, plan.kv, calib_batches, device)
        _log(f"{name} ({QUANT_CFG_CHOICES[name]}, KV cache {plan.kv}): calibrated in {time.time() - t0:.1f}s")
    calib_seconds = time.time() - t0
    table, counts = quantizer_table(model)
    _log(f"{name}: {counts['enabled']} of {counts['total']} ModelOpt quantizers enabled ("
         + ", ".join(f"{n} {k}" for k, n in counts["enabled_by_kind"].items()) + "); the table -> "
         + os.path.abspath(os.path.join(out, name, QUANT_SUMMARY)))
    left_on = enabled_quantizers(model, OUTPUT_LAYER)
    if left_on:
        raise RuntimeError(f"{name}: the output layer has enabled quantizers {left_on} (it must stay unquantized)")
    routers = moe_router_modules(model)
    left_on = [q for r in routers for q in enabled_quantizers(model, r)]
    if left_on:  # ModelOpt's default rules ('*block_sparse_moe.gate*', '*mlp.gate.*', '*router*') keep them off
        raise RuntimeError(f"{name}: MoE routers have enabled quantizers {left_on} (they must stay unquantized)")
    if routers:
        _log(f"{name}: {len(routers)} MoE routers left unquantized ({routers[0]}, ...)")
    t0 = time.time()
    q = perplexity(model, eval_batches, device)
    eval_seconds = time.time() - t0
    rel = q["ppl"] / fp32["ppl"] - 1.0
    _log(f"{name}: held-out loss {q['loss']:.4f}, perplexity {q['ppl']:.3f} ({100 * rel:+.2f}% vs fp32)")
    sanity.add(name, model)
    t0 = time.time()
    codes = provenance["modules"] if provenance and plan.weight_scales == "checkpoint" else \
        ({} if provenance else None)
    info = save_quantized(model, os.path.join(out, name), src, plan.export_dtype, {
        "quant_cfg": name, "modelopt_config": QUANT_CFG_CHOICES[name], "kv_cache_quant": plan.kv,
        "scales": provenance or {"scales": "calibrate"}, "source": source, "perplexity": q,
        "fp32_perplexity": fp32, "relative_change": rel, **data}, fp8_codes=codes)
    export_seconds = time.time() - t0
    with open(os.path.join(out, name, QUANT_SUMMARY), "w") as f:
        f.write(table)
    hf_dir = os.path.join(out, name, UNIFIED_HF_DIR)
    _log(f"{name}: {info['quant_algo']} unified HF checkpoint ({plan.export_dtype}) -> "
         f"{os.path.abspath(hf_dir)} ({export_seconds:.1f}s)")
    del model
    reloaded = reloaded_perplexity(hf_dir, eval_batches, device)
    if reloaded is not None:
        _log(f"{name}: the unified checkpoint read back: perplexity {reloaded['ppl']:.3f}")
    return {"name": name, "modelopt_config": QUANT_CFG_CHOICES[name], "quant_algo": info["quant_algo"],
            "kv_cache_quant_algo": info["kv_cache_quant_algo"], "scales": plan.scales if name == "fp8"
            else "calibrate", "loss": q["loss"], "ppl": q["ppl"], "relative_change": rel,
            "reloaded_ppl": None if reloaded is None else reloaded["ppl"],
            "calibration_seconds": calib_seconds, "eval_seconds": eval_seconds,
            "export_seconds": export_seconds}


def quantize(load: str, quant_cfgs, calib_data: str, out: str, *, iteration: Optional[int] = None,
             kv_cache_quant: str = "none", calib_size: int = 512, calib_batch_size: int = 4,
             calib_seq_length: int = 512, eval_data: Optional[str] = None, eval_samples: int = 256,
             eval_seq_length: Optional[int] = None, split: Optional[str] = None, prompt: Optional[str] = None,
             max_new_tokens: int = 24, export_dtype: Optional[str] = None, device: Optional[str] = None,
             scales: str = "calibrate", weight_scales: str = "checkpoint") -> dict:
    """Quantize checkpoint ``load`` with each of ``quant_cfgs`` (names or a comma string) and
    write ``out`` (layout in the module docstring). Returns the quality report (also
    ``out/quality.json``): ``rows`` = fp32 then one per config with ``loss`` (nats/token),
    ``ppl``, ``relative_change`` (``ppl / ppl_fp32 - 1``), ``quant_algo``, timings (s);
    ``eval`` / ``calibration`` describe the data; ``samples`` the sanity continuations.

    ``calib_batch_size`` also batches the evaluation. Sequence lengths above
    ``max_position_embeddings`` are clamped to it with a warning.

    ``scales="from-checkpoint"``: the ``fp8`` config takes the FP8-trained checkpoint's own
    scales (:func:`checkpoint_scaled_model`, ``weight_scales`` as there), no calibration;
    its ``quantize_info.json`` records where they came from. Every FP8 row also reports the
    perplexity of its unified checkpoint read back (:func:`reloaded_perplexity`).

    Raises:
        ExportError, before any array is restored: unknown ``--quant-cfg`` / ``--kv-cache-quant``,
            non-positive sizes, a non-empty ``out``, a missing ``PREFIX.bin/.idx``, a
            missing or unreadable checkpoint, an architecture with no Hugging Face target (the
            config fields are named), a split portion without text, ``--prompt`` without a
            tokenizer, ``--scales from-checkpoint`` without ``fp8`` among the configs, with FP8 KV
            cache, for an MoE checkpoint or one without FP8 scales; after loading: token ids
            outside the vocabulary.
    """
    t_start = time.time()
    plan = _plan(load, quant_cfgs, calib_data, out, iteration, kv_cache_quant, calib_size, calib_batch_size,
                 calib_seq_length, eval_data, eval_samples, eval_seq_length, split, prompt, max_new_tokens,
                 export_dtype, scales, weight_scales)

    # ---- work starts: restore the arrays, build the torch model
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.time()
    src = load_checkpoint(load, iteration, plan.saved)
    base = hf_model(src).to(device)
    calib_batches = make_batches(plan.calib.dataset, calib_size, calib_batch_size, src.vocab_size)
    eval_batches = make_batches(plan.held_out.dataset, eval_samples, calib_batch_size, src.vocab_size)
    source = {"load_dir": os.path.realpath(src.load_dir), "iteration": src.iteration, "architecture": plan.arch,
              "vocab_size": src.vocab_size, "tokenizer": src.tokenizer_path and os.path.realpath(src.tokenizer_path)}
    data = {"calibration": _portion_record(plan.calib, calib_batches, batch_size=calib_batch_size),
            "eval": _portion_record(plan.held_out, eval_batches)}
    cal, ev = data["calibration"], data["eval"]
    _log(f"{plan.arch} of {src.load_dir} iteration {src.iteration} loaded in {time.time() - t0:.1f}s; calibration: "
         f"{cal['samples']} x {cal['seq_length']} tokens of the train portion of {cal['prefix']}; evaluation: "
         f"{ev['samples']} x {ev['seq_length']} tokens of its test portion{' of ' + ev['prefix'] if eval_data else ''}"
         f" (split {plan.split!r})")

    t0 = time.time()
    fp32 = perplexity(base, eval_batches, device)
    ev["tokens"] = fp32["tokens"]
    rows = [{"name": "fp32", "modelopt_config": None, "quant_algo": None, "loss": fp32["loss"], "ppl": fp32["ppl"],
             "relative_change": None, "calibration_seconds": None, "eval_seconds": time.time() - t0}]
    _log(f"fp32: held-out loss {fp32['loss']:.4f}, perplexity {fp32['ppl']:.3f} ({rows[0]['eval_seconds']:.1f}s)")
    sanity = _Sanity(plan, prompt, eval_batches[0]["tokens"][0], max_new_tokens, device)
    if sanity.max_new:
        _log(f"sanity prompt {sanity.samples['prompt']!r}")
    sanity.add("fp32", base)
    sanity.add_jmegatron(src.load_dir, latest=iteration is None)

    os.makedirs(out, exist_ok=True)
    for name in plan.names:
        rows.append(_quantize_one(name, plan, base, src, out, calib_batches, eval_batches, fp32, sanity, device,
                                  source, data))

    report = {"source": source, "kv_cache_quant": plan.kv, "export_dtype": plan.export_dtype, "device": str(device),
              **data, "rows": rows, "samples": sanity.samples, "total_seconds": time.time() - t_start}
    _write_json(os.path.join(out, "quality.json"), report)
    md = _quality_markdown(report)
    with open(os.path.join(out, "quality.md"), "w") as f:
        f.write(md)
    _write_json(os.path.join(out, MANIFEST), {"quant_cfgs": plan.names, "kv_cache_quant": plan.kv, "source": source,
                                              "export_dtype": plan.export_dtype, **data,
                                              "total_seconds": report["total_seconds"]})
    print(md, flush=True)
    _log(f"done in {report['total_seconds']:.1f}s -> {os.path.abspath(out)}")
    return report
