"""Theoretical memory of one training step per device: weights, gradients, optimizer state
and activations, for a parallel layout (tensor, data with ZeRO-1 or FSDP, sequence parallel,
pipeline stages).

Follows Megatron-LM ``megatron/training/theoretical_memory_usage.py``
(``compute_weight_and_optimizer_memory``, ``compute_activation_memory``) and the paper it
cites, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), section 4 and Table 2. FLOPs stay in
:mod:`jmegatron.reporting.flops`; this module counts bytes and uses
:func:`flops.num_parameters` for the parameter count.

Units: every function returns **bytes per device** (floats, since the per-device share of
a sharded tensor is a division). Divide by ``2**20`` for Megatron's "MB".

Two bookkeepings of the model state:

* jmegatron's (:func:`weight_and_optimizer_memory`): float32 parameters, a float32 gradient
  accumulator of the full (tensor-sharded) parameter size, and AdamW's two float32
  moments: 16 bytes per parameter; with ``bf16`` / ``fp16`` (Megatron's split), 16-bit
  parameters and float32 main parameters beside the moments in the optimizer: 18 bytes
  (the accumulator 16-bit too for fp16 without ``accumulate_allreduce_grads_in_fp32``).
  The distributed optimizer (ZeRO-1) shards the optimizer state over data, and over
  context too under context parallelism (Megatron's data-parallel group with context
  parallelism: ``4 + 4 + 8 / (dp cp)``; ``2 + 4 + 12 / (dp cp)`` with bf16, Megatron's
  ``6 + 12 / dp``); FSDP shards all three (``16 / (dp cp)``) for the
  parameters with a hidden axis. Parameters the model keeps replicated over the tensor axis (norms, the
  row-parallel biases, position embeddings) are not divided by ``tp``
  (:func:`parameter_classes`).
* Megatron's (:func:`megatron_weight_and_optimizer_memory`): 16-bit parameters and fp32
  gradients, main parameters and moments, 18 bytes per parameter, ``6 + 12 / dp`` with the
  distributed optimizer, over Megatron's own parameter count (no biases, no position
  embeddings) of the most loaded tensor shard; for comparison with Megatron's printout.

Activations (:func:`activation_memory`) follow the paper's per-layer count term by term,
generalised from its 16-bit GPT layer to jmegatron's layers: ``e`` bytes per activation
element (4 in float32, 2 with ``bf16``), 1 byte per dropout-mask element (only when that
dropout is on), grouped-query widths ``q = heads * kv_channels``, ``kv = groups *
kv_channels``, SwiGLU, and the ``s x s`` score tensors. For GPT with ``ffn = 4h``,
``e = 2`` and dropout on, it is exactly the paper's ``sbh (34 + 5 a s / h)`` per layer
(``sbh (10 + 24/t + 5as/(ht))`` with tensor parallelism, ``sbh (34/t + 5as/(ht))`` with
sequence parallelism, the ``s^2`` terms gone with selective recomputation, and ``e * sbh
(/t with SP)`` stored per layer with full recomputation).

Pipeline stages (``pipeline_model_parallel_size`` = ``p`` > 1; jmegatron cannot train
them yet, the estimate is for reports such as :mod:`jmegatron.tools.model_report`) are
counted as Megatron's ``theoretical_memory_usage.py`` does (read in ByteMLPerf's fork,
``byte_train_perf/Megatron-LM/megatron/training/theoretical_memory_usage.py``, commit a30b4f97b174):
the figures are those of the most loaded device. Parameters: each stage holds ``L / p``
layers; the first stage also the word (and position) embeddings, the last the final norm
and the output layer (a tied model's last stage keeps its own copy of the word
embeddings, as Megatron); the larger of the two. Activations: the first stage under the
1F1B schedule, which holds ``min(num_microbatches, p)`` micro-batches of its ``L / p``
layers in flight (Megatron: ``num_layers`` layers' worth, times ``min(1, m / p)``), the
embedding input and dropout mask of as many micro-batches, and no output layer.

Mixture-of-experts layers (``num_moe_experts``, the layers ``moe_layer_freq`` picks): the
parameters are :func:`flops.num_parameters`' (router ``h x E``, ``E`` experts of
``moe_ffn_hidden_size``, the shared expert). The stacked experts are split over
``expert_model_parallel_size`` = ``ep`` (and tensor parallel, as the dense MLP); with ZeRO-1
Megatron shards the expert optimizer state over the expert-data-parallel group and the
dense state over the whole data-parallel group. In jmegatron's mesh the ``data`` axis
(:attr:`ParallelLayout.data_parallel_size`) excludes ``expert``: it *is* Megatron's
expert-data-parallel size, and Megatron's data-parallel size is ``dp * ep`` (the expert
ranks hold the same dense weights and take their own micro-batches). So: expert state
``/ dp``, dense state ``/ (dp * ep)``. Activations of an MoE layer
(:func:`activation_memory_per_layer` with ``moe=True``) count the routed copies of each token (``k`` per
token, dropless; ``E * min(capacity, tokens)`` slots with a capacity factor), assuming
balanced routing so that expert parallelism moves but does not change the per-device count.
Megatron's own ``theoretical_memory_usage.py`` counts MoE layers' parameters the same way
but without dividing by ``ep`` (no expert-parallel term) and without the router, and keeps
the dense ``ffn_hidden_size`` in its activation formula:
:func:`megatron_num_parameters_on_most_loaded_shard` / :func:`megatron_activation_memory`
reproduce that.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import jax

from jmegatron.config import JMegatronConfig, moe_layer_pattern
from jmegatron.models.backend import resolve_impls
from jmegatron.models.moe.moe_utils import get_capacity
from jmegatron.reporting import flops

FLOAT32_BYTES = 4
MASK_BYTES = 1  # a dropout mask element (Megatron's paper: 1 byte)
RECOMPUTE_CHOICES = ("none", "selective", "full")

# jmegatron's state, bytes per parameter (see the module docstring)
PARAM_BYTES = FLOAT32_BYTES
GRAD_BYTES = FLOAT32_BYTES
ADAM_STATE_BYTES = 2 * FLOAT32_BYTES


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How one training step is laid out over devices (Megatron's argument names).

    ``use_distributed_optimizer`` is ZeRO-1 over the data axis; ``use_megatron_fsdp``
    shards parameters, gradients and optimizer state over data.
    ``pipeline_model_parallel_size`` > 1 exists for the theory only (see the module
    docstring): the trainer and ``bench memory`` (:meth:`parse`) do not take it.
    ``expert_model_parallel_size`` splits the stacked experts; ``data_parallel_size`` is
    jmegatron's ``data`` mesh axis, which excludes the expert axis (Megatron's
    expert-data-parallel size; Megatron's data-parallel size is ``data_parallel_size *
    expert_model_parallel_size``).
    """

    tensor_model_parallel_size: int = 1
    data_parallel_size: int = 1
    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False
    use_megatron_fsdp: bool = False
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1

    def __post_init__(self):
        if min(self.tensor_model_parallel_size, self.data_parallel_size, self.pipeline_model_parallel_size,
               self.expert_model_parallel_size, self.context_parallel_size) < 1:
            raise ValueError(f"parallel sizes must be >= 1 (tp={self.tensor_model_parallel_size}, "
                             f"dp={self.data_parallel_size}, pp={self.pipeline_model_parallel_size}, "
                             f"ep={self.expert_model_parallel_size}, cp={self.context_parallel_size})")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
        if self.use_distributed_optimizer and self.use_megatron_fsdp:
            raise ValueError("use_megatron_fsdp already shards the optimizer state; drop zero1")

    @classmethod
    def from_config(cls, cfg: JMegatronConfig, data_parallel_size: int) -> "ParallelLayout":
        """The layout ``cfg`` asks for with ``data_parallel_size`` data-parallel ranks."""
        return cls(cfg.tensor_model_parallel_size, data_parallel_size, cfg.use_distributed_optimizer,
                   cfg.sequence_parallel, cfg.use_megatron_fsdp, cfg.pipeline_model_parallel_size,
                   cfg.expert_model_parallel_size, cfg.context_parallel_size)

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """``"tp2-dp4"``, ``"tp2-dp4-zero1"``, ``"tp4-sp-dp2"``, ``"dp8-fsdp"``, ``"cp4-dp2"``
        (parts in any order, missing sizes are 1). Raises ValueError naming the bad part."""
        tp, dp, cp, zero1, sp, fsdp = 1, 1, 1, False, False, False
        for part in text.lower().split("-"):
            m = re.fullmatch(r"(tp|dp|cp)(\d+)", part)
            if m:
                if m[1] == "tp":
                    tp = int(m[2])
                elif m[1] == "cp":
                    cp = int(m[2])
                else:
                    dp = int(m[2])
            elif part == "zero1":
                zero1 = True
            elif part == "sp":
                sp = True
            elif part == "fsdp":
                fsdp = True
            else:
                raise ValueError(f"layout {text!r}: unknown part {part!r} (use tpN, dpN, cpN, zero1, sp, fsdp, "
                                 f"joined by '-', e.g. tp2-dp4-zero1)")
        return cls(tp, dp, zero1, sp, fsdp, context_parallel_size=cp)

    @property
    def name(self) -> str:
        """The :meth:`parse` spelling, e.g. ``"tp2-dp4-zero1"``."""
        parts = [f"tp{self.tensor_model_parallel_size}"] + (["sp"] if self.sequence_parallel else [])
        if self.pipeline_model_parallel_size > 1:
            parts.append(f"pp{self.pipeline_model_parallel_size}")
        if self.expert_model_parallel_size > 1:
            parts.append(f"ep{self.expert_model_parallel_size}")
        if self.context_parallel_size > 1:
            parts.append(f"cp{self.context_parallel_size}")
        parts.append(f"dp{self.data_parallel_size}")
        if self.use_distributed_optimizer:
            parts.append("zero1")
        if self.use_megatron_fsdp:
            parts.append("fsdp")
        return "-".join(parts)

    @property
    def num_devices(self) -> int:
        return (self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size
                * self.expert_model_parallel_size * self.context_parallel_size)

    @property
    def megatron_data_parallel_size(self) -> int:
        """Megatron's data-parallel size: ``data_parallel_size * expert_model_parallel_size``
        (the ranks over which the dense weights are replicated and the batch is split)."""
        return self.data_parallel_size * self.expert_model_parallel_size


