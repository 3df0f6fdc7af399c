"""Validating a TensorRT-LLM checkpoint (the ``check-trtllm DIR`` command of
:mod:`jmegatron.export.trtllm`, and every ``trtllm`` export).

The format checked is TensorRT-LLM's "checkpoint" (the input of ``trtllm-build``, TRT-LLM
<= 1.2, ``docs/source/architecture/checkpoint.md``): ``config.json`` (``PretrainedConfig``
fields, ``tensorrt_llm/models/modeling_utils.py``) plus one ``rank{r}.safetensors`` per rank
of ``mapping.world_size``. :func:`check_trtllm_checkpoint` reads only the safetensors
headers for names, dtypes and shapes (the byte ranges are checked against the file size),
then optionally the float tensors for value checks. What is checked:

* config: the mandatory fields and the types of the optional ones, known values
  (``dtype``, ``hidden_act`` among ``tensorrt_llm.functional.ACT2FN``,
  ``position_embedding_type``, ``quant_algo`` / ``kv_cache_quant_algo``), ``mapping``
  (``world_size == tp_size * pp_size``), and the splits TP needs (heads and
  ``intermediate_size`` divisible by ``tp_size``; KV heads divisible by ``tp_size`` or
  ``tp_size`` a multiple of them, as ``tensorrt_llm/models/llama/convert.py`` duplicates).
* architecture: ``GPTForCausalLM`` (also ``GPT2LMHeadModel``, the same model class in
  ``tensorrt_llm.models.MODEL_MAP``), ``LlamaForCausalLM`` and ``MixtralForCausalLM``
  (``MODEL_MAP`` maps it to the Llama model; an MoE checkpoint needs ``moe.num_experts >
  1``, and a Llama with ``moe.num_experts > 1`` is checked with the same MoE layout).
* MoE (``moe`` block, ``tensorrt_llm/layers/moe.py`` ``MoeConfig``; ``tensorrt_llm/mapping.py``
  ``Mapping``): ``num_experts`` and ``top_k`` ints with ``1 <= top_k <= num_experts``,
  ``normalization_mode`` one of ``ExpertScaleNormalizationMode`` (0 NONE, 1 RENORMALIZE, 2
  SPARSE_MIXER, 3/4 DEVICE_LIMITED(_RENORM)), no field outside the MoeConfig dataclass
  (``MoeConfig.from_dict`` is ``cls(**config)``); ``mapping.moe_tp_size x moe_ep_size ==
  tp_size`` (absent: resolved as ``Mapping`` does), ``num_experts`` divisible by
  ``moe_ep_size`` and ``intermediate_size`` by ``moe_tp_size``. Per rank (tp rank ``t``:
  expert-parallel rank ``t % ep``, MoE tp rank ``t // ep``; ``g`` = 2 for a gated
  ``hidden_act`` such as swiglu, else 1)::

      transformer.layers.{i}.mlp.router.weight  [E, h]  float32, the same on every tp rank
      transformer.layers.{i}.mlp.fc.weight      [E/ep, g * f/moe_tp, h]
      transformer.layers.{i}.mlp.proj.weight    [E/ep, h, f/moe_tp]
      (mlp_bias: mlp.fc.bias [E/ep, g * f/moe_tp], mlp.proj.bias [E/ep, h])

  No ``mlp.gate``: the experts' gate rows are fused into ``mlp.fc`` (``MOEWeightWrapper``).
  Quantized MoE layouts are not validated (reported as an error).
* per rank (``rank = pp_rank * tp_size + tp_rank``): the exact tensor names (nothing missing,
  nothing unexpected), shapes and dtypes, following ``tensorrt_llm/models/gpt/convert.py``
  and ``llama/convert.py`` (``h`` hidden, ``nq`` heads, ``nkv`` KV heads, ``d`` head_size,
  ``f`` intermediate_size, ``V`` vocab_size, ``t`` tp_size; weights are ``[out, in]``)::

      transformer.vocab_embedding.weight        [V, h]; with use_parallel_embedding:
                                                [ceil(V/t), h] (embedding_sharding_dim 0)
                                                or [V, h/t] (dim 1)
      transformer.position_embedding.weight     GPT learned_absolute only; same rule with
                                                max_position_embeddings rows
      transformer.layers.{i}.input_layernorm.weight (+ .bias for GPT's LayerNorm)   [h]
      transformer.layers.{i}.attention.qkv.weight    [(nq/t + 2 * max(nkv/t, 1)) * d, h]
                                                rows q | k | v of this rank's heads
      transformer.layers.{i}.attention.dense.weight  [h, nq/t * d]
      transformer.layers.{i}.post_layernorm.weight (+ .bias)                         [h]
      transformer.layers.{i}.mlp.fc.weight      [f/t, h]   (the activation's input)
      transformer.layers.{i}.mlp.gate.weight    [f/t, h]   (gated MLPs: Llama, GPT swiglu)
      transformer.layers.{i}.mlp.proj.weight    [h, f/t]
      biases (GPT ``bias``; Llama ``attn_bias`` / ``mlp_bias``): qkv/fc/gate split like
      their rows, dense/proj ``[h]`` replicated on every rank
      transformer.ln_f.weight (+ .bias)         [h]
      lm_head.weight                            [ceil(V/t), h]  (vocab padded to a multiple
                                                of t, as pad_vocab_size); may be absent only
                                                with share_embedding_table when the
                                                embedding has the same per-rank shape

  Pipeline parallel (``pp_size`` > 1, ``tensorrt_llm/mapping.py`` ``Mapping``): rank
  ``r`` is pipeline stage ``r // tp_size`` and tensor parallel rank ``r % tp_size``; the
  layers are split by :func:`jmegatron.conversion.trtllm.pp_layers` (``Mapping.pp_layers``: contiguous blocks, the
  first ``L % pp_size`` stages one layer more, ``pp_size <= L``); a stage's file numbers
  its layers locally, ``transformer.layers.0 .. n_s - 1`` (the converters'
  ``l - layers_range[0]``, loaded into ``DecoderLayerList``), so every layer is held by
  exactly one stage. The embeddings live on the first stage only, ``ln_f`` and
  ``lm_head`` on the last only (``is_first_pp_rank`` / ``is_last_pp_rank``).
* dtypes: every tensor in ``dtype``, except the quantized linears' tensors below.
* quantization (the tensor names of ``checkpoint.md``, as ModelOpt's
  ``export_tensorrt_llm_checkpoint`` writes them; scaling factors any float dtype,
  ``prequant_scaling_factor`` in ``dtype`` or float32), per quantized linear
  ``P`` = ``attention.qkv``, ``attention.dense``, ``mlp.fc``, ``mlp.gate``, ``mlp.proj``
  (modules matched by ``quantization.exclude_modules`` stay in ``dtype``; ``lm_head`` may be
  quantized or not)::

      FP8                  P.weight float8_e4m3fn (or int8 bytes) [out, in];
                           P.weights_scaling_factor [1]; P.activation_scaling_factor [1]
      W8A8_SQ_PER_CHANNEL  P.weight int8 [out, in]; P.weights_scaling_factor [out]
                           (per channel); P.activation_scaling_factor [1];
                           P.prequant_scaling_factor [in] (SmoothQuant smoothing; absent
                           when none was applied, e.g. ModelOpt's plain int8 config)
      W4A16_AWQ            P.weight int8 [out/2, in] (two int4 per byte);
                           P.weights_scaling_factor [out, in/group_size] (per group);
                           P.prequant_scaling_factor [in] (AWQ pre-quant scale)
      W4A8_AWQ             as W4A16_AWQ + P.activation_scaling_factor [1] +
                           P.weights_scaling_factor_2 [1]
      W8A16                P.weight int8 [out, in] + P.weights_scaling_factor [out] (ModelOpt),
                           or int8 [in, out] + P.per_channel_scale [out] (TRT-LLM's
                           converter), or P.weight in ``dtype`` (quantized by trtllm-build)
      kv_cache_quant_algo FP8 / INT8: transformer.layers.{i}.attention.kv_cache_scaling_factor
                           [1] and/or k_cache_scaling_factor [1] + v_cache_scaling_factor [1]
                           (ModelOpt writes all three; TRT-LLM's preprocess_weights merges
                           k and v into kv);
                           kv_cache_rcp_scaling_factor [1] optional

  Other ``quant_algo`` values (W4A16, W4A16_GPTQ, NVFP4, ...) are reported as not validated.
  TRT-LLM's own SmoothQuant converter names (``per_channel_scale``, ``act_scale``,
  ``smoother``) are not accepted for W8A8_SQ_PER_CHANNEL.
* values (``check_values``): float tensors are finite; tensors every TP rank holds in full
  (norms, row-parallel biases, replicated embeddings) are identical on all ranks; with
  ``nkv < tp`` the K and V rows of ranks that share a duplicated KV head are identical.

Errors name the file and the tensor or config field; the CLI prints a report and exits 1
when any check fails.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import struct
from typing import Any, Optional

from jmegatron.conversion.trtllm import pp_layers

__all__ = ["TensorInfo", "RankFile", "CheckReport", "read_safetensors_header", "check_trtllm_checkpoint",
           "ARCHITECTURES", "VALIDATED_QUANT_ALGOS"]

# safetensors dtype codes -> torch-style names, and their item sizes in bytes
_SAFETENSORS_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}
_FLOATS = ("float32", "float16", "bfloat16")

# tensorrt_llm.models.MODEL_MAP entries for the two model classes checked here
ARCHITECTURES = {"GPTForCausalLM": "gpt", "GPT2LMHeadModel": "gpt", "LlamaForCausalLM": "llama",
                 "MixtralForCausalLM": "llama"}
# tensorrt_llm/layers/moe.py MoeConfig: ExpertScaleNormalizationMode values, and the dataclass's
# fields across releases (from_dict is cls(**config): any other key fails to load)
_MOE_NORMALIZATION_MODES = {0: "NONE", 1: "RENORMALIZE", 2: "SPARSE_MIXER", 3: "DEVICE_LIMITED",
                            4: "DEVICE_LIMITED_RENORM"}
_MOE_FIELDS = ("num_experts", "top_k", "normalization_mode", "sparse_mixer_epsilon", "tp_mode",
               "shared_expert_intermediate_size", "device_limited_n_group", "device_limited_topk_group",
               "device_limited_routed_scaling_factor")
# tensorrt_llm.functional.ACT2FN and its gated subset (GATED_ACT_2_ACT)
_ACT2FN = ("relu", "tanh", "gelu", "gelu_new", "gelu_fast", "geglu", "silu", "softplus", "squared-relu",
           "swiglu", "fast-swiglu")
_GATED_ACTS = ("swiglu", "fast-swiglu", "geglu")
# tensorrt_llm.functional.PositionEmbeddingType
_POSITION_TYPES = ("learned_absolute", "rope_gptj", "rope_gpt_neox", "long_rope", "alibi", "alibi_with_scale",
                   "relative", "chatglm", "yarn", "mrope", "deferred")
# checkpoint.md's supported lists, and what this checker validates tensor by tensor
_DOC_QUANT_ALGOS = ("W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W4A16_GPTQ", "FP8", "W8A8_SQ_PER_CHANNEL")
VALIDATED_QUANT_ALGOS = ("FP8", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "W4A8_AWQ", "W8A16")
_KV_CACHE_ALGOS = ("FP8", "INT8")
_LAYER_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One safetensors entry: dtype name (``"float16"``, ``"int8"``, ...), shape, bytes."""

    dtype: str
    shape: tuple
    nbytes: int


