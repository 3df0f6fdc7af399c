"""Typed, validated training configuration with Megatron-LM's argument names.

A config file is a Python file with ``get_config()`` returning the
``ml_collections.ConfigDict`` made by :func:`base_config` with some fields changed;
``base_config("llama")`` starts from a model family's architecture fields
(:mod:`jmegatron.presets`), so the file sets only sizes and training fields.
Command-line overrides follow ml_collections' ``--config.<field>=<value>`` convention
(see :mod:`jmegatron.train`). The ConfigDict is locked and type-safe, so an unknown
key or a value of the wrong type fails with the key named and the closest valid name
suggested; :class:`JMegatronConfig` then checks values (choices, divisibility) before
anything compiles and fills the derived fields the way Megatron's
``megatron/training/arguments.py`` (``validate_args``) does.

Field names, defaults and meanings follow ``megatron/training/arguments.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import json
import os
import sys
import typing
from typing import Any, Optional

import ml_collections

from jmegatron.arguments import MegatronArgumentError, read_yaml
from jmegatron.presets import FAMILIES
from jmegatron.num_microbatches_calculator import NumMicroBatchesCalculatorError, update_train_iters
from jmegatron.parallel.pipeline_layout import PipelineLayout

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")
# Megatron's --tokenizer-type values read (jmegatron.data.tokenizer.build_tokenizer), those
# refused, the fields that name a run's tokenizer (one of them set: a tokenizer is given) and all
# the fields of its tokenizer (what a checkpoint carries: use_checkpoint_args)
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer")
REFUSED_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer", "SFTTokenizer",
                           "NullMultimodalTokenizer")
TOKENIZER_NAME_FIELDS = ("tokenizer_model", "tokenizer_type", "vocab_file", "merge_file")
TOKENIZER_FIELDS = TOKENIZER_NAME_FIELDS + ("tiktoken_pattern", "tiktoken_num_special_tokens")
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2 ** 17  # Megatron's TikTokenizer without --vocab-size


def tokenizer_vocab_size(tokenizer_type: Optional[str], vocab_size: Optional[int]) -> Optional[int]:
    """The vocabulary (ids before padding) of Megatron's ``--tokenizer-type tokenizer_type
    --vocab-size vocab_size`` where that flag decides it, by each type's own rule
    (megatron/training/tokenizer/tokenizer.py, ``build_tokenizer``): ``NullTokenizer``
    ``vocab_size + 1`` (ids ``0 .. vocab_size - 1`` and the end of document ``vocab_size``:
    ``_NullTokenizer.vocab_size``); ``TikTokenizer`` ``vocab_size`` (default 2^17: the special
    tokens, then the first ``vocab_size - num_special_tokens`` ranks). None for the types whose
    files decide it (``--vocab-size`` is not read by them: HuggingFaceTokenizer, GPT2BPETokenizer,
    SentencePieceTokenizer, Llama2Tokenizer, ...) and for a NullTokenizer without a size."""
    if tokenizer_type == "NullTokenizer":
        return None if vocab_size is None else int(vocab_size) + 1
    if tokenizer_type == "TikTokenizer":
        return int(vocab_size) if vocab_size is not None else TIKTOKEN_DEFAULT_VOCAB_SIZE
    return None


def tokenizer_type_of(cfg: Any) -> Optional[str]:
    """The ``--tokenizer-type`` a run uses: ``cfg.tokenizer_type`` when set; else
    ``"HuggingFaceTokenizer"`` when ``tokenizer_model`` is set; else ``"GPT2BPETokenizer"`` when
    ``vocab_file`` and ``merge_file`` are (Megatron's ``pretrain_gpt.py`` passes
    ``args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}``, which ByteMLPerf's GPT scripts rely
    on); None: no tokenizer is named. ``cfg``: a :class:`JMegatronConfig`, a ConfigDict or a
    dict of its fields (a checkpoint's config.json)."""
    get = cfg.get if isinstance(cfg, dict) else (lambda name: getattr(cfg, name, None))
    if get("tokenizer_type"):
        return get("tokenizer_type")
    if get("tokenizer_model"):
        return "HuggingFaceTokenizer"
    if get("vocab_file") and get("merge_file"):
        return "GPT2BPETokenizer"
    return None


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD", "multi-step")  # multi-step: ByteMLPerf
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
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
PIPELINE_SCHEDULES = ("auto", "gpipe", "1f1b", "interleaved_1f1b")
DROPOUT_IMPLS = ("hash", "threefry")  # jmegatron.models.dropout.DROPOUT_IMPLS
# The MoE choices (Megatron's arguments.py / transformer_config.py); the layers in
# jmegatron/models/moe read them from here
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
TOKEN_DISPATCHER_TYPES = ("allgather", "alltoall")
ROUTER_DTYPES = (None, "fp32", "fp64")


class ConfigError(ValueError):
    """A config field has a bad value. The message names the field and the fix."""


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
class JMegatronConfig:
    """Every setting of a jmegatron run. ``None`` means "derive it" (see ``__post_init__``).

    Follows ``megatron/training/arguments.py``; the few jmegatron-only fields are
    marked as such.
    """

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
    # the RoPE base of the windowed layers (Gemma-3's local base), unscaled; the full layers
    # keep rotary_base and the scalings. None: one RoPE for all layers
    rotary_base_local: Optional[int] = None
    # post-norms after the attention and the MLP, before their residual adds (Gemma-2/3's
    # post_attention_layernorm / post_feedforward_layernorm): post_self_attn_layernorm,
    # post_mlp_layernorm
    sandwich_norms: bool = False
    # the word embeddings times sqrt(hidden_size), rounded to the compute dtype (Gemma)
    scale_embeddings: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # jmegatron-only model execution options
    scan_layers: bool = False  # nn.scan over layers (one compiled layer body)
    recompute_granularity: str = "none"  # Megatron: --recompute-granularity {full,selective}
    # core attention: "auto" | "xla" (plain XLA ops) | "dot_product" (jax.nn) | "cpu" (the
    # CPU kernel, jmegatron.kernels.cpu); "auto" = "cpu" on a CPU backend in float32 without
    # tensor parallelism, else "xla"
    attention_impl: str = "auto"
    # dense-layer matmuls: "auto" | "xla" | "blas" (jmegatron.kernels.cpu: OpenBLAS through an
    # XLA FFI custom call, no transposing copies in the backward) | "hybrid" (XLA's dot for the
    # forward and input gradient, the BLAS kernel for the weight gradient); "auto" = "hybrid"
    # where attention_impl's "auto" picks the CPU kernel, else "xla"
    matmul_impl: str = "auto"
    # dropout masks: "hash" (counter-based hash of the element index, jmegatron.models.dropout)
    # or "threefry" (jax.random.bernoulli, ~50x slower on CPU)
    dropout_impl: str = "hash"

    # --- precision (megatron/training/arguments.py: _add_mixed_precision_args; docs/PRECISION.md) ---
    # bf16 / fp16: parameters and compute in that dtype, float32 main parameters and
    # optimizer state held by the optimizer (Megatron's Float16OptimizerWithFloat16Params)
    bf16: bool = False
    fp16: bool = False  # with loss scaling: dynamic unless loss_scale is set
    loss_scale: Optional[float] = None  # fp16: a constant loss scale; None: dynamic
    initial_loss_scale: float = 2.0 ** 32  # fp16 dynamic loss scaling (megatron/core/optimizer/grad_scaler.py)
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # clean iterations before the scale doubles
    hysteresis: int = 2  # overflowing iterations tolerated before the scale halves
    # gradients accumulated over micro-batches and all-reduced in float32 (forced True
    # under bf16, as Megatron's validate_args does); False: in the parameters' dtype
    accumulate_allreduce_grads_in_fp32: bool = False
    # FP8 linear layers (Megatron's --fp8-format); None: off. Delayed scaling in pure JAX
    # (jmegatron.models.fp8) or Transformer Engine's recipes (transformer_impl)
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    transformer_impl: str = "auto"
    cross_entropy_impl: str = "auto"

    # --- batch sizes and schedule (megatron/training/arguments.py: _add_training_args) ---
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # None: micro_batch_size * data_parallel_size
    # (start global batch, increment, ramp-up samples): Megatron's --rampup-batch-size
    # (needs train_samples, as Megatron); see jmegatron.num_microbatches_calculator
    rampup_batch_size: Optional[tuple] = None
    # iteration- or sample-based (Megatron: exactly one of --train-iters / --train-samples);
    # None: derived from train_samples (Megatron's update_train_iters), else 100
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0  # the warm-up starts from this rate
    lr_warmup_fraction: Optional[float] = None  # warm-up = this fraction of the decay length
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0  # sample-based runs
    lr_decay_iters: Optional[int] = None  # None: = train_iters (iteration-based runs)
    lr_decay_samples: Optional[int] = None  # None: = train_samples (sample-based runs)
    lr_decay_style: str = "linear"
    # multi-step (ByteMLPerf's --lr-decay-multi-step): shares of the decay at lr, lr/sqrt(10), lr/10
    lr_decay_multi_step: tuple = (0.6, 0.3, 0.1)
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: Optional[int] = None  # WSD: the final annealing phase length
    lr_wsd_decay_samples: Optional[int] = None  # WSD, sample-based runs
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping

    # --- logging, evaluation, checkpoints ---
    log_interval: int = 10
    eval_interval: int = 100  # 0 disables evaluation during training
    eval_iters: int = 10
    # jmegatron-only: evaluate the same first eval_iters global batches every time (curves
    # compare point to point); False (default): Megatron's validation iterator, which
    # continues through the validation split from one evaluation to the next
    eval_fixed_batches: bool = False
    save_interval: Optional[int] = None  # None: save only at the end
    save: Optional[str] = None
    load: Optional[str] = None  # None: = save (resume automatically)
    # jmegatron-only: None keeps every save (Megatron); N: Orbax's max_to_keep, the newest N kept and
    # each deletion of an older one printed
    keep_checkpoints: Optional[int] = None
    async_save: bool = False  # Megatron: --async-save
    tensorboard_dir: Optional[str] = None  # None: <save>/tensorboard
    wandb_project: Optional[str] = None  # Megatron: --wandb-project (log the TensorBoard scalars to this W&B project)
    wandb_exp_name: Optional[str] = None  # Megatron: --wandb-exp-name (the W&B run name; needed with wandb_project)
    wandb_save_dir: Optional[str] = None  # Megatron: --wandb-save-dir (W&B's local files; None: <save>/wandb)
    wandb_entity: Optional[str] = None  # Megatron: --wandb-entity (W&B team or user; None: the account's default)
    exit_interval: Optional[int] = None  # Megatron: --exit-interval (save and stop when iteration % N == 0)
    exit_signal_handler: bool = True  # Megatron: --exit-signal-handler (SIGTERM/SIGINT save and exit 0)
    exit_duration_in_mins: Optional[float] = None  # Megatron: --exit-duration-in-mins (save and stop after N minutes)
    finetune: bool = False  # Megatron: --finetune (load params only from `load`; iteration, optimizer, RNG reset)
    # Megatron: --use-checkpoint-args: the architecture (MODEL_FIELDS, vocab_size, and the
    # tokenizer when none is given) comes from `load`'s config.json (load_config_file)
    use_checkpoint_args: bool = False
    # Megatron's resume rule for the learning-rate schedule (optimizer_param_scheduler.py): a
    # schedule (SCHEDULER_FIELDS) other than the checkpoint's is refused unless one of these says
    # which wins (both: an error)
    override_opt_param_scheduler: bool = False  # Megatron: --override-opt_param-scheduler (the config's schedule wins)
    use_checkpoint_opt_param_scheduler: bool = False  # Megatron: --use-checkpoint-opt_param-scheduler (the checkpoint's wins)
    no_load_optim: bool = False  # Megatron: --no-load-optim (fresh optimizer moments, iteration kept)
    no_load_rng: bool = False  # Megatron: --no-load-rng (dropout base key from `seed`, not the checkpoint's)
    ckpt_fallback: bool = True  # jmegatron-only: a corrupt checkpoint is skipped (warning) for the previous one
    # Megatron: --check-for-nan-in-loss-and-grad: every step, inside the jitted step, a non-finite
    # loss or gradient skips the update (counted as skipped / nan iterations; docs/RELIABILITY.md)
    check_for_nan_in_loss_and_grad: bool = True
    # jmegatron-only: stop with an error after this many non-finite iterations in a row (fp16
    # overflows the dynamic loss scaler can still back off from are not counted); 0: never stop
    max_consecutive_nan_iterations: int = 5
    peak_tflops: Optional[float] = None  # jmegatron-only: per-device peak for MFU; None: measured / default
    log_num_zeros_in_grad: bool = False  # Megatron: --log-num-zeros-in-grad (count zero gradients each step)
    test_memory: bool = False  # ByteMLPerf: --test-memory (memory line at every log, not only the first)
    seed: int = 1234

    # --- data (megatron/training/arguments.py: _add_data_args) ---
    data_path: Optional[str] = None  # "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..." (Megatron's --data-path, space separated)
    split: str = "969,30,1"
    tokenizer_model: Optional[str] = None  # a tokenizers tokenizer.json / save_pretrained folder, or the file of tokenizer_type
    # Megatron's --tokenizer-type (jmegatron.data.tokenizer.build_tokenizer): HuggingFaceTokenizer
    # (tokenizer_model), GPT2BPETokenizer (vocab_file + merge_file) or NullTokenizer (space-separated
    # ids; vocab_size as Megatron's --vocab-size: ids 0 .. vocab_size - 1 and the end of document
    # vocab_size, so the model has vocab_size + 1: tokenizer_vocab_size);
    # None: HuggingFaceTokenizer when tokenizer_model is set, else GPT2BPETokenizer when vocab_file and
    # merge_file are (Megatron's pretrain_gpt.py default; tokenizer_type_of)
    tokenizer_type: Optional[str] = None
    # SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: tokenizer_model is the
    # sentencepiece .model; TikTokenizer: tokenizer_model is Megatron's JSON rank file, its vocabulary
    # vocab_size (None: 2^17), Megatron's --tiktoken-pattern (v1 | v2) and --tiktoken-num-special-tokens
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = 1000
    vocab_file: Optional[str] = None  # GPT2BPETokenizer: GPT-2's vocab.json
    merge_file: Optional[str] = None  # GPT2BPETokenizer: GPT-2's merges.txt
    mock_data: bool = False
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False  # document masking: segment_ids in the batch (models/attention.py)
    # ByteMLPerf's --variable-data / --seq-length-step: samples of seq_length - k * seq_length_step
    # tokens, k in 1..9, padded to the batch's longest (jmegatron.data.gpt_variable_dataset)
    variable_data: bool = False
    seq_length_step: Optional[int] = None
    # ByteMLPerf's --seq-length-min ("minimum sequence length to process", its default 128): under
    # variable_data the shortest sample, seq_length - 9 * seq_length_step, must reach it (the draw
    # itself is ByteMLPerf's, which never reads it)
    seq_length_min: int = 128
    # chat conversations (preprocess_data --apply-chat-template) packed several to a sample
    # (jmegatron.data.sft_dataset)
    sft: bool = False  # Megatron's --sft: SFT data, loss on assistant tokens only (needs reset_attention_mask)
    # Megatron's fill-in-the-middle data (--fim-data ...; jmegatron.data.fim_dataset)
    fim_data: bool = False  # FIM samples: segments reordered prefix/suffix/middle around sentinel tokens
    fim_rate: float = 0.5  # probability to turn a segment (the text between EOD tokens) into FIM
    fim_spm_rate: float = 0.5  # probability that a FIM segment is SPM rather than PSM
    fim_split_sample: Optional[str] = None  # a token splitting segments into fragments, each FIM'd on its own
    fim_fragment_rate: Optional[float] = None  # probability of FIM per fragment (with fim_split_sample)
    fim_no_prefix: Optional[str] = None  # segments whose text starts with this are not FIM'd
    fim_prefix_token: str = "<fim_prefix>"  # FIM sentinel token before the prefix
    fim_middle_token: str = "<fim_middle>"  # FIM sentinel token before the middle
    fim_suffix_token: str = "<fim_suffix>"  # FIM sentinel token before the suffix
    fim_pad_token: str = "<fim_pad>"  # pads a FIM sample to seq_length (not in the loss)
    fim_eod_token: str = "<|endoftext|>"  # the end-of-document token FIM splits samples at
    # Megatron's --num-workers: batches a background thread keeps ready (0: read in the training
    # thread); Megatron's --dataloader-type: "single" stops with an error at the end of a split,
    # "cyclic" starts it again (jmegatron.data.loader)
    num_workers: int = 2
    dataloader_type: str = "single"

    # --- knowledge distillation (Megatron's --export-kd-teacher-load, --export-kd-cfg,
    # --export-kd-finalize; see jmegatron.distill) ---
    kd_teacher_load: Optional[str] = None  # checkpoint dir of the teacher (its own config is read from it)
    kd_cfg: Optional[str] = None  # distillation YAML; None: logits-only with Megatron's defaults
    kd_finalize: bool = False  # save a plain student (no kd settings): load the distilled run, save elsewhere
    kd_teacher_bf16: bool = False  # run the frozen teacher in bf16 (params cast at load)
    # offline distillation: a cache of the teacher's top-K log-probabilities per training sample
    # (python -m jmegatron.tools.cache_teacher_logits); the teacher does not run
    kd_teacher_logits_path: Optional[str] = None
    # the teacher on its own layout: its parameters sharded over the data ranks (ZeRO-3, whatever
    # the student's use_megatron_fsdp), its top-K computed before the student's micro-batch loop
    # under GSPMD (jmegatron.distill.loss_func.teacher_top_k_prologue); None: the student's layout
    kd_teacher_use_megatron_fsdp: Optional[bool] = None

    # --- parallelism (sizes; see jmegatron.parallel.mesh) ---
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Megatron's interleaved schedule: model chunks per pipeline stage (v), given directly
    # or as layers per chunk (--num-layers-per-virtual-pipeline-stage); None: v = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    # "auto" (Megatron's choice: 1F1B, interleaved when v > 1), "gpipe", "1f1b", "interleaved_1f1b"
    pipeline_schedule: str = "auto"
    # Megatron's uneven split (--decoder-first/last-pipeline-num-layers): layers on the first /
    # last pipeline stage, the rest split evenly over the others; None: even
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    context_parallel_size: int = 1
    # Megatron's --cp-comm-type: how attention reaches the other context ranks' keys/values:
    # "p2p" (ring attention), "all_gather" (K/V gathered), "a2a" (Ulysses all-to-all heads <->
    # sequence); jmegatron.parallel.context_parallel
    cp_comm_type: str = "p2p"
    expert_model_parallel_size: int = 1
    # Megatron: --expert-tensor-parallel-size; None: = tensor_model_parallel_size (the only
    # value built: expert weights split over "tensor" like the dense MLP's)
    expert_tensor_parallel_size: Optional[int] = None
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
    sequence_parallel: bool = False  # Megatron: --sequence-parallel (activations between blocks split on seq over tensor)
    use_distributed_optimizer: bool = False  # Megatron: --use-distributed-optimizer (ZeRO-1 over data)
    use_megatron_fsdp: bool = False  # Megatron: --use-megatron-fsdp (params, grads, optimizer state over data)

    def __post_init__(self):
        for name in ("rampup_batch_size", "lr_decay_multi_step", "moe_layer_freq", "window_size",
                     "window_attn_skip_freq"):  # JSON gives lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), _field_types()[f.name])
        self._check_choices()
        self._check_training_length()
        train_iters = self._derived_train_iters()
        derived = {
            "num_query_groups": self.num_query_groups or self.num_attention_heads,
            "ffn_hidden_size": self.ffn_hidden_size or 4 * self.hidden_size,
            "max_position_embeddings": self.max_position_embeddings or self.seq_length,
            "train_iters": train_iters,
            "lr_decay_iters": None if self.train_samples is not None else (self.lr_decay_iters or train_iters),
            "lr_decay_samples": self.lr_decay_samples or self.train_samples,
            "load": self.load or self.save,
            "moe_ffn_hidden_size": (self.moe_ffn_hidden_size if self.num_moe_experts is None
                                    else self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size),
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size or self.tensor_model_parallel_size,
            # Megatron's validate_args: bf16 accumulates and all-reduces gradients in float32
            "accumulate_allreduce_grads_in_fp32": self.accumulate_allreduce_grads_in_fp32 or self.bf16,
        }
        if self.kv_channels is None and self.num_attention_heads > 0:
            if self.hidden_size % self.num_attention_heads:  # Megatron's validate_args asserts this
                raise ConfigError(
                    f"config.hidden_size={self.hidden_size} is not divisible by config.num_attention_heads="
                    f"{self.num_attention_heads}; choose heads that divide hidden_size or set config.kv_channels.")
            derived["kv_channels"] = self.hidden_size // self.num_attention_heads
        for k, v in derived.items():
            object.__setattr__(self, k, v)
        self._check_values()

    # ------------------------------------------------------------------ checks
    def _check_training_length(self):
        """Iteration- vs sample-based fields, as Megatron's validate_args asserts them."""
        if self.train_samples is None:
            for name, unset in (("lr_warmup_samples", 0), ("lr_decay_samples", None),
                                ("lr_wsd_decay_samples", None), ("rampup_batch_size", None)):
                if getattr(self, name) != unset:
                    why = ("Megatron ramps the batch size only in sample-based training"
                           if name == "rampup_batch_size" else "it belongs to sample-based training")
                    raise ConfigError(f"config.{name}={getattr(self, name)!r} needs config.train_samples "
                                      f"({why}); set train_samples instead of train_iters, or drop {name}.")
        else:
            if self.train_samples <= 0:
                raise ConfigError(f"config.train_samples={self.train_samples} must be > 0.")
            for name, unset in (("lr_warmup_iters", 0), ("lr_decay_iters", None), ("lr_wsd_decay_iters", None)):
                if getattr(self, name) != unset:
                    raise ConfigError(
                        f"config.{name}={getattr(self, name)!r} is iteration-based but config.train_samples="
                        f"{self.train_samples} makes the run sample-based (Megatron allows one of the two); use "
                        f"{name.replace('iters', 'samples')}.")
            if self.global_batch_size is None:
                raise ConfigError("config.train_samples needs config.global_batch_size (the number of "
                                  "iterations is derived from it); set global_batch_size.")
        if self.lr_warmup_fraction is not None:
            if not 0.0 <= self.lr_warmup_fraction <= 1.0:
                raise ConfigError(f"config.lr_warmup_fraction={self.lr_warmup_fraction} must be in [0, 1].")
            if self.lr_warmup_iters or self.lr_warmup_samples:
                raise ConfigError("config.lr_warmup_fraction is set together with lr_warmup_iters/"
                                  "lr_warmup_samples; Megatron takes one of them: drop one.")
        ratios = self.lr_decay_multi_step
        if len(ratios) != 3 or any(isinstance(r, bool) or not isinstance(r, (int, float)) or r < 0 for r in ratios):
            raise ConfigError(f"config.lr_decay_multi_step={ratios!r} must be three shares >= 0 "
                              "(at lr, at lr/sqrt(10), at lr/10), e.g. (0.6, 0.3, 0.1).")
        if abs(sum(ratios) - 1.0) >= 1e-6:  # ByteMLPerf's assert in get_lr
            raise ConfigError(f"config.lr_decay_multi_step={ratios!r} sums to {sum(ratios):.6g}; the three "
                              "shares of the decay must sum to 1.")
        if self.num_workers < 0:
            raise ConfigError(f"config.num_workers={self.num_workers} must be >= 0 (0: no prefetch thread).")
        if self.dataloader_type not in ("single", "cyclic"):
            raise ConfigError(f"config.dataloader_type={self.dataloader_type!r} must be 'single' (stop at the end "
                              "of the data, Megatron's default) or 'cyclic' (start it again).")
        if self.variable_data and (self.seq_length_step is None or self.seq_length_step <= 0
                                   or self.seq_length - 9 * self.seq_length_step < 1):
            raise ConfigError(
                f"config.variable_data=True needs config.seq_length_step > 0 with seq_length - 9 x "
                f"seq_length_step >= 1 (samples have seq_length - k x step tokens, k in 1..9); got "
                f"seq_length={self.seq_length}, seq_length_step={self.seq_length_step}.")
        if self.variable_data and self.seq_length - 9 * self.seq_length_step < self.seq_length_min:
            raise ConfigError(
                f"config.seq_length_min={self.seq_length_min} exceeds the shortest variable_data sample, seq_length - "
                f"9 x seq_length_step = {self.seq_length - 9 * self.seq_length_step} (seq_length={self.seq_length}, "
                f"seq_length_step={self.seq_length_step}); lower seq_length_min or seq_length_step, or raise "
                f"seq_length.")
        for name in ("sft", "fim_data"):
            if getattr(self, name):
                self._refuse_with(name, dict(mock_data=self.mock_data, variable_data=self.sft and self.variable_data,
                                             fim_data=self.sft and self.fim_data),
                                  "its samples come from preprocessed data_path prefixes", "unset {name}.")
        if self.sft and not self.reset_attention_mask:
            raise ConfigError("config.sft=True packs several conversations into a sample; set "
                              "config.reset_attention_mask=True so that they do not attend to each other.")
        for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"config.{name}={value} must be a probability in [0, 1].")
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            raise ConfigError("config.fim_split_sample is set but config.fim_fragment_rate is not; give the "
                              "probability to turn each fragment into FIM.")

    def _derived_train_iters(self) -> int:
        """train_iters as Megatron's update_train_iters derives it from train_samples."""
        if self.train_samples is None:
            return 100 if self.train_iters is None else self.train_iters
        try:
            iters = update_train_iters(self.train_samples, self.global_batch_size, self.rampup_batch_size)
        except NumMicroBatchesCalculatorError as e:
            raise ConfigError(str(e)) from None
        if self.train_iters is not None and self.train_iters != iters:
            raise ConfigError(
                f"config.train_iters={self.train_iters} and config.train_samples={self.train_samples} are both "
                f"set (Megatron takes one): train_samples gives {iters} iterations; set train_iters=None.")
        return iters

    def _check_checkpoint_loading(self):
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ConfigError(f"config.exit_duration_in_mins={self.exit_duration_in_mins} must be > 0 "
                              "(or None: no time limit).")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:  # Megatron's assert
            raise ConfigError("config.override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=True: "
                              "the first keeps the config's learning-rate schedule, the second the checkpoint's; "
                              "set one.")
        for name in ("finetune", "no_load_optim", "no_load_rng"):
            if getattr(self, name) and (not self.load or os.path.abspath(self.load) == os.path.abspath(self.save or "")):
                where = f"config.load={self.load!r} is config.save" if self.load else "config.load is not set"
                raise ConfigError(f"config.{name}=True applies to the checkpoint read from config.load, but {where} "
                                  f"(a rerun resumes its own save exactly); set config.load to the checkpoint to "
                                  f"start from and config.save to a new directory.")

    def _check_precision(self):
        if self.bf16 and self.fp16:
            raise ConfigError("config.bf16=True and config.fp16=True: choose one compute dtype.")
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ConfigError(f"config.fp8={self.fp8!r} is not one of {list(FP8_FORMATS)} (or None: no FP8).")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ConfigError(f"config.loss_scale={self.loss_scale} must be > 0 (or None: dynamic).")
        for name in ("initial_loss_scale", "min_loss_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be > 0.")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"config.min_loss_scale={self.min_loss_scale} exceeds config.initial_loss_scale="
                              f"{self.initial_loss_scale}; lower min_loss_scale.")
        for name in ("loss_scale_window", "hysteresis", "fp8_amax_history_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be >= 1.")
        if self.fp8_margin < 0:
            raise ConfigError(f"config.fp8_margin={self.fp8_margin} must be >= 0.")
        if self.fp8 is not None and self.fp8_recipe != "delayed" and self.transformer_impl == "local":
            raise ConfigError(f"config.fp8_recipe={self.fp8_recipe!r} needs Transformer Engine "
                              f"(transformer_impl='transformer_engine' or 'auto' on a GPU); the pure-JAX "
                              f"layers (transformer_impl='local') build fp8_recipe='delayed'.")
        if self.fp8 is not None and self.fp8_recipe == "delayed" and self.transformer_impl == "transformer_engine":
            raise ConfigError("config.fp8_recipe='delayed' through Transformer Engine is not built (the train step "
                              "does not carry TE's amax history); use transformer_impl='local' (jmegatron's own "
                              "delayed scaling, the same fields) or fp8_recipe='tensorwise' / 'mxfp8' with TE.")
        if self.attention_impl == "cudnn":
            if self.attention_dropout > 0:
                raise ConfigError(f"config.attention_impl='cudnn' has no attention dropout (jax.nn.dot_product_attention); "
                                  f"set attention_dropout=0.0 (now {self.attention_dropout}) or attention_impl='pallas'.")
            if not (self.bf16 or self.fp16):
                raise ConfigError("config.attention_impl='cudnn' runs bfloat16 / float16 only; set bf16=True "
                                  "(or fp16=True), or attention_impl='pallas' / 'xla' for float32.")

    def _check_choices(self):
        choices = {
            "position_embedding_type": POSITION_EMBEDDING_TYPES,
            "normalization": NORMALIZATIONS,
            "lr_decay_style": LR_DECAY_STYLES,
            "lr_wsd_decay_style": WSD_DECAY_STYLES,
            "recompute_granularity": RECOMPUTE_GRANULARITIES,
            "attention_impl": ATTENTION_IMPLS,
            "matmul_impl": MATMUL_IMPLS,
            "cross_entropy_impl": CROSS_ENTROPY_IMPLS,
            "fp8_recipe": FP8_RECIPES,
            "fp8_amax_compute_algo": FP8_AMAX_COMPUTE_ALGOS,
            "transformer_impl": TRANSFORMER_IMPLS,
            "dropout_impl": DROPOUT_IMPLS,
            "pipeline_schedule": PIPELINE_SCHEDULES,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                close = difflib.get_close_matches(str(value), allowed, 1, 0.5)
                hint = f' Did you mean "{close[0]}"?' if close else ""
                raise ConfigError(f"config.{name}={value!r} is not one of {list(allowed)}.{hint}")

    def _check_values(self):
        positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "micro_batch_size", "make_vocab_size_divisible_by", "log_interval",
                    "eval_iters", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size", "ffn_hidden_size", "num_query_groups",
                    "kv_channels", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be > 0.")
        if self.keep_checkpoints is not None and self.keep_checkpoints <= 0:
            raise ConfigError(f"config.keep_checkpoints={self.keep_checkpoints} must be > 0, or None to keep every "
                              f"save (Megatron's behaviour).")
        nonneg = ("train_iters", "lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad",
                  "eval_interval", "adam_eps", "init_method_std", "lr_decay_iters", "lr_warmup_samples",
                  "lr_decay_samples", "lr_warmup_init",
                  "max_consecutive_nan_iterations")
        for name in nonneg:
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be >= 0.")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be in [0, 1).")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be in [0, 1).")
        self._check_precision()
        self._check_checkpoint_loading()
        if self.wandb_project and not self.wandb_exp_name:  # Megatron's _set_wandb_writer
            raise ConfigError(f"config.wandb_project={self.wandb_project!r} needs config.wandb_exp_name (the W&B run "
                              "name), as Megatron's --wandb-exp-name.")
        if self.wandb_project and not (self.wandb_save_dir or self.save):
            raise ConfigError("config.wandb_project needs config.wandb_save_dir or config.save (W&B writes its local "
                              "files to <save>/wandb by default).")
        if self.min_lr > self.lr:
            raise ConfigError(f"config.min_lr={self.min_lr} exceeds config.lr={self.lr}; lower min_lr.")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"config.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"config.num_query_groups={self.num_query_groups}; choose a divisor of the heads.")
        self._check_mla()
        self._check_mtp()
        if self.position_embedding_type in ("rope", "yarn") and self.kv_channels % 2 and not self.multi_latent_attention:
            raise ConfigError(f"config.kv_channels={self.kv_channels} must be even for {self.position_embedding_type}.")
        self._check_rope()
        self._check_gemma_blocks()
        if self.openai_gelu and self.swiglu:
            raise ConfigError("config.openai_gelu=True with swiglu=True: SwiGLU's activation is SiLU, so the tanh GELU "
                              "would not be used; set openai_gelu=False (or swiglu=False for a GELU MLP).")
        if self.seq_length > self.max_position_embeddings and self.position_embedding_type == "learned_absolute":
            raise ConfigError(
                f"config.seq_length={self.seq_length} exceeds config.max_position_embeddings="
                f"{self.max_position_embeddings}; raise max_position_embeddings.")
        if self.lr_warmup_init > self.lr:
            raise ConfigError(f"config.lr_warmup_init={self.lr_warmup_init} exceeds config.lr={self.lr}.")
        unit = "iters" if self.train_samples is None else "samples"
        warmup, decay = getattr(self, f"lr_warmup_{unit}"), getattr(self, f"lr_decay_{unit}")
        if warmup > decay and self.lr_decay_style != "constant":
            raise ConfigError(f"config.lr_warmup_{unit}={warmup} exceeds config.lr_decay_{unit}={decay}.")
        if self.lr_decay_style == "WSD" and getattr(self, f"lr_wsd_decay_{unit}") is None:
            raise ConfigError(f"config.lr_decay_style='WSD' needs config.lr_wsd_decay_{unit} (the annealing length).")
        if not self.mock_data and self.data_path is None and not self.kd_finalize:  # finalize reads no data
            raise ConfigError("config.data_path is not set; give a preprocessed prefix "
                              "(python -m jmegatron.tools.preprocess_data) or set config.mock_data=True.")
        kind = tokenizer_type_of(self)
        has_tokenizer = kind is not None
        if self.tokenizer_type is not None and self.tokenizer_type not in TOKENIZER_TYPES:
            close = difflib.get_close_matches(self.tokenizer_type, TOKENIZER_TYPES + REFUSED_TOKENIZER_TYPES, 1, 0.5)
            known = f"; Megatron's {self.tokenizer_type} is not read" if self.tokenizer_type in REFUSED_TOKENIZER_TYPES \
                else (f'; did you mean "{close[0]}"?' if close else "")
            raise ConfigError(f"config.tokenizer_type={self.tokenizer_type!r} is not one of {list(TOKENIZER_TYPES)}"
                              f"{known} (a transformers save_pretrained folder of any tokenizer loads as "
                              f"HuggingFaceTokenizer with tokenizer_model=DIR).")
        needs = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "NullTokenizer": ("vocab_size",),
                 "TikTokenizer": ("tokenizer_model", "tiktoken_pattern")}.get(kind, ("tokenizer_model",) if kind else ())
        for name in needs:
            if getattr(self, name) is None:
                raise ConfigError(f"config.tokenizer_type={kind!r} needs config.{name}.")
        if self.mock_data and self.vocab_size is None and not has_tokenizer:
            raise ConfigError("config.mock_data=True needs config.vocab_size (or config.tokenizer_model).")
        if not self.mock_data and not has_tokenizer and not (self.kd_finalize and self.vocab_size):
            raise ConfigError("config.tokenizer_model is not set; give the tokenizer.json used by "
                              "preprocess_data (its end-of-document id separates documents), GPT-2's "
                              "config.vocab_file and config.merge_file, or Megatron's config.tokenizer_type with "
                              "its files.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("config.sequence_parallel=True needs config.tensor_model_parallel_size > 1 "
                              "(Megatron disables it otherwise); set sequence_parallel=False.")
        for name, kernel in (("matmul_impl", "blas"), ("matmul_impl", "hybrid"), ("attention_impl", "cpu")):
            if getattr(self, name) == kernel and self.tensor_model_parallel_size > 1:
                raise ConfigError(
                    f"config.{name}={kernel!r} is a CPU custom call that GSPMD cannot partition, so it "
                    f"runs without tensor parallelism; set tensor_model_parallel_size=1 or {name}='auto'.")
        if self.use_distributed_optimizer and self.use_megatron_fsdp:
            raise ConfigError("config.use_megatron_fsdp=True already shards the optimizer state; "
                              "set config.use_distributed_optimizer=False.")
        self._check_pipeline()
        self._check_moe()
        self._check_context_parallel()
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
        if ep > 1 and self.use_megatron_fsdp:
            raise ConfigError("config.use_megatron_fsdp=True with expert_model_parallel_size > 1 is not built; use "
                              "use_distributed_optimizer=True (ZeRO-1) with expert parallelism.")
        if self.kd_finalize and (not self.save or not self.load or
                                 os.path.abspath(self.load) == os.path.abspath(self.save)):
            raise ConfigError("config.kd_finalize=True writes a plain student to a new directory: set "
                              "config.load to the distilled run and config.save to another directory.")
        if self.kd_teacher_logits_path is not None and not self.kd_finalize:
            if self.kd_teacher_load is not None:
                raise ConfigError("config.kd_teacher_logits_path (offline distillation: the teacher's cached top-K) and "
                                  "config.kd_teacher_load (online: the teacher runs) are both set; keep one.")
            self._refuse_with("kd_teacher_logits_path", dict(
                pipeline_model_parallel_size=self.pipeline_model_parallel_size > 1,
                context_parallel_size=self.context_parallel_size > 1,
                reset_attention_mask=self.reset_attention_mask, variable_data=self.variable_data),
                "offline distillation reads the cached rows into the unpipelined step's batch",
                "unset {name} or distil online (config.kd_teacher_load).")
        if self.kd_teacher_use_megatron_fsdp is not None and not self.kd_finalize:
            if self.kd_teacher_load is None:
                raise ConfigError("config.kd_teacher_use_megatron_fsdp lays out the teacher of config.kd_teacher_load, "
                                  "which is not set; set it or unset kd_teacher_use_megatron_fsdp.")
            self._refuse_with("kd_teacher_use_megatron_fsdp", dict(
                pipeline_model_parallel_size=self.pipeline_model_parallel_size > 1,
                context_parallel_size=self.context_parallel_size > 1),
                "the teacher on its own layout runs before the student's unpipelined micro-batch loop",
                "unset {name} or kd_teacher_use_megatron_fsdp (the teacher then takes the student's layout).")
        if self.kd_cfg is not None and self.kd_teacher_load is None and self.kd_teacher_logits_path is None \
                and not self.kd_finalize:
            raise ConfigError("config.kd_cfg is set but config.kd_teacher_load is not; give the teacher's "
                              "checkpoint directory.")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"config.global_batch_size={self.global_batch_size} is not a multiple of "
                f"config.micro_batch_size={self.micro_batch_size}.")

    # --------------------------------------------------------------- derived
    def unpadded_vocab_size(self) -> Optional[int]:
        """The model's vocabulary before padding as far as the config knows it:
        :func:`tokenizer_vocab_size` for the types whose ``vocab_size`` decides it
        (NullTokenizer: ``vocab_size + 1``), else ``vocab_size`` (None: the tokenizer's files
        decide)."""
        return tokenizer_vocab_size(self.tokenizer_type, self.vocab_size) or self.vocab_size

    def padded_vocab_size(self, vocab_size: Optional[int] = None) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``.

        Follows ``_vocab_size_with_padding`` in megatron/training/tokenizer/tokenizer.py.
        Raises ConfigError if no vocabulary size is known.
        """
        v = vocab_size if vocab_size is not None else self.unpadded_vocab_size()
        if v is None:
            raise ConfigError("config.vocab_size is unknown; set it or config.tokenizer_model.")
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return ((v + multiple - 1) // multiple) * multiple

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
        if cp < 1:
            raise ConfigError(f"config.context_parallel_size={cp} must be >= 1.")
        if self.cp_comm_type not in ("p2p", "all_gather", "a2a"):
            raise ConfigError(f"config.cp_comm_type={self.cp_comm_type!r}: choose 'p2p', 'all_gather' or 'a2a' "
                              f"(Megatron's --cp-comm-type).")
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

    def _check_rope(self):
        """The rotary fields (jmegatron.models.rope): scalings only where they apply."""
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
        if self.position_embedding_type == "yarn":
            if not self.yarn_rotary_scaling_factor >= 1:
                raise ConfigError(f"config.yarn_rotary_scaling_factor={self.yarn_rotary_scaling_factor} must be >= 1.")
            if self.yarn_original_max_position_embeddings <= 0:
                raise ConfigError("config.yarn_original_max_position_embeddings="
                                  f"{self.yarn_original_max_position_embeddings} must be > 0.")

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
                       rotary_seq_len_interpolation_factor=self.rotary_seq_len_interpolation_factor is not None)
        self._refuse_with("multi_latent_attention=True", refused, "multi-latent attention runs on one context / "
                          "pipeline rank with its own score scale and RoPE", "drop {name}.")
        if self.transformer_impl == "transformer_engine":
            raise ConfigError("config.multi_latent_attention=True with transformer_impl='transformer_engine' is not "
                              "built; set transformer_impl='local' (or 'auto').")

    def _check_mtp(self):
        """Multi-token prediction: its depth, its factor, and the layouts it is not built for."""
        if self.mtp_num_layers is None:
            return
        if self.mtp_num_layers < 1:
            raise ConfigError(f"config.mtp_num_layers={self.mtp_num_layers} must be >= 1 (None: no multi-token "
                              f"prediction).")
        if not self.mtp_loss_scaling_factor >= 0:
            raise ConfigError(f"config.mtp_loss_scaling_factor={self.mtp_loss_scaling_factor} must be >= 0.")
        refused = dict(context_parallel_size=self.context_parallel_size > 1,
                       kd_teacher_load=self.kd_teacher_load is not None,
                       kd_teacher_logits_path=self.kd_teacher_logits_path is not None)
        self._refuse_with(f"mtp_num_layers={self.mtp_num_layers}", refused, "multi-token prediction runs "
                          "without context parallelism, in language-model training",
                          "unset mtp_num_layers or {name}.")
        if self.pipeline_model_parallel_size > 1 and self.num_moe_experts:
            raise ConfigError(f"config.mtp_num_layers={self.mtp_num_layers} with pipeline_model_parallel_size="
                              f"{self.pipeline_model_parallel_size} and num_moe_experts={self.num_moe_experts} is not "
                              f"built (the pipelined report has no rows for the depths' MoE layers); unset "
                              f"mtp_num_layers, num_moe_experts or pipeline_model_parallel_size.")

    def _refuse_with(self, feature: str, refused: dict, why: str, fix: str) -> None:
        """ConfigError for the first field of ``refused`` (name -> whether its value is
        refused) that is: ``config.<feature> with <name>=<value> is not built (<why>); <fix>``
        (``{name}`` in ``fix`` becomes the field's name)."""
        for name, bad in refused.items():
            if bad:
                raise ConfigError(f"config.{feature} with {name}={getattr(self, name)!r} is not built ({why}); "
                                  + fix.format(name=name))

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP's linear_fc1 is gated ``[h, 2, ffn]``: ``swiglu`` or ``gated_linear_unit``."""
        return self.swiglu or self.gated_linear_unit

    def _check_gemma_blocks(self):
        """Sliding windows, soft-capping and the score scale (Gemma-2/3's blocks)."""
        for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"config.{name}={value} must be > 0 (or None: off).")
        if self.gated_linear_unit and not self.swiglu and self.num_moe_experts is not None:
            raise ConfigError("config.gated_linear_unit=True (a GELU-gated MLP) is built for dense MLPs; the MoE experts "
                              "build SwiGLU only: set swiglu=True, or num_moe_experts=None.")
        if self.context_parallel_size > 1:
            for name in ("window_size", "attn_logit_softcapping", "softmax_scale"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"config.{name}={getattr(self, name)!r} with context_parallel_size="
                                      f"{self.context_parallel_size} is not built (the ring's block kernels "
                                      f"take the causal mask and 1/sqrt(d) only); set context_parallel_size=1.")
        if self.window_size is None:
            for name in ("window_attn_skip_freq", "rotary_base_local"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"config.{name}={getattr(self, name)!r} needs config.window_size (which "
                                      f"layers slide, and their RoPE); set window_size=(W - 1, 0) or unset {name}.")
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
        if self.rotary_base_local is not None and self.position_embedding_type != "rope":
            raise ConfigError(f"config.rotary_base_local={self.rotary_base_local} needs position_embedding_type="
                              f"'rope', not {self.position_embedding_type!r}.")

    def _check_moe(self):
        """The MoE fields, as Megatron's TransformerConfig.__post_init__ and validate_args
        check them, plus what jmegatron does not build yet."""
        if self.num_moe_experts is None:
            for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"config.{name}={getattr(self, name)} needs config.num_moe_experts (the "
                                      f"model is dense without it); set num_moe_experts or unset {name}.")
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
        try:
            pattern = moe_layer_pattern(self.moe_layer_freq, self.num_layers)
        except ValueError as err:
            raise ConfigError(f"config.{err}.") from None
        if isinstance(self.moe_layer_freq, (list, str)):  # canonical: an int or a tuple
            object.__setattr__(self, "moe_layer_freq", parse_moe_layer_freq(self.moe_layer_freq))
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
        if self.add_bias_linear:
            raise ConfigError("config.add_bias_linear=True with config.num_moe_experts: expert and router "
                              "biases are not built; set add_bias_linear=False (as Mixtral and DeepSeek, "
                              "--disable-bias-linear).")
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

    def data_parallel_size(self, num_devices: int) -> int:
        """Devices left for data parallelism after tensor/pipeline/context/expert sizes."""
        model = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                 * self.context_parallel_size * self.expert_model_parallel_size)
        if num_devices % model:
            raise ConfigError(
                f"{num_devices} devices are not divisible by tensor({self.tensor_model_parallel_size}) x "
                f"pipeline({self.pipeline_model_parallel_size}) x context({self.context_parallel_size}) x "
                f"expert({self.expert_model_parallel_size}) = {model}.")
        return num_devices // model

    def num_microbatches(self, dp: int) -> int:
        """global_batch_size / (micro_batch_size * dp), as Megatron's num_microbatches_calculator."""
        gbs = self.global_batch_size or self.micro_batch_size * dp
        if gbs % (self.micro_batch_size * dp):
            raise ConfigError(
                f"config.global_batch_size={gbs} is not divisible by config.micro_batch_size="
                f"{self.micro_batch_size} x data_parallel_size={dp}.")
        return gbs // (self.micro_batch_size * dp)

    def to_dict(self) -> dict[str, Any]:
        """Every field, derived ones resolved (what checkpoints store)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def replace(self, **changes) -> "JMegatronConfig":
        """A copy with ``changes`` (validated); unknown names raise ConfigError.

        Derived fields already resolved in ``self`` (ffn_hidden_size, kv_channels, load,
        lr_decay_iters, train_iters, ...) keep their values: pass them too when changing what
        they derive from (for a sample-based run, ``train_iters=None`` re-derives it)."""
        _check_names(changes)
        return dataclasses.replace(self, **changes)


# The distillation settings, at their defaults: what a plain student (kd_finalize's checkpoint) and
# a read checkpoint keep of them.
DISTILLATION_RESETS = dict(kd_teacher_load=None, kd_teacher_logits_path=None, kd_cfg=None, kd_finalize=False,
                           kd_teacher_bf16=False, kd_teacher_use_megatron_fsdp=None)

# Fields that describe the network's parameters: resuming with a different value fails.
# (The padded vocabulary is compared separately, so make_vocab_size_divisible_by may change.)
MODEL_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "max_position_embeddings", "position_embedding_type", "rotary_base",
    "rotary_seq_len_interpolation_factor", "rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
    "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
    "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int",
    "normalization", "norm_epsilon", "swiglu", "openai_gelu", "untie_embeddings_and_output_weights",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "apply_layernorm_1p", "gated_linear_unit", "softmax_scale",
    "attn_logit_softcapping", "final_logit_softcapping", "window_size", "window_attn_skip_freq",
    "rotary_base_local", "sandwich_norms", "scale_embeddings", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
)

# The learning-rate schedule Megatron's OptimizerParamScheduler checks on resume
# (optimizer_param_scheduler.py _check_and_set: max/min lr, warm-up, decay length and style,
# WSD) and use_checkpoint_opt_param_scheduler takes from the checkpoint, with the fields
# jmegatron derives them from (jmegatron.checkpoint.checkpointing.schedule_of).
SCHEDULER_FIELDS = ("lr", "min_lr", "lr_warmup_init", "lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples",
                    "lr_decay_iters", "lr_decay_samples", "lr_decay_style", "lr_decay_multi_step",
                    "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples")


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(JMegatronConfig)


def _check_type(name: str, value: Any, hint: Any) -> None:
    if hint is Any:  # checked by the field's own validation
        return
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return
        hint = next(a for a in args if a is not type(None))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"config.{name}={value!r} must be an int, not a bool.")
    if not isinstance(value, hint):
        raise ConfigError(f"config.{name}={value!r} must be of type {hint.__name__}, got {type(value).__name__}.")


def _check_names(names) -> None:
    valid = [f.name for f in dataclasses.fields(JMegatronConfig)]
    for name in names:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, 3, 0.6)
            hint = f" Did you mean {close}?" if close else ""
            raise ConfigError(f"config.{name} is not a jmegatron config field.{hint}")


def base_config(family: Optional[str] = None) -> ml_collections.ConfigDict:
    """The defaults as a locked, type-safe ConfigDict for config files to modify.

    ``family`` (a key of :data:`jmegatron.presets.FAMILIES`: "gpt2", "llama", "llama3",
    "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3", "deepseek_v3")
    sets that family's architecture fields over the defaults (:func:`set_family`).
    Optional fields are typed placeholders, so ``--config.save=DIR`` type-checks.
    Raises ConfigError for an unknown family.
    """
    fields = {}
    hints = _field_types()
    for f in dataclasses.fields(JMegatronConfig):
        hint = hints[f.name]
        if hint is Any:  # e.g. moe_layer_freq: an int or a list
            fields[f.name] = ml_collections.FieldReference(f.default, field_type=object)
        elif typing.get_origin(hint) is typing.Union:
            inner = next(a for a in typing.get_args(hint) if a is not type(None))
            fields[f.name] = ml_collections.config_dict.placeholder(inner, f.default)
        else:
            fields[f.name] = f.default
    cd = ml_collections.ConfigDict(fields, type_safe=True)
    cd.lock()
    return cd if family is None else set_family(cd, family)


def set_family(cd: ml_collections.ConfigDict, family: str) -> ml_collections.ConfigDict:
    """Set model family ``family``'s architecture fields on ``cd`` (in place; returned).

    For a config that takes another config's sizes and training fields and changes its
    architecture (configs/llama_tiny.py: gpt_tiny's recipe as a Llama). Fields the family
    does not fix keep their values. Raises ConfigError for an unknown family.
    """
    if family not in FAMILIES:
        close = difflib.get_close_matches(family, FAMILIES, 3, 0.5)
        hint = f" Did you mean {close}?" if close else ""
        raise ConfigError(f"model family {family!r} is not one of {sorted(FAMILIES)}.{hint} "
                          f"A new family is an entry of jmegatron.presets.FAMILIES.")
    for name, value in FAMILIES[family].items():
        setattr(cd, name, value)
    return cd


def from_configdict(cd: Any) -> JMegatronConfig:
    """Validate a ConfigDict (or mapping) into a :class:`JMegatronConfig`.

    Raises ConfigError naming the field: unknown names (with close matches), wrong types,
    out-of-range or inconsistent values.
    """
    d = cd.to_dict() if hasattr(cd, "to_dict") else dict(cd)
    _check_names(d)
    return JMegatronConfig(**d)


def from_json(text: str) -> JMegatronConfig:
    """Read a config saved by :meth:`JMegatronConfig.to_json` (checkpoints store one)."""
    return from_configdict(json.loads(text))


def _configdict_with(values: dict, source: str) -> ml_collections.ConfigDict:
    """:func:`base_config` with ``values`` set (JSON lists as tuples), unvalidated. Raises
    ConfigError naming ``source`` and the key: an unknown field, a value of the wrong type."""
    try:
        _check_names(values)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    cd = base_config()
    for key, value in values.items():
        try:
            setattr(cd, key, tuple(value) if isinstance(value, list) else value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: {key}={value!r} has the wrong type ({e}); give a "
                              f"{_field_types()[key]} value.") from None
    return cd


def _configdict_from_yaml(path: str) -> ml_collections.ConfigDict:
    """Megatron's ``--yaml-cfg`` file as a ConfigDict (:func:`jmegatron.arguments.read_yaml`);
    the keys that change nothing a run computes are named on stderr."""
    try:
        resolution = read_yaml(path, JMegatronConfig)
        resolution.check()
    except MegatronArgumentError as e:
        raise ConfigError(str(e)) from None
    note = resolution.ignored_note()
    if note:
        print(note, file=sys.stderr, flush=True)
    return _configdict_with(resolution.fields, f"config file {path!r}")


def read_run_config(path: str) -> dict:
    """The fields of a run's or checkpoint's ``config.json`` (:meth:`JMegatronConfig.to_json`),
    as saved. Raises FileNotFoundError, ConfigError for a file that is not JSON, not an
    object, or a Hugging Face ``config.json`` (import it first)."""
    with open(path) as f:
        try:
            saved = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path!r} line {e.lineno}: not valid JSON ({e.msg}); a JSON config is "
                              f"the config.json a run writes to its save directory.") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"config file {path!r} holds a {type(saved).__name__}, not a config's fields.")
    if "num_layers" not in saved and "model_type" in saved:
        raise ConfigError(f"config file {path!r} is a Hugging Face config (model_type {saved['model_type']!r}); "
                          f"import the model first: python -m jmegatron.export import-hf --hf DIR --out CKPT, "
                          f"then --config CKPT/config.json or --config.load=CKPT.")
    return saved


def _configdict_from_json(path: str) -> ml_collections.ConfigDict:
    """A run's or checkpoint's ``config.json`` (:func:`read_run_config`) as a ConfigDict."""
    return _configdict_with(read_run_config(path), f"config file {path!r}")


def get_config_of(path: str) -> ml_collections.ConfigDict:
    """The fields of a config file, unvalidated: ``get_config()`` of a Python file (for
    configs that extend one), Megatron's YAML layout (``.yaml`` / ``.yml``:
    :func:`jmegatron.arguments.read_yaml`), or a run's ``config.json`` (``.json``).

    Raises FileNotFoundError for a missing file, ConfigError for a Python file without
    get_config(), bad YAML / JSON, or a key that is unknown, refused or of the wrong type.
    """
    import importlib.util
    import os

    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (pass --config configs/gpt_tiny.py)")
    if path.endswith((".yaml", ".yml")):
        return _configdict_from_yaml(path)
    if path.endswith(".json"):
        return _configdict_from_json(path)
    spec = importlib.util.spec_from_file_location(f"_jmegatron_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"config file {path!r} line {e.lineno}: {e.msg}; fix the Python syntax there "
                          f"(a config file is Python with a get_config() function).") from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} has no get_config() function; define one that returns "
                          f"base_config() with your fields set (see configs/gpt_tiny.py).")
    return module.get_config()


def load_config_file(path: Optional[str], overrides: Optional[dict[str, Any]] = None,
                     allow_no_file: bool = False) -> JMegatronConfig:
    """Load a config file (:func:`get_config_of`: Python, YAML or config.json; None:
    :func:`base_config`'s defaults, which needs ``use_checkpoint_args`` or ``allow_no_file``),
    apply ``overrides``, validate.

    With ``use_checkpoint_args`` (Megatron's ``--use-checkpoint-args``) the architecture
    comes from the checkpoint at ``load`` (else ``save``): :func:`checkpoint_args` replaces
    the file's fields, and an override that contradicts the checkpoint is an error naming
    both values; for an imported checkpoint the other fields its source set
    (:func:`imported_args`: e.g. a Hugging Face folder's dropouts) replace the defaults,
    unless an override or the file sets them. With ``use_checkpoint_opt_param_scheduler`` the learning-rate schedule
    (:data:`SCHEDULER_FIELDS`) comes from the checkpoint the run resumes
    (:func:`checkpoint_scheduler_args`), so the optimizer is built with it.

    Raises FileNotFoundError for a missing file, ConfigError for bad fields.
    """
    cd = base_config() if path is None else get_config_of(path)
    defaults = base_config()
    from_file = set() if path is None else {k for k in cd.keys() if cd[k] != defaults[k]}
    overrides = dict(overrides or {})
    for key, value in overrides.items():
        if key not in cd:
            _check_names([key])
        setattr(cd, key, value)
    if cd.use_checkpoint_args:
        load = cd.load or cd.save
        if load is None:
            raise ConfigError("config.use_checkpoint_args=True needs config.load (the checkpoint whose architecture "
                              "the run takes); set --config.load=CKPT.")
        given = any(getattr(cd, n) is not None for n in TOKENIZER_NAME_FIELDS)
        for name, value in checkpoint_args(load).items():
            if name in TOKENIZER_FIELDS and given:
                continue  # a tokenizer given here wins (the data's)
            if name in overrides and overrides[name] != value:
                raise ConfigError(f"config.{name}={overrides[name]!r} contradicts the checkpoint {load} "
                                  f"({name}={value!r}) under use_checkpoint_args=True; drop --config.{name} "
                                  f"or set use_checkpoint_args=False.")
            setattr(cd, name, tuple(value) if isinstance(value, list) else value)
        for name, value in imported_args(load).items():  # the import's source: the user's values win
            if name not in overrides and name not in from_file:
                setattr(cd, name, tuple(value) if isinstance(value, list) else value)
    elif path is None and not allow_no_file:
        raise ConfigError("--config is required (a Python config file), unless config.use_checkpoint_args=True takes "
                          "the architecture from config.load.")
    if cd.use_checkpoint_opt_param_scheduler and not (cd.override_opt_param_scheduler or cd.finetune
                                                      or cd.no_load_optim):  # these two start it afresh
        for name, value in checkpoint_scheduler_args(cd.save, cd.load).items():
            if name in overrides and overrides[name] != value:
                raise ConfigError(f"config.{name}={overrides[name]!r} contradicts the checkpoint's learning-rate "
                                  f"schedule ({name}={value!r}) under use_checkpoint_opt_param_scheduler=True; drop "
                                  f"--config.{name} or use override_opt_param_scheduler=True instead.")
            setattr(cd, name, tuple(value) if isinstance(value, list) else value)
    return from_configdict(cd)


def checkpoint_scheduler_args(save: Optional[str], load: Optional[str]) -> dict[str, Any]:
    """The learning-rate schedule (:data:`SCHEDULER_FIELDS`) of the run a config resumes,
    from the ``config.json`` beside its checkpoints: ``save``'s when it has one (a rerun
    continues its own save, as the training loop does), else ``load``'s; empty when neither
    has one (a fresh run keeps its own schedule, as Megatron's with nothing to load)."""
    for directory in (save, load):
        path = os.path.join(directory, "config.json") if directory else None
        if path and os.path.isfile(path):
            saved = read_run_config(path)
            return {name: saved[name] for name in SCHEDULER_FIELDS if name in saved}
    return {}


# Written beside an imported checkpoint (import-hf, import-megatron): the config fields its
# source set ({"fields": [names]}), read back by imported_args.
IMPORTED_FIELDS_FILE = "imported_fields.json"


def imported_args(load_dir: str) -> dict[str, Any]:
    """The fields an imported checkpoint's source set beyond :func:`checkpoint_args`' (a Hugging
    Face folder's dropouts, ``init_method_std``, MoE router settings, ...), with the values of
    the ``config.json`` beside it: under ``use_checkpoint_args`` they replace jmegatron's
    defaults, a value the user gives (an override, or a config file's value other than
    :func:`base_config`'s) wins. Empty for a checkpoint that is not an import (no
    :data:`IMPORTED_FIELDS_FILE`)."""
    record = os.path.join(load_dir, IMPORTED_FIELDS_FILE)
    if not os.path.isfile(record):
        return {}
    with open(record) as f:
        names = json.load(f)["fields"]
    saved = read_run_config(os.path.join(load_dir, "config.json"))
    forced = set(MODEL_FIELDS + ("vocab_size",) + TOKENIZER_FIELDS)
    return {name: saved[name] for name in names if name in saved and name not in forced}


def checkpoint_args(load_dir: str) -> dict[str, Any]:
    """The architecture fields (:data:`MODEL_FIELDS`, ``vocab_size``) and the tokenizer (:data:`TOKENIZER_FIELDS`)
    of the jmegatron checkpoint at ``load_dir``, from the ``config.json`` that training and
    ``import-hf`` write beside it (Megatron's ``load_args_from_checkpoint``).

    Raises ConfigError for a folder without one, or with a Hugging Face config.json (convert
    it first with ``python -m jmegatron.export import-hf``)."""
    path = os.path.join(load_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"config.use_checkpoint_args=True: {path} does not exist; config.load must be a "
                          f"jmegatron checkpoint directory (a training run's config.save, or import-hf's --out).")
    with open(path) as f:
        saved = json.load(f)
    if "num_layers" not in saved and "model_type" in saved:
        raise ConfigError(f"config.load={load_dir!r} is a Hugging Face folder (model_type {saved['model_type']!r}); "
                          f"convert it first: python -m jmegatron.export import-hf --hf {load_dir} --out CKPT, then "
                          f"--config.load=CKPT.")
    names = MODEL_FIELDS + ("vocab_size",) + TOKENIZER_FIELDS
    return {name: saved[name] for name in names if name in saved}
