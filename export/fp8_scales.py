"""FP8-trained checkpoints into TensorRT-LLM's FP8 checkpoint, with the training's own scales.

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
checkpoint (:func:`read_saved_params`), so it needs neither that module nor the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Mapping, Optional

import numpy as np

from jmegatron.export.common import ExportError

__all__ = ["FP8_E4M3_MAX", "FP8_LINEARS", "FP8_META", "WEIGHT_SCALES", "LinearScales", "saved_fp8_meta_paths",
           "read_saved_params", "has_fp8_meta", "layer_fp8_meta", "history_amax", "checkpoint_fp8_scales",
           "quantize_weight", "fp8_rank_tensors", "fp8_quantization_config", "write_fp8_trtllm_checkpoint",
           "export_fp8_checkpoint", "strip_fp8_meta"]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_META = "fp8_meta"
# jmegatron FP8 linear (path in a decoder layer) -> TensorRT-LLM linears it becomes (+ "mlp.gate" with SwiGLU)
FP8_LINEARS = {"self_attention/linear_qkv": ("attention.qkv",), "self_attention/linear_proj": ("attention.dense",),
               "mlp/linear_fc1": ("mlp.fc",), "mlp/linear_fc2": ("mlp.proj",)}
META_LEAVES = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history", "input_scale",
               "kernel_scale", "output_grad_scale")
WEIGHT_SCALES = ("checkpoint", "amax")


# ----------------------------------------------------------------------------- reading
def _state_metadata(load_dir: str, iteration: Optional[int]):
    """(params metadata tree (nested dicts of Orbax ArrayMetadata), the ``state`` item's
    directory, step, meta) of a checkpoint step; no array is read."""
    import orbax.checkpoint as ocp

    from jmegatron.training import checkpointing

    ckpt = checkpointing.Checkpointer(load_dir, create=False)
    try:
        step = ckpt.latest_step() if iteration is None else int(iteration)
        meta = ckpt.read_meta(step)  # CheckpointError for an iteration it does not hold
    finally:
        ckpt.close()
    state_dir = os.path.join(os.path.abspath(load_dir), str(step), "state")  # Orbax's default step naming
    if not os.path.isdir(state_dir):
        raise checkpointing.CheckpointError(f"no state item at {state_dir}")
    from etils import epath

    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(state_dir))
    tree = getattr(tree, "tree", tree)
    return tree["params"], state_dir, step, meta


def _paths(tree, prefix=()):
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _paths(v, prefix + (str(k),))
    else:
        yield prefix, tree


def saved_fp8_meta_paths(load_dir: str, iteration: Optional[int] = None) -> list[str]:
    """Slash paths of the ``fp8_meta`` leaves under ``params`` in checkpoint ``load_dir``,
    read from Orbax's metadata (no array is restored); empty for a checkpoint trained
    without ``config.fp8``. Raises ExportError for a missing or unreadable checkpoint."""
    from jmegatron.training.checkpointing import CheckpointError, has_checkpoint

    if not has_checkpoint(load_dir):
        raise ExportError(f"--load {load_dir}: no checkpoint found in {os.path.abspath(load_dir)}")
    try:
        params, _, _, _ = _state_metadata(load_dir, iteration)
    except (CheckpointError, KeyError, TypeError, ValueError, OSError) as e:
        raise ExportError(f"--load {load_dir}: unreadable checkpoint metadata: {type(e).__name__}: {e}") from e
    return ["/".join(p) for p, _ in _paths(params) if FP8_META in p]


def read_saved_params(load_dir: str, iteration: Optional[int] = None) -> tuple[dict, dict, int]:
    """``(params, meta, step)``: the checkpoint's ``params`` as float32 numpy in the
    per-layer layout (``decoder_layers_{i}``), restored from the on-disk tree itself (host
    numpy, no model built, no sharding; Orbax's partial restore of the ``params`` subtree,
    no optimizer state), so leaves the installed model does not declare (``fp8_meta`` of an
    FP8 run) come back too. Stacked layouts (``scan_layers``, pipeline
    stage order, uneven stages) are converted by
    :func:`jmegatron.training.checkpoint_layout.convert_layers`; auxiliary modules named in
    the meta's ``aux_params`` (a distillation run's projection) are dropped.
    Raises ExportError for a missing or unreadable checkpoint."""
    import jax
    import orbax.checkpoint as ocp

    from jmegatron.training import checkpointing
    from jmegatron.training.checkpoint_layout import LayerLayout, convert_layers

    if not checkpointing.has_checkpoint(load_dir):
        raise ExportError(f"--load {load_dir}: no checkpoint found in {os.path.abspath(load_dir)}")
    try:
        params_md, state_dir, step, meta = _state_metadata(load_dir, iteration)
        # auxiliary modules (a distillation run's projection) are not read at all
        params_md = {k: v for k, v in params_md.items() if k not in (meta.get("aux_params") or {})}
        target = _map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), params_md)
        restore_args = _map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), params_md)
        state = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
            item={"params": target}, restore_args={"params": restore_args}, partial_restore=True))
    except (checkpointing.CheckpointError, KeyError, TypeError, ValueError, OSError) as e:
        raise ExportError(f"--load {load_dir}: cannot read the checkpoint's parameters: {type(e).__name__}: {e}") \
            from e
    params = _map(lambda a: np.asarray(a, dtype=np.float32), dict(state["params"]))
    for name in (meta.get("aux_params") or {}):
        params.pop(name, None)
    num_layers = int(meta["config"]["num_layers"])
    saved = LayerLayout.of_config(meta["config"])
    per_layer = LayerLayout(False)
    if not saved.same_storage(per_layer, num_layers):
        params = convert_layers(params, saved, per_layer, num_layers)
    return params, meta, step


def _map(fn, tree):
    if isinstance(tree, Mapping):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)


def has_fp8_meta(params: Mapping) -> bool:
    """True if any subtree of ``params`` is named ``fp8_meta``."""
    return any(FP8_META in p for p, _ in _paths(params))


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


def layer_fp8_meta(params: Mapping, cfg) -> dict[int, dict[str, dict[str, np.ndarray]]]:
    """``{layer: {linear path: {leaf: float32 array}}}`` for every decoder layer and every
    linear of :data:`FP8_LINEARS`, from per-layer (or stacked ``decoder_layers``) params.

    The contract (docs/PRECISION.md) places ``fp8_meta`` among the linear's own parameters
    (``decoder_layers_{i}/self_attention/linear_qkv/fp8_meta/...``); only that placement is
    read. Raises ExportError naming the first linear without ``fp8_meta``, a missing leaf,
    or a leaf of the wrong shape (histories ``[H]``, scales ``[]``), and for MoE configs
    (their expert linears have no TensorRT-LLM FP8 layout here)."""
    from jmegatron.export.hf import unstack_layers

    if cfg.num_moe_experts is not None:
        raise ExportError("--scales from-checkpoint: mixture-of-experts checkpoints are not exported to the FP8 "
                          "TensorRT-LLM checkpoint (dense GPT / Llama only); export without --scales")
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
    from jmegatron.export.hf import unstack_layers

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
def fp8_quantization_config() -> dict:
    """``config.json``'s ``quantization`` block, as ModelOpt 0.47 writes it for FP8_DEFAULT_CFG
    with the output layer excluded and no KV-cache quantization."""
    return {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}


def fp8_rank_tensors(params: Mapping, cfg, vocab_size: int, tp: int, rank: int, scales: dict, *, pp: int = 1,
                     use_parallel_embedding: bool = True, weight_scales: str = "checkpoint") -> tuple[dict, int]:
    """``(tensors, saturated)``: the TensorRT-LLM tensors of ``rank`` (torch; names as
    :func:`jmegatron.export.trtllm.rank_tensors`) with every FP8 linear's ``weight`` in
    float8_e4m3fn plus its float32 ``[1]`` ``weights_scaling_factor`` and
    ``activation_scaling_factor``; other tensors float32 (cast by the writer). ``scales``:
    :func:`checkpoint_fp8_scales`. ``saturated``: weight values clipped to ±448."""
    import torch

    from jmegatron.export.trtllm import rank_tensors
    from jmegatron.export.trtllm_check import pp_layers

    plain = strip_fp8_meta(params)
    t = rank_tensors(plain, cfg, vocab_size, tp, rank, pp=pp, use_parallel_embedding=use_parallel_embedding)
    out = {k: torch.from_numpy(v) for k, v in t.items()}
    saturated = 0
    gated = bool(cfg.swiglu)
    for local, i in enumerate(pp_layers(cfg.num_layers, pp, rank // tp)):
        for path, names in FP8_LINEARS.items():
            sc = scales[i][path]
            if path == "mlp/linear_fc1" and gated:
                names = names + ("mlp.gate",)
            for n in names:
                key = f"transformer.layers.{local}.{n}"
                q, sat = quantize_weight(t[f"{key}.weight"], sc.weights_scaling_factor,
                                         sc.kernel_scale if weight_scales == "checkpoint" else None)
                saturated += sat
                out[f"{key}.weight"] = q
                out[f"{key}.weights_scaling_factor"] = torch.tensor([sc.weights_scaling_factor], dtype=torch.float32)
                out[f"{key}.activation_scaling_factor"] = torch.tensor([sc.activation_scaling_factor],
                                                                       dtype=torch.float32)
    return out, saturated


def write_fp8_trtllm_checkpoint(params: Mapping, cfg, vocab_size: int, out: str, *, tp: int = 1, pp: int = 1,
                                dtype: str = "float16", use_parallel_embedding: bool = True,
                                weight_scales: str = "checkpoint", overwrite: bool = False,
                                producer: Optional[dict] = None) -> dict:
    """Write the FP8 TensorRT-LLM checkpoint (``config.json`` + ``rank{r}.safetensors``,
    ``r < tp * pp``) of ``params`` holding ``fp8_meta`` (per-layer or stacked).

    Unquantized tensors (embeddings, norms, biases, ``lm_head``) in ``dtype``; quantized
    linears as the module docstring. ``config.json`` is
    :func:`jmegatron.export.trtllm.trtllm_config` with :func:`fp8_quantization_config` and a
    ``producer.fp8`` record (format, margin, amax algo and history length, weight-scale rule,
    saturated count). Written to a temporary sibling folder renamed into place. Returns the
    config. Raises ExportError as :func:`checkpoint_fp8_scales` and
    :func:`jmegatron.export.trtllm.check_exportable`, before anything is written."""
    import torch
    from safetensors.torch import save_file

    from jmegatron.export.trtllm import _check_out, _publish, _staging_dir, trtllm_config

    scales = checkpoint_fp8_scales(params, cfg, weight_scales)  # MoE and missing meta raise here
    config = trtllm_config(cfg, vocab_size, tp, dtype, pp=pp, use_parallel_embedding=use_parallel_embedding,
                           producer=producer)
    config["quantization"] = fp8_quantization_config()
    out = _check_out(out, overwrite)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    staging = _staging_dir(out)
    saturated = 0
    try:
        for r in range(tp * pp):
            tensors, sat = fp8_rank_tensors(params, cfg, vocab_size, tp, r, scales, pp=pp,
                                            use_parallel_embedding=use_parallel_embedding, weight_scales=weight_scales)
            saturated += sat
            tensors = {k: v if v.dtype in (torch.float8_e4m3fn,) or k.endswith("scaling_factor") else v.to(tdt)
                       for k, v in tensors.items()}
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(staging, f"rank{r}.safetensors"),
                      metadata={"format": "pt"})
        sources = sorted({s.activation_source for layer in scales.values() for s in layer.values()})
        config["producer"]["fp8"] = {
            "scales": "from-checkpoint", "fp8": cfg.fp8, "fp8_margin": int(cfg.fp8_margin),
            "fp8_amax_compute_algo": cfg.fp8_amax_compute_algo,
            "fp8_amax_history_len": int(cfg.fp8_amax_history_len), "weight_scales": weight_scales,
            "activation_scales_from": sources, "saturated_weight_values": int(saturated)}
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        _publish(staging, out)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)
    return config


def export_fp8_checkpoint(load: str, out: str, *, tp: int = 1, pp: int = 1, dtype: str = "float16",
                          iteration: Optional[int] = None, use_parallel_embedding: bool = True,
                          weight_scales: str = "checkpoint", overwrite: bool = False) -> dict:
    """``trtllm --load CKPT --scales from-checkpoint``: an FP8-trained checkpoint -> the FP8
    TensorRT-LLM checkpoint with its own scales (no calibration).

    Checked before any array is restored: the config (:func:`jmegatron.export.trtllm.
    check_exportable`), ``out``, ``weight_scales``, and that the checkpoint's parameters hold
    ``fp8_meta`` (else ExportError naming ``--scales`` and the fix: calibrate with
    ``quantize --quant-cfg fp8`` then ``trtllm --quantized``). Then the parameters are read
    with :func:`jmegatron.export.common.load_checkpoint` and written by
    :func:`write_fp8_trtllm_checkpoint`. Returns the config dict."""
    from jmegatron.export.common import checkpoint_config, load_checkpoint
    from jmegatron.export.trtllm import _check_out, _check_pp, check_exportable

    _check_pp(pp)
    if weight_scales not in WEIGHT_SCALES:
        raise ExportError(f"--weight-scales {weight_scales!r}: choose from {', '.join(WEIGHT_SCALES)}")
    cfg = checkpoint_config(load, iteration)
    check_exportable(cfg, tp, dtype, pp)
    if cfg.num_moe_experts is not None:
        layer_fp8_meta({}, cfg)
    _check_out(out, overwrite)
    if not saved_fp8_meta_paths(load, iteration):
        raise ExportError(
            f"--scales from-checkpoint: {os.path.abspath(load)} holds no FP8 scales (no fp8_meta in its parameters: "
            f"it was trained without config.fp8, fp8={cfg.fp8!r}). Drop --scales to export it unquantized, or "
            "calibrate FP8 scales with `python -m jmegatron.export quantize --load CKPT --quant-cfg fp8 "
            "--calib-data PREFIX --out QDIR` then `trtllm --quantized QDIR`")
    src = load_checkpoint(load, iteration)
    return write_fp8_trtllm_checkpoint(src.params, src.cfg, src.vocab_size, out, tp=tp, pp=pp, dtype=dtype,
                                       use_parallel_embedding=use_parallel_embedding, weight_scales=weight_scales,
                                       overwrite=overwrite,
                                       producer={"source": src.load_dir, "iteration": src.iteration})