@dataclasses.dataclass
class RankFile:
    """Summary of one ``rank{r}.safetensors``: tensor count, data bytes, count per dtype."""

    rank: int
    path: str
    tensors: dict = dataclasses.field(default_factory=dict)  # name -> TensorInfo
    ok: bool = True

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def dtype_counts(self) -> dict:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
        return dict(sorted(counts.items()))


@dataclasses.dataclass
class CheckReport:
    """Result of :func:`check_trtllm_checkpoint`.

    Attributes:
        checkpoint_dir: the directory checked.
        config: the parsed ``config.json`` (None when unreadable).
        errors: one line per failed check, naming the file and the tensor or config field.
        ranks: one :class:`RankFile` per rank file found.
        notes: facts worth printing that are not errors (e.g. defaults assumed).
        checks: names of the check groups that ran.
    """

    checkpoint_dir: str
    config: Optional[dict] = None
    errors: list = dataclasses.field(default_factory=list)
    ranks: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    checks: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def format(self) -> str:
        """A readable multi-line report (config summary, per-rank files, OK/FAIL lines)."""
        lines = [f"TensorRT-LLM checkpoint {self.checkpoint_dir}"]
        c = self.config
        if isinstance(c, dict):
            lines.append("config.json: " + _config_summary(c))
        for rf in self.ranks:
            counts = ", ".join(f"{k} x{v}" for k, v in rf.dtype_counts().items())
            lines.append(f"  {os.path.basename(rf.path):<20} {rf.num_tensors:4d} tensors "
                         f"{rf.nbytes:>14,d} bytes  ({counts})  {'OK' if rf.ok else 'FAIL'}")
        for n in self.notes:
            lines.append(f"note: {n}")
        if self.checks:
            lines.append("checked: " + ", ".join(self.checks))
        for e in self.errors:
            lines.append(f"FAIL {e}")
        lines.append("OK: valid TensorRT-LLM checkpoint" if self.ok else
                     f"INVALID: {len(self.errors)} check(s) failed")
        return "\n".join(lines)


