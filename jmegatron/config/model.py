"""The model group of a run's config: :class:`TransformerConfig` (the architecture, with
its rotary part :class:`RotaryConfig` and its mixture-of-experts part :class:`MoEConfig`,
over the parallel sizes :class:`jmegatron.config.parallel.ModelParallelConfig`, as
Megatron-Core's ``TransformerConfig`` extends ``ModelParallelConfig``), and
:class:`KernelConfig`, the kernels that run it. The model's modules take these groups
(:class:`jmegatron.models.transformer_config.ModelConfig` is a :class:`TransformerConfig`;
:class:`jmegatron.models.rope.RotaryEmbedding` holds a :class:`RotaryConfig`).

Field names, defaults and meanings follow megatron/training/arguments.py
(``_add_network_size_args``, ``_add_moe_args``) and
megatron/core/transformer/transformer_config.py.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from typing import Any, Optional

from jmegatron.config.common import (ConfigError, ConfigGroup, check_nonnegative, check_positive, check_unset,
                                     refuse_with)
from jmegatron.config.parallel import ModelParallelConfig
from jmegatron.parallel.pipeline_layout import PipelineLayout

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = ("none", "full", "selective")
# "auto": the CPU kernels (jmegatron.kernels.cpu) on a CPU backend in float32 without
# tensor parallelism, else XLA's ops ("xla"); resolved by jmegatron.models.gpt.ModelConfig.
# "auto" picks per backend (jmegatron.models.gpt.resolve_impls): the CPU kernel on a CPU, cuDNN's
# flash attention on an NVIDIA GPU, else XLA's; "pallas" = jmegatron.kernels.pallas (GPU, or the
# CPU in Pallas interpret mode); "cudnn" = jax.nn.dot_product_attention(implementation="cudnn")
ATTENTION_IMPLS = ("auto", "xla", "dot_product", "cpu", "pallas", "cudnn")
# the vocab-parallel cross-entropy: "xla" (jmegatron.fusions.fused_cross_entropy) or "pallas"
# (jmegatron.kernels.pallas); "auto": "pallas" on a GPU, else "xla"
CROSS_ENTROPY_IMPLS = ("auto", "xla", "pallas")
# Megatron's --fp8-format: "e4m3" everywhere, or "hybrid" (e4m3 forward, e5m2 gradients)
FP8_FORMATS = ("e4m3", "hybrid")
# Megatron's --fp8-recipe; the pure-JAX path builds "delayed" only (the others need
# Transformer Engine: jmegatron.models.te)
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8")
FP8_AMAX_COMPUTE_ALGOS = ("most_recent", "max")
# Megatron's --transformer-impl; "auto": Transformer Engine where transformer_engine.jax
# imports and the backend is a GPU, else "local" (jmegatron's own layers)
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
MATMUL_IMPLS = ("auto", "xla", "blas", "hybrid")
DROPOUT_IMPLS = ("hash", "threefry")  # jmegatron.models.dropout.DROPOUT_IMPLS
# megatron-core's softmax_type (the attention's softmax; jmegatron.kernels.xla.attention)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# The MoE choices (Megatron's arguments.py / transformer_config.py); the layers in
# jmegatron/models/moe read them from here
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
TOKEN_DISPATCHER_TYPES = ("allgather", "alltoall")
ROUTER_DTYPES = (None, "fp32", "fp64")
# what multi-token prediction is not built with (MTP's refusals, here and in the run's config)
MTP_REFUSAL = ("multi-token prediction runs without context parallelism, in language-model training",
               "unset mtp_num_layers or {name}.")



def yarn_concentration_factor(scale: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's attention factor for scaling factor ``scale``:
    ``(0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)``, 1 for ``s <= 1``
    (megatron-core ``_yarn_get_concentration_factor``; transformers' ``attention_factor``)."""
    return yarn_get_mscale(scale, mscale) / yarn_get_mscale(scale, mscale_all_dim)


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """YaRN's ``0.1 mscale ln(scale) + 1``, 1 for ``scale <= 1`` (megatron-core ``_yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

def moe_layer_pattern(moe_layer_freq: Any, num_layers: int) -> tuple[int, ...]:
    """1 for each decoder layer that is an MoE layer, 0 for a dense one.

    ``moe_layer_freq`` as Megatron's ``--moe-layer-freq`` (transformer_config.py,
    arguments.py ``moe_freq_type``): an int N makes layer i an MoE layer when i % N == 0;
    a sequence of 0/1 gives each layer (DeepSeek's first-k-dense is ``[0]*k + [1]*(L-k)``);
    a string is Megatron's command-line form, ``"2"``, ``"[0,1,1,1]"`` or
    ``"([0]*1+[1]*3)"``. Raises ValueError for anything else or a length != num_layers.
    """
    freq = parse_moe_layer_freq(moe_layer_freq)
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq} must be >= 1")
        return tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise ValueError(f"moe_layer_freq={list(freq)} must hold one 0 (dense) or 1 (MoE) per layer "
                         f"({num_layers} layers)")
    return tuple(int(v) for v in freq)


def window_layer_pattern(window_size: Any, window_attn_skip_freq: Any, num_layers: int) -> tuple[int, ...]:
    """1 for each decoder layer (0-based) whose attention slides, else 0: megatron-core's
    ``is_layer_window_attention`` (megatron/core/transformer/utils.py) with its 1-based
    layer numbers. No ``window_size``: all 0. ``window_attn_skip_freq`` None: every layer;
    an int N: layers whose number ``i + 1`` is not a multiple of N (Gemma-2: N = 2, Gemma-3:
    N = 6); a list: its 0/1 entry per layer. Raises ValueError for anything else or a list
    whose length is not ``num_layers``."""
    if window_size is None:
        return (0,) * num_layers
    freq = window_attn_skip_freq
    if freq is None:
        return (1,) * num_layers
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ValueError(f"window_attn_skip_freq={freq} must be >= 1")
        return tuple(int((i + 1) % freq != 0) for i in range(num_layers))
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(v in (0, 1) for v in freq):
        return tuple(int(v) for v in freq)
    raise ValueError(f"window_attn_skip_freq={freq!r} must be an int or one 0/1 per layer ({num_layers} layers; "
                     f"1 = sliding window)")


def no_rope_layer_pattern(no_rope_freq: Any, num_layers: int) -> tuple[int, ...]:
    """1 for each decoder layer (0-based) that applies no position embedding (NoPE), 0 for
    one that rotates its queries and keys: megatron-core's ``no_rope_freq``
    (megatron/core/transformer/transformer_config.py, attention.py). None (or Megatron's
    falsy 0): all 0. An int N: N - 1 RoPE layers then one NoPE layer, repeated (layers whose
    1-based number is a multiple of N skip RoPE; Megatron asserts ``num_layers % N == 0``);
    a list: its 0/1 entry per layer (1 = skip RoPE); a string is Megatron's command-line
    form, ``"4"`` or ``"([0]*3+[1])*2"``. Hugging Face SmolLM3's ``no_rope_layers`` is the
    complement (1 = RoPE). Raises ValueError for anything else, an int that does not divide
    ``num_layers`` or a list whose length is not ``num_layers``."""
    freq = no_rope_freq
    if isinstance(freq, str):
        try:
            freq = _eval_list_expr(ast.parse(freq.strip(), mode="eval").body)
        except (SyntaxError, ValueError, TypeError):
            raise ValueError(f"no_rope_freq={no_rope_freq!r} is not an int or a list expression such as "
                             f"'([0]*3+[1])*2'") from None
    if freq is None or (isinstance(freq, int) and not isinstance(freq, bool) and freq == 0):
        return (0,) * num_layers
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 0 or num_layers % freq:
            raise ValueError(f"no_rope_freq={freq} must be >= 1 and divide num_layers={num_layers} (Megatron's "
                             f"rule: N - 1 RoPE layers then one NoPE layer, repeated); give one 0/1 per layer "
                             f"instead")
        return tuple(int((i + 1) % freq == 0) for i in range(num_layers))
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(
            v in (0, 1) and not isinstance(v, float) for v in freq):
        return tuple(int(v) for v in freq)
    raise ValueError(f"no_rope_freq={no_rope_freq!r} must be an int or one 0/1 per layer ({num_layers} layers; "
                     f"1 = no RoPE)")


def parse_moe_layer_freq(value: Any) -> Any:
    """``value`` as an int or a tuple of ints (Megatron's ``moe_freq_type``: a string is
    evaluated as a list expression of integer lists, ``+`` and ``*`` only)."""
    if isinstance(value, bool):
        raise ValueError(f"moe_layer_freq={value!r} must be an int or a list of 0/1")
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, str):
        try:
            tree = ast.parse(value.strip(), mode="eval")
            return parse_moe_layer_freq(_eval_list_expr(tree.body))
        except (SyntaxError, ValueError, TypeError):
            raise ValueError(f"moe_layer_freq={value!r} is not an int or a list expression such as "
                             f"'([0]*1+[1]*3)'") from None
    raise ValueError(f"moe_layer_freq={value!r} must be an int or a list of 0/1")


def _eval_list_expr(node: ast.AST) -> Any:
    """Evaluate an expression of int constants, lists of them, ``+`` and ``*`` (no names,
    no calls)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval_list_expr(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_list_expr(node.left), _eval_list_expr(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("unsupported expression")



@dataclasses.dataclass(frozen=True)
class RotaryConfig(ConfigGroup):
    """The rotary position embedding's fields (megatron-core's ``RotaryEmbedding`` and
    ``YarnRotaryEmbedding`` arguments); :class:`jmegatron.models.rope.RotaryEmbedding`
    computes its frequencies from them."""

    CHOICES = {"position_embedding_type": POSITION_EMBEDDING_TYPES}

    # --- rotary positions (megatron/training/arguments.py: _add_network_size_args) ---
    position_embedding_type: str = "learned_absolute"  # "rope" | "yarn": rotary (jmegatron.models.rope)
    rotary_base: int = 10000
    # RoPE's positions divided by this factor (Megatron's --rotary-seq-len-interpolation-factor;
    # Hugging Face rope_type "linear"); None: 1
    rotary_seq_len_interpolation_factor: Optional[float] = None
    # Llama-3.x frequency scaling (megatron-core RotaryEmbedding's rope_scaling /
    # rope_scaling_factor; HF rope_type "llama3"); the three bounds are Megatron's fixed
    # values (1, 4, 8192), fields here because Hugging Face configs give them per model
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    # YaRN (Peng et al. 2023) under position_embedding_type="yarn": megatron-core's yarn_* fields
    # (YarnRotaryEmbedding; HF rope_type "yarn": factor, original_max_position_embeddings,
    # beta_fast, beta_slow, mscale, mscale_all_dim, truncate)
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    # partial RoPE (megatron-core's rotary_percent; HF partial_rotary_factor: Phi-3, GLM):
    # only the first int(kv_channels * rotary_percent) channels of each head rotate, the
    # rest pass through; 1.0: the whole head
    rotary_percent: float = 1.0
    # interleaved RoPE (megatron-core's rotary_interleaved; HF Cohere / GLM): channel pairs
    # (0, 1), (2, 3), ... rotate together instead of the two halves (i, i + d/2)
    rotary_interleaved: bool = False

    def check_rotary(self) -> None:
        """Raise ConfigError naming the field for a rotary scaling where it does not apply
        or out of range (jmegatron.models.rope)."""
        rotary = self.position_embedding_type in ("rope", "yarn")
        if self.rope_scaling and self.position_embedding_type != "rope":
            raise ConfigError(f"config.rope_scaling=True (Llama-3.x scaling) needs position_embedding_type='rope', "
                              f"not {self.position_embedding_type!r}.")
        if self.rotary_seq_len_interpolation_factor is not None and not rotary:
            raise ConfigError("config.rotary_seq_len_interpolation_factor needs position_embedding_type 'rope' "
                              f"or 'yarn', not {self.position_embedding_type!r}.")
        if self.rotary_seq_len_interpolation_factor is not None and self.rotary_seq_len_interpolation_factor < 1:
            raise ConfigError(f"config.rotary_seq_len_interpolation_factor={self.rotary_seq_len_interpolation_factor} "
                              "must be >= 1 (or None).")
        if self.rope_scaling:
            if not self.rope_scaling_factor >= 1:
                raise ConfigError(f"config.rope_scaling_factor={self.rope_scaling_factor} must be >= 1.")
            if not 0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor:
                raise ConfigError(f"config.rope_scaling_low_freq_factor={self.rope_scaling_low_freq_factor} must be "
                                  f"> 0 and below rope_scaling_high_freq_factor={self.rope_scaling_high_freq_factor}.")
            if self.rope_scaling_original_max_position_embeddings <= 0:
                raise ConfigError("config.rope_scaling_original_max_position_embeddings="
                                  f"{self.rope_scaling_original_max_position_embeddings} must be > 0.")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"config.rotary_percent={self.rotary_percent} must be in (0, 1] (the fraction of "
                              f"each head's channels RoPE rotates).")
        for name, off in (("rotary_percent", 1.0), ("rotary_interleaved", False)):
            if getattr(self, name) != off and not rotary:
                raise ConfigError(f"config.{name}={getattr(self, name)} needs position_embedding_type 'rope' or "
                                  f"'yarn', not {self.position_embedding_type!r}; unset {name}.")
        if self.position_embedding_type == "yarn":
            if not self.yarn_rotary_scaling_factor >= 1:
                raise ConfigError(f"config.yarn_rotary_scaling_factor={self.yarn_rotary_scaling_factor} must be >= 1.")
            if self.yarn_original_max_position_embeddings <= 0:
                raise ConfigError("config.yarn_original_max_position_embeddings="
                                  f"{self.yarn_original_max_position_embeddings} must be > 0.")


@dataclasses.dataclass(frozen=True)
class MoEConfig(ConfigGroup):
    """The mixture-of-experts fields (Megatron's ``_add_moe_args`` and TransformerConfig's
    ``moe_*``); ``moe_ffn_hidden_size`` is resolved by the run's config. The layers of
    :mod:`jmegatron.models.moe` read them."""

    # --- mixture of experts (megatron/training/arguments.py: _add_moe_args;
    # megatron/core/transformer/transformer_config.py; jmegatron.models.moe, docs/MOE.md) ---
    num_moe_experts: Optional[int] = None  # Megatron: --num-experts; None: dense MLPs
    moe_ffn_hidden_size: Optional[int] = None  # None: = ffn_hidden_size (MoE models)
    # which layers are MoE: int N -> layer i when i % N == 0; or one 0/1 per layer (Megatron's
    # list form; DeepSeek's first-k-dense is [0]*k + [1]*(L-k)); the string "([0]*1+[1]*3)" too
    moe_layer_freq: Any = 1
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False  # softmax (sigmoid) over all experts before the top-k
    moe_router_topk_scaling_factor: Optional[float] = None  # multiplies the top-k weights
    # group-limited (device-limited) routing, DeepSeek-V2/V3: the experts in
    # moe_router_num_groups groups, each scored by the sum of its top topk // group_topk
    # scores; the top-k is taken inside the best moe_router_group_topk groups. None: off
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | sinkhorn | none
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    # DeepSeek-V3's aux-loss-free balancing (sigmoid scores only): a per-expert bias on the routing
    # choice, moved by moe_router_bias_update_rate after each step (jmegatron.models.moe.moe_layer)
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_dtype: Optional[str] = None  # None (the activations' dtype) | fp32 | fp64 (needs jax x64)
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_token_dispatcher_type: str = "allgather"  # allgather | alltoall (the same on one expert rank)
    moe_grouped_gemm: bool = False  # accepted; the experts always run as grouped/batched GEMMs
    moe_shared_expert_intermediate_size: Optional[int] = None  # None: no shared expert
    # the shared expert's output times sigmoid(x W_g), W_g [h, 1] (Megatron-Core's
    # moe_shared_expert_gate; Qwen2-MoE's shared_expert_gate)
    moe_shared_expert_gate: bool = False

    def check_moe(self) -> None:
        """Raise ConfigError naming the field for a bad MoE value, as Megatron's
        TransformerConfig.__post_init__ and validate_args check them, plus what jmegatron does
        not build yet."""
        if self.num_moe_experts is None:
            check_unset(self, ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"),
                        "config.{name}={value} needs config.num_moe_experts (the model is dense without it); set "
                        "num_moe_experts or unset {name}.")
            return
        e, k = self.num_moe_experts, self.moe_router_topk
        for name, allowed in (("moe_router_score_function", SCORE_FUNCTIONS),
                              ("moe_router_load_balancing_type", LOAD_BALANCING_TYPES),
                              ("moe_token_drop_policy", TOKEN_DROP_POLICIES),
                              ("moe_token_dispatcher_type", TOKEN_DISPATCHER_TYPES),
                              ("moe_router_dtype", ROUTER_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"config.{name}={getattr(self, name)!r} is not one of {list(allowed)}.")
        for name in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be > 0.")
        if k > e:
            raise ConfigError(f"config.moe_router_topk={k} exceeds config.num_moe_experts={e}; "
                              f"a token cannot choose more experts than there are.")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be >= 0.")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError("config.moe_shared_expert_gate=True gates the shared expert, which needs "
                              "config.moe_shared_expert_intermediate_size; set it or unset the gate.")
        for name in ("moe_expert_capacity_factor", "moe_router_topk_scaling_factor",
                     "moe_shared_expert_intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                unset = " (None: dropless)" if name == "moe_expert_capacity_factor" else ""
                raise ConfigError(f"config.{name}={getattr(self, name)} must be > 0 or None{unset}.")
        balancing = self.moe_router_load_balancing_type
        if self.moe_expert_capacity_factor is not None and balancing == "sinkhorn":
            raise ConfigError("config.moe_expert_capacity_factor works with aux_loss, seq_aux_loss or none "
                              "load balancing (Megatron's rule), not sinkhorn; unset the capacity factor.")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ConfigError("config.moe_pad_expert_input_to_capacity=True needs "
                              "config.moe_expert_capacity_factor; set it or drop the padding.")
        if balancing == "sinkhorn" and self.moe_aux_loss_coeff:
            raise ConfigError("config.moe_router_load_balancing_type='sinkhorn' takes no auxiliary loss; "
                              "set moe_aux_loss_coeff=0.")
        if (k == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax
                and balancing != "sinkhorn"):
            raise ConfigError("config.moe_router_topk=1 with softmax scores needs "
                              "config.moe_router_pre_softmax=True (a softmax over one logit has no gradient; "
                              "Megatron's rule).")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ConfigError(f"config.moe_router_num_groups={groups} and moe_router_group_topk={group_topk}: "
                              f"group-limited routing needs both (or neither).")
        if groups is not None:
            if groups <= 0 or e % groups:
                raise ConfigError(f"config.moe_router_num_groups={groups} must divide num_moe_experts={e}.")
            if not 0 < group_topk <= groups:
                raise ConfigError(f"config.moe_router_group_topk={group_topk} must be in 1..moe_router_num_groups="
                                  f"{groups}.")
            if group_topk > k or k > group_topk * (e // groups):
                raise ConfigError(f"config.moe_router_group_topk={group_topk} with moe_router_topk={k}: each kept "
                                  f"group is scored by its top topk // group_topk experts (at least 1), and the "
                                  f"{group_topk} groups of {e // groups} experts must hold the top-{k}.")
        if self.moe_router_enable_expert_bias:
            if self.moe_router_score_function != "sigmoid":
                raise ConfigError("config.moe_router_enable_expert_bias=True needs "
                                  "config.moe_router_score_function='sigmoid' (Megatron's rule).")
        if self.moe_router_dtype == "fp64":
            import jax

            if not jax.config.jax_enable_x64:
                raise ConfigError("config.moe_router_dtype='fp64' needs 64-bit JAX (JAX_ENABLE_X64=1 in the "
                                  "environment); use 'fp32' otherwise.")


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ModelParallelConfig, RotaryConfig, MoEConfig):
    """The architecture of a run's model (Megatron-Core's ``TransformerConfig``): sizes,
    attention and MLP variants, multi-latent attention, multi-token prediction, FP8, with
    the rotary, MoE and parallel groups it extends. ``None`` fields are derived by the run's
    config (:class:`jmegatron.config.JMegatronConfig`)."""

    CHOICES = {"normalization": NORMALIZATIONS, "recompute_granularity": RECOMPUTE_GRANULARITIES,
               "dropout_impl": DROPOUT_IMPLS, "fp8_amax_compute_algo": FP8_AMAX_COMPUTE_ALGOS,
               "fp8_recipe": FP8_RECIPES}

    # --- model (megatron/training/arguments.py: _add_network_size_args) ---
    num_layers: int = 4
    hidden_size: int = 256
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size (8/3 * h rounded for swiglu is the user's job, as in Megatron)
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: = num_attention_heads (multi-head attention)
    kv_channels: Optional[int] = None  # None: hidden_size // num_attention_heads
    seq_length: int = 256
    max_position_embeddings: Optional[int] = None  # None: = seq_length
    vocab_size: Optional[int] = None  # None: taken from the tokenizer; required for mock data
    make_vocab_size_divisible_by: int = 128
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    # the MLP's GELU as the tanh approximation (Megatron's --openai-gelu; HF gelu_new /
    # gelu_pytorch_tanh); False: the exact erf GELU
    openai_gelu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # only used when add_bias_linear is False (Qwen-style QKV bias)
    # RMSNorm / LayerNorm (``normalization``) of each query and key head over kv_channels,
    # before RoPE (megatron-core's qk_layernorm; Qwen3, Gemma-3)
    qk_layernorm: bool = False
    # (jmegatron; Megatron-Core has no such option) with qk_layernorm: one norm over all query heads
    # together and one over all key heads, their statistics taken over heads x kv_channels and their
    # scales [num_attention_heads, kv_channels] / [num_query_groups, kv_channels] (OLMo-2/3's q_norm /
    # k_norm on the whole projection); False: each head normed over its kv_channels
    qk_layernorm_across_heads: bool = False
    # multi-latent attention (DeepSeek-V2/V3; megatron-core's MLATransformerConfig and
    # Megatron-LM's --multi-latent-attention, --q-lora-rank, ...): the queries through a rank
    # q_lora_rank bottleneck (None: one projection), keys and values through kv_lora_rank, heads of
    # qk_head_dim + qk_pos_emb_head_dim (the rotary part) for q and k and v_head_dim for v;
    # qk_layernorm gives the latents their norms. kv_channels is unused with it
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # multi-token prediction (DeepSeek-V3; Megatron-LM's --mtp-num-layers, --mtp-loss-scaling-factor):
    # mtp_num_layers depths, depth k predicting the token k + 1 ahead with one more transformer
    # layer of the last decoder layer's kind; their losses are reported as "mtp_k loss" and add
    # mtp_loss_scaling_factor / mtp_num_layers times their sum to the optimised loss. None: off
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    # Megatron's --apply-layernorm-1p (megatron-core's layernorm_zero_centered_gamma): every
    # norm multiplies by (1 + scale), its scale initialised to 0 (Gemma's RMSNorm)
    apply_layernorm_1p: bool = False
    # a gated MLP (megatron-core's gated_linear_unit): linear_fc1 [h, 2, ffn], act(gate) * up,
    # the activation GELU (tanh with openai_gelu: Gemma's GeGLU); swiglu is the SiLU form
    gated_linear_unit: bool = False
    # the quick-GELU gated MLP (Megatron-LM's --quick-geglu: gated_linear_unit with
    # megatron-core's quick_gelu activation, x * sigmoid(1.702 x)): linear_fc1 [h, 2, ffn],
    # quick_gelu(gate) * (up + glu_linear_offset), gate clamped to <= activation_func_clamp_value
    # and up to +-activation_func_clamp_value when that is set (gpt-oss's experts)
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0  # megatron-core's glu_linear_offset (quick_geglu only)
    activation_func_clamp_value: Optional[float] = None  # megatron-core's (quick_geglu only); None: no clamp
    # megatron-core's softmax_type: "vanilla" softmax; "off-by-one" adds a zero logit to each
    # query's softmax denominator; "learnable" adds a learned logit per query head
    # (self_attention/softmax_offset [num_attention_heads]; gpt-oss's attention sinks)
    softmax_type: str = "vanilla"
    # the attention's score scale (megatron-core's softmax_scale; HF query_pre_attn_scalar**-0.5);
    # None: 1 / sqrt(kv_channels)
    softmax_scale: Optional[float] = None
    # c * tanh(x / c) on the scaled attention scores before masking, and on the output
    # logits (Gemma-2's attn_logit_softcapping / final_logit_softcapping); None: off
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    # sliding-window attention (megatron-core's window_size (left, right); causal only, so
    # right is 0): query i sees keys i - left .. i. HF sliding_window W is (W - 1, 0). None: off
    window_size: Any = None
    # which layers slide (megatron-core's window_attn_skip_freq): an int N windows the layers
    # whose 1-based number is not a multiple of N; a list of 0/1 per layer (1 = windowed);
    # None: every layer (with window_size)
    window_attn_skip_freq: Any = None
    # the RoPE base of the windowed layers (Gemma-3's local base, OLMo-3's sliding layers'), unscaled; the full layers
    # keep rotary_base and the scalings. None: one RoPE for all layers
    rotary_base_local: Optional[int] = None
    # post-norms after the attention and the MLP, before their residual adds (Gemma-2/3's
    # post_attention_layernorm / post_feedforward_layernorm): post_self_attn_layernorm,
    # post_mlp_layernorm
    sandwich_norms: bool = False
    # (jmegatron; Megatron-Core's layers always have them) the pre-norms input_layernorm and
    # pre_mlp_layernorm before the attention and the MLP; False: none, the layer normalises only
    # their outputs (sandwich_norms' post-norms, which it needs: OLMo-2/3)
    pre_norms: bool = True
    # the word embeddings times sqrt(hidden_size), rounded to the compute dtype (Gemma)
    scale_embeddings: bool = False
    # the decoder layers that apply no position embedding (NoPE; megatron-core's no_rope_freq):
    # an int N skips RoPE on every N-th layer (1-based numbers N, 2N, ...; N divides num_layers),
    # a list of 0/1 per layer (1 = no RoPE; HF SmolLM3's no_rope_layers is its complement);
    # None: every layer rotates
    no_rope_freq: Any = None
    # Granite's scalars (transformers' GraniteConfig names; megatron-core has none): the word
    # embeddings times embedding_multiplier, each attention / MLP output times
    # residual_multiplier before its residual add, the output logits divided by
    # logits_scaling. 1.0: off
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # jmegatron-only model execution options
    scan_layers: bool = False  # nn.scan over layers (one compiled layer body)
    recompute_granularity: str = "none"  # Megatron: --recompute-granularity {full,selective}
    # dropout masks: "hash" (counter-based hash of the element index, jmegatron.models.dropout)
    # or "threefry" (jax.random.bernoulli, ~50x slower on CPU)
    dropout_impl: str = "hash"

    # --- FP8 (megatron/training/arguments.py: _add_mixed_precision_args; docs/PRECISION.md) ---
    # FP8 linear layers (Megatron's --fp8-format); None: off. Delayed scaling in pure JAX
    # (jmegatron.models.fp8) or Transformer Engine's recipes (transformer_impl)
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"

    def check_model(self) -> None:
        """Raise ConfigError naming the field for a bad model value: sizes, dropouts, the
        attention and MLP variants, RoPE, MoE, FP8, and the model's split over the parallel
        sizes (pipeline stages, context and expert ranks)."""
        check_positive(self, ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                              "make_vocab_size_divisible_by", "ffn_hidden_size", "num_query_groups", "kv_channels",
                              "max_position_embeddings"))
        self.check_parallel()
        check_nonnegative(self, ("init_method_std",))
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be in [0, 1).")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"config.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"config.num_query_groups={self.num_query_groups}; choose a divisor of the heads.")
        self._check_mla()
        self._check_mtp()
        self._check_norm_placement()
        if self.position_embedding_type in ("rope", "yarn") and self.kv_channels % 2 and not self.multi_latent_attention:
            raise ConfigError(f"config.kv_channels={self.kv_channels} must be even for {self.position_embedding_type}.")
        self.check_rotary()
        self._check_partial_rotary()
        self._check_gemma_blocks()
        self._check_no_rope()
        self._check_multipliers()
        self._check_gpt_oss_blocks()
        if self.openai_gelu and self.swiglu:
            raise ConfigError("config.openai_gelu=True with swiglu=True: SwiGLU's activation is SiLU, so the tanh GELU "
                              "would not be used; set openai_gelu=False (or swiglu=False for a GELU MLP).")
        if self.seq_length > self.max_position_embeddings and self.position_embedding_type == "learned_absolute":
            raise ConfigError(
                f"config.seq_length={self.seq_length} exceeds config.max_position_embeddings="
                f"{self.max_position_embeddings}; raise max_position_embeddings.")
        self._check_fp8()
        self._check_pipeline()
        self.check_moe()
        self._check_moe_layers()
        self._check_context_parallel()
        self._check_expert_parallel()

    def _check_fp8(self):
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ConfigError(f"config.fp8={self.fp8!r} is not one of {list(FP8_FORMATS)} (or None: no FP8).")
        if self.fp8_amax_history_len < 1:
            raise ConfigError(f"config.fp8_amax_history_len={self.fp8_amax_history_len} must be >= 1.")
        if self.fp8_margin < 0:
            raise ConfigError(f"config.fp8_margin={self.fp8_margin} must be >= 0.")

    def _check_moe_layers(self):
        """The MoE layers' placement and what the rest of the model must be for them."""
        if self.num_moe_experts is None:
            return
        try:
            pattern = moe_layer_pattern(self.moe_layer_freq, self.num_layers)
        except ValueError as err:
            raise ConfigError(f"config.{err}.") from None
        if isinstance(self.moe_layer_freq, (list, str)):  # canonical: an int or a tuple
            object.__setattr__(self, "moe_layer_freq", parse_moe_layer_freq(self.moe_layer_freq))
        if self.expert_tensor_parallel_size != self.tensor_model_parallel_size:
            raise ConfigError(f"config.expert_tensor_parallel_size={self.expert_tensor_parallel_size} differs "
                              f"from tensor_model_parallel_size={self.tensor_model_parallel_size}; only equal "
                              f"sizes are built (unset it).")
        if self.pipeline_model_parallel_size > 1 and len(set(pattern)) > 1:
            raise ConfigError(f"config.moe_layer_freq={self.moe_layer_freq!r} mixes dense and MoE layers, but "
                              f"pipeline_model_parallel_size={self.pipeline_model_parallel_size} stacks identical "
                              f"layers (each stage holds a slice of one stacked decoder); make every layer MoE "
                              f"(moe_layer_freq=1) or set pipeline_model_parallel_size=1.")
        if self.scan_layers and len(set(pattern)) > 1:
            raise ConfigError(f"config.scan_layers=True stacks identical layers, but config.moe_layer_freq="
                              f"{self.moe_layer_freq!r} mixes dense and MoE layers; set scan_layers=False or "
                              f"make every layer MoE (moe_layer_freq=1).")


    def _check_expert_parallel(self):
        ep = self.expert_model_parallel_size
        if ep > 1 and self.num_moe_experts is None:
            raise ConfigError(f"config.expert_model_parallel_size={ep} splits the experts of MoE layers; this model "
                              f"is dense (config.num_moe_experts is None): set num_moe_experts or use 1.")
        if ep > 1 and self.num_moe_experts % ep:
            raise ConfigError(f"config.num_moe_experts={self.num_moe_experts} is not divisible by "
                              f"config.expert_model_parallel_size={ep}; every expert rank holds the same number "
                              f"of experts.")
        if ep > 1 and self.moe_expert_capacity_factor is not None and self.moe_token_dispatcher_type == "allgather":
            raise ConfigError("config.moe_expert_capacity_factor with moe_token_dispatcher_type='allgather' under "
                              "expert parallelism: the allgather dispatcher is dropless (Megatron takes a capacity "
                              "with alltoall only); set moe_token_dispatcher_type='alltoall' or unset the factor.")

    def check_parallel_divisibility(self, padded_vocab_size: int, data_parallel_size: int) -> None:
        """Raise ConfigError naming the numbers when a parallel size does not divide the
        heads, query groups, FFN size, padded vocabulary or sequence (Megatron's
        validate_args and the divisibility asserts of its parallel layers)."""
        tp = self.tensor_model_parallel_size
        checks = [("num_attention_heads", self.num_attention_heads),
                  ("num_query_groups", self.num_query_groups),
                  ("ffn_hidden_size", self.ffn_hidden_size),
                  ("padded vocab size", padded_vocab_size)]
        if self.sequence_parallel:
            checks.append(("seq_length", self.seq_length))
        for name, value in checks:
            if value % tp:
                raise ConfigError(f"{name}={value} is not divisible by tensor_model_parallel_size={tp}; "
                                  f"choose a tensor size that divides it.")
        group = data_parallel_size * self.context_parallel_size  # FSDP shards over data x context
        if self.use_megatron_fsdp and self.hidden_size % group:
            raise ConfigError(f"hidden_size={self.hidden_size} is not divisible by the data-parallel size "
                              f"{data_parallel_size} x context_parallel_size {self.context_parallel_size} "
                              f"(use_megatron_fsdp shards parameters on hidden over both).")

    def _check_context_parallel(self):
        """Context parallelism (jmegatron.parallel.context_parallel, docs/CONTEXT_PARALLEL.md):
        Megatron's load-balanced split needs ``seq_length`` divisible by ``2 cp``; what is not
        built yet is refused naming the field."""
        cp = self.context_parallel_size
        if cp == 1:
            return
        tp = self.tensor_model_parallel_size
        if self.cp_comm_type == "a2a":
            for name in ("num_attention_heads", "num_query_groups"):
                heads = getattr(self, name) or self.num_attention_heads
                if heads % (tp * cp):
                    raise ConfigError(f"config.{name}={heads} is not divisible by tensor_model_parallel_size x "
                                      f"context_parallel_size = {tp * cp}: cp_comm_type='a2a' (Ulysses) splits "
                                      f"each tensor rank's heads over the context ranks; use cp_comm_type='p2p'.")
        if self.seq_length % (2 * cp):
            raise ConfigError(f"config.seq_length={self.seq_length} must be divisible by 2 x "
                              f"context_parallel_size={2 * cp} (Megatron's load-balanced split: 2 cp chunks).")
        if self.attention_dropout and self.cp_comm_type == "a2a":
            raise ConfigError(f"config.attention_dropout={self.attention_dropout} with context_parallel_size={cp} "
                              f"and cp_comm_type='a2a': the head-split attention has no dropout; set "
                              f"cp_comm_type='p2p' or 'all_gather', or attention_dropout=0.0.")
        if (self.hidden_dropout or self.attention_dropout) and self.dropout_impl != "hash":
            raise ConfigError(f"config.dropout_impl={self.dropout_impl!r} with dropout and "
                              f"context_parallel_size={cp}: only the 'hash' masks follow the load-balanced "
                              f"sequence slots; set dropout_impl='hash'.")
        if self.pipeline_model_parallel_size > 1 and self.cp_comm_type == "p2p":
            # XLA:CPU's collective-permute rendezvous spans every device of the program, so the ring's
            # ppermutes inside the schedule's per-stage conditionals meet other stages' executions
            # (measured: losses off by 2e-4..4e-3 relative; a ring under a one-stage cond deadlocks).
            # all_gather's and all_to_all's rendezvous are per context group: they pipeline.
            raise ConfigError(f"config.pipeline_model_parallel_size={self.pipeline_model_parallel_size} with "
                              f"context_parallel_size={cp} and cp_comm_type='p2p' is not built (the ring's "
                              f"ppermutes inside the pipeline schedule's stage conditionals); set "
                              f"cp_comm_type='all_gather' or 'a2a', or pipeline_model_parallel_size=1.")

    def _check_mla(self):
        """Multi-latent attention: what it needs and what is not built with it."""
        if not self.multi_latent_attention:
            return
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be > 0.")
        if self.position_embedding_type not in ("rope", "yarn") or self.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"config.multi_latent_attention=True rotates qk_pos_emb_head_dim="
                              f"{self.qk_pos_emb_head_dim} dims (even) with position_embedding_type 'rope' or "
                              f"'yarn', not {self.position_embedding_type!r}.")
        if self.num_query_groups != self.num_attention_heads:
            raise ConfigError(f"config.multi_latent_attention=True with num_query_groups={self.num_query_groups}: "
                              f"MLA has one key/value head per query head (Megatron makes MLA and GQA exclusive); "
                              f"unset num_query_groups.")
        refused = dict(context_parallel_size=self.context_parallel_size > 1,
                       pipeline_model_parallel_size=self.pipeline_model_parallel_size > 1,
                       softmax_scale=self.softmax_scale is not None, window_size=self.window_size is not None,
                       attn_logit_softcapping=self.attn_logit_softcapping is not None,
                       add_qkv_bias=self.add_qkv_bias, rope_scaling=self.rope_scaling,
                       softmax_type=self.softmax_type != "vanilla",
                       rotary_seq_len_interpolation_factor=self.rotary_seq_len_interpolation_factor is not None,
                       rotary_percent=self.rotary_percent != 1.0, rotary_interleaved=self.rotary_interleaved)
        refuse_with(self, "multi_latent_attention=True", refused, "multi-latent attention runs on one context / "
                          "pipeline rank with its own score scale and RoPE", "drop {name}.")

    def _check_norm_placement(self):
        """The QK-norm across heads and a layer without pre-norms (OLMo-2/3's blocks): what
        they need."""
        if self.qk_layernorm_across_heads and not self.qk_layernorm:
            raise ConfigError("config.qk_layernorm_across_heads=True says where the QK-norm takes its statistics, "
                              "but config.qk_layernorm=False has none; set qk_layernorm=True or unset "
                              "qk_layernorm_across_heads.")
        if self.qk_layernorm_across_heads and self.multi_latent_attention:
            raise ConfigError("config.qk_layernorm_across_heads=True with multi_latent_attention=True is not built "
                              "(MLA's qk_layernorm norms its latents); unset qk_layernorm_across_heads.")
        if not self.pre_norms and not self.sandwich_norms:
            raise ConfigError("config.pre_norms=False with sandwich_norms=False: a layer without any norm is not "
                              "built; set sandwich_norms=True (post-norms only, OLMo-2) or pre_norms=True.")

    def _check_partial_rotary(self):
        """Partial RoPE rotates ``int(kv_channels * rotary_percent)`` channels (megatron-core's
        RotaryEmbedding ``dim``): a positive even number."""
        if self.rotary_percent == 1.0 or self.multi_latent_attention:
            return
        dims = int(self.kv_channels * self.rotary_percent)
        if dims < 2 or dims % 2:
            raise ConfigError(f"config.rotary_percent={self.rotary_percent} with kv_channels={self.kv_channels} "
                              f"rotates int({self.kv_channels} x {self.rotary_percent}) = {dims} channels; RoPE "
                              f"rotates pairs: choose a rotary_percent that gives an even number >= 2.")

    def _check_mtp(self):
        """Multi-token prediction: its depth, its factor, and the layouts it is not built for."""
        if self.mtp_num_layers is None:
            return
        if self.mtp_num_layers < 1:
            raise ConfigError(f"config.mtp_num_layers={self.mtp_num_layers} must be >= 1 (None: no multi-token "
                              f"prediction).")
        if not self.mtp_loss_scaling_factor >= 0:
            raise ConfigError(f"config.mtp_loss_scaling_factor={self.mtp_loss_scaling_factor} must be >= 0.")
        refused = dict(context_parallel_size=self.context_parallel_size > 1)
        refuse_with(self, f"mtp_num_layers={self.mtp_num_layers}", refused, *MTP_REFUSAL)
        if self.pipeline_model_parallel_size > 1 and self.num_moe_experts:
            raise ConfigError(f"config.mtp_num_layers={self.mtp_num_layers} with pipeline_model_parallel_size="
                              f"{self.pipeline_model_parallel_size} and num_moe_experts={self.num_moe_experts} is not "
                              f"built (the pipelined report has no rows for the depths' MoE layers); unset "
                              f"mtp_num_layers, num_moe_experts or pipeline_model_parallel_size.")


    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP's linear_fc1 is gated ``[h, 2, ffn]``: ``swiglu``, ``gated_linear_unit`` or
        ``quick_geglu``."""
        return self.swiglu or self.gated_linear_unit or self.quick_geglu

    def _check_gpt_oss_blocks(self):
        """Attention sinks (``softmax_type``) and the quick-GELU gated MLP with its clamp and
        linear offset (gpt-oss's blocks)."""
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ConfigError(f"config.softmax_type={self.softmax_type!r} is not one of {list(SOFTMAX_TYPES)}.")
        if self.softmax_type != "vanilla" and self.context_parallel_size > 1:
            raise ConfigError(f"config.softmax_type={self.softmax_type!r} with context_parallel_size="
                              f"{self.context_parallel_size} is not built (the ring's block kernels merge plain "
                              f"softmax blocks, without the sink logit); set context_parallel_size=1.")
        if self.quick_geglu and (self.swiglu or self.openai_gelu):
            raise ConfigError(f"config.quick_geglu=True with swiglu={self.swiglu}, openai_gelu={self.openai_gelu}: "
                              f"one activation per MLP; set swiglu=False and openai_gelu=False.")
        if not self.quick_geglu:
            if self.glu_linear_offset != 0.0 or self.activation_func_clamp_value is not None:
                name = "glu_linear_offset" if self.glu_linear_offset != 0.0 else "activation_func_clamp_value"
                raise ConfigError(f"config.{name}={getattr(self, name)} is built for the quick-GELU gated MLP only "
                                  f"(megatron-core applies it with quick_gelu); set quick_geglu=True or unset {name}.")
        elif self.activation_func_clamp_value is not None and not self.activation_func_clamp_value > 0:
            raise ConfigError(f"config.activation_func_clamp_value={self.activation_func_clamp_value} must be > 0 "
                              f"(or None: no clamp).")

    def _check_gemma_blocks(self):
        """Sliding windows, soft-capping and the score scale (Gemma-2/3's blocks)."""
        for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"config.{name}={value} must be > 0 (or None: off).")
        if self.gated_linear_unit and not self.swiglu and not self.quick_geglu and self.num_moe_experts is not None:
            raise ConfigError("config.gated_linear_unit=True (a GELU-gated MLP) is built for dense MLPs; the MoE experts "
                              "build SwiGLU and quick_geglu only: set swiglu=True, or num_moe_experts=None.")
        if self.context_parallel_size > 1:
            for name in ("window_size", "attn_logit_softcapping", "softmax_scale"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"config.{name}={getattr(self, name)!r} with context_parallel_size="
                                      f"{self.context_parallel_size} is not built (the ring's block kernels "
                                      f"take the causal mask and 1/sqrt(d) only); set context_parallel_size=1.")
        if self.window_size is None:
            check_unset(self, ("window_attn_skip_freq", "rotary_base_local"),
                        "config.{name}={value!r} needs config.window_size (which layers slide, and their RoPE); set "
                        "window_size=(W - 1, 0) or unset {name}.")
            return
        w = self.window_size
        if (not isinstance(w, tuple) or len(w) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in w)):
            raise ConfigError(f"config.window_size={w!r} must be (left, right), two ints: query i sees keys "
                              f"i - left .. i + right (Hugging Face sliding_window W is (W - 1, 0)).")
        if w[1] != 0 or w[0] < 0:
            raise ConfigError(f"config.window_size={w!r}: only causal windows are built, (left >= 0, 0).")
        try:
            window_layer_pattern(self.window_size, self.window_attn_skip_freq, self.num_layers)
        except ValueError as e:
            raise ConfigError(f"config.{e}") from None
        if self.rotary_base_local is not None and self.position_embedding_type not in ("rope", "yarn"):
            raise ConfigError(f"config.rotary_base_local={self.rotary_base_local} needs position_embedding_type="
                              f"'rope' or 'yarn' (the full layers' RoPE), not {self.position_embedding_type!r}.")

    def _check_no_rope(self):
        """NoPE layers (``no_rope_freq``): the pattern, on a rotary model, not with
        multi-latent attention (whose rotary part is its own) or multi-token prediction."""
        if self.no_rope_freq is None:
            return
        try:
            pattern = no_rope_layer_pattern(self.no_rope_freq, self.num_layers)
        except ValueError as e:
            raise ConfigError(f"config.{e}.") from None
        if isinstance(self.no_rope_freq, (list, str)):  # canonical: an int or a tuple
            freq = self.no_rope_freq
            if isinstance(freq, str):
                freq = _eval_list_expr(ast.parse(freq.strip(), mode="eval").body)
            object.__setattr__(self, "no_rope_freq", freq if isinstance(freq, int) else tuple(freq))
        if any(pattern) and self.position_embedding_type not in ("rope", "yarn"):
            raise ConfigError(f"config.no_rope_freq={self.no_rope_freq!r} skips RoPE on some layers, which needs "
                              f"position_embedding_type 'rope' or 'yarn', not {self.position_embedding_type!r}; "
                              f"unset no_rope_freq.")
        if any(pattern) and self.mtp_num_layers:
            raise ConfigError(f"config.no_rope_freq={self.no_rope_freq!r} with mtp_num_layers={self.mtp_num_layers} is "
                              f"not built (megatron-core numbers the MTP layers after the decoder's, past the "
                              f"pattern's end); unset no_rope_freq or mtp_num_layers.")
        if any(pattern) and self.multi_latent_attention:
            raise ConfigError(f"config.no_rope_freq={self.no_rope_freq!r} with multi_latent_attention=True is not "
                              f"built (MLA's rotary part is its own); unset no_rope_freq.")

    def _check_multipliers(self):
        """Granite's scalars: finite, and > 0 for the logits' divisor."""
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"config.{name}={value!r} must be a finite number (1.0: off).")
        if not self.logits_scaling > 0:
            raise ConfigError(f"config.logits_scaling={self.logits_scaling} must be > 0 (the logits are divided "
                              f"by it; 1.0: off).")

    def _check_pipeline(self):
        pp, v = self.pipeline_model_parallel_size, self.virtual_pipeline_size()
        if v > 1 and pp == 1:
            raise ConfigError("config.virtual_pipeline_model_parallel_size > 1 needs "
                              "pipeline_model_parallel_size > 1 (Megatron's interleaved schedule); unset it.")
        uneven = self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None
        if uneven and self.num_layers_per_virtual_pipeline_stage is not None:
            raise ConfigError("config.num_layers_per_virtual_pipeline_stage assumes an even split; with "
                              "decoder_first/last_pipeline_num_layers give virtual_pipeline_model_parallel_size.")
        if not uneven and self.num_layers % (pp * v):
            raise ConfigError(
                f"config.num_layers={self.num_layers} is not divisible by pipeline_model_parallel_size={pp} x "
                f"virtual_pipeline_model_parallel_size={v}; every model chunk holds the same number of layers "
                f"unless decoder_first/last_pipeline_num_layers give the first/last stage's.")
        try:
            self.pipeline_layout()
        except ValueError as e:
            raise ConfigError(f"config.{e}") from None
        if self.pipeline_schedule == "interleaved_1f1b" and v == 1:
            raise ConfigError("config.pipeline_schedule='interleaved_1f1b' needs "
                              "virtual_pipeline_model_parallel_size > 1; set it or use '1f1b'.")
        if self.pipeline_schedule in ("gpipe", "1f1b") and v > 1:
            raise ConfigError(f"config.pipeline_schedule={self.pipeline_schedule!r} runs one model chunk per stage; "
                              f"with virtual_pipeline_model_parallel_size={v} use 'interleaved_1f1b' or 'auto'.")

    def pipeline_layout(self):
        """The decoder layers' placement on pipeline stages
        (:class:`jmegatron.parallel.pipeline_layout.PipelineLayout`). Raises ValueError when
        they do not split."""
        return PipelineLayout(self.num_layers, self.pipeline_model_parallel_size, self.virtual_pipeline_size(),
                              self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers)

    def virtual_pipeline_size(self) -> int:
        """Model chunks per pipeline stage (v): ``virtual_pipeline_model_parallel_size``, or
        ``num_layers / (pipeline_model_parallel_size * num_layers_per_virtual_pipeline_stage)``
        (Megatron's two spellings), else 1. Raises ConfigError if both are set and disagree
        or the layers do not divide."""
        v, per = self.virtual_pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage
        if per is not None:
            pp = self.pipeline_model_parallel_size
            if per <= 0 or self.num_layers % (pp * per):
                raise ConfigError(f"config.num_layers_per_virtual_pipeline_stage={per} must be > 0 and divide "
                                  f"num_layers / pipeline_model_parallel_size = {self.num_layers}/{pp}.")
            derived = self.num_layers // (pp * per)
            if v is not None and v != derived:
                raise ConfigError(f"config.virtual_pipeline_model_parallel_size={v} disagrees with "
                                  f"num_layers_per_virtual_pipeline_stage={per} (which gives {derived}); set one.")
            return derived
        if v is not None and v <= 0:
            raise ConfigError(f"config.virtual_pipeline_model_parallel_size={v} must be > 0.")
        return v or 1

    def resolved_pipeline_schedule(self) -> str:
        """``pipeline_schedule`` with "auto" resolved as Megatron does: "1f1b", or
        "interleaved_1f1b" when there are several model chunks per stage."""
        if self.pipeline_schedule != "auto":
            return self.pipeline_schedule
        return "interleaved_1f1b" if self.virtual_pipeline_size() > 1 else "1f1b"



