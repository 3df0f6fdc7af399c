"""ModelOpt's unified Hugging Face checkpoint read back as a server reads it.

``export quantize`` writes the unified checkpoint with ModelOpt's ``export_hf_checkpoint``
(``modelopt/torch/export/unified_export_hf.py``): the model's ``config.json`` with a
``quantization_config`` whose ``quant_method`` is ``"modelopt"``, ``hf_quant_config.json``
(``quant_algo``, ``kv_cache_quant_algo``, ``exclude_modules``) and safetensors. For
``quant_algo`` ``"FP8"`` (per-tensor E4M3, ModelOpt's ``FP8_DEFAULT_CFG``), each quantized
linear ``M`` holds::

    M.weight        float8_e4m3fn [out, in]   the codes: w ~= weight * weight_scale
    M.weight_scale  float32 []                 amax(w) / 448
    M.input_scale   float32 []                 the activations' grid: x_fp8 = cast(clip(x / input_scale, +-448))

and the modules left in the export dtype (the output layer, MoE routers and gates) are named
by ``exclude_modules`` (names or ``*`` patterns). TensorRT-LLM's PyTorch backend, vLLM and
SGLang load this format; transformers (5.14) does not: ``from_pretrained`` warns "Unknown
quantization type" and loads the float8 codes as weights. So :func:`unified_model` rebuilds
what those servers compute, in float32 on the CPU: weights dequantized, and each quantized
linear's input fake-quantized at its ``input_scale`` (a forward pre-hook), the KV cache not
quantized; GPT-2's weights, which ModelOpt exports as ``[out, in]`` Linear weights, go back
into its ``Conv1D`` layout. Attention runs transformers' eager path (its SDPA path drops
Gemma-2's soft-cap). The MoE experts (fused in transformers 5's modules) get their dequantized weights
but no input hooks.

Only ``FP8`` is read; other ``quant_algo`` values are refused by name (:class:`ExportError`).
Requires torch, safetensors and transformers (imported inside the functions that need them).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import json
import os
from typing import Any

import numpy as np

from jmegatron.export import hf_moe
from jmegatron.export.common import ExportError

__all__ = ["UnifiedCheckpoint", "read_unified", "check_unified", "unified_model", "FP8_E4M3_MAX"]

FP8_E4M3_MAX = 448.0
READABLE_ALGOS = ("FP8",)
# unquantized 2-D tensors that are not linear layers (exclude_modules need not list them)
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "wpe.weight")


@dataclasses.dataclass
class UnifiedCheckpoint:
    """One unified checkpoint folder, read: ``config`` (config.json without
    ``quantization_config``), ``quant`` (``hf_quant_config.json``'s ``quantization``), the
    stored tensors (``tensors``: name -> torch tensor, as stored), ``state_dict`` (float32
    numpy, quantized weights dequantized, scales dropped) and ``input_scales`` (quantized
    module name -> float)."""

    folder: str
    config: dict
    quant: dict
    tensors: dict
    state_dict: dict
    input_scales: dict


def _load_tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ExportError(f"{folder}: no *.safetensors; not a unified Hugging Face checkpoint")
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ExportError(f"{path} is missing; not a unified Hugging Face checkpoint written by ModelOpt "
                          "(`python -m jmegatron.export quantize`)")
    with open(path) as f:
        return json.load(f)


def read_unified(folder: str) -> UnifiedCheckpoint:
    """Read ``folder`` (a ``unified_hf`` directory). Raises ExportError when a file is missing,
    ``quant_algo`` is not one this reader dequantizes (``FP8``), or a float8 weight lacks its
    ``weight_scale`` / ``input_scale``."""
    import torch

    config = _read_json(os.path.join(folder, "config.json"))
    quant = _read_json(os.path.join(folder, "hf_quant_config.json")).get("quantization", {})
    algo = quant.get("quant_algo")
    if algo not in READABLE_ALGOS:
        raise ExportError(f"{folder}: quant_algo {algo!r} is not read back here (only {', '.join(READABLE_ALGOS)}: "
                          f"dequantized weights and fake-quantized inputs)")
    tensors = _load_tensors(folder)
    state_dict, input_scales = {}, {}
    for key, value in tensors.items():
        if key.endswith((".weight_scale", ".input_scale", ".k_scale", ".v_scale")):
            continue
        if value.dtype == torch.float8_e4m3fn:
            module = key[: -len(".weight")]
            for scale in ("weight_scale", "input_scale"):
                if f"{module}.{scale}" not in tensors:
                    raise ExportError(f"{folder}: {key} is float8 but {module}.{scale} is missing")
            state_dict[key] = (value.float() * tensors[f"{module}.weight_scale"].float()).numpy()
            input_scales[module] = float(tensors[f"{module}.input_scale"])
        else:
            state_dict[key] = value.float().numpy()
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    return UnifiedCheckpoint(folder, config, quant, tensors, state_dict, input_scales)


def _excluded(module: str, patterns) -> bool:
    return any(module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p) for p in patterns or ())


def check_unified(folder: str) -> list[str]:
    """What is wrong with the unified checkpoint ``folder`` as a server would load it ([] if
    nothing): every float8 weight has a positive 0-d float32 ``weight_scale`` and
    ``input_scale``; every 2-D weight left unquantized (not an embedding) is a module
    ``exclude_modules`` names; ``config.json``'s ``quantization_config`` says
    ``quant_method: "modelopt"`` and the ``quant_algo`` of ``hf_quant_config.json``. Raises
    ExportError as :func:`read_unified` for an unreadable folder."""
    import torch

    config = _read_json(os.path.join(folder, "config.json"))
    quant = _read_json(os.path.join(folder, "hf_quant_config.json")).get("quantization", {})
    tensors = _load_tensors(folder)
    problems = []
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "modelopt" or qc.get("quant_algo") != quant.get("quant_algo"):
        problems.append(f"config.json quantization_config {{quant_method: {qc.get('quant_method')!r}, quant_algo: "
                        f"{qc.get('quant_algo')!r}}} does not match hf_quant_config.json's {quant.get('quant_algo')!r}")
    for key, value in sorted(tensors.items()):
        if not key.endswith(".weight"):
            continue
        module = key[: -len(".weight")]
        if value.dtype == torch.float8_e4m3fn:
            for scale in ("weight_scale", "input_scale"):
                s = tensors.get(f"{module}.{scale}")
                if s is None or s.dtype != torch.float32 or s.dim() != 0 or not float(s) > 0:
                    problems.append(f"{module}.{scale}: expected a positive 0-d float32 scale, got "
                                    f"{None if s is None else (s.dtype, tuple(s.shape))}")
        elif value.dim() == 2 and not key.endswith(_EMBEDDINGS) and not _excluded(module, quant.get("exclude_modules")):
            problems.append(f"{key} is {value.dtype}, not quantized, and exclude_modules does not name {module}")
    return problems


def unified_model(folder: str):
    """``(model, checkpoint)``: the float32 transformers model of the unified checkpoint
    ``folder`` (eval mode), computing what a server's FP8 kernels compute: dequantized
    weights, and per quantized linear its input cast to E4M3 at ``input_scale`` (a forward
    pre-hook; MoE experts, fused in transformers 5, get none). ``checkpoint``: the
    :class:`UnifiedCheckpoint`. Raises ExportError as :func:`read_unified`, or when the
    tensors do not fill the model (missing or unexpected names)."""
    import torch
    import transformers

    ckpt = read_unified(folder)
    config = transformers.AutoConfig.for_model(**ckpt.config)
    # eager attention: transformers' SDPA path drops Gemma-2's attention soft-cap
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    keys = set(model.state_dict())
    arch = (ckpt.config.get("architectures") or [""])[0]
    sd = ckpt.state_dict
    if arch in hf_moe.MOE_ARCHITECTURES:
        sd = hf_moe.to_module_layout(sd, arch, keys)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}
    if "lm_head.weight" in keys and "lm_head.weight" not in tensors and getattr(config, "tie_word_embeddings", False):
        embedding = next(k for k in tensors if k.endswith(("embed_tokens.weight", "wte.weight")))
        tensors["lm_head.weight"] = tensors[embedding]
    from transformers.pytorch_utils import Conv1D

    for name, module in model.named_modules():  # GPT-2: ModelOpt exports its Conv1D [in, out] as Linear [out, in]
        if isinstance(module, Conv1D) and f"{name}.weight" in tensors:
            tensors[f"{name}.weight"] = tensors[f"{name}.weight"].T.contiguous()
    missing, unexpected = sorted(keys - set(tensors)), sorted(set(tensors) - keys)
    if missing or unexpected:
        raise ExportError(f"{folder}: the tensors do not fill {arch}: missing {missing[:6]}, unexpected "
                          f"{unexpected[:6]}")
    model.load_state_dict(tensors, strict=True)
    modules = dict(model.named_modules())
    for name, scale in ckpt.input_scales.items():
        if name in modules:
            modules[name].register_forward_pre_hook(_fake_quant_input(scale))
    return model, ckpt


def _fake_quant_input(scale: float) -> Any:
    import torch

    s = torch.tensor(scale, dtype=torch.float32)

    def hook(module, args):
        x = args[0]
        q = (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * s
        return (q.to(x.dtype),) + tuple(args[1:])

    return hook
