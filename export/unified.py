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

Read back per ``quant_algo`` (ModelOpt's ``modelopt/torch/export/quant_utils.py``
``to_quantized_weight`` packings, inverted here; :data:`READABLE_ALGOS`):

* ``FP8``: as above.
* ``W8A8_SQ_PER_CHANNEL`` (``int8_sq``): ``weight`` int8 ``[out, in]`` with ``weight_scale``
  float32 ``[out]``; the input is multiplied by ``pre_quant_scale`` ``[in]`` (SmoothQuant's
  smoothing; absent where ModelOpt folded it into the norm before the linear) and fake-quantized to int8 at ``input_scale`` (``round(clip(x / s, -128, 127)) * s``).
* ``W4A16_AWQ`` (``int4_awq``): ``weight`` uint8 ``[out / 2, in]`` (two signed int4 codes
  per byte along ``out``, low nibble first) with ``weight_scale`` ``[out, in / group_size]``;
  the input is multiplied by ``pre_quant_scale``, and stays unquantized (weight-only).
* ``NVFP4``: ``weight`` uint8 ``[out, in / 2]`` (two E2M1 codes per byte along ``in``, low
  nibble first) with ``weight_scale`` float8_e4m3fn ``[out, in / 16]`` times the per-tensor
  ``weight_scale_2``; the input is quantized to NVFP4 per block of 16 with the global scale
  ``input_scale`` (ModelOpt's ``NVFP4QTensor`` quantize / dequantize).

Other ``quant_algo`` values (``W4A8_AWQ``, ``MXFP8``, ...) are refused by name (:class:`ExportError`).
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

from jmegatron.conversion import hf_moe
from jmegatron.conversion.hf import GPT2, config_fields_from_hf, from_hf_state_dict
from jmegatron.export.common import ExportError
from jmegatron.export.fp8_scales import FP8_LINEARS, unified_modules

__all__ = ["UnifiedCheckpoint", "InputQuant", "read_unified", "check_unified", "unified_model", "is_unified_folder",
           "dequantize_weight", "fake_quant_input", "jmegatron_fields", "jmegatron_params", "FP8_E4M3_MAX",
           "READABLE_ALGOS", "JMEGATRON_ALGOS"]

FP8_E4M3_MAX = 448.0
READABLE_ALGOS = ("FP8", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "NVFP4")
# quant_algo -> the scales each quantized linear stores beside its weight; a ``pre_quant_scale``
# (SmoothQuant / AWQ) is there unless ModelOpt folded it into the norm before the linear
SCALE_TENSORS = {"FP8": ("weight_scale", "input_scale"),
                 "W8A8_SQ_PER_CHANNEL": ("weight_scale", "input_scale"),
                 "W4A16_AWQ": ("weight_scale",),
                 "NVFP4": ("weight_scale", "weight_scale_2", "input_scale")}
INPUT_KINDS = {"FP8": "fp8", "W8A8_SQ_PER_CHANNEL": "int8", "W4A16_AWQ": None, "NVFP4": "nvfp4"}
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale", ".k_scale", ".v_scale")
# ModelOpt's per-tensor FP8 scales of a fused 3-D expert parameter ``<param>`` (gpt-oss's
# ``mlp.experts.gate_up_proj`` / ``down_proj``): ``<param>_weight_scale``, ``<param>_input_scale``;
# read back dequantized, without input casts (as the other fused MoE experts)
_FUSED_SCALE_SUFFIXES = ("_weight_scale", "_input_scale")
NVFP4_BLOCK = 16
# what jmegatron's own model computes as a server does (``--load``): FP8 through its FP8 linears
# (models/fp8.py, the scales as its meta), W4A16 with the weights dequantized; the others
# quantize activations to int8 / NVFP4, which it has no layer for
JMEGATRON_ALGOS = ("FP8", "W4A16_AWQ")
_GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
INT8_MAX = 127.0
# unquantized 2-D tensors that are not linear layers (exclude_modules need not list them)
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "wpe.weight")


@dataclasses.dataclass(frozen=True)
class InputQuant:
    """What a server does to one quantized linear's input before its GEMM: multiply by
    ``pre_quant_scale`` (float32 ``[in]``, None: none), then fake-quantize as ``kind``
    (``"fp8"``: E4M3 at ``scale``; ``"int8"``: int8 at ``scale``; ``"nvfp4"``: NVFP4 blocks of
    16 with the global ``scale``; None: left in the compute dtype)."""

    kind: Any
    scale: Any = None
    pre_quant_scale: Any = None