def _config_summary(c: dict) -> str:
    g = c.get
    m = g("mapping") if isinstance(g("mapping"), dict) else {}
    q = g("quantization") if isinstance(g("quantization"), dict) else {}
    quant = q.get("quant_algo") or "none"
    if q.get("kv_cache_quant_algo"):
        quant += f", kv cache {q['kv_cache_quant_algo']}"
    emb = (f"parallel (dim {g('embedding_sharding_dim', 0)})" if g("use_parallel_embedding") else "replicated")
    return (f"{g('architecture')} {g('dtype')}, {g('num_hidden_layers')} layers, hidden {g('hidden_size')}, "
            f"heads {g('num_attention_heads')} (kv {g('num_key_value_heads', g('num_attention_heads'))}, "
            f"head_size {g('head_size')}), intermediate {g('intermediate_size')}, vocab {g('vocab_size')}, "
            f"{g('position_embedding_type')}, {g('hidden_act')}"
            + (f", moe {g('moe').get('num_experts')} experts top-{g('moe').get('top_k')}"
               if isinstance(g("moe"), dict) and (g("moe").get("num_experts") or 0) > 1 else "") + "\n"
            f"  mapping: world_size {m.get('world_size')} = tp {m.get('tp_size', 1)} x pp {m.get('pp_size', 1)}"
            + (f" (moe_tp {m.get('moe_tp_size')} x moe_ep {m.get('moe_ep_size')})" if "moe_ep_size" in m else "")
            + "; "
            f"quantization: {quant}; embedding: {emb}; share_embedding_table: {bool(g('share_embedding_table'))}")


# ----------------------------------------------------------------------------- safetensors
def read_safetensors_header(path: str) -> dict:
    """``{name: TensorInfo}`` of a ``.safetensors`` file, from its header only.

    Format (safetensors spec): 8-byte little-endian header length N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
    then the data. Raises ValueError when the header is truncated or not JSON, a dtype is
    unknown, or a byte range disagrees with the shape or lies outside the file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data_len = size - 8 - n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from e
        if code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {code!r}")
        dtype, itemsize = _SAFETENSORS_DTYPES[code]
        nbytes = math.prod(shape) * itemsize
        if end - begin != nbytes or not 0 <= begin <= end <= data_len:
            raise ValueError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not hold "
                             f"{dtype}{list(shape)} ({nbytes} bytes) within the {data_len} data bytes")
        out[name] = TensorInfo(dtype, shape, nbytes)
    return out


# ----------------------------------------------------------------------------- config
def _is_int(v) -> bool:
    return type(v) is int


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_REQUIRED_FIELDS = {"architecture": str, "dtype": str, "vocab_size": int, "hidden_size": int,
                    "num_hidden_layers": int, "num_attention_heads": int, "hidden_act": str}
_OPTIONAL_FIELDS = {"logits_dtype": str, "max_position_embeddings": int, "num_key_value_heads": int,
                    "intermediate_size": int, "norm_epsilon": float, "position_embedding_type": str,
                    "head_size": int, "use_parallel_embedding": bool, "embedding_sharding_dim": int,
                    "share_embedding_table": bool, "mapping": dict, "quantization": dict, "bias": bool,
                    "attn_bias": bool, "mlp_bias": bool, "rotary_base": float, "rotary_pct": float}


def _type_ok(v, t) -> bool:
    if t is int:
        return _is_int(v)
    if t is float:
        return _is_num(v)
    if t is bool:
        return isinstance(v, bool)
    return isinstance(v, t)


@dataclasses.dataclass
class _Model:
    """The config fields the tensor layout depends on, validated."""

    family: str
    dtype: str
    layers: int
    h: int
    nq: int
    nkv: int
    d: int
    ffn: int
    vocab: int
    max_pos: Optional[int]
    learned_pos: bool
    gated: bool
    attn_bias: bool
    mlp_bias: bool
    norm_bias: bool
    tp: int
    pp: int
    parallel_emb: bool
    emb_dim: int
    share_emb: bool
    quant_algo: Optional[str]
    kv_algo: Optional[str]
    group_size: int
    exclude: list
    experts: int = 0  # MoE: moe.num_experts (0: dense MLPs)
    top_k: int = 0
    moe_tp: int = 1
    moe_ep: int = 1


def _check_field_types(c: dict, errors: list) -> bool:
    """config.json's mandatory fields are present and every field has its type."""
    ok = True
    for k, t in _REQUIRED_FIELDS.items():
        if k not in c:
            errors.append(f"config.json: missing mandatory field {k!r}")
            ok = False
        elif not _type_ok(c[k], t):
            errors.append(f"config.json: field {k!r} = {c[k]!r} is not {t.__name__}")
            ok = False
    for k, t in _OPTIONAL_FIELDS.items():
        if c.get(k) is not None and not _type_ok(c[k], t):
            errors.append(f"config.json: field {k!r} = {c[k]!r} is not {t.__name__}")
            ok = False
    return ok


