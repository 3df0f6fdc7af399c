"""``python -m jmegatron.export trtllm``: TensorRT-LLM checkpoints (what ``trtllm-build`` reads).

    python -m jmegatron.export trtllm (--load CKPT | --quantized DIR [--quant-cfg NAME])
        --tp T [--pp P] [--moe-ep E] [--moe-tp T/E] --dtype float16|bfloat16 --out DIR
        [--no-parallel-embedding] [--build-engine]
    python -m jmegatron.export trtllm --load CKPT --scales from-checkpoint [--weight-scales checkpoint|amax] ...
    python -m jmegatron.export check-trtllm DIR

The format is TensorRT-LLM's checkpoint of TRT-LLM <= 1.2 (the one Megatron-LM's
``examples/export/ptq_and_trtllm_export`` targets; ``docs/source/architecture/checkpoint.md``):
``config.json`` (``PretrainedConfig`` / ``GPTConfig`` / ``LLaMAConfig`` fields of
``tensorrt_llm/models``) and ``rank{r}.safetensors`` for ``r < tp * pp``, each holding that
rank's shards under TRT-LLM's names. The checker
(:mod:`jmegatron.export.trtllm_check`) validates the result after every export.

Targets (chosen as for Hugging Face, :func:`jmegatron.conversion.hf.hf_architecture`):

* ``GPTForCausalLM`` for the GPT-2 variant (learned positions, LayerNorm, GELU, biases):
  ``position_embedding_type="learned_absolute"``, ``hidden_act="gelu"``, ``bias=true``.
  **GELU mismatch:** jmegatron's GELU is the exact erf form; TensorRT-LLM has no exact GELU:
  ``tensorrt_llm.functional.gelu`` (``ACT2FN`` "gelu", "gelu_new", "gelu_fast") is the tanh
  approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``. The two differ by at
  most 4.7e-4 per activation (at ``|x| ~= 2.7``), so engine logits differ slightly from
  jmegatron's (as with Megatron's own fused bias-GELU, which is the tanh form).
* ``LlamaForCausalLM`` for the Llama variant (RoPE, RMSNorm, SwiGLU, GQA):
  ``position_embedding_type="rope_gpt_neox"`` (rotate-half, jmegatron's RoPE),
  ``hidden_act="silu"``, ``rotary_base``, ``attn_bias`` / ``mlp_bias`` from
  ``add_bias_linear``. TRT-LLM's ``GatedMLP`` computes ``proj(act(fc(x)) * gate(x))``, so
  ``mlp.fc`` is the SwiGLU gate (jmegatron fc1 index 0, HF ``gate_proj``) and ``mlp.gate`` is
  the up projection (fc1 index 1, HF ``up_proj``), as ``tensorrt_llm/models/llama/convert.py``.

* ``MixtralForCausalLM`` for mixture-of-experts models without a shared expert (every layer
  an MoE layer, Llama's attention; the Hugging Face target of
  :func:`jmegatron.conversion.hf_moe.moe_architecture`). TensorRT-LLM's ``MODEL_MAP`` maps the
  name to its ``LLaMAForCausalLM`` with ``MixtureOfExperts`` MLPs; the config is what
  ``LLaMAConfig.from_hugging_face`` writes for ``model_type == "mixtral"``:
  ``hidden_act="swiglu"`` (the gated activation made explicit), ``intermediate_size`` =
  ``moe_ffn_hidden_size`` and ``moe = {num_experts, top_k, normalization_mode: 1}``
  (``MoeConfig.ExpertScaleNormalizationMode.RENORMALIZE``: softmax over the top-k router
  logits, which equals Megatron's softmax over all experts renormalised over the top-k,
  ``moe_router_pre_softmax=False``; the three fields ModelOpt's
  ``tensorrt_llm_utils.convert_to_tensorrt_llm_config`` writes, which every MoeConfig
  release accepts). Shared experts (Qwen2-MoE), dense layers among MoE layers, sigmoid
  scores / expert bias / top-k scaling (DeepSeek-V3) have no ``MixtralForCausalLM`` form
  and are refused, naming the field.

The tensor layouts (MoE layers, tensor and pipeline parallelism) and ``config.json`` are
:mod:`jmegatron.conversion.trtllm`. ``--quantized`` supports ``--pp 1`` only, and dense models only: for an MoE source it is
refused by name (ModelOpt 0.47's TensorRT-LLM exporter cannot read transformers 5's Mixtral;
the quantize command's unified Hugging Face checkpoint is the quantized MoE deliverable).

``--quantized DIR`` takes a ``jmegatron.export quantize`` output: the fake-quantized model
(:func:`jmegatron.export.quantized.load_quantized`) goes through ModelOpt's
``export_tensorrt_llm_checkpoint`` (``decoder_type`` "gpt"/"llama",
``inference_tensor_parallel=tp``), whose quantized tensors (int8 / fp8 / packed int4 weights
and scaling factors) are kept, and its ``config.json`` is corrected by
:func:`fix_modelopt_config` (each fix documented there and printed).

``--load CKPT --scales from-checkpoint`` takes an FP8-trained checkpoint (``config.fp8``: its
FP8 linears hold ``fp8_meta``) and writes the FP8 checkpoint ModelOpt's FP8 export would
(``quant_algo`` FP8, float8_e4m3fn weights, per-tensor ``weights_scaling_factor`` /
``activation_scaling_factor``) with the training's own amax histories and scales instead of
a calibration pass (:mod:`jmegatron.export.fp8_scales`; any ``--tp`` / ``--pp``, dense
models). A checkpoint without ``fp8_meta`` is refused, naming the flag and the calibration
route; without ``--scales`` an FP8 checkpoint is written unquantized (a note says so).

Bad input (an architecture TRT-LLM cannot represent, a tp that does not divide the heads,
KV heads or ffn size, a pp outside ``[1, num_layers]``, ``--moe-ep`` / ``--moe-tp`` whose
product is not ``--tp`` or that do not divide the experts / the expert FFN, a non-empty ``--out``,
``--build-engine`` without TensorRT-LLM) raises :class:`ExportError` before anything is
written. Output is written to a temporary sibling folder and renamed into place, so a
failure never leaves a partial checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Mapping, Optional

import numpy as np

from jmegatron.conversion.hf import GPT2, QWEN2 as HF_QWEN2, hf_architecture
from jmegatron.conversion.hf import GRANITE as HF_GRANITE, SMOLLM3 as HF_SMOLLM3
from jmegatron.conversion.hf_moe import GPT_OSS as HF_GPT_OSS, MIXTRAL as HF_MIXTRAL
from jmegatron.conversion.trtllm import GPT, LLAMA, MIXTRAL, pp_layers, rank_tensors, trtllm_config
from jmegatron.export.common import ExportError, checkpoint_config, load_checkpoint, open_checkpoint, refuse_moe
from jmegatron.export.fp8_scales import (FP8_LINEARS, WEIGHT_SCALES, check_fp8_exportable, checkpoint_fp8_scales,
                                         quantize_weight, saved_fp8_meta_paths, strip_fp8_meta)
from jmegatron.export.quantized import load_quantized, quantized_source_config
from jmegatron.export.trtllm_check import check_trtllm_checkpoint

__all__ = ["register", "run", "register_check", "run_check", "trtllm_architecture", "check_exportable", "write_trtllm_checkpoint", "export_checkpoint",
           "export_quantized_model", "export_quantized", "fix_modelopt_config", "build_engine", "moe_parallel_sizes",
           "DTYPES", "FLOAT32_TENSORS"]

DTYPES = ("float16", "bfloat16")
GELU_TANH_MAX_ABS_DIFF = 4.7e-4  # max |gelu_erf(x) - gelu_tanh(x)| over the reals, at |x| ~= 2.70
# written in float32 whatever --dtype (TRT-LLM's MixtureOfExperts router is a float32 RowLinear
# with strict_dtype; llama/convert.py passes the HF gate weight as torch.float32)
FLOAT32_TENSORS = (".mlp.router.weight",)


# ----------------------------------------------------------------------------- checks
def trtllm_architecture(cfg) -> str:
    """``"GPTForCausalLM"``, ``"LlamaForCausalLM"`` or ``"MixtralForCausalLM"`` for ``cfg``
    (a JMegatronConfig).

    Same rules as :func:`jmegatron.conversion.hf.hf_architecture` (GPT-2: learned_absolute +
    LayerNorm + GELU + MHA + biases; Llama: rope + RMSNorm + SwiGLU; MoE: Mixtral, every
    layer MoE with a renormalised softmax top-k). Raises ExportError naming every config
    field the target cannot represent, and for an MoE config with a shared expert
    (``moe_shared_expert_intermediate_size``: Qwen2-MoE / DeepSeek layouts are not written).
    """
    if cfg.num_moe_experts is not None and cfg.moe_shared_expert_intermediate_size is not None:
        raise ExportError(
            f"trtllm: config.moe_shared_expert_intermediate_size={cfg.moe_shared_expert_intermediate_size}: "
            f"the TensorRT-LLM MoE checkpoint written here is {MIXTRAL} (router + routed experts only); "
            "shared experts (Qwen2-MoE's gated shared expert, DeepSeek's) are not written. "
            "`python -m jmegatron.export hf` exports this model as Qwen2MoeForCausalLM")
    try:
        hf_arch = hf_architecture(cfg)
    except ValueError as e:
        targets = MIXTRAL if cfg.num_moe_experts is not None else "GPTForCausalLM / LlamaForCausalLM"
        raise ExportError(f"no TensorRT-LLM target ({targets}) for this checkpoint: {e}") from e
    unwritten = [f"config.{name}={getattr(cfg, name)!r}" for name, off in (
        ("qk_layernorm", False), ("openai_gelu", False), ("rope_scaling", False),
        ("rotary_seq_len_interpolation_factor", None), ("rotary_percent", 1.0), ("rotary_interleaved", False))
        if getattr(cfg, name) != off]
    if cfg.position_embedding_type == "yarn":
        unwritten.append("config.position_embedding_type='yarn'")
    if hf_arch in (HF_SMOLLM3, HF_GRANITE):  # NoPE layers, Granite's scalars and score scale
        unwritten += [f"config.{n}={getattr(cfg, n)!r}" for n, off in (
            ("no_rope_freq", None), ("embedding_multiplier", 1.0), ("residual_multiplier", 1.0),
            ("logits_scaling", 1.0), ("softmax_scale", None)) if getattr(cfg, n) != off]
    if hf_arch == HF_QWEN2:
        unwritten.append("config.add_qkv_bias=True without add_bias_linear (Qwen2's layout)")
    if hf_arch == HF_GPT_OSS:
        unwritten.append(f"config.softmax_type={cfg.softmax_type!r}, quick_geglu={cfg.quick_geglu} (gpt-oss's layout)")
    if unwritten:
        raise ExportError(f"trtllm: {', '.join(unwritten)}: the TensorRT-LLM legacy checkpoint written here has GPT-2 "
                          f"and Llama-2 blocks only. `python -m jmegatron.export hf` writes this model as {hf_arch}, "
                          "which TensorRT-LLM's PyTorch backend, vLLM and SGLang load")
    if hf_arch == HF_MIXTRAL:
        return MIXTRAL
    return GPT if hf_arch == GPT2 else LLAMA


def moe_parallel_sizes(tp: int, moe_tp: Optional[int] = None, moe_ep: Optional[int] = None) -> tuple[int, int]:
    """``(moe_tp_size, moe_ep_size)`` as TensorRT-LLM's ``Mapping`` resolves them for ``tp``:
    neither given -> ``(tp, 1)``; one given -> the other is ``tp`` divided by it; both must
    multiply to ``tp`` (the MoE ranks are the tensor parallel ranks). Raises ExportError
    naming ``--moe-tp`` / ``--moe-ep`` otherwise."""
    for v, flag in ((moe_tp, "--moe-tp"), (moe_ep, "--moe-ep")):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ExportError(f"{flag} {v!r}: must be an integer >= 1")
    if moe_tp is None and moe_ep is None:
        return tp, 1
    if moe_tp is None:
        if tp % moe_ep:
            raise ExportError(f"--moe-ep {moe_ep} does not divide --tp {tp}: TensorRT-LLM's MoE ranks are the tp "
                              f"ranks (moe_tp_size x moe_ep_size = tp_size); use --tp {moe_ep} (or a multiple)")
        return tp // moe_ep, moe_ep
    if moe_ep is None:
        if tp % moe_tp:
            raise ExportError(f"--moe-tp {moe_tp} does not divide --tp {tp} (moe_tp_size x moe_ep_size = tp_size)")
        return moe_tp, tp // moe_tp
    if moe_tp * moe_ep != tp:
        raise ExportError(f"--moe-tp {moe_tp} x --moe-ep {moe_ep} = {moe_tp * moe_ep} != --tp {tp}: TensorRT-LLM's "
                          "Mapping needs moe_tp_size x moe_ep_size = tp_size (the MoE ranks are the tp ranks)")
    return moe_tp, moe_ep


def check_exportable(cfg, tp: int, dtype: str, pp: int = 1, *, moe_tp: Optional[int] = None,
                     moe_ep: Optional[int] = None) -> str:
    """Refuse what the TensorRT-LLM layout cannot hold, before any work; returns the architecture.

    Raises ExportError for: ``dtype`` not float16/bfloat16; ``tp < 1``; ``pp`` not in
    ``[1, num_layers]`` (every pipeline stage needs a layer); an architecture with
    no target; ``num_attention_heads`` or ``ffn_hidden_size`` not divisible by ``tp``;
    ``num_query_groups`` neither divisible by ``tp`` nor dividing it (TRT-LLM splits KV heads
    or duplicates them when there are fewer than ``tp``). A vocabulary not divisible by
    ``tp`` is fine: it is padded, as TRT-LLM's ``pad_vocab_size``. MoE (``MixtralForCausalLM``):
    ``moe_tp`` / ``moe_ep`` resolved by :func:`moe_parallel_sizes`, ``num_moe_experts``
    divisible by ``moe_ep`` and ``moe_ffn_hidden_size`` by ``moe_tp`` (``MixtureOfExperts``
    raises otherwise); ``moe_tp`` / ``moe_ep`` other than None / 1 for a dense model.
    """
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: TensorRT-LLM checkpoints are written in one of {DTYPES}")
    if not isinstance(tp, int) or tp < 1:
        raise ExportError(f"--tp {tp!r}: the tensor parallel size must be an integer >= 1")
    _check_pp(pp)
    arch = trtllm_architecture(cfg)
    if arch != MIXTRAL and (moe_tp or 1) * (moe_ep or 1) != 1:
        raise ExportError(f"--moe-tp / --moe-ep are for mixture-of-experts checkpoints; this one is a dense {arch} "
                          "(num_moe_experts unset): leave them out")
    if pp > cfg.num_layers:
        raise ExportError(f"--pp {pp}: num_layers={cfg.num_layers} cannot fill {pp} pipeline stages (TensorRT-LLM's "
                          f"Mapping.pp_layers needs pp_size <= num_hidden_layers); use --pp 1..{cfg.num_layers}")
    nq, nkv, ffn = cfg.num_attention_heads, cfg.num_query_groups, cfg.ffn_hidden_size
    problems = []
    if nq % tp:
        problems.append(f"num_attention_heads={nq} is not divisible by --tp {tp} (each rank holds nq/tp heads)")
    if nkv % tp and tp % nkv:
        problems.append(f"num_query_groups={nkv}: --tp {tp} must divide it, or be a multiple of it (KV heads are "
                        "split, or duplicated when fewer than tp)")
    dense_mlp = arch != MIXTRAL  # Mixtral: every layer is an MoE layer (its experts are checked below)
    if dense_mlp and ffn % tp:
        problems.append(f"ffn_hidden_size={ffn} is not divisible by --tp {tp}")
    if problems:
        divisors = [t for t in range(1, nq + 1)
                    if not nq % t and not (dense_mlp and ffn % t) and (not nkv % t or not t % nkv)]
        raise ExportError("--tp " + str(tp) + ": " + "; ".join(problems)
                          + f". Tensor parallel sizes that fit this model: {divisors}")
    if arch == MIXTRAL:
        mtp, mep = moe_parallel_sizes(tp, moe_tp, moe_ep)
        E, F = cfg.num_moe_experts, cfg.moe_ffn_hidden_size
        if E % mep:
            raise ExportError(f"--moe-ep {mep}: num_moe_experts={E} is not divisible by it (each expert-parallel rank "
                              f"holds E/ep whole experts); use one of {[e for e in range(1, E + 1) if not E % e]}")
        if F % mtp:
            raise ExportError(f"--moe-tp {mtp}: moe_ffn_hidden_size={F} is not divisible by it (each MoE tp rank "
                              f"holds F/moe_tp columns of every expert); raise --moe-ep to lower --moe-tp")
    return arch


def _check_pp(pp) -> None:
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ExportError(f"--pp {pp!r}: the pipeline parallel size must be an integer >= 1")


def _check_out(out: str, overwrite: bool) -> str:
    if not out:
        raise ExportError("--out is required: the TensorRT-LLM checkpoint folder to create")
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out} is a file; give a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ExportError(f"--out {out} is not empty; choose a new folder (or pass --overwrite to replace it)")
    return out


def _check_build_engine_possible() -> None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise ExportError("--build-engine runs `trtllm-build`, which needs TensorRT-LLM (<= 1.2, the TensorRT "
                          "backend) and an NVIDIA GPU: `import tensorrt_llm` is not available in this environment. "
                          "Export without --build-engine, then run `trtllm-build --checkpoint_dir OUT --output_dir "
                          "ENGINE_DIR` where TensorRT-LLM is installed.")


def _save_rank(tensors: dict[str, np.ndarray], path: str, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    save_file({k: torch.from_numpy(np.require(v, requirements=["C", "W"])).to(
        torch.float32 if k.endswith(FLOAT32_TENSORS) else tdt) for k, v in tensors.items()},
              path, metadata={"format": "pt"})


def _staging_dir(out: str) -> str:
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)


def _publish(staging: str, out: str) -> None:
    """Move the finished ``staging`` folder to ``out`` (replacing an existing ``out``), with
    the umask's ordinary permissions (``mkdtemp`` makes it private)."""
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(staging):
        os.chmod(root, 0o777 & ~umask)
        for fn in files:
            os.chmod(os.path.join(root, fn), 0o666 & ~umask)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(staging, out)