# ------------------------------------------------------------------ parameters
def bytes_per_device(tree: Any) -> int:
    """The bytes of the arrays in ``tree`` on its most loaded device (each leaf's largest
    addressable shard; a leaf without shards counts whole), e.g. a teacher's parameters
    in their shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        total += max(s.data.nbytes for s in shards) if shards else int(getattr(leaf, "nbytes", 0))
    return total


def stage_layers(cfg: JMegatronConfig, pipeline_model_parallel_size: int) -> tuple[int, int]:
    """(layers the first pipeline stage computes, layer slots every stage stores) for ``p``
    stages: ``(L / p, L / p)`` for Megatron's even split; with ``cfg``'s own uneven split
    (``decoder_first/last_pipeline_num_layers``, when ``p`` is cfg's
    ``pipeline_model_parallel_size``) the first stage's count and the padded slots of
    :class:`jmegatron.parallel.pipeline_layout.PipelineLayout` (every stage stores the
    largest stage's layers). Raises ValueError when ``p`` does not divide an even split."""
    p = pipeline_model_parallel_size
    uneven = cfg.decoder_first_pipeline_num_layers is not None or cfg.decoder_last_pipeline_num_layers is not None
    if p > 1 and uneven and p == cfg.pipeline_model_parallel_size:
        layout = cfg.pipeline_layout()
        return int(layout.stage_layers()[0]), layout.num_slots // p
    if p < 1 or cfg.num_layers % p:
        raise ValueError(f"pipeline_model_parallel_size={p} must be >= 1 and divide num_layers={cfg.num_layers} "
                         f"(Megatron splits the layers evenly over the stages)")
    return cfg.num_layers // p, cfg.num_layers // p


def parameter_classes(cfg: JMegatronConfig, padded_vocab_size: int, pipeline_model_parallel_size: int = 1,
                      pipeline_stage: int = 0) -> dict[str, int]:
    """Parameter counts by how jmegatron's logical-axis rules lay them out:

    * ``tensor_replicated_fsdp_sharded``: no tensor axis but a hidden (``embed``) axis: the
      ``[h]`` biases of the row-parallel ``linear_proj`` and ``linear_fc2``, learned
      position embeddings, and multi-latent attention's down projections;
    * ``replicated``: neither: the norms;
    * ``tensor_sharded_fsdp_replicated``: a tensor axis but no hidden axis: the
      ``linear_qkv`` and ``linear_fc1`` biases, the QK-norms of ``qk_layernorm_across_heads``, the
      attention sinks (``softmax_offset``);
    * ``sharded``: both (every kernel, the word embeddings, the untied output layer, the
      shared expert);
    * ``expert``: the stacked routed experts' kernels ``[E, h, (2,) ffn]`` and ``[E, ffn, h]``
      (and biases) of the MoE layers: split over the expert axis as well as tensor (and data under
      FSDP). An MoE layer's router ``[h, E]`` (and shared-expert gate ``[h, 1]``) is
      ``tensor_replicated_fsdp_sharded``, its bias ``[E]`` ``replicated``.

    Multi-token prediction layers count as layers of the last decoder layer's kind, their
    ``eh_proj`` ``[2h, h]`` as ``tensor_replicated_fsdp_sharded`` and their three norms as
    ``replicated``.

    The five add up to :func:`flops.num_parameters`. With ``pipeline_model_parallel_size``
    = ``p`` > 1, the classes of pipeline stage ``pipeline_stage`` (0-based): ``L / p``
    layers, plus the embeddings on stage 0 and the final norm and output layer (``V h``,
    tied or not) on stage ``p - 1``; uneven stages store :func:`stage_layers`' slots each.
    Raises ValueError when ``p`` does not divide ``num_layers`` (Megatron's even split) or
    the stage is out of range.
    """
    p = pipeline_model_parallel_size
    _, stored = stage_layers(cfg, p)
    if not 0 <= pipeline_stage < p:
        raise ValueError(f"pipeline_stage={pipeline_stage} is not in 0..{p - 1}")
    h = cfg.hidden_size
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    qk_norms = 2 * (2 if cfg.normalization == "LayerNorm" else 1) * cfg.kv_channels if cfg.qk_layernorm else 0
    heads_norms = 0  # qk_layernorm_across_heads: scales [nq, d] / [ng, d] split with the heads over tensor ranks
    if cfg.qk_layernorm and cfg.qk_layernorm_across_heads and not cfg.multi_latent_attention:
        heads_norms = ((2 if cfg.normalization == "LayerNorm" else 1)
                       * (cfg.num_attention_heads + cfg.num_query_groups) * cfg.kv_channels)
        qk_norms = 0
    down = 0  # MLA's down projections [h, rq], [h, rkv + dr]: replicated over tensor ranks, a hidden axis
    if cfg.multi_latent_attention:  # the latent norms
        qk_norms = (2 if cfg.normalization == "LayerNorm" else 1) * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank) \
            if cfg.qk_layernorm else 0
        down = h * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim)
    bias = cfg.add_bias_linear
    qkv_bias = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels \
        if (bias or cfg.add_qkv_bias) else 0
    fc1_bias = (2 if cfg.gated_mlp else 1) * cfg.ffn_hidden_size if bias else 0
    positions = cfg.max_position_embeddings * h if cfg.position_embedding_type == "learned_absolute" else 0
    num_moe_layers = flops.moe_layer_count(cfg, mtp=True)
    layers_all, mtp = flops.transformer_layer_count(cfg), flops.mtp_depths(cfg)  # the MTP layers count too
    router, experts = 0, 0
    # with add_bias_linear an MoE layer has no dense fc1 / fc2 biases but the router's bias [E]
    # (replicated), the experts' [E, (2,) f] and [E, h] (expert) and the shared expert's
    moe_fc1_bias, moe_fc2_bias, router_bias = 0, 0, 0
    sinks = cfg.num_attention_heads if cfg.softmax_type == "learnable" else 0  # softmax_offset [nq]: "heads"
    if num_moe_layers:
        f = cfg.moe_ffn_hidden_size
        router = num_moe_layers * (h * (cfg.num_moe_experts + (1 if cfg.moe_shared_expert_gate else 0))
                                   + (cfg.num_moe_experts if cfg.moe_router_enable_expert_bias else 0))
        fc1_width = 2 * f if cfg.gated_mlp else f
        experts = num_moe_layers * cfg.num_moe_experts * (h * fc1_width + f * h + ((fc1_width + h) if bias else 0))
        if bias:
            shared = cfg.moe_shared_expert_intermediate_size or 0
            router_bias = num_moe_layers * cfg.num_moe_experts
            moe_fc1_bias = num_moe_layers * ((2 * shared if cfg.gated_mlp else shared) - fc1_bias)
            moe_fc2_bias = num_moe_layers * ((h if shared else 0) - h)
    classes = {
        "tensor_replicated_fsdp_sharded": layers_all * ((2 * h if bias else 0) + down) + moe_fc2_bias + positions
                                          + router + mtp * 2 * h * h,  # + MTP's eh_proj [2h, h]
        "replicated": layers_all * ((4 if cfg.sandwich_norms else 2) * norm - (0 if cfg.pre_norms else 2 * norm)
                                    + qk_norms) + norm
                      + mtp * 3 * norm + router_bias,  # + MTP's enorm, hnorm, final_layernorm
        "tensor_sharded_fsdp_replicated": layers_all * (qkv_bias + fc1_bias + heads_norms + sinks) + moe_fc1_bias,
        "expert": experts,
    }
    classes["sharded"] = flops.num_parameters(cfg, padded_vocab_size) - sum(classes.values())
    if p == 1:
        return classes
    # Pipeline stages: split the whole-model classes into layers, embeddings and the head.
    word = padded_vocab_size * h
    output = word if cfg.untie_embeddings_and_output_weights else 0
    layers = {
        "tensor_replicated_fsdp_sharded": classes["tensor_replicated_fsdp_sharded"] - positions,
        "replicated": classes["replicated"] - norm,
        "tensor_sharded_fsdp_replicated": classes["tensor_sharded_fsdp_replicated"],
        "sharded": classes["sharded"] - word - output,
        "expert": classes["expert"],
    }
    if 0 < num_moe_layers < cfg.num_layers:
        # Mixed dense and MoE layers: count every stored slot as an MoE layer (an upper
        # bound: the most loaded stage holds as many MoE layers as it can).
        all_moe = parameter_classes(cfg.replace(moe_layer_freq=1), padded_vocab_size)
        layers = {k: all_moe[k] - {"tensor_replicated_fsdp_sharded": positions, "replicated": norm,
                                   "sharded": word + output}.get(k, 0) for k in all_moe}
    stage = {k: v // cfg.num_layers * stored for k, v in layers.items()}
    if pipeline_stage == 0:
        stage["tensor_replicated_fsdp_sharded"] += positions
        stage["sharded"] += word
    if pipeline_stage == p - 1:
        stage["replicated"] += norm
        stage["sharded"] += word  # the output layer, or a tied model's copy of the embeddings
    return stage


def parameters_per_device(cfg: JMegatronConfig, padded_vocab_size: int, layout: ParallelLayout) -> float:
    """Parameters held by one device (:func:`parameter_classes`): tensor-sharded classes
    divided by tp, the routed experts also by ep, and under FSDP the classes with a hidden
    axis divided by dp; with pipeline stages, those of the most loaded stage (the first or
    the last). :func:`expert_parameters_per_device` is the experts' part of it."""
    return _dense_and_expert_per_device(cfg, padded_vocab_size, layout)[0]


def expert_parameters_per_device(cfg: JMegatronConfig, padded_vocab_size: int, layout: ParallelLayout) -> float:
    """The routed experts' share of :func:`parameters_per_device` (0 for a dense model):
    ``num_moe_layers * E * (3 h ffn with SwiGLU, else 2 h ffn) / (tp * ep)`` (``/ dp`` too
    under FSDP), of the same most loaded pipeline stage."""
    return _dense_and_expert_per_device(cfg, padded_vocab_size, layout)[1]


def _dense_and_expert_per_device(cfg, padded_vocab_size, layout) -> tuple[float, float]:
    """(all parameters, routed-expert parameters) on one device of the most loaded stage."""
    p = layout.pipeline_model_parallel_size
    t = layout.tensor_model_parallel_size
    # FSDP shards over data x context (rules.make_rules)
    d = layout.data_parallel_size * layout.context_parallel_size if layout.use_megatron_fsdp else 1
    ep = layout.expert_model_parallel_size

    def per_device(c):
        experts = c["expert"] / (t * ep * d)
        return (c["sharded"] / (t * d) + c["tensor_sharded_fsdp_replicated"] / t
                + c["tensor_replicated_fsdp_sharded"] / d + c["replicated"] + experts, experts)

    return max(per_device(parameter_classes(cfg, padded_vocab_size, p, stage)) for stage in {0, p - 1})


@dataclasses.dataclass(frozen=True)
class StateMemory:
    """Bytes per device of the model state: ``weights``, ``gradients``, ``optimizer_state``."""

    weights: float
    gradients: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state


def weight_and_optimizer_memory(cfg: JMegatronConfig, padded_vocab_size: int,
                                layout: ParallelLayout) -> StateMemory:
    """jmegatron's model state per device (bytes), per parameter as
    :func:`state_bytes_per_parameter`: the model's weights (4 B float32, 2 B under bf16 /
    fp16), the gradient accumulator (4 B float32; the micro-batch loop accumulates full
    local gradients before the one reduction, as Megatron's grad buffer), the optimizer
    state (AdamW moments 8 B, plus the float32 main parameters 4 B under bf16 / fp16;
    divided by dp with the distributed optimizer). FSDP divides all three by dp for the
    parameters it shards (gradients reduce-scattered per micro-batch).

    With expert parallelism the distributed optimizer divides the routed experts' moments
    by ``dp`` (their expert-data-parallel group, jmegatron's ``data`` axis) and the rest by
    Megatron's data-parallel size ``dp * ep`` (Megatron's ``DistributedOptimizer`` with
    its expert-data-parallel buffers). Under context parallelism both groups include the
    ``cp`` context ranks (Megatron shards over ``get_data_parallel_group(with_context_parallel=True)``;
    jmegatron.parallel.distributed_optimizer): ``/ (dp cp)`` and ``/ (dp ep cp)``. Megatron's
    own ``theoretical_memory_usage.py`` divides by its ``data_parallel_size`` alone, which
    excludes cp (:func:`megatron_weight_and_optimizer_memory` keeps that)."""
    n, experts = _dense_and_expert_per_device(cfg, padded_vocab_size, layout)  # FSDP's / dp included
    param_bytes, grad_bytes, per_param = state_bytes_per_parameter(cfg)
    optimizer = per_param * n
    if layout.use_distributed_optimizer:
        cp = layout.context_parallel_size
        optimizer = per_param * ((n - experts) / (layout.megatron_data_parallel_size * cp)
                                 + experts / (layout.data_parallel_size * cp))
    return StateMemory(weights=param_bytes * n, gradients=grad_bytes * n, optimizer_state=optimizer)


def state_bytes_per_parameter(cfg: JMegatronConfig) -> tuple[int, int, int]:
    """(model parameter, gradient accumulator, optimizer state) bytes per parameter: (4, 4, 8)
    in float32; (2, 4, 12) with ``bf16`` / ``fp16`` (16-bit model parameters; the optimizer
    holds float32 main parameters beside its two moments:
    jmegatron.training.float16_optimizer), the accumulator 2 bytes under fp16 without
    ``accumulate_allreduce_grads_in_fp32``."""
    if not (cfg.bf16 or cfg.fp16):
        return PARAM_BYTES, GRAD_BYTES, ADAM_STATE_BYTES
    return 2, (GRAD_BYTES if cfg.accumulate_allreduce_grads_in_fp32 else 2), ADAM_STATE_BYTES + FLOAT32_BYTES


def megatron_num_parameters_on_most_loaded_shard(cfg: JMegatronConfig, padded_vocab_size: int,
                                                 tensor_model_parallel_size: int = 1,
                                                 pipeline_model_parallel_size: int = 1) -> float:
    """Megatron's ``num_parameters_on_most_loaded_model_shard``:
    ``(T / p + V h (x2 if untied and p == 1)) / tp`` with the transformer's ``T = L_dense *
    (2h (ffn * g + norm) + A) + L_moe * (2h ((E * moe_ffn + shared) * g + norm) + A) + norm
    h``, ``A = 2h^2 (1 + groups/heads) q/h``, ``g = 3/2`` for SwiGLU, ``norm = 2`` for
    LayerNorm (1 for RMSNorm); no biases, no position embeddings and no router, and the
    experts not divided by expert parallelism, as Megatron counts (its final norm is split
    over the stages with the layers). With ``multi_latent_attention``, ``A`` is Megatron's
    MLA term: ``q_lora (h + heads (dk + dr) + norm)`` (``h heads (dk + dr)`` without q-LoRA)
    ``+ kv_lora (h + heads (dk + dv) + norm) + h dr + heads dv h``. Each multi-token
    prediction depth adds one layer of the last decoder layer's kind (Megatron counts the
    layer alone, not its ``eh_proj`` and norms)."""
    h = cfg.hidden_size
    norm_size = 1 if cfg.normalization == "RMSNorm" else 2
    gated = 1.5 if cfg.gated_mlp else 1.0
    nq = cfg.num_attention_heads
    if cfg.multi_latent_attention:
        qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        q_term = h * nq * qk if cfg.q_lora_rank is None else cfg.q_lora_rank * (h + nq * qk + norm_size)
        self_attn = (q_term + cfg.kv_lora_rank * (h + nq * (cfg.qk_head_dim + cfg.v_head_dim) + norm_size)
                     + h * cfg.qk_pos_emb_head_dim + nq * cfg.v_head_dim * h)
    else:
        q_ratio = cfg.kv_channels * nq / h
        self_attn = 2 * h * h * ((1 + cfg.num_query_groups / nq) * q_ratio)
    layer = 2 * h * (cfg.ffn_hidden_size * gated + norm_size) + self_attn
    num_moe_layers = flops.moe_layer_count(cfg, mtp=True)
    moe_layer = 0.0
    if num_moe_layers:
        moe_mlp = cfg.moe_ffn_hidden_size * cfg.num_moe_experts + (cfg.moe_shared_expert_intermediate_size or 0)
        moe_layer = 2 * h * (moe_mlp * gated + norm_size) + self_attn
    embedding = h * padded_vocab_size
    block = (flops.transformer_layer_count(cfg) - num_moe_layers) * layer + num_moe_layers * moe_layer + norm_size * h
    shard = block / pipeline_model_parallel_size + embedding
    if cfg.untie_embeddings_and_output_weights and pipeline_model_parallel_size == 1:
        shard += embedding
    return shard / tensor_model_parallel_size


def megatron_weight_and_optimizer_memory(cfg: JMegatronConfig, padded_vocab_size: int,
                                         layout: ParallelLayout) -> float:
    """Megatron's ``compute_weight_and_optimizer_memory`` (bytes): 18 bytes per parameter
    of the most loaded shard, ``6 + 12 / dp`` with the distributed optimizer, ``dp`` being
    Megatron's data-parallel size (``data_parallel_size * expert_model_parallel_size``)."""
    dp = layout.megatron_data_parallel_size
    per_param = 6 + 12 / dp if layout.use_distributed_optimizer else 18
    return per_param * megatron_num_parameters_on_most_loaded_shard(
        cfg, padded_vocab_size, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size)


def megatron_activation_memory(cfg: JMegatronConfig, padded_vocab_size: int, layout: ParallelLayout,
                               num_microbatches: Optional[int] = None) -> float:
    """Megatron's ``compute_activation_memory`` (bytes per device of the first pipeline
    stage; Table 2 of arXiv:2205.05198 with sequence parallelism and selective recomputation
    assumed, 16-bit activations, ``q = h``): ``s b h (18 + 4 ffn / h) L`` for the layers,
    ``8 s b p`` token ids and ``s b h p`` embedding dropout masks, all times ``min(1, m / p)``
    when ``p > 1`` and ``m`` = ``num_microbatches`` is known, plus ``4 s b h (1 + V / h)``
    for the output layer and cross-entropy when ``p == 1``; the sum divided by tp."""
    s, b, h = cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size
    p = layout.pipeline_model_parallel_size
    act = s * b * h * (18 + 4 * cfg.ffn_hidden_size / h) * cfg.num_layers
    act += 8 * s * b * p + s * b * h * p
    if p > 1 and num_microbatches is not None:
        act *= min(1.0, num_microbatches / p)
    if p == 1:
        act += 4 * s * b * h * (1 + padded_vocab_size / h)
    return act / layout.tensor_model_parallel_size


# ------------------------------------------------------------------ activations
def activation_bytes_per_element(cfg: JMegatronConfig) -> int:
    """2 with ``bf16`` (bfloat16 compute), else 4 (float32)."""
    return 2 if cfg.bf16 else 4


def moe_routed_tokens(cfg: JMegatronConfig, num_tokens: int) -> int:
    """Token copies the routed experts compute per device for ``num_tokens`` tokens of a
    micro-batch: ``num_tokens * moe_router_topk`` dropless (each token goes to k experts;
    with expert parallelism the all-to-all moves them, and with balanced routing every
    device computes as many as it sent), or with ``moe_expert_capacity_factor`` the static
    buffer ``E * min(capacity, num_tokens)``, ``capacity = get_capacity(num_tokens * k, E,
    factor)`` (:func:`jmegatron.models.moe.moe_utils.get_capacity`, every slot computed)."""
    k, e_ = cfg.moe_router_topk, cfg.num_moe_experts
    if cfg.moe_expert_capacity_factor is None:
        return num_tokens * k
    return e_ * min(get_capacity(num_tokens * k, e_, cfg.moe_expert_capacity_factor), num_tokens)


def _moe_mlp_bytes(cfg: JMegatronConfig, n: int, e: int, t: int) -> float:
    """Bytes per device the MoE MLP keeps for ``n`` tokens (see
    :func:`activation_memory_per_layer`, ``moe=True``)."""
    h, num_experts = cfg.hidden_size, cfg.num_moe_experts
    router_bytes = {"fp32": 4, "fp64": 8}.get(cfg.moe_router_dtype, e)
    f = cfg.moe_ffn_hidden_size
    f1 = 2 * f if cfg.gated_mlp else f
    r = moe_routed_tokens(cfg, n)
    routed = r * (e * h + e * f1 + 2 * e * f + 2 * FLOAT32_BYTES) / t
    router = 2 * router_bytes * n * num_experts
    shared = 0.0
    if cfg.moe_shared_expert_intermediate_size:
        fs = cfg.moe_shared_expert_intermediate_size
        shared = n * e * ((2 * fs if cfg.gated_mlp else fs) + fs) / t
    return routed + router + shared


def activation_memory_per_layer(cfg: JMegatronConfig, micro_batch_size: int, layout: ParallelLayout,
                                recompute: str = "none", bytes_per_element: Optional[int] = None,
                                moe: bool = False) -> float:
    """Bytes one transformer layer keeps for its backward pass, per device, for one
    micro-batch of ``micro_batch_size`` sequences of ``cfg.seq_length`` tokens.

    With ``e`` = ``bytes_per_element`` (default :func:`activation_bytes_per_element`),
    ``m`` = 1 byte when the hidden dropout is on (else 0), ``m_a`` likewise for attention
    dropout, ``t`` = tp, ``n = s * b`` tokens, ``a`` heads, ``F`` = ffn (``2F`` fc1 width
    with SwiGLU)::

        replicated over t without SP (all / t with SP):
          2 e n h      inputs of input_layernorm and pre_mlp_layernorm
          e n h        linear_qkv input (layernorm output)
          e n h        linear_fc1 input (layernorm output)
          2 m n h      the two residual dropout masks
        split over t:
          e n (q + kv) Q and K for the scores;  e n kv  V
          e a s^2 b    softmax output;  (m_a + e) a s^2 b  attention dropout mask and output
          e n q        linear_proj input
          e n F_1      activation input (fc1 output, F_1 = F or 2F);  e n F  linear_fc2 input

    ``moe=True`` (an MoE layer of ``cfg``): the dense ``e n F_1 + e n F`` are replaced by,
    with ``r`` = :func:`moe_routed_tokens` token copies, ``F`` = moe_ffn_hidden_size,
    ``e_r`` = 4 bytes with ``moe_router_dtype`` fp32 (8 fp64, else ``e``)::

        e r h        the dispatched (permuted) tokens, linear_fc1's input
        e r F_1      linear_fc1's output (the activation's input)
        2 e r F      the activation's output and the routing-weighted linear_fc2 input
        8 r          float32 routing weights and int32 permutation, per copy
        2 e_r n E    router logits and scores
        e n F_s1 + e n F_s   the shared expert (as a dense MLP of its width)

    (the routed and shared terms split over t like the dense MLP's, the router's not).

    ``recompute="selective"`` drops the ``s^2`` terms (core attention recomputed);
    ``"full"`` keeps only the layer input, ``e n h`` (/ t with SP). With the CPU attention
    kernel (``attention_impl`` resolving to "cpu", :mod:`jmegatron.kernels.cpu`; float32
    compute only: with ``bf16`` it falls back to XLA's attention) the ``s^2`` terms are
    replaced by its float32 log-sum-exp, ``4 a s b`` (its output is the linear_proj input
    already counted), as FlashAttention.

    Context parallelism (``layout.context_parallel_size`` = ``c`` > 1,
    :mod:`jmegatron.parallel.context_parallel`): each device holds ``n = s b / c`` tokens,
    and the ``s^2`` terms become the context-parallel attention's (float32, whatever
    ``attention_impl`` says; ``recompute="selective"`` does not apply to it):
    ``cp_comm_type="p2p"`` (the ring's custom VJP keeps q, k, v, the output and the
    log-sum-exp) ``4 a n``; ``"all_gather"`` the gathered K and V ``2 e s b kv`` and the
    probabilities ``4 a n s``; ``"a2a"`` the head-split q, k, v ``e s b (q + 2 kv) / c`` and
    the probabilities ``4 (a / c) s^2 b`` (all / t); with the CPU kernel's block forms
    (float32) all_gather and a2a keep the log-sum-exp instead of the probabilities
    (``4 a n`` and ``4 (a / c) s b``); attention dropout under cp runs XLA's blocks (the
    ring recomputes its masks; all_gather also keeps the mask and the dropped
    probabilities, ``(4 + 1 + 4) a n s``). Raises ValueError for another
    ``recompute``, or ``moe=True`` with a dense ``cfg`` (``num_moe_experts`` None).
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTE_CHOICES}")
    if moe and cfg.num_moe_experts is None:
        raise ValueError("moe=True needs an MoE config: config.num_moe_experts is None")
    e = activation_bytes_per_element(cfg) if bytes_per_element is None else bytes_per_element
    t = layout.tensor_model_parallel_size
    sp_div = t if layout.sequence_parallel else 1
    s, b, h = cfg.seq_length, micro_batch_size, cfg.hidden_size
    c = layout.context_parallel_size
    n = s * b / c
    if recompute == "full":
        return e * n * h / sp_div
    m = MASK_BYTES if cfg.hidden_dropout > 0 else 0
    m_a = MASK_BYTES if cfg.attention_dropout > 0 else 0
    q = cfg.kv_channels * cfg.num_attention_heads
    kv = cfg.kv_channels * cfg.num_query_groups
    ffn = cfg.ffn_hidden_size
    fc1_width = 2 * ffn if cfg.gated_mlp else ffn
    replicated = n * h * (2 * e + e + e + 2 * m)
    split = n * (e * (q + kv) + e * kv + e * q + e * fc1_width + e * ffn)
    moe_mlp = 0.0
    if moe:
        # The MoE MLP replaces the dense one's fc1/fc2 terms (its input, the layernorm
        # output, stays in `replicated` as the router's and the dispatcher's input).
        split -= n * (e * fc1_width + e * ffn)
        moe_mlp = _moe_mlp_bytes(cfg, n, e, t)
    a = cfg.num_attention_heads
    kernel = resolve_impls(cfg)["attention_impl"] == "cpu" and not cfg.bf16  # bf16 falls back to XLA's
    if c > 1 and m_a:  # attention dropout under cp runs XLA's blocks
        kernel = False
    keys = 1 if kernel else s  # the kernel keeps a query's log-sum-exp, XLA its probabilities
    if c > 1 and cfg.cp_comm_type == "all_gather":
        # (with attention dropout, autodiff keeps the mask and the dropped probabilities too)
        per_score = FLOAT32_BYTES if kernel else FLOAT32_BYTES + (m_a + FLOAT32_BYTES if m_a else 0)
        scores = 2 * e * s * b * kv + per_score * a * n * keys
    elif c > 1 and cfg.cp_comm_type == "a2a":
        scores = e * s * b * (q + 2 * kv) / c + FLOAT32_BYTES * a / c * s * keys * b
    elif c > 1:  # p2p
        scores = FLOAT32_BYTES * a * n
    elif kernel:
        scores = FLOAT32_BYTES * cfg.num_attention_heads * s * b
    elif recompute == "selective":
        scores = 0
    else:
        scores = cfg.num_attention_heads * s * s * b * (e + (m_a + e if m_a else 0))
    return replicated / sp_div + (split + scores) / t + moe_mlp


@dataclasses.dataclass(frozen=True)
class ActivationMemory:
    """Bytes per device kept for the backward pass of one micro-batch: ``per_layer``
    (x ``num_layers`` = ``layers``), ``embedding`` (token ids and the embedding dropout
    mask), ``output`` (final layernorm input and output-layer input, float32 logits for
    the cross-entropy), ``recompute_working_set`` (full recomputation: one layer's
    activations rebuilt during its backward pass), ``recompute``; ``per_moe_layer``: an MoE
    layer's bytes (0 for a dense model), which replace ``per_layer`` in ``layers`` for the
    MoE layers."""

    recompute: str
    per_layer: float
    per_moe_layer: float
    layers: float
    embedding: float
    output: float
    recompute_working_set: float

    @property
    def total(self) -> float:
        return self.layers + self.embedding + self.output + self.recompute_working_set


def activation_memory(cfg: JMegatronConfig, padded_vocab_size: int, layout: ParallelLayout,
                      micro_batch_size: Optional[int] = None, recompute: Optional[str] = None,
                      bytes_per_element: Optional[int] = None,
                      num_microbatches: Optional[int] = None) -> ActivationMemory:
    """Activation bytes per device for one micro-batch (jmegatron's micro-batch loop holds
    one at a time). With pipeline stages (``p`` > 1), the first stage's under 1F1B, as
    Megatron: ``L / p`` layers for each of ``min(num_microbatches, p)`` micro-batches in
    flight (``p`` when ``num_microbatches`` is None), the embedding terms for as many, and
    no output layer (it is on the last stage).

    ``micro_batch_size`` defaults to ``cfg.micro_batch_size`` (sequences per data-parallel
    rank), ``recompute`` to ``cfg.recompute_granularity``. Besides the layers
    (:func:`activation_memory_per_layer`): token ids, 4 bytes per token (Megatron counts 8
    for int64), and the embedding dropout mask ``m s b h``; the final layernorm input and
    the output layer input ``2 e s b h`` (/ t with SP) and the float32 logits ``4 s b V / t``
    (Megatron's ``4 sbh (1 + V/h)`` counts the same logits plus one ``[s, b, h]``).

    MoE layers count ``activation_memory_per_layer(..., moe=True)`` each; the first pipeline
    stage is taken to hold the first layers of ``moe_layer_freq``'s pattern (Megatron's
    even split).
    """
    recompute = cfg.recompute_granularity if recompute is None else recompute
    b = cfg.micro_batch_size if micro_batch_size is None else micro_batch_size
    e = activation_bytes_per_element(cfg) if bytes_per_element is None else bytes_per_element
    t = layout.tensor_model_parallel_size
    sp_div = t if layout.sequence_parallel else 1
    n = cfg.seq_length * b / layout.context_parallel_size
    per_layer = activation_memory_per_layer(cfg, b, layout, recompute, e)
    m = MASK_BYTES if cfg.hidden_dropout > 0 else 0
    embedding = FLOAT32_BYTES * n + m * n * cfg.hidden_size / sp_div
    output = 2 * e * n * cfg.hidden_size / sp_div + FLOAT32_BYTES * n * padded_vocab_size / t
    pattern = (0,) * cfg.num_layers
    per_moe_layer = 0.0
    if cfg.num_moe_experts is not None:
        pattern = moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)
        per_moe_layer = activation_memory_per_layer(cfg, b, layout, recompute, e, moe=True)
    working = 0.0
    if recompute == "full":
        working = activation_memory_per_layer(cfg, b, layout, "none", e, moe=any(pattern))
    p = layout.pipeline_model_parallel_size
    held = pattern
    in_flight = 1
    if p > 1:
        first, _ = stage_layers(cfg, p)
        in_flight = p if num_microbatches is None else min(num_microbatches, p)
        held = pattern[:first]
        embedding *= in_flight
        output = 0.0
    layers = in_flight * (per_layer * (len(held) - sum(held)) + per_moe_layer * sum(held))
    return ActivationMemory(per_layer=per_layer, layers=layers, embedding=embedding,
                            output=output, recompute_working_set=working, recompute=recompute,
                            per_moe_layer=per_moe_layer)


# ------------------------------------------------------------------ everything
@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Theoretical bytes per device of one training step (see :func:`theoretical_memory`)."""

    layout: str
    num_parameters: int
    parameters_per_device: float
    weights: float
    gradients: float
    optimizer_state: float
    activations: float
    activations_by_recompute: dict
    megatron_weight_and_optimizer: float
    fsdp_gathered: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state + self.activations + self.fsdp_gathered

    def to_dict(self) -> dict:
        """Every field plus ``total`` (bytes), JSON-ready."""
        return {**dataclasses.asdict(self), "total": self.total}


def theoretical_memory(cfg: JMegatronConfig, padded_vocab_size: int, layout: ParallelLayout,
                       micro_batch_size: Optional[int] = None,
                       num_microbatches: Optional[int] = None) -> MemoryEstimate:
    """Weights, gradients, optimizer state (:func:`weight_and_optimizer_memory`) and
    activations (:func:`activation_memory` with ``cfg.recompute_granularity``; the other
    recompute choices in ``activations_by_recompute``) in bytes per device, and Megatron's
    own weight+optimizer figure for the same layout.

    Under FSDP, ``fsdp_gathered`` counts what the step materialises besides the shards:
    each micro-batch all-gathers the whole (tensor-sharded) float32 parameters, and
    autodiff produces their whole gradient before the reduce-scatter (jmegatron gathers
    all layers at once, not layer by layer as Megatron-FSDP): ``2 * 4`` bytes per
    parameter of the layout without FSDP, counted whole (XLA may overlap their lifetimes).
    ``num_microbatches`` matters only with pipeline stages (:func:`activation_memory`)."""
    state = weight_and_optimizer_memory(cfg, padded_vocab_size, layout)
    gathered = 0.0
    if layout.use_megatron_fsdp:
        unsharded = dataclasses.replace(layout, use_megatron_fsdp=False)
        param_bytes, grad_bytes, _ = state_bytes_per_parameter(cfg)
        gathered = (param_bytes + grad_bytes) * parameters_per_device(cfg, padded_vocab_size, unsharded)
    by_recompute = {r: activation_memory(cfg, padded_vocab_size, layout, micro_batch_size, r,
                                         num_microbatches=num_microbatches).total
                    for r in RECOMPUTE_CHOICES}
    return MemoryEstimate(
        layout=layout.name, num_parameters=flops.num_parameters(cfg, padded_vocab_size),
        parameters_per_device=parameters_per_device(cfg, padded_vocab_size, layout),
        weights=state.weights, gradients=state.gradients, optimizer_state=state.optimizer_state,
        activations=by_recompute[cfg.recompute_granularity], activations_by_recompute=by_recompute,
        megatron_weight_and_optimizer=megatron_weight_and_optimizer_memory(cfg, padded_vocab_size, layout),
        fsdp_gathered=gathered)