def _check_architecture(c: dict, errors: list) -> tuple[Optional[str], int, int, bool]:
    """The sizes, architecture, dtypes, activation, positions and MoE block of a typed
    config.json: (family, experts, top_k, whether an error makes the layout unknowable)."""
    bad = False
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "head_size", "max_position_embeddings"):
        if c.get(k) is not None and c[k] <= 0:
            errors.append(f"config.json: field {k!r} = {c[k]} must be positive")
            bad = True
    arch = c["architecture"]
    family = ARCHITECTURES.get(arch)
    if family is None:
        errors.append(f"config.json: architecture {arch!r} is not checked here (supported: "
                      f"{', '.join(ARCHITECTURES)})")
        bad = True
    if c["dtype"] not in _FLOATS:
        errors.append(f"config.json: dtype {c['dtype']!r} is not one of {_FLOATS}")
        bad = True
    if c.get("logits_dtype") is not None and c["logits_dtype"] not in _FLOATS:
        errors.append(f"config.json: logits_dtype {c['logits_dtype']!r} is not one of {_FLOATS}")
    act = c["hidden_act"]
    if act not in _ACT2FN:
        errors.append(f"config.json: hidden_act {act!r} is not a TensorRT-LLM activation ({', '.join(_ACT2FN)})")
        bad = True
    pos = c.get("position_embedding_type", "learned_absolute")
    if pos not in _POSITION_TYPES:
        errors.append(f"config.json: position_embedding_type {pos!r} is not one of {_POSITION_TYPES}")
        bad = True
    if family == "llama" and not str(pos).startswith("rope"):
        errors.append(f"config.json: position_embedding_type {pos!r}: LlamaForCausalLM has no position "
                      "embedding table, it needs a rope type (rope_gpt_neox for rotate-half RoPE)")
    moe = c.get("moe")
    experts, top_k = 0, 0
    if moe is not None:
        experts, top_k = _check_moe(moe, c, family, errors)
        if experts < 0:
            bad = True
            experts = 0
    if arch == "MixtralForCausalLM" and experts <= 1 and not bad:
        errors.append("config.json: architecture 'MixtralForCausalLM' needs a moe block with num_experts > 1 "
                      "(MoeConfig.has_moe)")
        bad = True
    if family == "llama" and act in _GATED_ACTS and not experts:
        errors.append(f"config.json: hidden_act {act!r}: LlamaForCausalLM's GatedMLP takes the plain "
                      "activation (silu); gated names are for MoE")
    if family == "gpt" and pos == "learned_absolute" and c.get("max_position_embeddings") is None:
        errors.append("config.json: max_position_embeddings is required with learned_absolute positions "
                      "(rows of transformer.position_embedding.weight)")
        bad = True
    if experts and family != "llama":
        errors.append(f"config.json: moe.num_experts = {experts} with architecture {arch!r}: mixture-of-experts "
                      "layouts are checked for MixtralForCausalLM / LlamaForCausalLM only")
        bad = True
    return family, experts, top_k, bad


def _check_quantization(q: dict, errors: list, notes: list) -> Optional[tuple]:
    """config.json's quantization block: (quant_algo, kv_cache_quant_algo, group_size,
    exclude_modules), or None after an error."""
    bad = False
    qa, kva = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if qa is not None and qa not in VALIDATED_QUANT_ALGOS:
        why = ("listed in checkpoint.md but its tensors are not validated by this checker"
               if qa in _DOC_QUANT_ALGOS else "not a quant_algo of TensorRT-LLM's checkpoint.md")
        errors.append(f"config.json: quantization.quant_algo {qa!r}: {why} (validated: "
                      f"{', '.join(VALIDATED_QUANT_ALGOS)})")
        bad = True
    if kva is not None and kva not in _KV_CACHE_ALGOS:
        errors.append(f"config.json: quantization.kv_cache_quant_algo {kva!r} is not one of {_KV_CACHE_ALGOS}")
        bad = True
    group = q.get("group_size")
    if qa in ("W4A16_AWQ", "W4A8_AWQ"):
        if group is None:
            group = 128
            notes.append("quantization.group_size absent: QuantConfig's default 128 assumed")
        elif not _is_int(group) or group <= 0:
            errors.append(f"config.json: quantization.group_size = {group!r} must be a positive int")
            bad = True
    exclude = q.get("exclude_modules") or []
    if not isinstance(exclude, list) or not all(isinstance(s, str) for s in exclude):
        errors.append(f"config.json: quantization.exclude_modules = {exclude!r} must be a list of names/patterns")
        bad = True
    return None if bad else (qa, kva, group, exclude)


def _check_layout(m: _Model, errors: list, notes: list) -> bool:
    """The sizes of ``m`` split over its tensor, expert and pipeline ranks as TensorRT-LLM
    needs (heads, FFN, experts, embedding, layers)."""
    ok = True
    tp, pp, nq, nkv, L = m.tp, m.pp, m.nq, m.nkv, m.layers
    if m.emb_dim not in (0, 1):
        errors.append(f"config.json: embedding_sharding_dim = {m.emb_dim} must be 0 (vocab) or 1 (hidden)")
        ok = False
    if nq % nkv:
        errors.append(f"config.json: num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}")
        ok = False
    if nq % tp:
        errors.append(f"config.json: num_attention_heads {nq} is not divisible by mapping.tp_size {tp}")
        ok = False
    if nkv % tp and tp % nkv:
        errors.append(f"config.json: num_key_value_heads {nkv} and mapping.tp_size {tp}: one must divide the "
                      "other (KV heads are split, or duplicated when fewer than tp)")
        ok = False
    if m.experts:
        if m.experts % m.moe_ep:
            errors.append(f"config.json: moe.num_experts {m.experts} is not divisible by mapping.moe_ep_size "
                          f"{m.moe_ep} (MixtureOfExperts: each expert-parallel rank holds num_experts / "
                          "moe_ep_size experts)")
            ok = False
        if m.ffn % m.moe_tp:
            errors.append(f"config.json: intermediate_size {m.ffn} (the experts' FFN) is not divisible by "
                          f"mapping.moe_tp_size {m.moe_tp}")
            ok = False
        if m.quant_algo is not None:
            errors.append(f"config.json: quantization.quant_algo {m.quant_algo!r} with moe.num_experts = "
                          f"{m.experts}: quantized MoE layouts (MOEWeightWrapper's scaling factors) are not "
                          "validated by this checker")
            ok = False
    elif m.ffn % tp:
        errors.append(f"config.json: intermediate_size {m.ffn} is not divisible by mapping.tp_size {tp}")
        ok = False
    if m.parallel_emb and m.emb_dim == 1 and m.h % tp:
        errors.append(f"config.json: hidden_size {m.h} is not divisible by tp_size {tp} (embedding_sharding_dim 1)")
        ok = False
    if pp > L:
        errors.append(f"config.json: mapping.pp_size {pp} > num_hidden_layers {L}: TensorRT-LLM's "
                      "Mapping.pp_layers needs at least one layer per pipeline stage")
        ok = False
    elif pp > 1 and L % pp:
        notes.append(f"uneven pipeline split: {L} layers over pp_size {pp} (Mapping.pp_layers gives the first "
                     f"{L % pp} stage(s) one layer more; TensorRT-LLM releases whose pp_layers floor-divides "
                     "would drop layers)")
    if m.share_emb and tp > 1 and not (m.parallel_emb and m.emb_dim == 0):
        errors.append("config.json: share_embedding_table with tp_size > 1 needs use_parallel_embedding=true "
                      "and embedding_sharding_dim=0 (TensorRT-LLM's GPT model refuses otherwise)")
        ok = False
    return ok