@contextlib.contextmanager
def _staged(out: str, config: Optional[dict] = None):
    """A private folder beside ``out`` to write a checkpoint into; when the block ends
    without an error, ``config`` (if given, as it is then) is written as its config.json and
    the folder replaces ``out`` (:func:`_publish`). The folder is removed in every case, so a
    failed export leaves ``out`` as it was."""
    staging = _staging_dir(out)
    try:
        yield staging
        if config is not None:
            with open(os.path.join(staging, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
        _publish(staging, out)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)


def write_trtllm_checkpoint(params: dict, cfg, vocab_size: int, out: str, *, tp: int = 1, pp: int = 1,
                            dtype: str = "float16", use_parallel_embedding: bool = True, overwrite: bool = False,
                            producer: Optional[dict] = None, moe_tp: Optional[int] = None,
                            moe_ep: Optional[int] = None) -> dict:
    """Write ``config.json`` + ``rank{r}.safetensors`` (``r < tp * pp``) for jmegatron ``params``.

    Tensors are cast from float32 to ``dtype`` (float16 / bfloat16) with torch, except
    :data:`FLOAT32_TENSORS` (the MoE router), kept in float32. ``moe_tp`` / ``moe_ep``: the
    MoE split of an MoE checkpoint (:func:`moe_parallel_sizes`). Everything
    is validated (:func:`check_exportable`, ``out`` empty or absent unless ``overwrite``)
    before any file is written, and written in a temporary sibling folder renamed to
    ``out`` at the end. Returns the config dict. Raises ExportError for bad input and
    ValueError when ``params`` do not match ``cfg``.
    """
    arch = check_exportable(cfg, tp, dtype, pp, moe_tp=moe_tp, moe_ep=moe_ep)
    moe_sizes = moe_parallel_sizes(tp, moe_tp, moe_ep)
    config = trtllm_config(cfg, arch, vocab_size, tp, dtype, pp=pp, use_parallel_embedding=use_parallel_embedding,
                           producer=producer, moe_sizes=moe_sizes)
    out = _check_out(out, overwrite)
    with _staged(out, config) as staging:
        for r in range(tp * pp):
            _save_rank(rank_tensors(params, cfg, arch, vocab_size, tp, r, pp=pp,
                                    use_parallel_embedding=use_parallel_embedding, moe_sizes=moe_sizes),
                       os.path.join(staging, f"rank{r}.safetensors"), dtype)
    return config


def export_checkpoint(load: str, out: str, *, tp: int = 1, pp: int = 1, dtype: str = "float16",
                      iteration: Optional[int] = None, use_parallel_embedding: bool = True,
                      overwrite: bool = False, moe_tp: Optional[int] = None, moe_ep: Optional[int] = None) -> dict:
    """``trtllm --load``: a jmegatron checkpoint (any parallel layout) -> TensorRT-LLM checkpoint.

    The config is read first (no arrays) and checked (:func:`check_exportable`, ``out``);
    then the float32 params are restored (:func:`jmegatron.export.common.load_checkpoint`)
    and written by :func:`write_trtllm_checkpoint` (``tp`` x ``pp`` ranks; the checkpoint's
    own pipeline layout is converted by the restore, its expert-parallel layout too). ``moe_tp``
    / ``moe_ep``: the MoE split (:func:`moe_parallel_sizes`). Returns the config dict.
    """
    _check_pp(pp)
    saved = open_checkpoint(load, iteration)
    cfg = checkpoint_config(load, iteration, saved)
    check_exportable(cfg, tp, dtype, pp, moe_tp=moe_tp, moe_ep=moe_ep)
    _check_out(out, overwrite)
    src = load_checkpoint(load, iteration, saved)
    return write_trtllm_checkpoint(src.params, src.cfg, src.vocab_size, out, tp=tp, pp=pp, dtype=dtype,
                                   use_parallel_embedding=use_parallel_embedding, overwrite=overwrite,
                                   producer={"source": src.load_dir, "iteration": src.iteration},
                                   moe_tp=moe_tp, moe_ep=moe_ep)


# ----------------------------------------------------------------------------- FP8-trained checkpoints
def fp8_quantization_config() -> dict:
    """``config.json``'s ``quantization`` block, as ModelOpt 0.47 writes it for FP8_DEFAULT_CFG
    with the output layer excluded and no KV-cache quantization."""
    return {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}


def fp8_rank_tensors(params: Mapping, cfg, vocab_size: int, tp: int, rank: int, scales: dict, *, pp: int = 1,
                     use_parallel_embedding: bool = True, weight_scales: str = "checkpoint") -> tuple[dict, int]:
    """``(tensors, saturated)``: the TensorRT-LLM tensors of ``rank`` (torch; names as
    :func:`jmegatron.conversion.trtllm.rank_tensors`) with every FP8 linear's ``weight`` in
    float8_e4m3fn plus its float32 ``[1]`` ``weights_scaling_factor`` and
    ``activation_scaling_factor``; other tensors float32 (cast by the writer). ``scales``:
    :func:`jmegatron.export.fp8_scales.checkpoint_fp8_scales`. ``saturated``: weight values clipped to ±448."""
    import torch

    plain = strip_fp8_meta(params)
    arch = check_exportable(cfg, tp, "float16", pp)
    t = rank_tensors(plain, cfg, arch, vocab_size, tp, rank, pp=pp, use_parallel_embedding=use_parallel_embedding)
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
    linears as :mod:`jmegatron.export.fp8_scales` describes. ``config.json`` is
    :func:`jmegatron.conversion.trtllm.trtllm_config` with :func:`fp8_quantization_config` and a
    ``producer.fp8`` record (format, margin, amax algo and history length, weight-scale rule,
    saturated count). Written to a temporary sibling folder renamed into place. Returns the
    config. Raises ExportError as :func:`jmegatron.export.fp8_scales.checkpoint_fp8_scales` and
    :func:`check_exportable`, before anything is written."""
    import torch
    from safetensors.torch import save_file

    scales = checkpoint_fp8_scales(params, cfg, weight_scales)  # MoE and missing meta raise here
    config = trtllm_config(cfg, check_exportable(cfg, tp, dtype, pp), vocab_size, tp, dtype, pp=pp,
                           use_parallel_embedding=use_parallel_embedding, producer=producer)
    config["quantization"] = fp8_quantization_config()
    out = _check_out(out, overwrite)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    saturated = 0
    with _staged(out, config) as staging:
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
    return config


def export_fp8_checkpoint(load: str, out: str, *, tp: int = 1, pp: int = 1, dtype: str = "float16",
                          iteration: Optional[int] = None, use_parallel_embedding: bool = True,
                          weight_scales: str = "checkpoint", overwrite: bool = False) -> dict:
    """``trtllm --load CKPT --scales from-checkpoint``: an FP8-trained checkpoint -> the FP8
    TensorRT-LLM checkpoint with its own scales (no calibration).

    Checked before any array is restored: the config (:func:`check_exportable`), ``out``,
    ``weight_scales``, and that the checkpoint's parameters hold
    ``fp8_meta`` (else ExportError naming ``--scales`` and the fix: calibrate with
    ``quantize --quant-cfg fp8`` then ``trtllm --quantized``). Then the parameters are read
    with :func:`jmegatron.export.common.load_checkpoint` and written by
    :func:`write_fp8_trtllm_checkpoint`. Returns the config dict."""
    _check_pp(pp)
    if weight_scales not in WEIGHT_SCALES:
        raise ExportError(f"--weight-scales {weight_scales!r}: choose from {', '.join(WEIGHT_SCALES)}")
    saved = open_checkpoint(load, iteration)
    cfg = checkpoint_config(load, iteration, saved)
    check_exportable(cfg, tp, dtype, pp)
    check_fp8_exportable(cfg)
    _check_out(out, overwrite)
    if not saved_fp8_meta_paths(load, iteration, saved):
        raise ExportError(
            f"--scales from-checkpoint: {os.path.abspath(load)} holds no FP8 scales (no fp8_meta in its parameters: "
            f"it was trained without config.fp8, fp8={cfg.fp8!r}). Drop --scales to export it unquantized, or "
            "calibrate FP8 scales with `python -m jmegatron.export quantize --load CKPT --quant-cfg fp8 "
            "--calib-data PREFIX --out QDIR` then `trtllm --quantized QDIR`")
    src = load_checkpoint(load, iteration, saved)
    return write_fp8_trtllm_checkpoint(src.params, src.cfg, src.vocab_size, out, tp=tp, pp=pp, dtype=dtype,
                                       use_parallel_embedding=use_parallel_embedding, weight_scales=weight_scales,
                                       overwrite=overwrite,
                                       producer={"source": src.load_dir, "iteration": src.iteration})


# ----------------------------------------------------------------------------- quantized (ModelOpt)
def fix_modelopt_config(config: dict, cfg) -> tuple[dict, list[str]]:
    """Correct what ModelOpt 0.47's manual config path (used when ``tensorrt_llm`` is not
    importable: ``modelopt/torch/export/tensorrt_llm_utils.py``) gets wrong or leaves out.

    Returns ``(fixed_config, fixes)`` with one sentence per change made:

    * GPT: ``position_embedding_type`` is written as ``"rope_gpt_neox"`` for every model
      (``decoder_config.position_embedding_type or "rope_gpt_neox"``); GPT-2 has learned
      absolute positions (its ``transformer.position_embedding.weight`` is exported), so it
      becomes ``"learned_absolute"``. ``rotary_base`` is dropped for it. ``architecture``
      (ModelOpt copies the HF name ``GPT2LMHeadModel``, an alias of the same TRT-LLM class)
      is written as ``GPTForCausalLM``, as the unquantized export does.
    * Llama: TRT-LLM's ``LLaMAConfig`` reads ``attn_bias`` / ``mlp_bias`` (default false);
      ModelOpt writes only its own ``bias`` field, so a Llama with biases would build without
      them: both are set from ``cfg.add_bias_linear``. ``rotary_base`` is set to
      ``cfg.rotary_base`` and ``rotary_scaling`` to null when missing.
    * Both: ``rank`` (ModelOpt writes the rank of the last rank file into the one shared
      config) is removed; ``tie_word_embeddings`` is recorded; ``producer`` names this
      command. ``hidden_act`` "gelu" is kept (TensorRT-LLM's GELU is the tanh form, see the
      module docstring). Kept as ModelOpt writes them: ``logits_dtype`` (float16 for a
      bfloat16 model), its extra fields (``decoder``, ``rmsnorm``, ``rotary_pct``, ...), and
      for AWQ the vocabulary padded to a multiple of 64 (``vocab_size`` grows; the extra
      embedding and ``lm_head`` rows are zero).
    """
    c = json.loads(json.dumps(config))
    fixes: list[str] = []
    arch = trtllm_architecture(cfg)
    if arch == GPT:
        if c.get("position_embedding_type") != "learned_absolute":
            fixes.append(f"position_embedding_type {c.get('position_embedding_type')!r} -> 'learned_absolute' "
                         "(GPT-2 has a learned position table; ModelOpt's manual config writes rope for all)")
            c["position_embedding_type"] = "learned_absolute"
            c.pop("rotary_base", None)
        if c.get("architecture") != GPT:
            fixes.append(f"architecture {c.get('architecture')!r} -> {GPT!r} (the Hugging Face class name; "
                         f"MODEL_MAP maps both to {GPT}, written as the unquantized export writes it)")
            c["architecture"] = GPT
    else:
        bias = bool(cfg.add_bias_linear)
        for k in ("attn_bias", "mlp_bias"):
            if c.get(k) != bias:
                fixes.append(f"{k} {c.get(k)!r} -> {bias} (LLaMAConfig reads {k}; ModelOpt writes only 'bias')")
                c[k] = bias
        if c.get("rotary_base") != float(cfg.rotary_base):
            fixes.append(f"rotary_base {c.get('rotary_base')!r} -> {float(cfg.rotary_base)}")
            c["rotary_base"] = float(cfg.rotary_base)
        c.setdefault("rotary_scaling", None)
        if c.get("architecture") != LLAMA:
            fixes.append(f"architecture {c.get('architecture')!r} -> {LLAMA!r}")
            c["architecture"] = LLAMA
    if "rank" in c:
        fixes.append(f"removed 'rank': {c['rank']} (a per-rank value in the config every rank reads)")
        del c["rank"]
    c["tie_word_embeddings"] = not cfg.untie_embeddings_and_output_weights
    c["producer"] = dict(c.get("producer") or {}, exported_by="jmegatron.export trtllm --quantized")
    return c, fixes


def export_quantized_model(model, cfg, out: str, *, tp: int = 1, dtype: str = "float16",
                           overwrite: bool = False, producer: Optional[dict] = None) -> tuple[dict, list[str]]:
    """ModelOpt's TensorRT-LLM export of a fake-quantized ``transformers`` model, config fixed.

    ``model``: ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` with ModelOpt quantizers (from
    ``mtq.quantize`` or ``load_quantized``); ``cfg``: the jmegatron config it came from.
    Calls ``modelopt.torch.export.export_tensorrt_llm_checkpoint(model, decoder_type
    "gpt"/"llama", dtype, export_dir, inference_tensor_parallel=tp)`` into a temporary folder,
    applies :func:`fix_modelopt_config`, and moves the result to ``out``. Returns
    ``(config, fixes)``. Raises ExportError for bad input (as :func:`check_exportable`) and
    when ModelOpt refuses the layout (e.g. SmoothQuant with fewer KV heads than tp, AWQ with
    per-rank input features not divisible by its block size), quoting ModelOpt's reason.
    """
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    arch = check_exportable(cfg, tp, dtype)
    out = _check_out(out, overwrite)
    with _staged(out) as staging:
        try:
            export_tensorrt_llm_checkpoint(model, "gpt" if arch == GPT else "llama",
                                           {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype],
                                           export_dir=staging, inference_tensor_parallel=tp)
        except (NotImplementedError, AssertionError, ValueError) as e:
            raise ExportError(f"ModelOpt cannot export this quantized model at --tp {tp}: {type(e).__name__}: {e} "
                              "(try another --tp, e.g. 1)") from e
        path = os.path.join(staging, "config.json")
        with open(path) as f:
            config = json.load(f)
        config, fixes = fix_modelopt_config(config, cfg)
        if producer:
            config["producer"].update(producer)
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    return config, fixes


def export_quantized(quantized_dir: str, out: str, *, tp: int = 1, dtype: str = "float16",
                     quant_cfg: Optional[str] = None, overwrite: bool = False) -> tuple[dict, list[str]]:
    """``trtllm --quantized DIR``: a ``jmegatron.export quantize`` output -> TensorRT-LLM checkpoint.

    Restores the fake-quantized model with
    ``jmegatron.export.quantized.load_quantized(quantized_dir, quant_cfg) -> (model, src, info)``
    and exports it with :func:`export_quantized_model`. ``dtype``/``tp``/``out`` are checked
    before the model is restored, the architecture and tp splits right after (they need the
    source config). Returns ``(config, fixes)``.
    """
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: TensorRT-LLM checkpoints are written in one of {DTYPES}")
    if not isinstance(tp, int) or tp < 1:
        raise ExportError(f"--tp {tp!r}: the tensor parallel size must be an integer >= 1")
    _check_out(out, overwrite)
    refuse_moe(quantized_source_config(quantized_dir, quant_cfg), "trtllm --quantized",
               "the TensorRT-LLM export of a quantized MoE model (ModelOpt's MixtralForCausalLM checkpoint with "
               "MOEWeightWrapper's scaling factors, and its check)",
               "the quantize output's unified_hf folder (FP8 experts, router unquantized) is what TensorRT-LLM's "
               "LLM(model=...) reads; `trtllm --load` writes the unquantized MoE checkpoint")
    model, src, info = load_quantized(quantized_dir, quant_cfg)
    check_exportable(src.cfg, tp, dtype)
    producer = {"source": src.load_dir, "iteration": src.iteration, "quantized_dir": os.path.abspath(quantized_dir),
                "quant_cfg": info.get("quant_cfg") if isinstance(info, dict) else None}
    return export_quantized_model(model, src.cfg, out, tp=tp, dtype=dtype, overwrite=overwrite, producer=producer)


# ----------------------------------------------------------------------------- engine
def build_engine(checkpoint_dir: str, engine_dir: str) -> None:
    """Run ``trtllm-build --checkpoint_dir checkpoint_dir --output_dir engine_dir``.

    Uses the ``trtllm-build`` on PATH, else ``python -m tensorrt_llm.commands.build``.
    Raises ExportError when TensorRT-LLM is not importable or the build fails.
    """
    _check_build_engine_possible()
    exe = shutil.which("trtllm-build")
    cmd = ([exe] if exe else [sys.executable, "-m", "tensorrt_llm.commands.build"]) + [
        "--checkpoint_dir", checkpoint_dir, "--output_dir", engine_dir]
    print("[jmegatron.export trtllm] " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise ExportError(f"trtllm-build failed (exit {rc}) on {checkpoint_dir}")


# ----------------------------------------------------------------------------- CLI
def register(sub) -> None:
    """Add ``trtllm`` and ``check-trtllm`` to an argparse subparsers object."""
    p = sub.add_parser("trtllm", help="write a TensorRT-LLM checkpoint (config.json + rank{r}.safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="jmegatron checkpoint directory")
    src.add_argument("--quantized", help="output folder of `python -m jmegatron.export quantize`")
    p.add_argument("--iteration", type=int, default=None, help="with --load: default the latest")
    p.add_argument("--quant-cfg", default=None, help="with --quantized: which config of DIR (e.g. int8_sq)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of the engine (rank files)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline parallel size of the engine: tp x pp rank files, layers split as TensorRT-LLM's "
                        "Mapping.pp_layers (with --load only)")
    p.add_argument("--moe-ep", type=int, default=None,
                   help="MoE checkpoints: expert parallel size (TensorRT-LLM's moe_ep_size; each rank holds "
                        "num_experts/E experts); --moe-tp x --moe-ep must equal --tp (default: --moe-tp = --tp, "
                        "--moe-ep 1)")
    p.add_argument("--moe-tp", type=int, default=None,
                   help="MoE checkpoints: tensor parallel size of the experts' FFN (TensorRT-LLM's moe_tp_size; "
                        "default --tp / --moe-ep)")
    p.add_argument("--dtype", choices=DTYPES, default="float16")
    p.add_argument("--out", required=True, help="checkpoint folder to create (must be empty or absent)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-parallel-embedding", action="store_true",
                   help="replicate the vocab/position embeddings on every rank (default: split on rows)")
    p.add_argument("--scales", choices=("from-checkpoint",), default=None,
                   help="with --load of an FP8-trained checkpoint (config.fp8): write the FP8 TensorRT-LLM checkpoint "
                        "(quant_algo FP8) with the training's own scales from its fp8_meta, no calibration "
                        "(jmegatron.export.fp8_scales)")
    p.add_argument("--weight-scales", choices=("checkpoint", "amax"), default="checkpoint",
                   help="with --scales from-checkpoint: weights_scaling_factor = 1/kernel_scale of the training "
                        "(default: the FP8 forward's own codes) or amax(weight)/448 (ModelOpt's rule)")
    p.add_argument("--build-engine", action="store_true", help="then run trtllm-build (needs TensorRT-LLM)")
    p.add_argument("--engine-dir", default=None, help="with --build-engine: default OUT/engine")
    p.set_defaults(func=run)
    register_check(sub)


def _wrote_line(out: str, report) -> str:
    """One line saying what ``trtllm`` wrote: folder, architecture, quantization or dtype, the
    tp x pp layout and the rank files' total size."""
    c = report.config if isinstance(report.config, dict) else {}
    m = c.get("mapping") if isinstance(c.get("mapping"), dict) else {}
    q = (c.get("quantization") or {}).get("quant_algo") if isinstance(c.get("quantization"), dict) else None
    total = sum(rf.nbytes for rf in report.ranks)
    return (f"[jmegatron.export trtllm] wrote {out}: {c.get('architecture')} "
            f"{q + ' (unquantized tensors ' + str(c.get('dtype')) + ')' if q else c.get('dtype')}, "
            f"tp {m.get('tp_size', 1)} x pp {m.get('pp_size', 1)}: config.json + {len(report.ranks)} rank "
            f"file{'s' if len(report.ranks) != 1 else ''} ({total / 2**20:.1f} MiB)")


def run(args) -> int:
    """The ``trtllm`` command: export, self-check with the checker, optionally build."""
    if args.build_engine:
        _check_build_engine_possible()
    if args.load and args.quant_cfg:
        raise ExportError("--quant-cfg goes with --quantized, not --load")
    if args.quantized and args.iteration is not None:
        raise ExportError("--iteration goes with --load (a --quantized folder records its source iteration)")
    _check_pp(args.pp)
    if args.scales and not args.load:
        raise ExportError("--scales from-checkpoint goes with --load (an FP8-trained jmegatron checkpoint); a "
                          "--quantized folder already holds ModelOpt's calibrated scales")
    if args.weight_scales != "checkpoint" and not args.scales:
        raise ExportError("--weight-scales goes with --scales from-checkpoint")
    if args.quantized:
        if args.moe_tp is not None or args.moe_ep is not None:
            raise ExportError("--moe-tp / --moe-ep are not available with --quantized (ModelOpt's TensorRT-LLM export "
                              "writes moe_ep_size 1); export with --load for an expert-parallel checkpoint")
        if args.pp != 1:
            raise ExportError(f"--pp {args.pp} is not available with --quantized (ModelOpt's export is used with "
                              "--pp 1 only); export with --load for a pipeline-parallel checkpoint")
        if args.no_parallel_embedding:
            raise ExportError("--no-parallel-embedding is not available with --quantized (ModelOpt splits the "
                              "embeddings)")
        _, fixes = export_quantized(args.quantized, args.out, tp=args.tp, dtype=args.dtype,
                                    quant_cfg=args.quant_cfg, overwrite=args.overwrite)
        for fx in fixes:
            print(f"[jmegatron.export trtllm] config.json fix: {fx}")
    elif args.scales:

        if args.moe_tp is not None or args.moe_ep is not None:
            raise ExportError("--moe-tp / --moe-ep are not available with --scales from-checkpoint (dense models only)")
        config = export_fp8_checkpoint(args.load, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                       iteration=args.iteration, use_parallel_embedding=not args.no_parallel_embedding,
                                       weight_scales=args.weight_scales, overwrite=args.overwrite)
        f = config["producer"]["fp8"]
        rule = "1 / kernel_scale" if f["weight_scales"] == "checkpoint" else "amax(weight) / 448"
        print(f"[jmegatron.export trtllm] FP8 (quant_algo FP8, e4m3) with the checkpoint's own scales (fp8_meta, "
              f"no calibration): activation_scaling_factor = amax(input_amax_history, fp8_amax_compute_algo="
              f"{f['fp8_amax_compute_algo']!r}, H={f['fp8_amax_history_len']}) * 2**{f['fp8_margin']} / 448 "
              f"(from {', '.join(f['activation_scales_from'])}); weights_scaling_factor = {rule}; "
              f"{f['saturated_weight_values']} weight values saturated at +-448")
    else:

        export_checkpoint(args.load, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, iteration=args.iteration,
                          use_parallel_embedding=not args.no_parallel_embedding, overwrite=args.overwrite,
                          moe_tp=args.moe_tp, moe_ep=args.moe_ep)
        if saved_fp8_meta_paths(args.load, args.iteration):
            print("[jmegatron.export trtllm] note: this checkpoint was trained in FP8 (fp8_meta in its parameters); "
                  f"written unquantized in {args.dtype}. `--scales from-checkpoint` writes the FP8 checkpoint with "
                  "the training's own scales")
    report = check_trtllm_checkpoint(args.out)
    print(report.format())
    if not report.ok:
        print(f"error: the written checkpoint fails its own check ({len(report.errors)} errors)", file=sys.stderr)
        return 1
    print(_wrote_line(os.path.abspath(args.out), report), flush=True)
    if args.build_engine:
        build_engine(os.path.abspath(args.out), os.path.abspath(args.engine_dir or os.path.join(args.out, "engine")))
    return 0


def register_check(sub) -> None:
    """Add ``check-trtllm DIR`` to an argparse subparsers object."""
    p = sub.add_parser("check-trtllm", help="validate a TensorRT-LLM checkpoint (config.json + rank*.safetensors)")
    p.add_argument("checkpoint_dir", metavar="DIR")
    p.add_argument("--no-values", action="store_true",
                   help="check names, shapes and dtypes only (do not read the tensors)")
    p.set_defaults(func=run_check)


def run_check(args) -> int:
    """Print the report of ``args.checkpoint_dir``; 0 when valid, 1 otherwise."""
    report = check_trtllm_checkpoint(args.checkpoint_dir, check_values=not args.no_values)
    print(report.format())
    return 0 if report.ok else 1