@dataclasses.dataclass(frozen=True)
class KernelConfig(ConfigGroup):
    """The kernels a run's model runs on (jmegatron-only, with Megatron's
    ``--transformer-impl``); :class:`jmegatron.models.backend.Backend` resolves their
    "auto" for the backend JAX runs on."""

    CHOICES = {"attention_impl": ATTENTION_IMPLS, "matmul_impl": MATMUL_IMPLS,
               "cross_entropy_impl": CROSS_ENTROPY_IMPLS, "transformer_impl": TRANSFORMER_IMPLS}

    # --- kernels (jmegatron.models.backend) ---
    # core attention: "auto" | "xla" (plain XLA ops) | "dot_product" (jax.nn) | "cpu" (the
    # CPU kernel, jmegatron.kernels.cpu); "auto" = "cpu" on a CPU backend in float32 without
    # tensor parallelism, else "xla"
    attention_impl: str = "auto"
    # dense-layer matmuls: "auto" | "xla" | "blas" (jmegatron.kernels.cpu: OpenBLAS through an
    # XLA FFI custom call, no transposing copies in the backward) | "hybrid" (XLA's dot for the
    # forward and input gradient, the BLAS kernel for the weight gradient); "auto" = "hybrid"
    # where attention_impl's "auto" picks the CPU kernel, else "xla"
    matmul_impl: str = "auto"
    # Megatron's --transformer-impl; "auto": Transformer Engine where transformer_engine.jax
    # imports and the backend is a GPU, else "local" (jmegatron's own layers)
    transformer_impl: str = "auto"
    # the vocab-parallel cross-entropy: "xla" (jmegatron.fusions.fused_cross_entropy) or "pallas"
    # (jmegatron.kernels.pallas); "auto": "pallas" on a GPU, else "xla"
    cross_entropy_impl: str = "auto"