def _check_config(c: Any, errors: list, notes: list) -> Optional[_Model]:
    """Validate config.json's fields; returns the layout model, or None when an error
    makes the tensor checks meaningless."""
    if not isinstance(c, dict):
        errors.append("config.json: not a JSON object")
        return None
    if not _check_field_types(c, errors):
        return None
    family, experts, top_k, bad = _check_architecture(c, errors)
    m = c.get("mapping") or {}
    tp, pp = m.get("tp_size", 1), m.get("pp_size", 1)
    ws = m.get("world_size", 1)
    for k, v in (("world_size", ws), ("tp_size", tp), ("pp_size", pp)):
        if not _is_int(v) or v < 1:
            errors.append(f"config.json: mapping.{k} = {v!r} must be a positive int")
            bad = True
    if bad:
        return None
    if m.get("cp_size", 1) != 1:
        errors.append(f"config.json: mapping.cp_size = {m.get('cp_size')} (context parallel) is not checked here")
        return None
    if ws != tp * pp:
        errors.append(f"config.json: mapping.world_size = {ws} != tp_size {tp} x pp_size {pp}")
        return None
    moe_tp, moe_ep = _moe_mapping(m, tp, errors)
    if moe_tp is None:
        return None
    quant = _check_quantization(c.get("quantization") or {}, errors, notes)
    if quant is None:
        return None
    qa, kva, group, exclude = quant

    h, nq, L = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    nkv = c.get("num_key_value_heads") or nq
    d = c.get("head_size") or h // nq
    if c.get("head_size") is None:
        notes.append(f"head_size absent: hidden_size // num_attention_heads = {d} assumed")
    act = c["hidden_act"]
    pos = c.get("position_embedding_type", "learned_absolute")
    if family == "gpt":
        gated = act in _GATED_ACTS
        attn_bias = mlp_bias = bool(c.get("bias", True))
        norm_bias = True
    else:
        gated = act in _GATED_ACTS if experts else True  # MoE: fc holds 2F rows for a gated activation only
        attn_bias, mlp_bias = bool(c.get("attn_bias", False)), bool(c.get("mlp_bias", False))
        norm_bias = False
    model = _Model(family=family, dtype=c["dtype"], layers=L, h=h, nq=nq, nkv=nkv, d=d,
                   ffn=c.get("intermediate_size") or 4 * h, vocab=c["vocab_size"],
                   max_pos=c.get("max_position_embeddings"),
                   learned_pos=(family == "gpt" and pos == "learned_absolute"), gated=gated,
                   attn_bias=attn_bias, mlp_bias=mlp_bias, norm_bias=norm_bias, tp=tp, pp=pp,
                   parallel_emb=bool(c.get("use_parallel_embedding", False)),
                   emb_dim=c.get("embedding_sharding_dim", 0), share_emb=bool(c.get("share_embedding_table", False)),
                   quant_algo=qa, kv_algo=kva, group_size=group or 128, exclude=list(exclude), experts=experts,
                   top_k=top_k, moe_tp=moe_tp, moe_ep=moe_ep)
    return model if _check_layout(model, errors, notes) else None


def _check_moe(moe: Any, c: dict, family: Optional[str], errors: list) -> tuple[int, int]:
    """(num_experts, top_k) of a ``moe`` block; num_experts -1 when the block is unusable."""
    if not isinstance(moe, dict):
        errors.append(f"config.json: moe = {moe!r} must be an object (MoeConfig fields)")
        return -1, 0
    unknown = sorted(set(moe) - set(_MOE_FIELDS))
    if unknown:
        errors.append(f"config.json: moe has unknown field(s) {unknown}: MoeConfig.from_dict passes every key to "
                      f"the dataclass (fields: {', '.join(_MOE_FIELDS)})")
    n, k = moe.get("num_experts", 0), moe.get("top_k", 0)
    if not _is_int(n) or not _is_int(k) or n < 0 or k < 0:
        errors.append(f"config.json: moe.num_experts = {n!r} and moe.top_k = {k!r} must be ints >= 0")
        return -1, 0
    if (n == 0) != (k == 0):
        errors.append(f"config.json: moe.num_experts = {n}, moe.top_k = {k}: both or neither must be 0 "
                      "(MoeConfig.validate)")
        return -1, 0
    if k > n:
        errors.append(f"config.json: moe.top_k = {k} > moe.num_experts = {n}")
        return -1, 0
    mode = moe.get("normalization_mode", 1)
    if not _is_int(mode) or mode not in _MOE_NORMALIZATION_MODES:
        errors.append(f"config.json: moe.normalization_mode = {mode!r} is not an ExpertScaleNormalizationMode "
                      f"({', '.join(f'{v} {k_}' for v, k_ in _MOE_NORMALIZATION_MODES.items())})")
    if n == 1:
        return 0, 0  # MoeConfig.has_moe() is num_experts > 1: a plain MLP layout
    return n, k


def _moe_mapping(m: dict, tp: int, errors: list) -> tuple[Optional[int], Optional[int]]:
    """(moe_tp_size, moe_ep_size) resolved as TensorRT-LLM's ``Mapping`` does (absent or -1:
    derived from ``tp_size``); (None, None) with an error when they do not multiply to tp."""
    mtp, mep = m.get("moe_tp_size", -1), m.get("moe_ep_size", -1)
    for k, v in (("moe_tp_size", mtp), ("moe_ep_size", mep)):
        if not _is_int(v) or (v < 1 and v != -1):
            errors.append(f"config.json: mapping.{k} = {v!r} must be a positive int (or -1 / absent)")
            return None, None
    if mtp == -1 and mep == -1:
        return tp, 1
    if mtp == -1:
        mtp = tp // mep
    elif mep == -1:
        mep = tp // mtp
    if mtp * mep != tp:
        errors.append(f"config.json: mapping.moe_tp_size {mtp} x moe_ep_size {mep} != tp_size {tp} (TensorRT-LLM's "
                      "Mapping: the MoE ranks are the tensor parallel ranks)")
        return None, None
    return mtp, mep


