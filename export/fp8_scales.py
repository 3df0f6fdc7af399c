"""FP8 scales of an FP8-trained checkpoint, for TensorRT-LLM's FP8 checkpoint (written by
:func:`jmegatron.export.trtllm.write_fp8_trtllm_checkpoint`), with the training's own scales.

    python -m jmegatron.export trtllm --load CKPT --scales from-checkpoint [--weight-scales checkpoint|amax]
        [--tp T] [--pp P] [--dtype float16|bfloat16] --out DIR

A run trained with ``config.fp8`` (delayed scaling, docs/PRECISION.md "FP8 meta") holds, in
each FP8 linear layer's parameters, a subtree ``fp8_meta`` of float32 leaves:
``input_amax_history`` / ``kernel_amax_history`` / ``output_grad_amax_history`` ``[H]``
(newest first) and ``input_scale`` / ``kernel_scale`` / ``output_grad_scale`` ``[]``
(Transformer Engine's ``scale``: ``x_fp8 = cast(x * scale)``, ``scale = fp8_max / amax /
2**fp8_margin``). The layers are Megatron's TE linears: ``self_attention/linear_qkv``,
``self_attention/linear_proj``, ``mlp/linear_fc1``, ``mlp/linear_fc2`` of every decoder
layer (stacked ``[num_layers, ...]`` under ``scan_layers`` / pipeline layouts, unstacked at
restore like every layer parameter). Nothing else (embeddings, output layer, norms) is FP8.

This module turns those into the tensors ModelOpt's ``export_tensorrt_llm_checkpoint`` writes
for ``FP8_DEFAULT_CFG`` (compared tensor by tensor in tests/test_export_fp8.py), **without
calibration data**. Per quantized TensorRT-LLM linear ``P`` (``attention.qkv``,
``attention.dense``, ``mlp.fc``, ``mlp.gate`` (SwiGLU), ``mlp.proj``) on every rank::

    P.weight                     float8_e4m3fn [out, in]  (this rank's shard)
    P.weights_scaling_factor     float32 [1]   dequantization multiplier: w ~= w_fp8 * s_w
    P.activation_scaling_factor  float32 [1]   dequantization multiplier: x_fp8 = cast(x / s_x)

and ``config.json``'s ``quantization = {quant_algo: "FP8", kv_cache_quant_algo: null,
exclude_modules: ["lm_head"]}`` (the output layer stays in ``dtype``, as Megatron and
ModelOpt leave it). TensorRT-LLM's scaling factors are *dequantization* multipliers
(ModelOpt: ``amax / 448`` for e4m3, ``modelopt/torch/export/quant_utils.py``
``get_scaling_factor``), the reciprocal of TE's ``scale``.

Which scales:

* ``activation_scaling_factor`` = ``amax * 2**fp8_margin / 448`` with ``amax`` from
  ``input_amax_history`` by ``fp8_amax_compute_algo`` (``max``: max of the history;
  ``most_recent``: ``history[0]``), i.e. ``1 / input_scale`` of the scale update that
  produced the checkpoint: the activation grid the training's FP8 forward used. With
  Megatron's default ``fp8_margin = 0`` this is ModelOpt's ``amax / 448``. A history whose
  amax is 0 or not finite (a layer that never ran a step) falls back to ``1 / input_scale``
  as Transformer Engine keeps the old scale; a scale that is also the initial 1 (no FP8
  step at all) is refused (:class:`jmegatron.export.common.ExportError`).
* ``weights_scaling_factor``, ``--weight-scales checkpoint`` (default) = ``1 / kernel_scale``
  and ``P.weight = cast_e4m3(clip(w * kernel_scale, -448, 448))``: exactly the FP8 codes the
  training's next forward would use for these weights (delayed scaling quantizes with the
  stored scale; TE's cast saturates, so values the last update pushed past the stale amax
  clip; the count is reported). ``--weight-scales amax``: ``amax(w) / 448`` of the exported
  weight, ModelOpt's rule (``w / s_w`` cast), never saturating, bit-for-bit ModelOpt's
  factor.
* Fused GEMMs: jmegatron's QKV is already one fused linear with one scale pair, as
  TensorRT-LLM's ``attention.qkv`` (ModelOpt takes the max over its q/k/v quantizers to get
  there); SwiGLU's ``linear_fc1`` ``[h, 2, ffn]`` is one linear, so ``mlp.fc`` (gate) and
  ``mlp.gate`` (up) get the same pair (ModelOpt also writes equal ones). Every tensor
  parallel rank holds the full tensor's per-tensor factors.

The FP8 training path itself lives in ``jmegatron.models.fp8``; this module reads only the
checkpoint (:func:`jmegatron.checkpoint.restore.read_saved_params`), so it needs neither that
module nor the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np

from jmegatron.checkpoint.metadata import SavedStep
from jmegatron.checkpoint.restore import tree_paths
from jmegatron.conversion.tree import unstack_layers
from jmegatron.export.common import ExportError, open_checkpoint

__all__ = ["FP8_E4M3_MAX", "FP8_LINEARS", "UNIFIED_LINEARS", "unified_modules", "FP8_META", "WEIGHT_SCALES", "LinearScales", "saved_fp8_meta_paths",
           "check_fp8_exportable", "has_fp8_meta", "layer_fp8_meta", "history_amax", "checkpoint_fp8_scales",
           "quantize_weight", "strip_fp8_meta"]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_META = "fp8_meta"
# jmegatron FP8 linear (path in a decoder layer) -> TensorRT-LLM linears it becomes (+ "mlp.gate" with SwiGLU)
FP8_LINEARS = {"self_attention/linear_qkv": ("attention.qkv",), "self_attention/linear_proj": ("attention.dense",),
               "mlp/linear_fc1": ("mlp.fc",), "mlp/linear_fc2": ("mlp.proj",)}
# ... -> the Hugging Face modules of the unified checkpoint that see its input (one scale pair each)
UNIFIED_LINEARS = {"self_attention/linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                   "self_attention/linear_proj": ("self_attn.o_proj",),
                   "mlp/linear_fc1": ("mlp.gate_proj", "mlp.up_proj"), "mlp/linear_fc2": ("mlp.down_proj",)}
UNIFIED_LINEARS_GPT2 = {"self_attention/linear_qkv": ("attn.c_attn",), "self_attention/linear_proj": ("attn.c_proj",),
                        "mlp/linear_fc1": ("mlp.c_fc",), "mlp/linear_fc2": ("mlp.c_proj",)}


def unified_modules(cfg, layer: int, path: str) -> tuple[str, ...]:
    """The Hugging Face module names (in the unified checkpoint) of decoder layer ``layer``'s
    FP8 linear ``path`` (a key of :data:`FP8_LINEARS`): GPT-2's ``transformer.h.{i}.attn.c_attn``
    ..., else the Llama layout's ``model.layers.{i}.self_attn.{q,k,v}_proj`` ... (a gated
    fc1 is ``gate_proj`` and ``up_proj``)."""
    if cfg.position_embedding_type == "learned_absolute":
        return tuple(f"transformer.h.{layer}.{n}" for n in UNIFIED_LINEARS_GPT2[path])
    return tuple(f"model.layers.{layer}.{n}" for n in UNIFIED_LINEARS[path])
META_LEAVES = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history", "input_scale",
               "kernel_scale", "output_grad_scale")
WEIGHT_SCALES = ("checkpoint", "amax")


# ----------------------------------------------------------------------------- reading
def saved_fp8_meta_paths(load_dir: str, iteration: Optional[int] = None, saved: Optional[SavedStep] = None) -> list[str]:
    """Slash paths of the ``fp8_meta`` leaves under ``params`` in checkpoint ``load_dir``,
    read from Orbax's metadata (no array is restored; ``saved``: the step already opened,
    :func:`jmegatron.export.common.open_checkpoint`); empty for a checkpoint trained
    without ``config.fp8``. Raises ExportError for a missing or unreadable checkpoint."""
    saved = saved or open_checkpoint(load_dir, iteration)
    return ["/".join(p) for p, _ in tree_paths(saved.tree.get("params") or {}) if FP8_META in p]


def has_fp8_meta(params: Mapping) -> bool:
    """True if any subtree of ``params`` is named ``fp8_meta``."""
    return any(FP8_META in p for p, _ in tree_paths(params))


def strip_fp8_meta(params: Mapping) -> dict:
    """``params`` without its ``fp8_meta`` subtrees (the plain weights)."""
    if isinstance(params, Mapping):
        return {k: strip_fp8_meta(v) for k, v in params.items() if k != FP8_META}
    return params


# ----------------------------------------------------------------------------- scales
@dataclasses.dataclass(frozen=True)
class LinearScales:
    """TensorRT-LLM's dequantization multipliers of one FP8 linear (float32 scalars).

    ``weights_scaling_factor`` / ``activation_scaling_factor``: the values written;
    ``kernel_scale`` / ``input_scale``: the training's TE scales they come from;
    ``input_amax``: the amax the activation factor encodes; ``activation_source``: which
    rule gave it (``"history"`` or ``"stored input_scale"``)."""

    weights_scaling_factor: np.float32
    activation_scaling_factor: np.float32
    kernel_scale: np.float32
    input_scale: np.float32
    input_amax: float
    activation_source: str


def check_fp8_exportable(cfg) -> None:
    """Raise ExportError, naming ``config.num_moe_experts`` and the fix, for a mixture-of-experts
    config: jmegatron's FP8 training leaves the experts unquantized (docs/PRECISION.md), so the
    checkpoint holds no scales for the expert linears that ModelOpt's and TensorRT-LLM's FP8
    formats quantize. Dense models (GPT-2, Llama, Mistral, Qwen2/3, Gemma layouts) pass."""
    if cfg.num_moe_experts is not None:
        raise ExportError(f"--scales from-checkpoint: config.num_moe_experts={cfg.num_moe_experts}: FP8 training "
                          "leaves the MoE experts unquantized, so this checkpoint has no FP8 scales for them (only "
                          "for the attention linears); calibrate instead: `python -m jmegatron.export quantize "
                          "--quant-cfg fp8 --calib-data PREFIX` without --scales (then `trtllm --quantized`)")


def layer_fp8_meta(params: Mapping, cfg) -> dict[int, dict[str, dict[str, np.ndarray]]]:
    """``{layer: {linear path: {leaf: float32 array}}}`` for every decoder layer and every
    linear of :data:`FP8_LINEARS`, from per-layer (or stacked ``decoder_layers``) params.

    The contract (docs/PRECISION.md) places ``fp8_meta`` among the linear's own parameters
    (``decoder_layers_{i}/self_attention/linear_qkv/fp8_meta/...``); only that placement is
    read. Raises ExportError naming the first linear without ``fp8_meta``, a missing leaf,
    or a leaf of the wrong shape (histories ``[H]``, scales ``[]``), and for MoE configs
    (:func:`check_fp8_exportable`)."""
    check_fp8_exportable(cfg)
    p = dict(params)
    if "decoder_layers" in p:
        p = unstack_layers(p, cfg.num_layers)
    out: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    for i in range(cfg.num_layers):
        out[i] = {}
        for path in FP8_LINEARS:
            node: Any = p.get(f"decoder_layers_{i}", {})
            for part in path.split("/"):
                node = node.get(part, {}) if isinstance(node, Mapping) else {}
            meta = node.get(FP8_META) if isinstance(node, Mapping) else None
            where = f"decoder_layers_{i}/{path}/{FP8_META}"
            if not isinstance(meta, Mapping):
                raise ExportError(f"--scales from-checkpoint: the checkpoint has no {where} (every FP8 linear holds "
                                  f"one: {', '.join(FP8_LINEARS)}); export without --scales, or calibrate with "
                                  "`quantize --quant-cfg fp8`")
            leaves = {}
            for leaf in META_LEAVES:
                if leaf not in meta:
                    raise ExportError(f"--scales from-checkpoint: {where} has no {leaf!r} (expected {META_LEAVES})")
                a = np.asarray(meta[leaf], np.float32)
                want = 1 if leaf.endswith("history") else 0
                if a.ndim != want:
                    raise ExportError(f"--scales from-checkpoint: {where}/{leaf} has shape {a.shape}, expected "
                                      + ("[fp8_amax_history_len]" if want else "[] (a scalar)"))
                leaves[leaf] = a
            out[i][path] = leaves
    return out


def history_amax(history: np.ndarray, algo: str) -> float:
    """The amax of an amax history (newest first) by Megatron's ``fp8_amax_compute_algo``:
    ``"max"`` -> ``max(history)``, ``"most_recent"`` -> ``history[0]`` (Transformer Engine's
    ``_default_get_amax_and_update_history``). Raises ExportError for another algo."""
    h = np.asarray(history, np.float32)
    if algo == "max":
        return float(h.max())
    if algo == "most_recent":
        return float(h[0])
    raise ExportError(f"config.fp8_amax_compute_algo={algo!r}: expected 'max' or 'most_recent'")


def checkpoint_fp8_scales(params: Mapping, cfg, weight_scales: str = "checkpoint"
                          ) -> dict[int, dict[str, LinearScales]]:
    """``{layer: {jmegatron linear path: LinearScales}}`` from the checkpoint's ``fp8_meta``
    (rules in the module docstring; ``cfg`` gives ``fp8_margin`` and
    ``fp8_amax_compute_algo``). ``weight_scales``: ``"checkpoint"`` (``1 / kernel_scale``)
    or ``"amax"`` (``amax(kernel) / 448``; SwiGLU's fc1 and the fused QKV: amax over the
    whole kernel). Raises ExportError as :func:`layer_fp8_meta`, for an unknown
    ``weight_scales``, and for a linear with neither a positive history amax nor a trained
    scale (a checkpoint that never ran an FP8 step), or a non-positive kernel scale."""
    if weight_scales not in WEIGHT_SCALES:
        raise ExportError(f"--weight-scales {weight_scales!r}: choose from {', '.join(WEIGHT_SCALES)}")
    metas = layer_fp8_meta(params, cfg)
    p = dict(params)
    if "decoder_layers" in p:
        p = unstack_layers(p, cfg.num_layers)
    margin = float(2.0 ** int(cfg.fp8_margin))
    out: dict[int, dict[str, LinearScales]] = {}
    for i, linears in metas.items():
        out[i] = {}
        for path, m in linears.items():
            where = f"decoder_layers_{i}/{path}/{FP8_META}"
            amax = history_amax(m["input_amax_history"], cfg.fp8_amax_compute_algo)
            if np.isfinite(amax) and amax > 0:
                act, source = np.float32(np.float32(amax) * np.float32(margin) / np.float32(FP8_E4M3_MAX)), "history"
            else:
                s = float(m["input_scale"])
                if not (np.isfinite(s) and s > 0) or s == 1.0:
                    raise ExportError(f"--scales from-checkpoint: {where}: input_amax_history gives amax {amax} and "
                                      f"input_scale is {s} (the initial value): this checkpoint ran no FP8 step, so "
                                      "it has no activation scales; calibrate with `quantize --quant-cfg fp8` instead")
                act, source = np.float32(1.0) / np.float32(s), "stored input_scale"
                amax = float(act) * FP8_E4M3_MAX / margin
            ks = np.float32(m["kernel_scale"])
            if not (np.isfinite(ks) and ks > 0):
                raise ExportError(f"--scales from-checkpoint: {where}/kernel_scale is {ks}; expected a positive scale")
            if weight_scales == "checkpoint":
                wsf = np.float32(1.0) / ks
            else:
                node: Any = p[f"decoder_layers_{i}"]
                for part in path.split("/"):
                    node = node[part]
                wsf = np.float32(np.abs(np.asarray(node["kernel"], np.float32)).max()) / np.float32(FP8_E4M3_MAX)
                if not wsf > 0:
                    raise ExportError(f"--weight-scales amax: decoder_layers_{i}/{path}/kernel is all zeros")
            out[i][path] = LinearScales(np.float32(wsf), np.float32(act), ks, np.float32(m["input_scale"]),
                                        float(amax), source)
    return out


def quantize_weight(w: np.ndarray, s_w: np.float32, kernel_scale: Optional[np.float32] = None):
    """``(float8_e4m3fn torch tensor, saturated count)`` of float32 ``w`` (any shape).

    With ``kernel_scale`` (the training's TE scale): ``cast(clip(w * kernel_scale, ±448))``,
    the FP8 forward's own codes (TE saturates). Without: ``cast(clip(w / s_w, ±448))``, as
    ModelOpt's ``to_quantized_weight`` (``weight / weights_scaling_factor``; its scale is the
    weight's amax so nothing clips). Round to nearest even (torch's cast)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    t = t * torch.tensor(np.float32(kernel_scale)) if kernel_scale is not None else t / torch.tensor(np.float32(s_w))
    saturated = int((t.abs() > FP8_E4M3_MAX).sum())
    return t.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), saturated


# ----------------------------------------------------------------------------- writing