@dataclasses.dataclass
class UnifiedCheckpoint:
    """One unified checkpoint folder, read: ``config`` (config.json without
    ``quantization_config``), ``quant`` (``hf_quant_config.json``'s ``quantization``), the
    stored tensors (``tensors``: name -> torch tensor, as stored), ``state_dict`` (float32
    numpy, quantized weights dequantized, scales dropped), ``input_quant`` (quantized module
    name -> :class:`InputQuant`) and ``input_scales`` (quantized module name -> its
    ``input_scale`` as a float, for the modules that have one)."""

    folder: str
    config: dict
    quant: dict
    tensors: dict
    state_dict: dict
    input_quant: dict
    input_scales: dict

    @property
    def algo(self) -> str:
        """``quant_algo`` (one of :data:`READABLE_ALGOS`)."""
        return self.quant.get("quant_algo")


def is_unified_folder(path: str) -> bool:
    """True for a folder holding ModelOpt's unified checkpoint: ``hf_quant_config.json``, or
    a ``config.json`` whose ``quantization_config`` says ``quant_method: "modelopt"``."""
    if os.path.isfile(os.path.join(path, "hf_quant_config.json")):
        return True
    conf = os.path.join(path, "config.json")
    if not os.path.isfile(conf):
        return False
    with open(conf) as f:
        qc = json.load(f).get("quantization_config") or {}
    return isinstance(qc, dict) and qc.get("quant_method") == "modelopt"


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


def _code_dtypes():
    import torch

    return (torch.float8_e4m3fn, torch.int8, torch.uint8)


def _read_quant(folder: str) -> dict:
    """``hf_quant_config.json``'s ``quantization``, its ``quant_algo`` checked against
    :data:`READABLE_ALGOS` (ExportError naming it otherwise)."""
    quant = _read_json(os.path.join(folder, "hf_quant_config.json")).get("quantization", {})
    algo = quant.get("quant_algo")
    if algo not in READABLE_ALGOS:
        raise ExportError(f"{folder}: quant_algo {algo!r} is not read back here (read: {', '.join(READABLE_ALGOS)}; "
                          f"`python -m jmegatron.export quantize --quant-cfg fp8|int8_sq|int4_awq|nvfp4` writes them)")
    return quant


def dequantize_weight(algo: str, weight, scales: dict, group_size: int | None = None) -> np.ndarray:
    """The float32 ``[out, in]`` weight a server multiplies by: ``weight`` (as stored) with
    ``scales`` (``weight_scale`` and, for NVFP4, ``weight_scale_2``) decoded for ``algo``
    (the packings of the module docstring). Raises ExportError for shapes that do not fit."""
    import torch

    ws = scales["weight_scale"].float()
    if algo == "FP8":
        return (weight.float() * ws).numpy()
    if algo == "W8A8_SQ_PER_CHANNEL":
        return (weight.float() * ws.reshape(-1, 1)).numpy()
    if algo == "W4A16_AWQ":
        packed = weight.view(torch.uint8).to(torch.int16)
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1, packed.shape[-1])  # [out, in]
        codes = torch.where(codes > 7, codes - 16, codes).float()
        block = codes.shape[1] // ws.shape[1] if group_size is None else group_size
        if ws.shape[0] != codes.shape[0] or block * ws.shape[1] < codes.shape[1]:
            raise ExportError(f"int4 weight {tuple(codes.shape)} and weight_scale {tuple(ws.shape)} do not fit")
        return (codes * ws.repeat_interleave(block, dim=1)[:, : codes.shape[1]]).numpy()
    if algo == "NVFP4":
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

        shape = (weight.shape[0], weight.shape[1] * 2)
        q = NVFP4QTensor(torch.Size(shape), torch.float32, weight.view(torch.uint8))
        return q.dequantize(torch.float32, scale=scales["weight_scale"], double_scale=scales["weight_scale_2"].float(),
                            block_sizes={-1: NVFP4_BLOCK}).numpy()
    raise ExportError(f"quant_algo {algo!r} is not read back here (read: {', '.join(READABLE_ALGOS)})")