# ----------------------------------------------------------------------------- expected layout
@dataclasses.dataclass(frozen=True)
class _Spec:
    shape: tuple
    dtypes: tuple
    replicated: bool = False  # every TP rank holds the full tensor (value check)
    optional: bool = False  # may be absent


def _kv_heads_per_rank(m: _Model) -> int:
    return max(m.nkv // m.tp, 1)


def _linear_shapes(m: _Model) -> dict:
    """Per-rank ``(out, in, bias_replicated)`` of each layer linear."""
    t = m.tp
    qkv_out = (m.nq // t + 2 * _kv_heads_per_rank(m)) * m.d
    shapes = {"attention.qkv": (qkv_out, m.h, False), "attention.dense": (m.h, m.nq // t * m.d, True)}
    if m.experts:
        return shapes  # the MoE MLP: _moe_specs
    shapes.update({"mlp.fc": (m.ffn // t, m.h, False), "mlp.proj": (m.h, m.ffn // t, True)})
    if m.gated:
        shapes["mlp.gate"] = (m.ffn // t, m.h, False)
    return shapes


def _excluded(m: _Model, module: str) -> bool:
    return any(fnmatch.fnmatchcase(module, pat) for pat in m.exclude)


def _linear_specs(m: _Model, module: str, out: int, inp: int, bias: bool, bias_replicated: bool,
                  present: dict, errors: list, where: str, lm_head: bool = False) -> dict:
    """Expected tensors of one linear layer ``module`` (weight ``[out, in]``)."""
    dt = (m.dtype,)
    specs: dict[str, _Spec] = {}
    if bias:
        specs[f"{module}.bias"] = _Spec((out,), dt, replicated=bias_replicated)
    w = present.get(f"{module}.weight")
    algo = m.quant_algo
    if algo is None or _excluded(m, module) or (lm_head and (w is None or w.dtype == m.dtype)):
        specs[f"{module}.weight"] = _Spec((out, inp), dt)
        return specs
    scale = _FLOATS
    pre = (m.dtype, "float32")
    one = (1,)
    if algo == "FP8":
        specs[f"{module}.weight"] = _Spec((out, inp), ("float8_e4m3fn", "int8"))
        specs[f"{module}.weights_scaling_factor"] = _Spec(one, scale)
        specs[f"{module}.activation_scaling_factor"] = _Spec(one, scale)
    elif algo == "W8A8_SQ_PER_CHANNEL":
        specs[f"{module}.weight"] = _Spec((out, inp), ("int8",))
        specs[f"{module}.weights_scaling_factor"] = _Spec((out,), scale)
        specs[f"{module}.activation_scaling_factor"] = _Spec(one, scale)
        # the smoothing factors: present after SmoothQuant (ModelOpt int8_sq), absent after
        # plain per-channel int8 (ModelOpt's int8 config exports the same quant_algo)
        specs[f"{module}.prequant_scaling_factor"] = _Spec((inp,), pre, optional=True)
    elif algo in ("W4A16_AWQ", "W4A8_AWQ"):
        g = m.group_size
        if out % 2 or inp % g:
            errors.append(f"{where}: {module}: [out, in] = [{out}, {inp}] cannot hold int4 pairs per byte with "
                          f"group_size {g} (out must be even, in divisible by group_size)")
        specs[f"{module}.weight"] = _Spec((out // 2, inp), ("int8",))
        specs[f"{module}.weights_scaling_factor"] = _Spec((out, inp // g), scale)
        specs[f"{module}.prequant_scaling_factor"] = _Spec((inp,), pre)
        if algo == "W4A8_AWQ":
            specs[f"{module}.activation_scaling_factor"] = _Spec(one, scale)
            specs[f"{module}.weights_scaling_factor_2"] = _Spec(one, scale)
    elif algo == "W8A16":
        if w is not None and w.dtype == m.dtype:
            specs[f"{module}.weight"] = _Spec((out, inp), dt)
        elif f"{module}.per_channel_scale" in present:
            specs[f"{module}.weight"] = _Spec((inp, out), ("int8",))
            specs[f"{module}.per_channel_scale"] = _Spec((out,), scale)
        else:
            specs[f"{module}.weight"] = _Spec((out, inp), ("int8",))
            specs[f"{module}.weights_scaling_factor"] = _Spec((out,), scale)
    return specs


def _moe_specs(m: _Model, p: str) -> dict:
    """Expected MoE tensors of layer prefix ``p`` on any tp rank (``MOEWeightWrapper`` shapes)."""
    local, f = m.experts // m.moe_ep, m.ffn // m.moe_tp
    fc_rows = (2 if m.gated else 1) * f
    dt = (m.dtype,)
    specs = {f"{p}.mlp.router.weight": _Spec((m.experts, m.h), ("float32",), replicated=True),
             f"{p}.mlp.fc.weight": _Spec((local, fc_rows, m.h), dt),
             f"{p}.mlp.proj.weight": _Spec((local, m.h, f), dt)}
    if m.mlp_bias:
        specs[f"{p}.mlp.fc.bias"] = _Spec((local, fc_rows), dt)
        specs[f"{p}.mlp.proj.bias"] = _Spec((local, m.h), dt)
    return specs


def _emb_shape(m: _Model, rows: int) -> tuple:
    if not m.parallel_emb or m.tp == 1:
        return (rows, m.h)
    return (-(-rows // m.tp), m.h) if m.emb_dim == 0 else (rows, m.h // m.tp)


def _expected(m: _Model, rank: int, present: dict, errors: list, where: str) -> tuple[dict, dict]:
    """(required, optional) ``{name: _Spec}`` of one rank."""
    pp_rank = rank // m.tp
    per_stage = len(pp_layers(m.layers, m.pp, pp_rank))
    dt = (m.dtype,)
    req: dict[str, _Spec] = {}
    opt: dict[str, _Spec] = {}
    emb_replicated = not m.parallel_emb or m.tp == 1
    if pp_rank == 0:
        req["transformer.vocab_embedding.weight"] = _Spec(_emb_shape(m, m.vocab), dt, replicated=emb_replicated)
        if m.learned_pos:
            req["transformer.position_embedding.weight"] = _Spec(_emb_shape(m, m.max_pos), dt,
                                                                 replicated=emb_replicated)
    norms = ("weight", "bias") if m.norm_bias else ("weight",)
    for i in range(per_stage):
        p = f"transformer.layers.{i}"
        for n in ("input_layernorm", "post_layernorm"):
            for s in norms:
                req[f"{p}.{n}.{s}"] = _Spec((m.h,), dt, replicated=True)
        for mod, (out, inp, bias_rep) in _linear_shapes(m).items():
            bias = m.attn_bias if mod.startswith("attention") else m.mlp_bias
            req.update(_linear_specs(m, f"{p}.{mod}", out, inp, bias, bias_rep, present, errors, where))
        if m.experts:
            req.update(_moe_specs(m, p))
        if m.kv_algo is not None:
            # one KV scale, or K and V scales apart (ModelOpt; TRT-LLM's preprocess_weights
            # merges them into kv_cache_scaling_factor = max(k, v))
            a = f"{p}.attention"
            kv, split = f"{a}.kv_cache_scaling_factor", (f"{a}.k_cache_scaling_factor", f"{a}.v_cache_scaling_factor")
            has_split = any(n in present for n in split)
            for n in (split if has_split else ()) + ((kv,) if kv in present or not has_split else ()):
                req[n] = _Spec((1,), _FLOATS)
            opt[f"{a}.kv_cache_rcp_scaling_factor"] = _Spec((1,), _FLOATS)
    if pp_rank == m.pp - 1:
        for s in norms:
            req[f"transformer.ln_f.{s}"] = _Spec((m.h,), dt, replicated=True)
        lm_rows = -(-m.vocab // m.tp)
        lm = _linear_specs(m, "lm_head", lm_rows, m.h, False, False, present, errors, where, lm_head=True)
        if m.share_emb:
            emb = req.get("transformer.vocab_embedding.weight")
            if emb is not None and emb.shape != (lm_rows, m.h) and "lm_head.weight" not in present:
                errors.append(f"{where}: share_embedding_table without lm_head.weight needs the vocab embedding "
                              f"shaped like lm_head {(lm_rows, m.h)}, not {emb.shape}")
            opt.update(lm)  # lm_head may be omitted: it then shares vocab_embedding.weight
        else:
            req.update(lm)
    return req, opt


# ----------------------------------------------------------------------------- values
def _kv_groups(m: _Model) -> list[list[int]]:
    """TP ranks that hold the same duplicated KV head (nkv < tp)."""
    if m.nkv >= m.tp:
        return []
    dup = m.tp // m.nkv
    return [list(range(g * dup, (g + 1) * dup)) for g in range(m.nkv)]


def _check_values(m: _Model, report: CheckReport, specs: dict, files: dict) -> None:
    """Finite float tensors; replicated tensors equal on every TP rank of a stage; duplicated
    KV rows equal. ``specs``: rank -> required specs; ``files``: rank -> path."""
    import torch
    from safetensors import safe_open

    handles = {r: safe_open(p, framework="pt") for r, p in files.items()}
    errors = report.errors

    def get(r, name):
        return handles[r].get_tensor(name)

    for r, rank_specs in specs.items():
        where = f"rank{r}.safetensors"
        keys = set(handles[r].keys())
        for name in sorted(keys):
            t = get(r, name)
            if t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                if not bool(torch.isfinite(t).all()):
                    errors.append(f"{where}: {name} has non-finite values (NaN/Inf)")
    for stage in range(m.pp):
        ranks = [stage * m.tp + t for t in range(m.tp)]
        if len(ranks) < 2 or not all(r in specs for r in ranks):
            continue
        first = ranks[0]
        for name, spec in specs[first].items():
            if not spec.replicated or any(name not in handles[r].keys() for r in ranks):
                continue
            ref = get(first, name)
            for r in ranks[1:]:
                other = get(r, name)
                if other.shape == ref.shape and not torch.equal(other, ref):
                    errors.append(f"rank{r}.safetensors: {name} differs from rank{first}'s; every TP rank "
                                  "holds this tensor in full")
        # duplicated KV heads: K and V rows of the qkv weight/bias are equal within a group
        qrows = m.nq // m.tp * m.d
        for i in range(len(pp_layers(m.layers, m.pp, stage))):
            for suffix in ("weight", "bias"):
                name = f"transformer.layers.{i}.attention.qkv.{suffix}"
                for group in _kv_groups(m):
                    grp = [stage * m.tp + g for g in group]
                    if not all(name in handles[r].keys() for r in grp):
                        continue
                    ts = [get(r, name) for r in grp]
                    if not all(t.is_floating_point() and t.shape[0] == qrows + 2 * m.d for t in ts):
                        continue
                    ref = ts[0][qrows:]
                    for r, t in zip(grp[1:], ts[1:]):
                        if not torch.equal(t[qrows:], ref):
                            errors.append(f"rank{r}.safetensors: {name}: K/V rows differ from rank{grp[0]}'s, "
                                          f"but both hold duplicated KV head {group[0] * m.nkv // m.tp}")
    report.checks.append("values (finite, replicated tensors equal across TP ranks"
                         + (", duplicated KV heads equal" if _kv_groups(m) else "") + ")")


# ----------------------------------------------------------------------------- pipeline mapping
_LAYER_NAME = re.compile(r"^transformer\.layers\.(\d+)\.")


def _stage_summary(m: _Model, stage: int) -> str:
    layers = pp_layers(m.layers, m.pp, stage)
    ranks = f"rank{stage * m.tp}" + (f"-{stage * m.tp + m.tp - 1}" if m.tp > 1 else "")
    held = [f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"]
    if stage == 0:
        held.insert(0, "embeddings")
    if stage == m.pp - 1:
        held.append("ln_f, lm_head")
    return f"stage {stage} ({ranks}): " + ", ".join(held)


def _check_pipeline(m: _Model, headers: dict, errors: list) -> None:
    """Every decoder layer held exactly once along each pipeline (the ranks with one tp
    rank), under the stage's local indices. ``headers``: rank -> {name: TensorInfo}."""
    for t in range(m.tp):
        owners: dict[int, list[int]] = {g: [] for g in range(m.layers)}
        for stage in range(m.pp):
            r = stage * m.tp + t
            if r not in headers:
                continue
            layers = pp_layers(m.layers, m.pp, stage)
            local = sorted({int(mt[1]) for name in headers[r] if (mt := _LAYER_NAME.match(name))})
            beyond = [i for i in local if i >= len(layers)]
            if beyond:
                hint = (" (they look like global indices)" if all(i in layers for i in beyond) else "")
                errors.append(f"rank{r}.safetensors: transformer.layers.{{{','.join(map(str, beyond))}}} beyond the "
                              f"{len(layers)} layer(s) of pipeline stage {stage} (global layers {layers[0]}-"
                              f"{layers[-1]}): TensorRT-LLM numbers a stage's layers locally from 0{hint}")
            for i in local:
                if layers[0] + i < m.layers:
                    owners[layers[0] + i].append(stage)
        if len(headers) < m.tp * m.pp:
            continue  # a missing rank file is reported already
        for g, stages in owners.items():
            if not stages:
                errors.append(f"layer {g} (tp rank {t}) is held by no pipeline stage (Mapping.pp_layers puts it on "
                              f"stage {next(s for s in range(m.pp) if g in pp_layers(m.layers, m.pp, s))})")
            elif len(stages) > 1:
                errors.append(f"layer {g} (tp rank {t}) is held by pipeline stages {stages}; each layer belongs to "
                              "exactly one")


# ----------------------------------------------------------------------------- entry point
_RANK_FILE = re.compile(r"^rank(\d+)\.safetensors$")


def check_trtllm_checkpoint(checkpoint_dir: str, check_values: bool = True) -> CheckReport:
    """Validate a TensorRT-LLM checkpoint directory (see the module docstring for the rules).

    Args:
        checkpoint_dir: folder with ``config.json`` and ``rank{r}.safetensors``.
        check_values: also read the tensors (finite values, replicated tensors equal across
            TP ranks, duplicated KV heads equal); False checks names, shapes, dtypes only.

    Returns:
        :class:`CheckReport`; ``report.ok`` is False when any check failed, and
        ``report.errors`` names the file and the tensor or config field of each failure.
        Never raises for a bad checkpoint (a missing directory is an error in the report).
    """
    report = CheckReport(checkpoint_dir=checkpoint_dir)
    errors = report.errors
    if not os.path.isdir(checkpoint_dir):
        errors.append(f"{checkpoint_dir}: no such directory")
        return report
    cfg_path = os.path.join(checkpoint_dir, "config.json")
    try:
        with open(cfg_path) as f:
            report.config = json.load(f)
    except FileNotFoundError:
        errors.append("config.json: missing")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        errors.append(f"config.json: not valid JSON ({e})")

    # rank files: read every header (the listing is useful even when the config is bad)
    files: dict[int, str] = {}
    for fn in sorted(os.listdir(checkpoint_dir)):
        mt = _RANK_FILE.match(fn)
        if mt:
            files[int(mt[1])] = os.path.join(checkpoint_dir, fn)
    headers: dict[int, dict] = {}
    for r in sorted(files):
        rf = RankFile(rank=r, path=files[r])
        try:
            rf.tensors = read_safetensors_header(files[r])
            headers[r] = rf.tensors
        except (ValueError, OSError) as e:
            errors.append(f"rank{r}.safetensors: unreadable: {e}")
            rf.ok = False
        report.ranks.append(rf)
    report.checks.append("safetensors headers")
    if report.config is None:
        return report

    model = _check_config(report.config, errors, report.notes)
    report.checks.append("config fields")
    if model is None:
        return report
    world = model.tp * model.pp
    for r in range(world):
        if r not in files:
            errors.append(f"rank{r}.safetensors: missing (mapping.world_size = {world})")
    for r in files:
        if r >= world:
            errors.append(f"rank{r}.safetensors: unexpected file (mapping.world_size = {world})")

    all_specs: dict[int, dict] = {}
    for rf in report.ranks:
        r = rf.rank
        if r >= world or r not in headers:
            continue
        where = f"rank{r}.safetensors"
        n_before = len(errors)
        present = headers[r]
        req, opt = _expected(model, r, present, errors, where)
        opt.update({k: v for k, v in req.items() if v.optional})
        req = {k: v for k, v in req.items() if not v.optional}
        all_specs[r] = {**opt, **req}
        for name in sorted(set(req) - set(present)):
            errors.append(f"{where}: missing tensor {name}")
        for name in sorted(set(present) - set(req) - set(opt)):
            errors.append(f"{where}: unexpected tensor {name} (not part of {report.config['architecture']} "
                          f"with this config)")
        for name in sorted(set(present) & (set(req) | set(opt))):
            spec, info = all_specs[r][name], present[name]
            if tuple(info.shape) != tuple(spec.shape):
                errors.append(f"{where}: {name} has shape {tuple(info.shape)}, expected {tuple(spec.shape)}")
            if info.dtype not in spec.dtypes:
                errors.append(f"{where}: {name} has dtype {info.dtype}, expected "
                              + (" or ".join(spec.dtypes)))
        rf.ok = len(errors) == n_before
    if model.pp > 1:
        n_before = len(errors)
        _check_pipeline(model, {r: h for r, h in headers.items() if r < world}, errors)
        for rf in report.ranks:
            if any(e.startswith(f"rank{rf.rank}.safetensors") for e in errors[n_before:]):
                rf.ok = False
        report.checks.append("pipeline mapping (each layer on exactly one stage: "
                             + "; ".join(_stage_summary(model, s) for s in range(model.pp)) + ")")
    report.checks.append(f"tensor names, shapes, dtypes per rank (tp {model.tp}, pp {model.pp}"
                         + (f", {model.experts} experts over moe_tp {model.moe_tp} x moe_ep {model.moe_ep}"
                            if model.experts else "")
                         + (f", {model.quant_algo}" if model.quant_algo else "")
                         + (f", kv cache {model.kv_algo}" if model.kv_algo else "") + ")")
    if check_values and all_specs:
        n_before = len(errors)
        usable = {r: files[r] for r in all_specs}
        try:
            _check_values(model, report, all_specs, usable)
        except Exception as e:  # a file the header parser accepted but safetensors cannot read
            errors.append(f"value checks could not read the tensors: {type(e).__name__}: {e}")
        if len(errors) > n_before:
            for rf in report.ranks:
                if any(e.startswith(f"rank{rf.rank}.safetensors") for e in errors[n_before:]):
                    rf.ok = False
    return report
