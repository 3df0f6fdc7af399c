"""TensorRT-LLM's checkpoint of jmegatron parameters (numpy): ``config.json`` and the
tensors of each rank, in the format of TRT-LLM <= 1.2 (``docs/source/architecture/checkpoint.md``).
Writing the files and checking the input are :mod:`jmegatron.export.trtllm`.

MoE layer layout (``tensorrt_llm/layers/moe.py`` ``MixtureOfExperts`` / ``MOEWeightWrapper``,
the ``moe_config.has_moe()`` branch of ``tensorrt_llm/models/llama/convert.py``
``convert_hf_llama``, ``tensorrt_llm/mapping.py``): the MoE ranks are the tp ranks of a
stage, ``moe_tp_size * moe_ep_size == tp_size`` (``Mapping`` raises otherwise; with neither
given ``moe_tp_size = tp``, ``moe_ep_size = 1``; with one given the other is ``tp`` divided by
it). Tensor parallel rank ``t`` is expert-parallel rank ``t % moe_ep_size`` and MoE tensor
parallel rank ``t // moe_ep_size`` (``Mapping.moe_ep_rank`` / ``moe_tp_rank``), and holds
experts ``ep_rank * E/ep .. (ep_rank + 1) * E/ep - 1`` (``Mapping.ep_experts``) with the FFN
columns ``moe_tp_rank * F/moe_tp ..`` of each. Per layer ``o = transformer.layers.{i}``::

    o.mlp.router.weight  [E, h]              float32 on every rank (the router is a float32
                                             RowLinear, never split or quantized)
    o.mlp.fc.weight      [E/ep, 2 F/mtp, h]  per expert: the up rows (HF w3, jmegatron fc1
                                             index 1) then the gate rows (w1, index 0):
                                             convert.py's ``concat([w3, w1], dim=-2)``; the
                                             activation applies to the second half
                                             (``MoeOOTB.load_weights``: rows [:F] -> the
                                             GatedMLP's gate, rows [F:] -> its fc)
    o.mlp.proj.weight    [E/ep, h, F/mtp]    HF w2 columns of this MoE tp rank

Note the order is the reverse of the dense ``GatedMLP``'s (there ``mlp.fc`` is the gate).
Attention, norms, embeddings and ``lm_head`` are split over ``tp`` as for Llama, and
``--pp`` works as for dense models.

Tensor parallel layout (``tensorrt_llm/models/gpt/convert.py``, ``llama/convert.py``):
``attention.qkv.weight`` of rank ``r`` is ``[(nq/tp + 2 kv_r) * d, h]``: the rows of query
heads ``r*nq/tp .. (r+1)*nq/tp - 1``, then the K rows, then the V rows of its KV heads
(``kv_r = nkv/tp``; when ``nkv < tp`` each KV head is duplicated on the ``tp/nkv`` ranks whose
query heads use it, ``kv_r = 1``). jmegatron's fused kernel ``[h, nkv, nq/nkv + 2, d]``
(per group: its query heads, K, V) is unpacked into that order. ``attention.dense`` and
``mlp.proj`` are split on their input columns (biases replicated), ``mlp.fc``/``mlp.gate`` on
rows, norms replicated. The vocabulary is the true one (Megatron's padding rows dropped) and,
as TRT-LLM's ``pad_vocab_size``, ``lm_head.weight`` is zero-padded to a multiple of tp and
split on rows (``[ceil(V/tp), h]`` per rank). With ``use_parallel_embedding`` (the default,
ModelOpt's and Megatron's vocab-parallel choice; ``embedding_sharding_dim=0``) the vocab and
position embeddings are zero-padded and split on rows too; ``--no-parallel-embedding``
replicates them. ``lm_head.weight`` is always written (``share_embedding_table=false``), also
for tied models, as TRT-LLM's converters do.

Pipeline parallel layout (``--pp P``; ``tensorrt_llm/mapping.py`` ``Mapping`` and the
converters' ``mapping.pp_layers`` loops): ``config.json``'s ``mapping`` is
``{world_size: tp * pp, tp_size: tp, pp_size: pp}``; rank ``r`` is pipeline stage
``r // tp`` and tensor parallel rank ``r % tp`` (a stage's tp ranks are consecutive). Stage
``s`` holds the layers of :func:`pp_layers` (TRT-LLM's
``Mapping.pp_layers``: contiguous blocks, the first ``L % pp`` stages one layer more),
renumbered ``transformer.layers.0 ..`` from 0 in its files (``l - layers_range[0]``, what
``DecoderLayerList`` loads); the vocab and position embeddings are written on stage 0 only,
``ln_f`` and ``lm_head`` on the last stage only (``is_first_pp_rank`` /
``is_last_pp_rank``). Each tensor of a stage's rank is the same tensor as in the ``--pp 1``
export at the same tp (tested). ``--pp`` must be at least 1 and at most ``num_layers``
(TRT-LLM asserts ``pp size cannot be larger than num_hidden_layers``). An uneven split
follows ``torch.tensor_split`` as current TRT-LLM does; releases whose ``pp_layers``
floor-divides (``num_layers // pp_size`` per stage) cannot load it, so prefer a ``--pp``
that divides ``num_layers``. The source checkpoint's own pipeline layout (any p, v) does
not matter: it is converted at restore (:mod:`jmegatron.checkpoint.layout`).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from jmegatron.conversion.tree import check_shape, get, plain, unstack_layers

GPT = "GPTForCausalLM"
LLAMA = "LlamaForCausalLM"
MIXTRAL = "MixtralForCausalLM"


def pp_layers(num_layers: int, pp_size: int, pp_rank: int) -> list[int]:
    """Global indices of the decoder layers pipeline stage ``pp_rank`` holds.

    TensorRT-LLM's ``Mapping.pp_layers`` (``tensorrt_llm/mapping.py``, without a
    ``pp_partition``): ``torch.tensor_split(arange(num_layers), pp_size)[pp_rank]``, i.e.
    contiguous blocks of ``num_layers // pp_size`` layers, the first ``num_layers % pp_size``
    stages holding one more. Raises ValueError unless ``1 <= pp_size <= num_layers`` (TRT-LLM
    asserts ``pp size cannot be larger than num_hidden_layers``) and ``0 <= pp_rank < pp_size``.
    """
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size {pp_size} must be in [1, num_layers = {num_layers}]")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} must be in [0, {pp_size})")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return list(range(start, start + base + (pp_rank < extra)))


def trtllm_config(cfg, arch: str, vocab_size: int, tp: int, dtype: str, *, pp: int = 1,
                  use_parallel_embedding: bool = True, producer: Optional[dict] = None,
                  moe_sizes: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    """The ``config.json`` of the unquantized TensorRT-LLM checkpoint for ``cfg``.

    ``PretrainedConfig`` fields (architecture, dtype, logits_dtype float32, vocab_size =
    ``vocab_size`` (the true vocabulary), max_position_embeddings, hidden_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_size (kv_channels),
    intermediate_size, hidden_act, norm_epsilon, position_embedding_type, mapping
    ``{world_size: tp * pp, tp_size: tp, pp_size: pp}``, quantization ``{quant_algo: null,
    kv_cache_quant_algo: null}``, use_parallel_embedding, embedding_sharding_dim 0,
    share_embedding_table false) plus ``GPTConfig`` (bias, rotary_pct, rotary_base,
    q_scaling, apply_query_key_layer_scaling, gpt_variant) or ``LLaMAConfig`` (rotary_base,
    rotary_scaling, attn_bias, mlp_bias) fields, ``tie_word_embeddings`` and a ``producer``
    record. ``MixtralForCausalLM`` (module docstring): Llama's fields with ``hidden_act``
    "swiglu", ``intermediate_size`` = ``moe_ffn_hidden_size``, ``moe`` ``{num_experts,
    top_k, normalization_mode: 1}`` and ``mapping.moe_tp_size`` / ``moe_ep_size``.
    ``arch``: :data:`GPT`, :data:`LLAMA` or :data:`MIXTRAL`, and ``moe_sizes``: ``(moe_tp,
    moe_ep)``, both as the export command checked them
    (:func:`jmegatron.export.trtllm.check_exportable`).
    """
    c: dict[str, Any] = {
        "architecture": arch,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(cfg.max_position_embeddings),
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": int(cfg.num_layers),
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_key_value_heads": int(cfg.num_query_groups),
        "head_size": int(cfg.kv_channels),
        "intermediate_size": int(cfg.ffn_hidden_size),
        "norm_epsilon": float(cfg.norm_epsilon),
        "mapping": {"world_size": int(tp * pp), "tp_size": int(tp), "pp_size": int(pp)},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "use_parallel_embedding": bool(use_parallel_embedding),
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
    }
    if arch == GPT:
        c.update(position_embedding_type="learned_absolute", hidden_act="gelu", bias=True, gpt_variant="gpt2",
                 rotary_pct=1.0, rotary_base=float(cfg.rotary_base), q_scaling=1.0,
                 apply_query_key_layer_scaling=False)
    else:
        c.update(position_embedding_type="rope_gpt_neox", hidden_act="silu", rotary_base=float(cfg.rotary_base),
                 rotary_scaling=None, attn_bias=bool(cfg.add_bias_linear), mlp_bias=bool(cfg.add_bias_linear))
    if arch == MIXTRAL:
        mtp, mep = moe_sizes
        c["hidden_act"] = "swiglu"
        c["intermediate_size"] = int(cfg.moe_ffn_hidden_size)
        c["mapping"].update(moe_tp_size=int(mtp), moe_ep_size=int(mep))
        c["moe"] = {"num_experts": int(cfg.num_moe_experts), "top_k": int(cfg.moe_router_topk),
                    "normalization_mode": 1}  # MoeConfig.ExpertScaleNormalizationMode.RENORMALIZE
    c["producer"] = dict(producer or {}, name="jmegatron.export trtllm")
    return c


# ----------------------------------------------------------------------------- tensors
def _rows_split(a: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """Zero-pad axis 0 to a multiple of ``tp`` (TRT-LLM's pad_vocab_size) and take ``rank``'s rows."""
    rows = -(-a.shape[0] // tp)
    if rows * tp != a.shape[0]:
        a = np.concatenate([a, np.zeros((rows * tp - a.shape[0],) + a.shape[1:], a.dtype)])
    return a[rank * rows:(rank + 1) * rows]


def _kv_heads_of_rank(nkv: int, tp: int, rank: int) -> list[int]:
    """The KV heads tensor parallel ``rank`` holds (duplicated when ``nkv < tp``)."""
    if nkv >= tp:
        per = nkv // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // nkv)]  # duplicated: ranks r*tp/nkv .. share KV head r


def rank_tensors(params: dict, cfg, arch: str, vocab_size: int, tp: int, rank: int, *, pp: int = 1,
                 use_parallel_embedding: bool = True, moe_sizes: tuple[int, int] = (1, 1)) -> dict[str, np.ndarray]:
    """TensorRT-LLM tensors of ``rank`` (float32 numpy, C-contiguous), ``0 <= rank < tp * pp``.

    ``rank`` is TRT-LLM's: pipeline stage ``rank // tp``, tensor parallel rank ``rank % tp``
    (with ``pp = 1`` it is the tensor parallel rank). The stage's layers
    (:func:`pp_layers`) are numbered from 0; embeddings only on stage 0, ``ln_f`` and
    ``lm_head`` only on the last stage. ``params``: jmegatron parameters in the per-layer or
    scanned layout (see :mod:`jmegatron.conversion.hf` for names and shapes); ``vocab_size``: the true vocabulary
    (rows beyond it, Megatron's padding, are dropped). Names and per-rank shapes are listed
    in :mod:`jmegatron.export.trtllm_check`; the splits are described in this module's
    docstring (MoE layers: ``mlp.router.weight [E, h]``, ``mlp.fc.weight [E/ep, 2F/moe_tp, h]``,
    ``mlp.proj.weight [E/ep, h, F/moe_tp]`` of this rank's experts, :func:`moe_rank_tensors`).
    ``arch`` and ``moe_sizes`` as in :func:`trtllm_config`. Raises ValueError for a ``rank``
    outside ``[0, tp * pp)`` or params that do not match ``cfg``.
    """
    if not isinstance(rank, int) or not 0 <= rank < tp * pp:
        raise ValueError(f"rank={rank!r} must be in [0, tp * pp = {tp * pp})")
    pp_rank, rank = divmod(rank, tp)  # from here on ``rank`` is the tensor parallel rank
    first, last = pp_rank == 0, pp_rank == pp - 1
    p = plain(params)
    if "decoder_layers" in p:
        p = unstack_layers(p, cfg.num_layers)
    h, nq, nkv, d, ffn = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
                          cfg.ffn_hidden_size)
    per = nq // nkv
    bias = cfg.add_bias_linear
    qh = np.arange(rank * nq // tp, (rank + 1) * nq // tp)
    kvh = np.asarray(_kv_heads_of_rank(nkv, tp, rank))
    fsl = slice(rank * ffn // tp, (rank + 1) * ffn // tp)
    g = lambda path: np.asarray(get(p, path, cfg), dtype=np.float32)  # noqa: E731
    out: dict[str, np.ndarray] = {}

    wte = g("word_embeddings/embedding")
    if not 0 < vocab_size <= wte.shape[0]:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {wte.shape[0]}] (the embedding's rows)")
    emb = wte[:vocab_size]
    if first:
        out["transformer.vocab_embedding.weight"] = _rows_split(emb, tp, rank) if use_parallel_embedding else emb
    if first and arch == GPT:
        pos = check_shape("position_embeddings/embedding", g("position_embeddings/embedding"),
                           (cfg.max_position_embeddings, h))
        out["transformer.position_embedding.weight"] = _rows_split(pos, tp, rank) if use_parallel_embedding else pos
    norm_parts = (("weight", "scale"), ("bias", "bias")) if arch == GPT else (("weight", "scale"),)

    for local, i in enumerate(pp_layers(cfg.num_layers, pp, pp_rank)):
        L, o = f"decoder_layers_{i}", f"transformer.layers.{local}"
        for dst, src in (("input_layernorm", "input_layernorm"), ("post_layernorm", "pre_mlp_layernorm")):
            for tname, jname in norm_parts:
                out[f"{o}.{dst}.{tname}"] = g(f"{L}/{src}/{jname}")
        # QKV: fused [h, nkv, per + 2, d] -> rows q(rank heads) | k(rank kv heads) | v
        qkv = check_shape(f"{L}/self_attention/linear_qkv/kernel", g(f"{L}/self_attention/linear_qkv/kernel"),
                           (h, nkv, per + 2, d))
        q = qkv[:, :, :per].reshape(h, nq, d)  # head index g * per + j, Megatron's group-major order
        blocks = [q[:, qh], qkv[:, kvh, per], qkv[:, kvh, per + 1]]
        out[f"{o}.attention.qkv.weight"] = np.concatenate([b.reshape(h, -1) for b in blocks], axis=1).T
        if bias:
            b = check_shape(f"{L}/self_attention/linear_qkv/bias", g(f"{L}/self_attention/linear_qkv/bias"),
                             (nkv, per + 2, d))
            qb = b[:, :per].reshape(nq, d)
            out[f"{o}.attention.qkv.bias"] = np.concatenate([qb[qh].ravel(), b[kvh, per].ravel(),
                                                             b[kvh, per + 1].ravel()])
        proj = check_shape(f"{L}/self_attention/linear_proj/kernel", g(f"{L}/self_attention/linear_proj/kernel"),
                            (nq, d, h))
        out[f"{o}.attention.dense.weight"] = proj[qh].reshape(-1, h).T
        if bias:
            out[f"{o}.attention.dense.bias"] = g(f"{L}/self_attention/linear_proj/bias")
        if arch == MIXTRAL:
            out.update(moe_rank_tensors(p[L]["mlp"], cfg, i, local, tp, rank, moe_sizes))
            continue
        fc1 = g(f"{L}/mlp/linear_fc1/kernel")
        if arch == GPT:
            check_shape(f"{L}/mlp/linear_fc1/kernel", fc1, (h, ffn))
            out[f"{o}.mlp.fc.weight"] = fc1[:, fsl].T
            out[f"{o}.mlp.fc.bias"] = g(f"{L}/mlp/linear_fc1/bias")[fsl]
        else:
            check_shape(f"{L}/mlp/linear_fc1/kernel", fc1, (h, 2, ffn))
            out[f"{o}.mlp.fc.weight"] = fc1[:, 0, fsl].T  # SwiGLU gate: silu(fc(x)) * gate(x)
            out[f"{o}.mlp.gate.weight"] = fc1[:, 1, fsl].T  # up projection
            if bias:
                b1 = g(f"{L}/mlp/linear_fc1/bias")
                out[f"{o}.mlp.fc.bias"] = b1[0, fsl]
                out[f"{o}.mlp.gate.bias"] = b1[1, fsl]
        fc2 = check_shape(f"{L}/mlp/linear_fc2/kernel", g(f"{L}/mlp/linear_fc2/kernel"), (ffn, h))
        out[f"{o}.mlp.proj.weight"] = fc2[fsl].T
        if bias:
            out[f"{o}.mlp.proj.bias"] = g(f"{L}/mlp/linear_fc2/bias")

    if not last:
        return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
    for tname, jname in norm_parts:
        out[f"transformer.ln_f.{tname}"] = g(f"final_layernorm/{jname}")
    if cfg.untie_embeddings_and_output_weights:
        head = check_shape("output_layer/kernel", g("output_layer/kernel"), (h, wte.shape[0]))[:, :vocab_size].T
    else:
        head = emb
    out["lm_head.weight"] = _rows_split(head, tp, rank)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def moe_rank_tensors(mlp: dict, cfg, layer: int, local: int, tp: int, rank: int,
                     moe_sizes: tuple[int, int]) -> dict[str, np.ndarray]:
    """TensorRT-LLM tensors of MoE layer ``layer`` (numbered ``local`` in its stage's file) on
    tensor parallel rank ``rank`` (float32 numpy).

    ``mlp``: the layer's jmegatron ``mlp`` params (``router/kernel [h, E]``,
    ``experts/linear_fc1/kernel [E, h, 2, F]`` gate then up, ``experts/linear_fc2/kernel
    [E, F, h]``). With ``(mtp, ep) = moe_sizes``, the rank is
    expert-parallel rank ``rank % ep`` and MoE tp rank ``rank // ep`` (TensorRT-LLM's
    ``Mapping.moe_ep_rank`` / ``moe_tp_rank``) and holds experts ``Mapping.ep_experts``
    (a contiguous block of ``E/ep``) and FFN columns ``[moe_tp_rank * F/mtp, +F/mtp)``::

        transformer.layers.{local}.mlp.router.weight  [E, h]            (router/kernel^T, full)
        transformer.layers.{local}.mlp.fc.weight      [E/ep, 2F/mtp, h] (up rows, then gate rows)
        transformer.layers.{local}.mlp.proj.weight    [E/ep, h, F/mtp]

    as ``tensorrt_llm/models/llama/convert.py`` (``split(w3|w1, moe_tp_size, moe_tp_rank,
    dim=1)``, ``split(w2, ..., dim=2)``, ``concat([w3, w1], dim=-2)``). Raises ValueError for
    a missing or misshapen tensor (naming it).
    """
    h, E, F = cfg.hidden_size, cfg.num_moe_experts, cfg.moe_ffn_hidden_size
    mtp, mep = moe_sizes
    ep_rank, mtp_rank = rank % mep, rank // mep
    experts = slice(ep_rank * (E // mep), (ep_rank + 1) * (E // mep))
    cols = slice(mtp_rank * (F // mtp), (mtp_rank + 1) * (F // mtp))
    L = f"decoder_layers_{layer}/mlp"
    try:
        router = np.asarray(mlp["router"]["kernel"], np.float32)
        fc1 = np.asarray(mlp["experts"]["linear_fc1"]["kernel"], np.float32)
        fc2 = np.asarray(mlp["experts"]["linear_fc2"]["kernel"], np.float32)
    except KeyError as err:
        raise ValueError(f"params have no {L}/{err.args[0]}...: layer {layer} is not an MoE layer of this config "
                         f"(num_moe_experts={E})") from None
    check_shape(f"{L}/router/kernel", router, (h, E))
    check_shape(f"{L}/experts/linear_fc1/kernel", fc1, (E, h, 2, F))
    check_shape(f"{L}/experts/linear_fc2/kernel", fc2, (E, F, h))
    fc1 = fc1[experts, :, :, cols]  # [E/ep, h, 2, F/mtp]
    o = f"transformer.layers.{local}.mlp"
    return {f"{o}.router.weight": router.T,
            # MixtureOfExperts: "the left matrix is a linear projection (no activation), the right
            # the gating value (activation applied)": up (w3) rows first, gate (w1) rows second
            f"{o}.fc.weight": np.concatenate([fc1[:, :, 1].transpose(0, 2, 1), fc1[:, :, 0].transpose(0, 2, 1)], 1),
            f"{o}.proj.weight": fc2[experts, cols].transpose(0, 2, 1)}