def read_unified(folder: str) -> UnifiedCheckpoint:
    """Read ``folder`` (a ``unified_hf`` directory). Raises ExportError when a file is missing,
    ``quant_algo`` is not one this reader dequantizes (:data:`READABLE_ALGOS`), or a quantized
    weight lacks one of its scale tensors (:data:`SCALE_TENSORS`)."""
    config = _read_json(os.path.join(folder, "config.json"))
    quant = _read_quant(folder)
    algo = quant["quant_algo"]
    tensors = _load_tensors(folder)
    state_dict, input_quant, input_scales = {}, {}, {}
    for key, value in tensors.items():
        if key.endswith(_SCALE_SUFFIXES) or key.endswith(_FUSED_SCALE_SUFFIXES) and key.rsplit("_", 2)[0] in tensors:
            continue
        if algo == "FP8" and f"{key}_weight_scale" in tensors:  # a fused expert parameter (gpt-oss's experts)
            state_dict[key] = dequantize_weight(algo, value, {"weight_scale": tensors[f"{key}_weight_scale"]})
            continue
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module is None or f"{module}.weight_scale" not in tensors:
            if value.dtype in _code_dtypes():
                raise ExportError(f"{folder}: {key} holds {value.dtype} codes but {module}.weight_scale is missing")
            state_dict[key] = value.float().numpy()
            continue
        missing = [n for n in SCALE_TENSORS[algo] if f"{module}.{n}" not in tensors]
        if missing:
            raise ExportError(f"{folder}: {key} is quantized ({algo}) but {', '.join(f'{module}.{n}' for n in missing)} "
                              f"is missing")
        scales = {n: tensors[f"{module}.{n}"] for n in SCALE_TENSORS[algo]}
        state_dict[key] = dequantize_weight(algo, value, scales, quant.get("group_size"))
        pqs = tensors.get(f"{module}.pre_quant_scale")
        scale = float(scales["input_scale"]) if "input_scale" in scales else None
        input_quant[module] = InputQuant(INPUT_KINDS[algo], scale, None if pqs is None else pqs.float().numpy())
        if scale is not None:
            input_scales[module] = scale
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    return UnifiedCheckpoint(folder, config, quant, tensors, state_dict, input_quant, input_scales)


def _excluded(module: str, patterns) -> bool:
    return any(module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p) for p in patterns or ())


def check_unified(folder: str) -> list[str]:
    """What is wrong with the unified checkpoint ``folder`` as a server would load it ([] if
    nothing): every quantized weight (float8 / int8 / uint8 codes) has its scale tensors
    (:data:`SCALE_TENSORS` of its ``quant_algo``), each float32 and positive (NVFP4's block
    ``weight_scale`` float8_e4m3fn), the per-tensor ones 0-d; its codes and scales have the
    shapes the format packs (checked by decoding them); every 2-D weight left unquantized
    (not an embedding) is a module ``exclude_modules`` names; ``config.json``'s
    ``quantization_config`` says ``quant_method: "modelopt"`` and the ``quant_algo`` of
    ``hf_quant_config.json``. Raises ExportError as :func:`read_unified` for an unreadable
    folder or a ``quant_algo`` it does not read."""
    import torch

    config = _read_json(os.path.join(folder, "config.json"))
    quant = _read_quant(folder)
    algo = quant["quant_algo"]
    tensors = _load_tensors(folder)
    problems = []
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "modelopt" or qc.get("quant_algo") != algo:
        problems.append(f"config.json quantization_config {{quant_method: {qc.get('quant_method')!r}, quant_algo: "
                        f"{qc.get('quant_algo')!r}}} does not match hf_quant_config.json's {algo!r}")
    per_tensor = ("input_scale", "weight_scale_2") + (("weight_scale",) if algo == "FP8" else ())
    for key, value in sorted(tensors.items()):
        if not key.endswith(".weight"):
            continue
        module = key[: -len(".weight")]
        if value.dtype in _code_dtypes() or f"{module}.weight_scale" in tensors:
            bad = False
            optional = ("pre_quant_scale",) if f"{module}.pre_quant_scale" in tensors else ()
            for name in SCALE_TENSORS[algo] + optional:
                s = tensors.get(f"{module}.{name}")
                want = torch.float8_e4m3fn if (algo == "NVFP4" and name == "weight_scale") else None
                ok = (s is not None and (s.dtype == want if want else s.dtype in (torch.float32, torch.float16,
                                                                                   torch.bfloat16)
                                         and (name == "pre_quant_scale" or s.dtype == torch.float32))
                      and (s.dim() == 0 or name not in per_tensor) and bool((s.float() > 0).all()))
                if not ok:
                    bad = True
                    problems.append(f"{module}.{name}: expected a positive {'0-d ' if name in per_tensor else ''}"
                                    f"{'float8_e4m3fn' if want else 'float32'} scale, got "
                                    f"{None if s is None else (s.dtype, tuple(s.shape))}")
            if not bad:
                try:
                    w = dequantize_weight(algo, value, {n: tensors[f"{module}.{n}"] for n in SCALE_TENSORS[algo]},
                                          quant.get("group_size"))
                    pqs = tensors.get(f"{module}.pre_quant_scale")
                    if pqs is not None and pqs.shape != (w.shape[-1],):
                        problems.append(f"{module}.pre_quant_scale: shape {tuple(pqs.shape)}, the weight's input "
                                        f"has {w.shape[-1]} features")
                    if not np.isfinite(w).all():
                        problems.append(f"{key}: dequantized values are not all finite")
                except (ExportError, RuntimeError, ValueError) as e:
                    problems.append(f"{key}: codes {value.dtype} {tuple(value.shape)} do not decode as {algo}: {e}")
        elif value.dim() == 2 and not key.endswith(_EMBEDDINGS) and not _excluded(module, quant.get("exclude_modules")):
            problems.append(f"{key} is {value.dtype}, not quantized, and exclude_modules does not name {module}")
    return problems


