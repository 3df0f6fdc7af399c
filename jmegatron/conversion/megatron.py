"""The Megatron-LM mapping of jmegatron parameters and configs, both ways (numpy).

The global (tensor-parallel-independent) state dict, megatron-core's local-spec names
(``megatron/core/models/gpt/gpt_layer_specs.py``, ``get_gpt_layer_local_spec``; ``W`` is a
torch ``[out, in]`` weight, ``K`` the jmegatron kernel, names as in :mod:`jmegatron.conversion.hf`)::

    embedding.word_embeddings.weight                 [Vp, h]      = K
    embedding.position_embeddings.weight             [max_pos, h] (learned_absolute)
    decoder.layers.{i}.input_layernorm.{weight,bias} [h]
    decoder.layers.{i}.self_attention.linear_qkv.weight   [ng (r + 2) d, h]
          row (g (r + 2) + j) d + c = K[:, g, j, c]: per query group its r = nq / ng query
          heads, then K_g, then V_g (megatron/core/transformer/attention.py); bias likewise
    decoder.layers.{i}.self_attention.linear_proj.weight  [h, nq d]    (+ bias [h])
    decoder.layers.{i}.self_attention.{q,k}_layernorm.weight [d]   (qk_layernorm)
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}    [h]
    decoder.layers.{i}.mlp.linear_fc1.weight         [2F, h] gate rows then up rows (swiglu),
                                                     or [F, h]   (+ bias [2F] / [F])
    decoder.layers.{i}.mlp.linear_fc2.weight         [h, F]      (+ bias [h])
    MoE layers: mlp.router.weight [E, h] (+ mlp.router.expert_bias [E]),
                mlp.experts.local_experts.{e}.linear_fc{1,2}.weight (as the dense MLP),
                mlp.shared_experts.linear_fc{1,2}.weight, mlp.shared_experts.gate_weight [1, h]
    decoder.final_layernorm.{weight,bias}            [h]
    output_layer.weight                              [Vp, h]     (untied only)
    mtp.layers.{k}.{enorm,hnorm,final_layernorm}.weight [h]      (mtp_num_layers; last stage)
    mtp.layers.{k}.eh_proj.weight                    [h, 2h]     (column-parallel)
    mtp.layers.{k}.transformer_layer.*               a decoder layer's names

Tensor parallelism (megatron/core/tensor_parallel/layers.py): column-parallel weights
(``linear_qkv``, ``linear_fc1``, the embedding and ``output_layer``) split their rows,
row-parallel weights (``linear_proj``, ``linear_fc2``) their columns; biases of row-parallel
layers, norms and routers are whole on every rank; a SwiGLU ``linear_fc1`` holds on rank t
its gate block t and its up block t (megatron/core/transformer/mlp.py,
``apply_swiglu_sharded_factory``), not a contiguous slice. Expert parallelism gives the rank
of expert group s the experts ``s E / ep ... (s + 1) E / ep - 1`` as ``local_experts.{j}``;
pipeline stages hold their layers under local indices (uniform stages; virtual stages as
``model{v}``, Megatron's ``get_transformer_layer_offset``).

The Transformer Engine spec's names also import: ``self_attention.linear_qkv.layer_norm_*``
(the input norm fused into ``linear_qkv``), ``mlp.linear_fc1.layer_norm_*`` (the pre-MLP
norm), ``_extra_state`` entries are ignored. Refused, by name: multi-latent attention,
``rotary_percent`` below 1, interleaved RoPE, ``apply_layernorm_1p``,
``squared_relu``, ``expert_tensor_parallel_size`` other than the tensor size, uneven pipeline
stages, heterogeneous or hybrid layers.

The files (``torch`` / ``torch_dist`` reading and writing, megatron-core on the CPU) and
the commands are :mod:`jmegatron.export.megatron`.

Sources followed: Megatron-LM ``megatron/training/checkpointing.py`` (tracker, directory and
file names, what a checkpoint holds), ``megatron/training/arguments.py`` (argument names),
megatron-core ``models/gpt``, ``transformer/attention.py``, ``transformer/mlp.py``,
``transformer/moe/experts.py`` and ``dist_checkpointing`` (tests/test_megatron_checkpoint.py
builds megatron-core models on the CPU and checks logits both ways).
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

import numpy as np

from jmegatron.conversion import hf_moe
from jmegatron.conversion.tree import check_shape, map_leaves, plain, stack_layers, to_numpy, unstack_layers

TRACKER = "latest_checkpointed_iteration.txt"
FORMATS = ("torch", "torch_dist")
CHECKPOINT_VERSION = 3.0  # megatron/training/checkpointing.py: the QKV layout of every current release

# the Transformer Engine spec's names -> the local spec's (the input and pre-MLP norms fused
# into linear_qkv / linear_fc1, megatron/core/models/gpt/gpt_layer_specs.py)
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
# the MoE fields that define the model, under the same name in Megatron's args, megatron-core's
# TransformerConfig and jmegatron's config
MOE_MODEL_FIELDS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
                     "moe_shared_expert_gate", "moe_router_score_function", "moe_router_pre_softmax",
                     "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_num_groups",
                     "moe_router_group_topk")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER_KEY = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.+)$")  # an MTP depth's transformer layer
_EXPERT_KEY = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TEGroupedMLP's per-expert weights


# ----------------------------------------------------------------------------- config
def refuse_blocks(cfg) -> None:
    """Raise ValueError naming every block of ``cfg`` a Megatron-LM GPT checkpoint cannot
    hold (multi-latent attention, Gemma's norms, soft-caps and windows, GeGLU, a shared
    expert without SwiGLU), and the partial or interleaved RoPE that
    :func:`config_fields_from_megatron_args` does not read back."""
    problems = []
    for name in ("multi_latent_attention", "sandwich_norms", "scale_embeddings", "apply_layernorm_1p"):
        if getattr(cfg, name):
            problems.append(f"config.{name}=True")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "window_size", "rotary_base_local",
                 "softmax_scale"):
        if getattr(cfg, name) is not None:
            problems.append(f"config.{name}={getattr(cfg, name)!r}")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):  # Granite's: no Megatron args
        if getattr(cfg, name) != 1.0:
            problems.append(f"config.{name}={getattr(cfg, name)!r}")
    if cfg.gated_linear_unit and not cfg.swiglu:
        problems.append("config.gated_linear_unit=True (GeGLU)")
    if cfg.qk_layernorm_across_heads:
        problems.append("config.qk_layernorm_across_heads=True (OLMo's QK-norm over all heads)")
    if not cfg.pre_norms:
        problems.append("config.pre_norms=False (OLMo's post-norms only)")
    if cfg.rotary_percent != 1.0:
        problems.append(f"config.rotary_percent={cfg.rotary_percent} (partial RoPE: jmegatron's Megatron import "
                        f"refuses it)")
    if cfg.rotary_interleaved:
        problems.append("config.rotary_interleaved=True (jmegatron's Megatron import refuses it)")
    if cfg.quick_geglu:  # (gpt-oss's blocks: not mapped to Megatron-LM's names)
        problems.append("config.quick_geglu=True")
    if cfg.softmax_type != "vanilla":
        problems.append(f"config.softmax_type={cfg.softmax_type!r}")
    if cfg.num_moe_experts is not None and cfg.add_bias_linear:
        problems.append("config.add_bias_linear=True with num_moe_experts (router and expert biases)")
    if cfg.num_moe_experts is not None and cfg.moe_shared_expert_intermediate_size and not cfg.swiglu:
        problems.append("a shared expert without swiglu")
    if problems:
        raise ValueError(f"a Megatron-LM GPT checkpoint cannot hold {', '.join(problems)}: these "
                         f"blocks (Gemma, DeepSeek-V3, gpt-oss, OLMo, SmolLM3, Granite, Phi-3) export to Hugging Face "
                         f"(`python -m jmegatron.export hf`)")


# Megatron arguments read as jmegatron fields of the same name
_SAME_NAME = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
              "max_position_embeddings", "seq_length", "position_embedding_type", "rotary_base",
              "rotary_seq_len_interpolation_factor", "rope_scaling_factor", "normalization", "norm_epsilon", "swiglu",
              "openai_gelu", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
              "make_vocab_size_divisible_by", "init_method_std")
_MOE_SAME_NAME = MOE_MODEL_FIELDS + ("moe_layer_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff")


def config_fields_from_megatron_args(args: Any) -> dict[str, Any]:
    """jmegatron config fields (architecture and tokenizer) from a checkpoint's ``args``.

    ``args``: the ``argparse.Namespace`` (or a mapping) Megatron-LM saved. Returns a dict
    of :class:`jmegatron.config.JMegatronConfig` fields, ``vocab_size`` included when the
    args know it (``None`` otherwise), and ``tokenizer_type`` with its files
    (``tokenizer_model`` or ``vocab_file`` / ``merge_file``, absolute) when the args name a
    HuggingFaceTokenizer or GPT2BPETokenizer whose files exist on this machine. Raises ValueError naming every argument jmegatron
    cannot represent (multi-latent attention, partial or
    interleaved RoPE, ``apply_layernorm_1p``, ``squared_relu``, an expert tensor size other
    than the tensor size, uneven or hybrid layer layouts).
    """
    get = (args.get if isinstance(args, Mapping) else lambda k, d=None: getattr(args, k, d))
    refused = {"multi_latent_attention": (True,), "squared_relu": (True,), "rotary_interleaved": (True,),
               "apply_layernorm_1p": (True,), "hybrid_override_pattern": None, "heterogeneous_layers_config_path": None,
               "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
               "account_for_embedding_in_pipeline_split": (True,), "account_for_loss_in_pipeline_split": (True,)}
    problems = []
    for name, bad in refused.items():
        v = get(name)
        if (bad is None and v is not None) or (bad is not None and v in bad):
            problems.append(f"{name}={v!r}")
    if get("rotary_percent", 1.0) not in (None, 1.0):
        problems.append(f"rotary_percent={get('rotary_percent')} (partial RoPE)")
    if get("num_experts") and get("expert_tensor_parallel_size") not in (None, get("tensor_model_parallel_size", 1)):
        problems.append(f"expert_tensor_parallel_size={get('expert_tensor_parallel_size')} (only the tensor size "
                        f"{get('tensor_model_parallel_size', 1)} is read)")
    if get("num_layers") is None or get("hidden_size") is None:
        problems.append("no num_layers / hidden_size (is this a GPT checkpoint?)")
    if problems:
        raise ValueError(f"the checkpoint's args hold what jmegatron cannot represent: {', '.join(problems)}")
    fields = {k: get(k) for k in _SAME_NAME if get(k) is not None}
    fields["num_query_groups"] = get("num_query_groups") if get("group_query_attention") else get("num_attention_heads")
    fields["rope_scaling"] = bool(get("use_rope_scaling", False))
    if fields.get("position_embedding_type") not in ("learned_absolute", "rope"):
        raise ValueError(f"position_embedding_type={fields.get('position_embedding_type')!r} is not read "
                         f"(learned_absolute or rope)")
    if not fields["add_bias_linear"] and get("add_qkv_bias"):
        fields["add_qkv_bias"] = True
    elif fields["add_bias_linear"]:
        fields["add_qkv_bias"] = False  # jmegatron: the QKV bias comes with add_bias_linear
    if get("num_experts"):
        fields["num_moe_experts"] = get("num_experts")
        fields.update({k: get(k) for k in _MOE_SAME_NAME if get(k) is not None})
        if isinstance(fields.get("moe_layer_freq"), list):
            fields["moe_layer_freq"] = tuple(fields["moe_layer_freq"])
    if get("no_rope_freq"):  # megatron-core's NoPE layers: an int N or one 0/1 per layer
        freq = get("no_rope_freq")
        fields["no_rope_freq"] = tuple(freq) if isinstance(freq, (list, tuple)) else freq
    if get("mtp_num_layers"):
        fields.update(mtp_num_layers=get("mtp_num_layers"), mtp_loss_scaling_factor=get("mtp_loss_scaling_factor", 0.1))
    fields["vocab_size"] = get("vocab_size")
    kind = get("tokenizer_type")
    if kind == "NullTokenizer" and get("vocab_size") is not None:  # no file: the size is the tokenizer
        fields["tokenizer_type"] = kind
    files = {"HuggingFaceTokenizer": ("tokenizer_model",), "GPT2BPETokenizer": ("vocab_file", "merge_file")}.get(kind)
    if files and all(get(n) and os.path.exists(get(n)) for n in files):  # the tokenizer, when its files are here
        fields.update({"tokenizer_type": kind, **{n: os.path.abspath(get(n)) for n in files}})
    return fields


# ----------------------------------------------------------------------------- the global mapping
def _fc1_to(k: np.ndarray, glu: bool) -> np.ndarray:
    """jmegatron fc1 kernel ``[(E,) h, (2,) F]`` -> Megatron ``[(E,) (2) F, h]`` (gate rows first)."""
    if glu:
        k = np.swapaxes(k, -3, -2)  # [..., 2, h, F]
        return np.swapaxes(k, -1, -2).reshape(k.shape[:-3] + (2 * k.shape[-1], k.shape[-2]))
    return np.swapaxes(k, -1, -2)


def _fc1_from(w: np.ndarray, glu: bool) -> np.ndarray:
    if glu:
        f, h = w.shape[-2] // 2, w.shape[-1]
        return np.ascontiguousarray(np.moveaxis(w.reshape(w.shape[:-2] + (2, f, h)), -1, -3))  # [h, 2, F]
    return np.ascontiguousarray(np.swapaxes(w, -1, -2))


def _layer_to_megatron(layer: Mapping, cfg, moe: bool) -> dict[str, np.ndarray]:
    """One decoder layer's jmegatron subtree -> ``{local name: tensor}`` (local spec)."""
    h, nq, d = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels
    out: dict[str, np.ndarray] = {}
    for norm in ("input_layernorm", "pre_mlp_layernorm"):
        out[f"{norm}.weight"] = layer[norm]["scale"]
        if "bias" in layer[norm]:
            out[f"{norm}.bias"] = layer[norm]["bias"]
    attn = layer["self_attention"]
    qkv = attn["linear_qkv"]
    out["self_attention.linear_qkv.weight"] = np.transpose(qkv["kernel"], (1, 2, 3, 0)).reshape(-1, h)
    if "bias" in qkv:
        out["self_attention.linear_qkv.bias"] = qkv["bias"].reshape(-1)
    out["self_attention.linear_proj.weight"] = attn["linear_proj"]["kernel"].reshape(nq * d, h).T
    if "bias" in attn["linear_proj"]:
        out["self_attention.linear_proj.bias"] = attn["linear_proj"]["bias"]
    for n in "qk":
        if f"{n}_layernorm" in attn:
            out[f"self_attention.{n}_layernorm.weight"] = attn[f"{n}_layernorm"]["scale"]
    mlp = layer["mlp"]

    def dense(prefix: str, m: Mapping, glu: bool) -> None:
        out[f"{prefix}.linear_fc1.weight"] = _fc1_to(m["linear_fc1"]["kernel"], glu)
        if "bias" in m["linear_fc1"]:
            out[f"{prefix}.linear_fc1.bias"] = m["linear_fc1"]["bias"].reshape(-1)
        out[f"{prefix}.linear_fc2.weight"] = np.swapaxes(m["linear_fc2"]["kernel"], -1, -2)
        if "bias" in m["linear_fc2"]:
            out[f"{prefix}.linear_fc2.bias"] = m["linear_fc2"]["bias"]

    if not moe:
        dense("mlp", mlp, cfg.swiglu)
        return {k: np.ascontiguousarray(v) for k, v in out.items()}
    out["mlp.router.weight"] = mlp["router"]["kernel"].T
    if "expert_bias" in mlp["router"]:
        out["mlp.router.expert_bias"] = mlp["router"]["expert_bias"]
    fc1 = _fc1_to(mlp["experts"]["linear_fc1"]["kernel"], cfg.swiglu)
    fc2 = np.swapaxes(mlp["experts"]["linear_fc2"]["kernel"], -1, -2)
    for e in range(cfg.num_moe_experts):
        out[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
        out[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
    if "shared_experts" in mlp:
        dense("mlp.shared_experts", mlp["shared_experts"], cfg.swiglu)
    if "shared_expert_gate" in mlp:
        out["mlp.shared_experts.gate_weight"] = mlp["shared_expert_gate"]["gate"]["kernel"].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def to_megatron_state_dict(params: Mapping, cfg, padded_vocab_size: Optional[int] = None,
                           vocab_size: Optional[int] = None) -> dict[str, np.ndarray]:
    """jmegatron params (per-layer or scanned) -> megatron-core's global ``GPTModel``
    state dict (local-spec names, per-layer keys, no ``_extra_state``), numpy arrays in
    the params' dtype.

    ``padded_vocab_size`` (default: the params' rows) re-pads the embedding and output
    layer for the target layout (Megatron pads to ``make_vocab_size_divisible_by * tp``):
    rows past ``vocab_size`` (default: all) are dropped, then zero rows appended. A tied
    output layer is not stored (megatron-core ties it to the embedding). Raises ValueError
    for a block Megatron's GPT model does not have (:func:`megatron_args`) or params that
    do not match ``cfg``.
    """
    refuse_blocks(cfg)
    p = plain(params)
    if "decoder_layers" in p:
        p = unstack_layers(p, cfg.num_layers)
    emb = p["word_embeddings"]["embedding"]
    v = vocab_size or emb.shape[0]
    rows = padded_vocab_size or emb.shape[0]
    if rows < v:
        raise ValueError(f"padded_vocab_size={rows} is smaller than the vocabulary {v}")

    def repad(a: np.ndarray) -> np.ndarray:
        a = a[:v]
        return a if rows == v else np.concatenate([a, np.zeros((rows - v,) + a.shape[1:], a.dtype)])

    sd = {"embedding.word_embeddings.weight": repad(emb)}
    if "position_embeddings" in p:
        sd["embedding.position_embeddings.weight"] = p["position_embeddings"]["embedding"]
    moe_layers = hf_moe.moe_layers(cfg)
    for i in range(cfg.num_layers):
        for k, t in _layer_to_megatron(p[f"decoder_layers_{i}"], cfg, bool(moe_layers[i])).items():
            sd[f"decoder.layers.{i}.{k}"] = t
    sd["decoder.final_layernorm.weight"] = p["final_layernorm"]["scale"]
    if "bias" in p["final_layernorm"]:
        sd["decoder.final_layernorm.bias"] = p["final_layernorm"]["bias"]
    for k in range(cfg.mtp_num_layers or 0):  # megatron-core's MultiTokenPredictionLayer
        m, o = p[f"mtp_layers_{k}"], f"mtp.layers.{k}"
        for norm in ("enorm", "hnorm", "final_layernorm"):
            sd[f"{o}.{norm}.weight"] = m[norm]["scale"]
            if "bias" in m[norm]:
                sd[f"{o}.{norm}.bias"] = m[norm]["bias"]
        sd[f"{o}.eh_proj.weight"] = np.ascontiguousarray(m["eh_proj"]["kernel"].T)
        for key, t in _layer_to_megatron(m["transformer_layer"], cfg, bool(moe_layers[-1])).items():
            sd[f"{o}.transformer_layer.{key}"] = t
    if cfg.untie_embeddings_and_output_weights:
        sd["output_layer.weight"] = repad(np.ascontiguousarray(p["output_layer"]["kernel"].T))
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def canonical_key(key: str) -> Optional[str]:
    """A state-dict key in the local spec's naming; None for entries that are not weights."""
    if key.endswith("_extra_state") or "._extra_state" in key:
        return None
    m = _LAYER_KEY.match(key)
    prefix = f"decoder.layers.{m[1]}" if m else None
    if not m:
        m = _MTP_LAYER_KEY.match(key)
        if not m:
            return key
        prefix = m[1]
    rest = _TE_NORMS.get(m[2], m[2])
    g = _TE_GROUPED.match(rest)
    if g:
        rest = f"mlp.experts.local_experts.{g[2]}.{g[1]}.weight"
    return f"{prefix}.{rest}"


def from_megatron_state_dict(state_dict: Mapping[str, Any], cfg, padded_vocab_size: Optional[int] = None,
                             vocab_size: Optional[int] = None) -> dict:
    """megatron-core's global ``GPTModel`` state dict -> jmegatron params (float32 numpy).

    The inverse of :func:`to_megatron_state_dict`; also takes the Transformer Engine spec's
    names and ignores ``_extra_state`` entries (see the module docstring). The embedding
    (and untied output layer) keep their first ``vocab_size`` rows (default: all the
    checkpoint's) re-padded with zeros to ``padded_vocab_size`` (default
    ``cfg.padded_vocab_size(vocab_size)``). Returns the per-layer layout, or the stacked
    ``decoder_layers`` layout with ``cfg.scan_layers``. Raises ValueError for a missing,
    misshapen or unused tensor (named).
    """
    refuse_blocks(cfg)
    sd: dict[str, Any] = {}
    for key, value in state_dict.items():
        c = canonical_key(key)
        if c is not None and value is not None:
            sd[c] = value
    read = _StateDictReader(sd, cfg)
    t, norm = read.t, read.norm
    h = cfg.hidden_size
    emb = t("embedding.word_embeddings.weight")
    v = vocab_size or emb.shape[0]
    rows = padded_vocab_size or cfg.padded_vocab_size(v)
    if emb.shape[0] < v or rows < v:
        raise ValueError(f"vocabulary {v} does not fit the checkpoint's {emb.shape[0]} rows / padded {rows}")

    def repad(a: np.ndarray) -> np.ndarray:
        a = a[:v]
        return a if rows == v else np.concatenate([a, np.zeros((rows - v,) + a.shape[1:], a.dtype)])

    p: dict[str, Any] = {"word_embeddings": {"embedding": repad(emb)}}
    if cfg.position_embedding_type == "learned_absolute":
        p["position_embeddings"] = {"embedding": t("embedding.position_embeddings.weight",
                                                    (cfg.max_position_embeddings, h))}
    moe_layers = hf_moe.moe_layers(cfg)
    for i in range(cfg.num_layers):
        p[f"decoder_layers_{i}"] = read.transformer_layer(f"decoder.layers.{i}", bool(moe_layers[i]))
    p["final_layernorm"] = norm("decoder.final_layernorm")
    for k in range(cfg.mtp_num_layers or 0):  # megatron-core's MultiTokenPredictionLayer
        o = f"mtp.layers.{k}"
        p[f"mtp_layers_{k}"] = {
            "enorm": norm(f"{o}.enorm"), "hnorm": norm(f"{o}.hnorm"), "final_layernorm": norm(f"{o}.final_layernorm"),
            "eh_proj": {"kernel": np.ascontiguousarray(t(f"{o}.eh_proj.weight", (h, 2 * h)).T)},
            "transformer_layer": read.transformer_layer(f"{o}.transformer_layer", bool(moe_layers[-1]))}
    if cfg.untie_embeddings_and_output_weights:
        p["output_layer"] = {"kernel": np.ascontiguousarray(repad(t("output_layer.weight", (emb.shape[0], h))).T)}
    else:
        read.used.add("output_layer.weight")  # the last pipeline stage's copy of the tied embedding
    unused = sorted(set(sd) - read.used)
    if unused:
        raise ValueError(f"the Megatron state dict has tensors this config does not use: {unused[:8]}"
                         + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else ""))
    p = map_leaves(np.ascontiguousarray, p)
    return stack_layers(p, cfg.num_layers) if cfg.scan_layers else p


class _StateDictReader:
    """The jmegatron subtrees of a canonical megatron-core state dict ``sd``
    (:func:`canonical_key` names) for ``cfg``, as float32 numpy; ``used``: the keys read."""

    def __init__(self, sd: Mapping[str, Any], cfg):
        self.sd, self.cfg, self.used = sd, cfg, set()

    def t(self, key: str, shape: Optional[tuple] = None) -> np.ndarray:
        """Tensor ``key`` (ValueError when absent or not of ``shape``)."""
        if key not in self.sd:
            raise ValueError(f"the Megatron state dict has no {key!r} (needed by this config)")
        self.used.add(key)
        a = to_numpy(self.sd[key]).astype(np.float32)
        return a if shape is None else check_shape(key, a, shape)

    def opt(self, key: str, shape: tuple) -> Optional[np.ndarray]:
        """Tensor ``key`` when present, else None."""
        return self.t(key, shape) if key in self.sd else None

    def norm(self, key: str) -> dict:
        """The norm ``key`` (``scale``, and ``bias`` for LayerNorm)."""
        h = self.cfg.hidden_size
        n = {"scale": self.t(f"{key}.weight", (h,))}
        if self.cfg.normalization == "LayerNorm":
            n["bias"] = self.t(f"{key}.bias", (h,))
        return n

    def dense(self, prefix: str, f: int) -> dict:
        """The MLP under ``prefix`` with ``f`` hidden units (ValueError for a bias the config has not)."""
        cfg, t, h, glu = self.cfg, self.t, self.cfg.hidden_size, self.cfg.swiglu
        m = {"linear_fc1": {"kernel": _fc1_from(t(f"{prefix}.linear_fc1.weight", ((2 if glu else 1) * f, h)), glu)},
             "linear_fc2": {"kernel": np.ascontiguousarray(t(f"{prefix}.linear_fc2.weight", (h, f)).T)}}
        b1 = self.opt(f"{prefix}.linear_fc1.bias", ((2 if glu else 1) * f,))
        b2 = self.opt(f"{prefix}.linear_fc2.bias", (h,))
        if cfg.add_bias_linear:
            m["linear_fc1"]["bias"] = t(f"{prefix}.linear_fc1.bias").reshape((2, f) if glu else (f,))
            m["linear_fc2"]["bias"] = t(f"{prefix}.linear_fc2.bias", (h,))
        elif b1 is not None or b2 is not None:
            raise ValueError(f"{prefix}.linear_fc1/2 has a bias but add_bias_linear=False")
        return m

    def transformer_layer(self, o: str, moe: bool) -> dict:
        """The decoder layer under ``o`` (an MoE layer's router, experts and shared expert when ``moe``)."""
        cfg, t = self.cfg, self.t
        h, nq, ng, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        r = nq // ng
        qkv = {"kernel": np.ascontiguousarray(
            t(f"{o}.self_attention.linear_qkv.weight", (ng * (r + 2) * d, h)).reshape(ng, r + 2, d, h)
            .transpose(3, 0, 1, 2))}
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            qkv["bias"] = t(f"{o}.self_attention.linear_qkv.bias", (ng * (r + 2) * d,)).reshape(ng, r + 2, d)
        proj = {"kernel": np.ascontiguousarray(t(f"{o}.self_attention.linear_proj.weight", (h, nq * d)).T
                                               .reshape(nq, d, h))}
        if cfg.add_bias_linear:
            proj["bias"] = t(f"{o}.self_attention.linear_proj.bias", (h,))
        attn = {"linear_qkv": qkv, "linear_proj": proj}
        if cfg.qk_layernorm:
            for n in "qk":
                attn[f"{n}_layernorm"] = {"scale": t(f"{o}.self_attention.{n}_layernorm.weight", (d,))}
        layer = {"input_layernorm": self.norm(f"{o}.input_layernorm"), "self_attention": attn,
                 "pre_mlp_layernorm": self.norm(f"{o}.pre_mlp_layernorm")}
        if not moe:
            layer["mlp"] = self.dense(f"{o}.mlp", cfg.ffn_hidden_size)
            return layer
        e, f = cfg.num_moe_experts, cfg.moe_ffn_hidden_size
        experts = [self.dense(f"{o}.mlp.experts.local_experts.{x}", f) for x in range(e)]
        mlp = {"router": {"kernel": np.ascontiguousarray(t(f"{o}.mlp.router.weight", (e, h)).T)},
               "experts": {n: {"kernel": np.stack([x[n]["kernel"] for x in experts])}
                           for n in ("linear_fc1", "linear_fc2")}}
        if cfg.moe_router_enable_expert_bias:
            mlp["router"]["expert_bias"] = t(f"{o}.mlp.router.expert_bias", (e,))
        elif f"{o}.mlp.router.expert_bias" in self.sd:
            self.used.add(f"{o}.mlp.router.expert_bias")  # a buffer megatron-core keeps unused
        if cfg.moe_shared_expert_intermediate_size:
            mlp["shared_experts"] = self.dense(f"{o}.mlp.shared_experts", cfg.moe_shared_expert_intermediate_size)
            if cfg.moe_shared_expert_gate:
                mlp["shared_expert_gate"] = {"gate": {"kernel": np.ascontiguousarray(
                    t(f"{o}.mlp.shared_experts.gate_weight", (1, h)).T)}}
        layer["mlp"] = mlp
        return layer


# ----------------------------------------------------------------------------- tensor / pipeline / expert shards
_COLUMN = re.compile(r"(linear_qkv\.(weight|bias)|word_embeddings\.weight|^output_layer\.weight|eh_proj\.weight)$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")
_FC1 = re.compile(r"linear_fc1\.(weight|bias)$")


def _tp_split(key: str, a: np.ndarray, tp: int, glu: bool) -> list[np.ndarray]:
    if tp == 1:
        return [a]
    if _FC1.search(key):
        if glu:  # rank t: gate block t then up block t
            halves = a.reshape((2, tp, a.shape[0] // (2 * tp)) + a.shape[1:])
            return [np.ascontiguousarray(halves[:, t].reshape((-1,) + a.shape[1:])) for t in range(tp)]
        return [np.ascontiguousarray(x) for x in np.split(a, tp, axis=0)]
    if _COLUMN.search(key):
        return [np.ascontiguousarray(x) for x in np.split(a, tp, axis=0)]
    if _ROW.search(key):
        return [np.ascontiguousarray(x) for x in np.split(a, tp, axis=1)]
    return [a] * tp


def _tp_merge(key: str, shards: list[np.ndarray], glu: bool) -> np.ndarray:
    if len(shards) == 1:
        return shards[0]
    tp = len(shards)
    if _FC1.search(key):
        if glu:
            parts = [s.reshape((2, s.shape[0] // 2) + s.shape[1:]) for s in shards]
            return np.stack(parts, axis=1).reshape((-1,) + shards[0].shape[1:])
        return np.concatenate(shards, axis=0)
    if _COLUMN.search(key):
        return np.concatenate(shards, axis=0)
    if _ROW.search(key):
        return np.concatenate(shards, axis=1)
    for s in shards[1:]:
        if s.shape != shards[0].shape or not np.array_equal(s, shards[0]):
            raise ValueError(f"{key} differs between tensor-parallel ranks (expected a replicated tensor); tp={tp}")
    return shards[0]


def rank_dir(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """megatron/training/checkpointing.py ``get_checkpoint_name``'s rank folder."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    return name + (f"_{ep_rank:03d}" if ep > 1 else "")


def _stage_layers(num_layers: int, pp: int, vp: int, pp_rank: int, v: int) -> range:
    """Global layer indices of virtual chunk ``v`` on pipeline rank ``pp_rank`` (uniform
    stages, megatron/core/transformer/transformer_layer.py ``get_transformer_layer_offset``)."""
    if num_layers % (pp * vp):
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline_model_parallel_size={pp} x "
                         f"virtual stages {vp}: uneven stages are not read")
    per = num_layers // (pp * vp)
    start = v * (num_layers // vp) + pp_rank * per
    return range(start, start + per)


def shard_state_dict(sd: Mapping[str, np.ndarray], cfg, tp: int = 1, pp: int = 1,
                     ep: int = 1) -> dict[str, dict[str, np.ndarray]]:
    """A global state dict -> ``{rank folder: model state dict}`` of layout (tp, pp, ep),
    as each rank's ``GPTModel.state_dict()`` holds it (local layer and expert indices,
    ``_extra_state: None`` beside every linear layer, as megatron-core's local layers save
    it). The last stage of a tied model keeps a copy of the embedding as
    ``output_layer.weight`` only when pp > 1 (megatron-core's shared embedding). Raises
    ValueError for sizes that do not divide the model."""
    glu = cfg.swiglu
    stages = [_stage_layers(cfg.num_layers, pp, 1, s, 0) for s in range(pp)]
    e = cfg.num_moe_experts or 0
    if e and e % ep:
        raise ValueError(f"num_moe_experts={e} is not divisible by expert_model_parallel_size={ep}")
    if ep > 1 and not e:
        raise ValueError("expert_model_parallel_size > 1 needs a mixture-of-experts model")
    out: dict[str, dict[str, np.ndarray]] = {}
    for s in range(pp):
        for x in range(ep):
            local: list[dict] = [dict() for _ in range(tp)]
            for key, a in sd.items():
                m = _LAYER_KEY.match(key)
                if m:
                    i, rest = int(m[1]), m[2]
                    if i not in stages[s]:
                        continue
                    em = _EXPERT_KEY.match(rest)
                    if em:
                        j = int(em[1])
                        if j // (e // ep) != x:
                            continue
                        rest = f"mlp.experts.local_experts.{j % (e // ep)}.{em[2]}"
                    name = f"decoder.layers.{i - stages[s].start}.{rest}"
                elif key.startswith("embedding."):
                    if s != 0:
                        continue
                    name = key
                else:  # final norm, output layer, multi-token prediction
                    if s != pp - 1:
                        continue
                    name = key
                    mm = _MTP_LAYER_KEY.match(key)
                    em = _EXPERT_KEY.match(mm[2]) if mm else None
                    if em:
                        j = int(em[1])
                        if j // (e // ep) != x:
                            continue
                        name = f"{mm[1]}.mlp.experts.local_experts.{j % (e // ep)}.{em[2]}"
                for t, piece in enumerate(_tp_split(name, a, tp, glu)):
                    local[t][name] = piece
            if pp > 1 and s == pp - 1 and not cfg.untie_embeddings_and_output_weights:
                for t, piece in enumerate(_tp_split("output_layer.weight", sd["embedding.word_embeddings.weight"],
                                                    tp, glu)):
                    local[t]["output_layer.weight"] = piece
            for t in range(tp):
                extra = {re.sub(r"\.(weight)$", "._extra_state", k): None for k in local[t]
                         if re.search(r"(linear_\w+|output_layer)\.weight$", k)}
                if s == pp - 1 and "output_layer._extra_state" not in extra:
                    extra["output_layer._extra_state"] = None
                out[rank_dir(t, s, x, pp, ep)] = {**local[t], **extra}
    return out


def merge_shards(shards: Mapping[tuple[int, int, int], Mapping[str, Any]], cfg, tp: int, pp: int, ep: int,
                 vp: int = 1) -> dict[str, np.ndarray]:
    """The inverse of :func:`shard_state_dict`: ``{(tp_rank, pp_rank, ep_rank): {model key
    (virtual chunk v as "model{v}/" prefix when vp > 1): tensor}}`` -> the global state dict
    (numpy). Raises ValueError for a missing rank, a replicated tensor that differs between
    ranks, or keys that do not fit the layout."""
    glu = cfg.swiglu
    e = cfg.num_moe_experts or 0
    groups: dict[str, dict[int, Any]] = {}  # global key -> {tp rank: tensor}
    for s in range(pp):
        for x in range(ep):
            for t in range(tp):
                if (t, s, x) not in shards:
                    raise ValueError(f"rank folder {rank_dir(t, s, x, pp, ep)} is missing "
                                     f"(tensor {tp} x pipeline {pp} x expert {ep} ranks expected)")
                for key, value in shards[(t, s, x)].items():
                    v = 0
                    if vp > 1:
                        chunk, key = key.split("/", 1)
                        v = int(chunk[len("model"):])
                    c = canonical_key(key)
                    if c is None or value is None:
                        continue
                    m = _LAYER_KEY.match(c)
                    if m:
                        i = _stage_layers(cfg.num_layers, pp, vp, s, v)[int(m[1])]
                        rest = m[2]
                        em = _EXPERT_KEY.match(rest)
                        if em:
                            rest = f"mlp.experts.local_experts.{x * (e // ep) + int(em[1])}.{em[2]}"
                        c = f"decoder.layers.{i}.{rest}"
                    elif _MTP_LAYER_KEY.match(c) and _EXPERT_KEY.match(_MTP_LAYER_KEY.match(c)[2]):
                        mm = _MTP_LAYER_KEY.match(c)
                        em = _EXPERT_KEY.match(mm[2])
                        c = f"{mm[1]}.mlp.experts.local_experts.{x * (e // ep) + int(em[1])}.{em[2]}"
                    elif x > 0:
                        continue  # expert ranks repeat the dense tensors
                    elif c == "output_layer.weight" and pp > 1 and s == pp - 1 and \
                            not cfg.untie_embeddings_and_output_weights:
                        continue  # the last stage's copy of the tied embedding
                    groups.setdefault(c, {})[t] = to_numpy(value)
    out = {}
    for key, ranks in groups.items():
        if sorted(ranks) != list(range(tp)):
            raise ValueError(f"{key} is held by tensor ranks {sorted(ranks)}, expected all of 0..{tp - 1}")
        out[key] = _tp_merge(key, [ranks[t] for t in range(tp)], glu)
    return out