def unified_model(folder: str):
    """``(model, checkpoint)``: the float32 transformers model of the unified checkpoint
    ``folder`` (eval mode), computing what a server's quantized kernels compute: dequantized
    weights, and per quantized linear its input treated as :class:`InputQuant` says
    (:func:`fake_quant_input` in a forward pre-hook; MoE experts, fused in transformers 5,
    get none). ``checkpoint``: the
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
    for name, iq in ckpt.input_quant.items():
        if name in modules and (iq.kind is not None or iq.pre_quant_scale is not None):
            modules[name].register_forward_pre_hook(_input_hook(iq))
    return model, ckpt


def fake_quant_input(x, iq: InputQuant):
    """``x`` (a torch tensor ``[..., in]``, any float dtype) as the server's GEMM sees it,
    computed in float32 and returned in ``x.dtype``: times ``iq.pre_quant_scale``, then
    ``"fp8"``: ``cast_e4m3(clip(x / s, +-448)) * s``; ``"int8"``: ``round(clip(x / s, -128,
    127)) * s`` (ModelOpt's int8 fake quantization, rounding half to even); ``"nvfp4"``:
    ModelOpt's NVFP4 quantize / dequantize per block of 16 with the global scale ``s``."""
    import torch

    y = x.float()
    if iq.pre_quant_scale is not None:
        y = y * torch.as_tensor(iq.pre_quant_scale, dtype=torch.float32)
    if iq.kind == "fp8":
        s = torch.tensor(iq.scale, dtype=torch.float32)
        y = (y / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    elif iq.kind == "int8":
        s = torch.tensor(iq.scale, dtype=torch.float32)
        y = torch.round(y / s).clamp(-INT8_MAX - 1, INT8_MAX) * s
    elif iq.kind == "nvfp4":
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

        s = torch.tensor(iq.scale, dtype=torch.float32)
        q, block_scale, _ = NVFP4QTensor.quantize(y, NVFP4_BLOCK, weights_scaling_factor_2=s)
        y = q.dequantize(torch.float32, scale=block_scale, double_scale=s, block_sizes={-1: NVFP4_BLOCK})
    elif iq.kind is not None:
        raise ExportError(f"input quantization {iq.kind!r} is not one of fp8, int8, nvfp4")
    return y.to(x.dtype)


def _input_hook(iq: InputQuant) -> Any:
    def hook(module, args):
        return (fake_quant_input(args[0], iq),) + tuple(args[1:])

    return hook


# ----------------------------------------------------------------------------- jmegatron import
def jmegatron_fields(ckpt: UnifiedCheckpoint) -> dict:
    """The jmegatron config fields of the unified checkpoint ``ckpt``: the architecture of its
    ``config.json`` (:func:`jmegatron.conversion.hf.config_fields_from_hf`) and, for ``FP8``,
    ``fp8="e4m3"`` with a one-entry amax history (the FP8 linears then quantize with the
    folder's scales). Raises ExportError for a ``quant_algo`` outside :data:`JMEGATRON_ALGOS`
    (naming ``check-unified``, which reads those in torch) or an architecture jmegatron does
    not represent."""
    if ckpt.algo not in JMEGATRON_ALGOS:
        raise ExportError(
            f"{ckpt.folder}: quant_algo {ckpt.algo!r} quantizes the activations "
            f"({INPUT_KINDS.get(ckpt.algo)}), which jmegatron's model does not compute; it loads "
            f"{', '.join(JMEGATRON_ALGOS)} folders. `python -m jmegatron.export check-unified --load {ckpt.folder}` "
            f"reads this one back as a server computes it (torch)")
    try:
        fields = config_fields_from_hf(ckpt.config)
    except (KeyError, ValueError) as e:
        raise ExportError(f"{ckpt.folder}: {e}") from e
    if ckpt.algo == "FP8":
        fields.update(fp8="e4m3", fp8_amax_history_len=1, fp8_margin=0, fp8_amax_compute_algo="most_recent")
    return fields


def jmegatron_params(ckpt: UnifiedCheckpoint, cfg, padded_vocab_size: int) -> dict:
    """jmegatron parameters (per-layer layout, float32 numpy) computing what a server computes
    for ``ckpt`` under ``cfg`` (:func:`jmegatron_fields`): the dequantized weights, each
    ``pre_quant_scale`` folded into its weight's input columns (exact: no input quantization
    follows in W4A16), GPT-2's ``[out, in]`` exports back in its ``Conv1D`` layout; for FP8 each
    decoder linear's ``fp8_meta`` holds ``input_scale = 1 / max(input_scale)`` and
    ``kernel_scale = 1 / max(weight_scale)`` over the Hugging Face modules it fuses (q/k/v,
    gate/up: ModelOpt writes them equal), the histories the matching amaxes (``scale * 448``),
    so the forward casts inputs and weights to E4M3 on the folder's grids. MoE experts
    (no FP8 path in jmegatron) run on their dequantized weights. Raises ExportError when a
    tensor is missing or does not fit."""
    sd = {}
    for key, w in ckpt.state_dict.items():
        iq = ckpt.input_quant.get(key[: -len(".weight")]) if key.endswith(".weight") else None
        if iq is not None and iq.pre_quant_scale is not None:
            w = w * np.asarray(iq.pre_quant_scale, np.float32)[None, :]
        if (ckpt.config.get("architectures") or [""])[0] == GPT2 and key.endswith(_GPT2_CONV1D) and w.ndim == 2:
            w = np.ascontiguousarray(w.T)
        sd[key] = w
    try:
        params = from_hf_state_dict(sd, cfg, padded_vocab_size)
    except ValueError as e:
        raise ExportError(f"{ckpt.folder}: {e}") from e
    if ckpt.algo != "FP8":
        return params
    for i in range(cfg.num_layers):
        layer = params[f"decoder_layers_{i}"]
        for path in FP8_LINEARS:
            modules = unified_modules(cfg, i, path)
            absent = [m for m in modules if m not in ckpt.input_scales]
            if absent:
                raise ExportError(f"{ckpt.folder}: {absent} hold no FP8 weight with its input_scale; jmegatron's FP8 "
                                  f"layer {path} of layer {i} needs one")
            sx = max(ckpt.input_scales[m] for m in modules)
            sw = max(float(ckpt.tensors[f"{m}.weight_scale"]) for m in modules)
            node = layer
            for part in path.split("/"):
                node = node[part]
            node["fp8_meta"] = {
                "input_amax_history": np.full((1,), sx * FP8_E4M3_MAX, np.float32),
                "kernel_amax_history": np.full((1,), sw * FP8_E4M3_MAX, np.float32),
                "output_grad_amax_history": np.zeros((1,), np.float32),
                "input_scale": np.float32(1.0) / np.float32(sx), "kernel_scale": np.float32(1.0) / np.float32(sw),
                "output_grad_scale": np.float32(1.0)}
    return params
