"""Megatron-LM's training arguments as its users write them: the command-line flags of
``megatron/training/arguments.py`` and the ``--yaml-cfg`` file of
``megatron/training/yaml_arguments.py``, translated to :class:`jmegatron.config.JMegatronConfig`
fields.

``python -m jmegatron.train --num-layers 24 --hidden-size 1024 --bf16 --disable-bias-linear
--data-path 1.0 PREFIX --split 949,50,1 ...`` parses with :mod:`argparse` (no abbreviations):
every config field is a flag of its own name (``--num-layers``; ``--no-<field>`` for a field
that defaults to True), and the tables below add Megatron's other spellings:

* :data:`RENAMED`: a Megatron name whose field is spelled otherwise (``--num-experts`` ->
  ``num_moe_experts``);
* :data:`CLI_SPELLINGS`: flags whose destination or value differs from their name
  (``--disable-bias-linear`` -> ``add_bias_linear=False``, ``--fp8-format`` -> ``fp8``);
* :data:`SPECIAL`: Megatron arguments with no field of their own but a meaning jmegatron has
  (``--group-query-attention``, ``--recompute-activations``, ``--optimizer adam``);
* :data:`IGNORED`: arguments that change only logging, launch, kernels or memory placement,
  not the numbers a run computes; accepted and named on one line;
* :data:`REFUSED`: arguments for features jmegatron does not build, each with why and what
  stands for it; refused unless given their inert value (``--squared-relu False``).

Megatron's YAML (``examples/gpt3/gpt_config.yaml``) has top-level training keys and the
sections ``language_model`` (TransformerConfig's names: ``layernorm_epsilon``,
``activation_func``, ...) and ``model_parallel``; they are flattened into one namespace as
``validate_yaml`` does (a key in two sections is an error), ``${VAR}`` is replaced by the
environment variable, and every key goes through the same tables. A ``null`` leaves the field
at its default. An unknown key or flag is refused with the closest known names.

Megatron's derivations that depend on its spellings are applied where they are given together
(``validate_args``): ``--num-query-groups`` counts only with ``--group-query-attention`` (else
heads; alone it means 1 group), ``--swiglu`` with ``--hidden-size`` and no ``--ffn-hidden-size``
gives ``int(4 h 2/3 / 64) 64``, and ``--sequence-parallel`` with
``--tensor-model-parallel-size 1`` is turned off.

This module reads the config class it is given and imports nothing from jmegatron
(:mod:`jmegatron.config` imports it for ``--config x.yaml``). Errors are
:class:`MegatronArgumentError`, one line naming every bad flag or key.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
import os
import re
import shlex
import tokenize
import typing
from typing import Any, Optional, Sequence

import yaml


class MegatronArgumentError(ValueError):
    """A Megatron flag or YAML key is unknown, refused or badly typed; the message (one
    line) names each one and why."""


# Megatron argument name (its argparse dest, the YAML key) -> the config field it sets.
RENAMED = {
    "num_experts": "num_moe_experts",
    "use_rope_scaling": "rope_scaling",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
    "mscale": "yarn_mscale",
    "mscale_all_dim": "yarn_mscale_all_dim",
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "rotary_scaling_factor": "yarn_rotary_scaling_factor",
    "export_kd_teacher_load": "kd_teacher_load",
    "export_kd_cfg": "kd_cfg",
    "export_kd_finalize": "kd_finalize",
}
# TransformerConfig's names in Megatron's YAML (language_model section) -> field; accepted as
# flags too (Megatron's older --layernorm-epsilon).
YAML_NAMES = {
    "layernorm_epsilon": "norm_epsilon",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p",
}
RENAMED.update(YAML_NAMES)

VALUE = object()  # in CLI_SPELLINGS: the flag takes a value

# Flags whose dest (or stored value) is not their name: flag -> (dest, the constant it stores
# or VALUE). Megatron's store_false "--no-X"/"--disable-X" flags are here.
CLI_SPELLINGS = {
    "--disable-bias-linear": ("add_bias_linear", False),
    "--no-check-for-nan-in-loss-and-grad": ("check_for_nan_in_loss_and_grad", False),
    "--no-yarn-correction-range-round-to-int": ("yarn_correction_range_round_to_int", False),
    "--no-position-embedding": ("add_position_embedding", False),
    "--fp8-format": ("fp8", VALUE),
    "--override-opt_param-scheduler": ("override_opt_param_scheduler", True),
    "--use-checkpoint-opt_param-scheduler": ("use_checkpoint_opt_param_scheduler", True),
    "--use-mcore-models": ("use_mcore_models", True),
    "--no-masked-softmax-fusion": ("masked_softmax_fusion", False),
    "--no-bias-gelu-fusion": ("bias_gelu_fusion", False),
    "--no-bias-swiglu-fusion": ("bias_swiglu_fusion", False),
    "--no-bias-dropout-fusion": ("bias_dropout_fusion", False),
    "--no-rope-fusion": ("apply_rope_fusion", False),
    "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", False),
    "--no-async-tensor-model-parallel-allreduce": ("async_tensor_model_parallel_allreduce", False),
    "--no-persist-layer-norm": ("persist_layer_norm", False),
    "--no-create-attention-mask-in-dataloader": ("create_attention_mask_in_dataloader", False),
    "--no-mmap-bin-files": ("mmap_bin_files", False),
    "--no-clone-scatter-output-in-embedding": ("clone_scatter_output_in_embedding", False),
    "--no-one-logger": ("enable_one_logger", False),
    "--no-barrier-with-level-1-timing": ("barrier_with_L1_time", False),
    "--no-log-loss-scale-to-tensorboard": ("log_loss_scale_to_tensorboard", False),
    "--no-overlap-p2p-communication": ("overlap_p2p_comm", False),
    "--no-align-grad-reduce": ("align_grad_reduce", False),
    "--no-align-param-gather": ("align_param_gather", False),
    "--no-scatter-gather-tensors-in-pipeline": ("scatter_gather_tensors_in_pipeline", False),
    "--no-fp8-wgrad": ("fp8_wgrad", False),
    "--no-manual-gc-eval": ("manual_gc_eval", False),
    "--no-initialization": ("perform_initialization", False),
    "--no-save-optim": ("no_save_optim", True),
    "--no-save-rng": ("no_save_rng", True),
    "--no-ckpt-fully-parallel-save": ("ckpt_fully_parallel_save", False),
    "--microbatch-group-size-per-virtual-pipeline-stage": ("microbatch_group_size_per_vp_stage", VALUE),
    "--dist-ckpt-format": ("dist_ckpt_format", VALUE),
    "--yaml-cfg": ("yaml_cfg", VALUE),
}

# Megatron arguments with a meaning but no field of their own: dest -> (argparse kind, what it
# does). Kinds: "flag" (store_true), "int", "float", "str".
SPECIAL = {
    "group_query_attention": ("flag", "num_query_groups counts only with it (alone: 1 group)"),
    "use_rotary_position_embeddings": ("flag", "position_embedding_type='rope'"),
    "recompute_activations": ("flag", "recompute_granularity='selective'"),
    "checkpoint_activations": ("flag", "recompute_granularity='full'"),
    "optimizer": ("str", "'adam' is jmegatron's AdamW"),
    "add_position_embedding": ("flag", "RoPE / none replace the learned positions"),
    "activation_func": ("str", "'swiglu' -> swiglu, 'gelu' -> the GELU MLP"),
    "encoder_num_layers": ("int", "num_layers (Megatron's alias)"),
    "encoder_seq_length": ("int", "seq_length (Megatron's alias)"),
    "yaml_cfg": ("str", "the YAML config file, as --config"),
}

_LOG = "logging only"
_PERF = "a kernel, fusion or overlap choice: the same numbers (XLA picks jmegatron's kernels)"
_LAUNCH = "launch / process-group set-up (jax.distributed and the device mesh do this)"
_CKPT = "checkpoint format or writer: jmegatron writes Orbax checkpoints of the whole state"
_MEM = "memory or recompute placement only: the same numbers"
_DET = "jmegatron's step is deterministic on its own"
_YAML = "a TransformerConfig / ModelParallelConfig internal Megatron derives; no effect here"

# dest -> why it is accepted and ignored (it does not change what a run computes).
IGNORED = {
    **dict.fromkeys((
        "log_params_norm", "log_throughput", "log_progress", "timing_log_level", "timing_log_option",
        "barrier_with_L1_time", "tensorboard_log_interval", "tensorboard_queue_size", "log_timers_to_tensorboard",
        "log_loss_scale_to_tensorboard", "log_validation_ppl_to_tensorboard", "log_memory_to_tensorboard",
        "log_world_size_to_tensorboard", "logging_level",
        "enable_one_logger", "one_logger_project", "one_logger_run_name", "one_logger_async", "app_tag_run_name",
        "app_tag_run_version", "config_logger_dir", "log_straggler", "disable_straggler_on_startup",
        "straggler_ctrlr_port", "straggler_minmax_count", "profile", "profile_step_start", "profile_step_end",
        "use_pytorch_profiler", "profile_ranks", "record_memory_history", "memory_snapshot_path",
        "moe_per_layer_logging", "check_for_spiky_loss", "timers"), _LOG),
    **dict.fromkeys((
        "masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "apply_rope_fusion",
        "gradient_accumulation_fusion", "async_tensor_model_parallel_allreduce", "persist_layer_norm",
        "memory_efficient_layer_norm", "bias_activation_fusion", "cross_entropy_loss_fusion", "use_flash_attn",
        "attention_backend", "enable_cuda_graph", "flash_decode", "te_rng_tracker", "inference_rng_tracker",
        "overlap_grad_reduce", "overlap_param_gather", "overlap_param_gather_with_optimizer_step",
        "delay_grad_reduce", "delay_param_gather", "align_grad_reduce", "align_param_gather", "ddp_bucket_size",
        "ddp_average_in_collective", "defer_embedding_wgrad_compute", "wgrad_deferral_limit",
        "scatter_gather_tensors_in_pipeline", "use_ring_exchange_p2p", "overlap_p2p_comm",
        "overlap_p2p_comm_warmup_flush", "batch_p2p_comm", "batch_p2p_sync", "microbatch_group_size_per_vp_stage",
        "num_distributed_optimizer_instances", "tp_comm_overlap", "tp_comm_overlap_cfg", "tp_comm_overlap_ag",
        "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_bulk_dgrad", "tp_comm_bulk_wgrad",
        "tp_comm_split_ag", "tp_comm_split_rs", "tp_comm_atomic_ag", "tp_comm_atomic_rs", "tp_comm_bootstrap_backend",
        "moe_shared_expert_overlap", "moe_use_legacy_grouped_gemm", "fp8_param_gather", "fp8_interval",
        "apply_query_key_layer_scaling", "clone_scatter_output_in_embedding", "create_attention_mask_in_dataloader",
        "onnx_safe"), _PERF),
    **dict.fromkeys((
        "recompute_method", "recompute_num_layers", "distribute_saved_activations", "moe_layer_recompute",
        "use_cpu_initialization", "empty_unused_memory_level", "manual_gc", "manual_gc_interval", "manual_gc_eval",
        "cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_weights", "cpu_offloading_activations",
        "num_microbatches_with_partial_activation_checkpoints", "deallocate_pipeline_outputs",
        "moe_unbalanced_recompute_activation_scale"), _MEM),
    **dict.fromkeys((
        "distributed_backend", "distributed_timeout_minutes", "local_rank", "lazy_mpu_init",
        "nccl_communicator_config_path", "use_tp_pp_dp_mapping", "adlr_autoresume", "adlr_autoresume_interval",
        "enable_ft_package", "train_sync_interval", "check_weight_hash_across_dp_replicas_interval",
        "error_injection_rate", "error_injection_type", "rerun_mode", "world_size", "rank"), _LAUNCH),
    **dict.fromkeys((
        "use_dist_ckpt", "dist_ckpt_format", "ckpt_format", "auto_detect_ckpt_format", "ckpt_fully_parallel_save",
        "ckpt_fully_parallel_load", "ckpt_assume_constant_structure", "dist_ckpt_strictness",
        "non_persistent_save_interval", "non_persistent_ckpt_type", "non_persistent_global_ckpt_dir",
        "non_persistent_local_ckpt_dir", "non_persistent_local_ckpt_algo"), _CKPT),
    **dict.fromkeys(("deterministic_mode", "perform_initialization"), _DET),
    **dict.fromkeys(("data_cache_path", "s3_cache_path", "no_shared_storage", "mmap_bin_files",
                     "num_dataset_builder_threads"), "where and how Megatron caches the dataset's index files"),
    "use_mcore_models": "jmegatron's model is Megatron-Core's GPT model (the only one)",
    "attention_softmax_in_fp32": "jmegatron's attention softmax is always float32",
    **dict.fromkeys((
        "params_dtype", "pipeline_dtype", "finalize_model_grads_func", "grad_scale_func", "no_sync_func",
        "grad_sync_func", "param_sync_func", "enable_autocast", "autocast_dtype", "variable_seq_lengths",
        "_cpu_offloading_context", "transformer_pipeline_model_parallel_size", "bert_binary_head",
        "retriever_seq_length", "sample_rate", "mask_prob", "short_seq_prob"), _YAML),
    "no_save_optim": "jmegatron's checkpoints always hold the optimizer state (resume is exact)",
    "no_save_rng": "jmegatron's checkpoints always hold the RNG state (resume is exact)",
    "exit_on_missing_checkpoint": "jmegatron stops with an error when config.load holds no checkpoint anyway",
    "sgd_momentum": "used only with --optimizer sgd, which is refused",
    "yaml_cfg_version": "the YAML layout's version",
}

# dest -> (the values that leave it inert, why it is refused and what stands for it).
REFUSED = {
    "squared_relu": ((False,), "the squared-ReLU MLP is not built; use --swiglu or the GELU MLP"),
    "quick_geglu": ((False,), "the quick-GEGLU MLP is not built; use --swiglu"),
    "apply_residual_connection_post_layernorm": ((False,), "post-LN residuals are not built (pre-LN only)"),
    "fp32_residual_connection": ((False,), "the residual stream stays in the compute dtype"),
    "use_legacy_models": ((False,), "jmegatron builds the Megatron-Core GPT model only"),
    "decoder_num_layers": ((None,), "encoder-decoder models are not built; use --num-layers"),
    "decoder_seq_length": ((None,), "encoder-decoder models are not built; use --seq-length"),
    "encoder_tensor_model_parallel_size": ((None, 0), "encoder-decoder models are not built"),
    "encoder_pipeline_model_parallel_size": ((None, 0), "encoder-decoder models are not built"),
    "pipeline_model_parallel_split_rank": ((None,), "encoder-decoder models are not built"),
    "standalone_embedding_stage": ((False,), "the embedding shares the first pipeline stage"),
    "account_for_embedding_in_pipeline_split": ((False,), "the embedding shares the first pipeline stage; "
                                                "use --decoder-first-pipeline-num-layers"),
    "init_method": ((None,), "init is normal(0, init_method_std) with the scaled output projection"),
    "output_layer_init_method": ((None,), "init is normal(0, init_method_std) with the scaled output projection"),
    "init_method_xavier_uniform": ((False,), "init is normal(0, init_method_std)"),
    "data_parallel_random_init": ((False,), "every data rank holds the same initial parameters"),
    "fp16_lm_cross_entropy": ((False,), "the cross-entropy runs in float32"),
    "fp8_wgrad": ((True,), "FP8 covers the weight gradients too"),
    "calculate_per_token_loss": ((False,), "the loss is averaged per micro-batch as Megatron's default"),
    "decoupled_lr": ((None,), "one learning rate for every parameter"),
    "decoupled_min_lr": ((None,), "one learning rate for every parameter"),
    "start_weight_decay": ((None,), "the weight decay is constant (--weight-decay)"),
    "end_weight_decay": ((None,), "the weight decay is constant (--weight-decay)"),
    "weight_decay_incr_style": (("constant",), "the weight decay is constant (--weight-decay)"),
    "use_precision_aware_optimizer": ((False,), "the optimizer state is float32"),
    "main_grads_dtype": ((None, "fp32"), "main gradients are float32"),
    "main_params_dtype": ((None, "fp32"), "main parameters are float32"),
    "exp_avg_dtype": ((None, "fp32"), "Adam's moments are float32"),
    "exp_avg_sq_dtype": ((None, "fp32"), "Adam's moments are float32"),
    "use_torch_fsdp2": ((False,), "use --use-megatron-fsdp (parameters, gradients and optimizer state over data)"),
    "hierarchical_context_parallel_sizes": ((None,), "one context-parallel group (--cp-comm-type p2p, "
                                            "all_gather or a2a)"),
    "moe_extended_tp": ((False,), "experts split over tensor like the dense MLP only"),
    "moe_use_upcycling": ((False,), "upcycling a dense checkpoint is not built"),
    "moe_input_jitter_eps": ((None,), "router input jitter is not built"),
    "moe_token_dropping": ((False,), "use --moe-expert-capacity-factor for token dropping"),
    "moe_router_topk_limited_devices": ((None,), "use --moe-router-num-groups and --moe-router-group-topk"),
    "first_k_dense_replace": ((None,), "use --moe-layer-freq '([0]*k+[1]*(L-k))'"),
    "relative_attention_num_buckets": ((None, 32), "relative position embeddings are not built"),
    "relative_attention_max_distance": ((None, 128), "relative position embeddings are not built"),
    "apply_rope_offload": ((False,), "not built"),
    "spec": ((None,), "the layer spec is jmegatron's GPT block (families: jmegatron.presets)"),
    "hybrid_attention_ratio": ((None, 0.0), "hybrid (Mamba) models are not built"),
    "hybrid_mlp_ratio": ((None, 0.0), "hybrid (Mamba) models are not built"),
    "hybrid_override_pattern": ((None,), "hybrid (Mamba) models are not built"),
    "vocab_extra_ids": ((0,), "T5's extra ids are not built"),
    "train_data_path": ((None,), "use --data-path with --split"),
    "valid_data_path": ((None,), "use --data-path with --split"),
    "test_data_path": ((None,), "use --data-path with --split"),
    "data_args_path": ((None,), "use --data-path with --split"),
    "per_split_data_args_path": ((None,), "use --data-path with --split"),
    "renormalize_blend_weights": ((False,), "blend weights are used as given"),
    "tiktoken_special_tokens": ((None,), "TikTokenizer's special tokens are Megatron's default <unk>, <s>, </s> "
                                         "and fillers"),
    "tokenizer_name_or_path": ((None,), "use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR"),
    "pretrained_checkpoint": ((None,), "use --load CKPT (with --finetune for a fresh iteration count)"),
    "ckpt_step": ((None,), "jmegatron resumes the newest complete step of --load"),
    "use_mp_args_from_checkpoint_args": ((False,), "use --use-checkpoint-args"),
    "use_tokenizer_model_from_checkpoint_args": ((True,), "the tokenizer given wins over the checkpoint's anyway"),
    "ckpt_convert_format": ((None,), "convert with python -m jmegatron.export"),
    "ckpt_convert_save": ((None,), "convert with python -m jmegatron.export"),
    "ckpt_convert_update_legacy_dist_opt_format": ((False,), "convert with python -m jmegatron.export"),
    "skip_train": ((False,), "evaluate with python -m jmegatron.evaluate"),
    "decrease_batch_size_if_needed": ((False,), "the global batch is fixed (or ramped with --rampup-batch-size)"),
    "batch_size": ((None,), "Megatron's old name; use --micro-batch-size"),
    "warmup": ((None,), "Megatron's old name; use --lr-warmup-iters or --lr-warmup-fraction"),
    "model_parallel_size": ((None,), "Megatron's old name; use --tensor-model-parallel-size"),
    "retro_add_retriever": ((False,), "RETRO is not built"),
}

_FLAG_KINDS = {"int": int, "float": float, "str": str}
_ALL_TABLES = (RENAMED, SPECIAL, IGNORED, REFUSED)


def flag_name(dest: str) -> str:
    """``--num-layers`` for ``num_layers`` (Megatron's spelling of a dest)."""
    return "--" + dest.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Row:
    """One argument as given: its spelling (``--num-layers 12`` or a YAML key), ``status``
    "accepted" / "ignored" / "refused" / "unknown", and ``detail``: ``field=value`` or why."""

    spelling: str
    status: str
    detail: str


@dataclasses.dataclass
class Resolution:
    """What a Megatron command line or YAML file sets: ``fields`` (config field -> value),
    ``rows`` (one per argument, in the order given), ``config_path`` (``--yaml-cfg``),
    ``derived`` (the fields of ``fields`` that Megatron's validate_args derives rather than
    the arguments give: ``--swiglu``'s ffn_hidden_size, ``--group-query-attention``'s default
    num_query_groups; a value given another way wins over them)."""

    source: str
    fields: dict
    rows: list
    config_path: Optional[str] = None
    derived: frozenset = frozenset()

    def by_status(self, status: str) -> list:
        """The rows whose status is ``status`` ("accepted", "ignored", "refused", "unknown")."""
        return [r for r in self.rows if r.status == status]

    def check(self) -> None:
        """Raise MegatronArgumentError (one line) naming every unknown or refused argument."""
        bad = [r for r in self.rows if r.status in ("unknown", "refused")]
        if bad:
            what = "; ".join(f"{r.status} {r.spelling} ({r.detail})" for r in bad)
            raise MegatronArgumentError(f"{self.source}: {what}")

    def ignored_note(self) -> Optional[str]:
        """One line naming the ignored arguments, or None."""
        names = sorted({r.spelling.split(" ")[0] for r in self.by_status("ignored")})
        if not names:
            return None
        return (f"[jmegatron] {self.source}: ignored (no effect on what the run computes): " + ", ".join(names))


# ------------------------------------------------------------------ the config class

def _field_hints(config_cls) -> dict:
    return typing.get_type_hints(config_cls)


def _inner(hint):
    """(the type of a field without Optional, whether it is Optional)."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _all_names(config_cls) -> list:
    names = set(_field_hints(config_cls))
    for table in _ALL_TABLES:
        names |= set(table)
    return sorted(names)


def _closest(name: str, config_cls, flags: bool) -> str:
    names = _all_names(config_cls)
    if flags:
        pool = [flag_name(n) for n in names] + list(CLI_SPELLINGS)
        close = difflib.get_close_matches(name, pool, 3, 0.6)
    else:
        close = difflib.get_close_matches(name, names, 3, 0.6)
    return f"did you mean {', '.join(close)}?" if close else "not a Megatron-LM training argument jmegatron knows"


# ------------------------------------------------------------------ values

def _int(text: str) -> int:
    """An int from ``text``; an integral float ("1000.0", Megatron's float-typed flags) too."""
    value = float(text) if not re.fullmatch(r"[+-]?\d+", text.strip()) else int(text)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(text)
        value = int(value)
    return value


_int.__name__ = "int"  # argparse names the type in its message


def _coerce(name: str, value: Any, hint) -> Any:
    """``value`` (from YAML or a flag) as field ``name``'s type; raises MegatronArgumentError."""
    inner, _ = _inner(hint)
    if value is None:
        return None
    try:
        if inner is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise ValueError
        if inner is int:
            if isinstance(value, bool):
                raise ValueError
            return value if isinstance(value, int) else _int(str(value))
        if inner is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if inner is str:
            if isinstance(value, (list, tuple)) and name == "data_path":  # Megatron's nargs: "W1 P1 W2 P2"
                return " ".join(str(v) for v in value)
            if isinstance(value, (list, tuple)) and len(value) == 1:  # --cp-comm-type p2p (nargs "+")
                value = value[0]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name == "split":
                return str(value)
            if not isinstance(value, str):
                raise ValueError
            return value
        if inner is tuple:
            if isinstance(value, str):
                value = ast.literal_eval(value)
            return tuple(_as_python([v]) if isinstance(v, str) else v for v in value)
        if isinstance(value, str) and name in ("window_size", "window_attn_skip_freq", "no_rope_freq"):
            try:
                return ast.literal_eval(value)
            except (ValueError, SyntaxError):
                return value
        return tuple(value) if isinstance(value, list) else value
    except (ValueError, TypeError, SyntaxError):
        kind = inner.__name__ if isinstance(inner, type) else str(inner)
        raise MegatronArgumentError(f"{name}={value!r} is not a valid {kind}") from None


def _as_python(tokens: Any) -> Any:
    """A raw flag's tokens as a value: no token (a store_true flag) -> True, one token ->
    its YAML scalar (``1.0`` -> 1.0, ``null`` -> None), several -> a list of them."""
    if tokens is True or tokens is False or not isinstance(tokens, list):
        return tokens
    vals = []
    for t in tokens:
        try:
            vals.append(yaml.safe_load(t))
        except yaml.YAMLError:
            vals.append(t)
    return True if not vals else vals[0] if len(vals) == 1 else vals


# ------------------------------------------------------------------ translation

def _translate(raw: dict, config_cls, kind: str) -> tuple[dict, dict]:
    """``raw`` (Megatron dest -> value, in the order given) -> (fields, {dest: (status,
    detail)}). ``kind`` "flags" or "yaml" (YAML takes num_query_groups as TransformerConfig
    does, without --group-query-attention)."""
    hints = _field_hints(config_cls)
    refused_tokenizers = getattr(inspect.getmodule(config_cls), "REFUSED_TOKENIZER_TYPES", ())
    fields: dict = {}
    status: dict = {}
    origin: dict = {}  # field -> the dest that set it

    def put(dest, field, value, note=""):
        if field in fields and fields[field] != value and origin[field] != dest:
            raise MegatronArgumentError(f"{origin[field]} and {dest} both set {field} ({fields[field]!r} vs "
                                        f"{value!r}); give one")
        fields[field], origin[field] = value, dest
        status[dest] = ("accepted", f"{field}={value!r}" + (f" ({note})" if note else ""))

    for dest, value in raw.items():
        field = dest if dest in hints else RENAMED.get(dest)
        if field is not None and field in hints:
            if value is None and not _inner(hints[field])[1]:
                status[dest] = ("ignored", "null: Megatron's default")
                continue
            if field == "tokenizer_type" and value in refused_tokenizers:
                status[dest] = ("refused", f"{value} is not read; the same tokenizer saved by transformers loads "
                                f"as --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR")
                continue
            try:
                put(dest, field, _coerce(field, value, hints[field]))
            except MegatronArgumentError as e:
                status[dest] = ("refused", str(e))
            continue
        value = _as_python(value)
        if dest in SPECIAL:
            _special(dest, value, raw, kind, put, status, hints)
        elif dest in IGNORED:
            status[dest] = ("ignored", IGNORED[dest])
        elif dest in REFUSED:
            inert, why = REFUSED[dest]
            if value in inert or (value is None and None in inert):
                status[dest] = ("ignored", f"{value!r}: off, Megatron's default")
            else:
                status[dest] = ("refused", why)
        else:
            status[dest] = ("unknown", "")
    _megatron_rules(raw, kind, fields, status, put)
    return fields, status


def _special(dest, value, raw, kind, put, status, hints) -> None:
    """The SPECIAL arguments (see the table)."""
    if dest == "group_query_attention":
        if kind == "flags" and value:
            status[dest] = ("accepted", "num_query_groups from --num-query-groups (1 when not given)")
        else:
            status[dest] = ("ignored", "TransformerConfig's num_query_groups decides")
    elif dest == "use_rotary_position_embeddings":
        if value:
            put(dest, "position_embedding_type", "rope")
        else:
            status[dest] = ("ignored", "off")
    elif dest in ("recompute_activations", "checkpoint_activations"):
        if value:
            put(dest, "recompute_granularity", "selective" if dest == "recompute_activations" else "full")
        else:
            status[dest] = ("ignored", "off")
    elif dest == "optimizer":
        if value == "adam":
            status[dest] = ("accepted", "AdamW (jmegatron's optimizer)")
        else:
            status[dest] = ("refused", "jmegatron's optimizer is Adam(W) only; use adam")
    elif dest == "add_position_embedding":
        pos = raw.get("position_embedding_type")
        if value or pos not in (None, "learned_absolute"):
            status[dest] = ("ignored", f"position_embedding_type={pos!r} decides" if pos else "on")
        else:
            status[dest] = ("refused", "deprecated in Megatron (its validate_args raises); use "
                            "--position-embedding-type rope or none")
    elif dest == "activation_func":
        if value == "swiglu":
            put(dest, "swiglu", True)
        elif value == "gelu":
            status[dest] = ("accepted", "the GELU MLP (openai_gelu picks the tanh form)")
        else:
            status[dest] = ("refused", "the MLP is swiglu or gelu")
    elif dest in ("encoder_num_layers", "encoder_seq_length"):
        target = dest.removeprefix("encoder_")
        if value is None:
            status[dest] = ("ignored", "null")
        elif target in raw and raw[target] is not None:
            status[dest] = ("refused", f"both --{dest.replace('_', '-')} and --{target.replace('_', '-')} given "
                            f"(Megatron asserts one)")
        else:
            put(dest, target, _coerce(target, value, hints[target]), "Megatron's alias")
    elif dest == "yaml_cfg":
        status[dest] = ("accepted", f"the config file {value} (as --config)")


def _derived(raw, kind, fields) -> frozenset:
    """The fields :func:`_megatron_rules` derived rather than took from an argument."""
    out = set()
    if kind == "flags" and raw.get("group_query_attention") and "num_query_groups" not in raw:
        out.add("num_query_groups")
    if fields.get("swiglu") and raw.get("ffn_hidden_size") is None and "ffn_hidden_size" in fields:
        out.add("ffn_hidden_size")
    return frozenset(out)


def _megatron_rules(raw, kind, fields, status, put) -> None:
    """Megatron's validate_args derivations between arguments given together."""
    if kind == "flags" and "num_query_groups" in fields and not raw.get("group_query_attention"):
        del fields["num_query_groups"]
        status["num_query_groups"] = ("ignored", "Megatron reads it only with --group-query-attention")
    if kind == "flags" and raw.get("group_query_attention") and "num_query_groups" not in fields:
        put("group_query_attention", "num_query_groups", 1, "Megatron's default --num-query-groups")
    if fields.get("sequence_parallel") and fields.get("tensor_model_parallel_size") == 1:
        del fields["sequence_parallel"]
        dest = "sequence_parallel"
        status[dest] = ("ignored", "off at --tensor-model-parallel-size 1, as Megatron's validate_args")
    if fields.get("swiglu") and fields.get("ffn_hidden_size") is None and fields.get("hidden_size"):
        h = fields["hidden_size"]
        src = "swiglu" if "swiglu" in raw else "activation_func"
        fields["ffn_hidden_size"] = int((4 * h * 2 / 3) / 64) * 64
        s, d = status.get(src, ("accepted", "swiglu=True"))
        status[src] = (s, d + f", ffn_hidden_size={fields['ffn_hidden_size']} (Megatron's int(4h x 2/3 / 64) x 64)")


# ------------------------------------------------------------------ the command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise MegatronArgumentError(message)


def build_parser(config_cls) -> argparse.ArgumentParser:
    """argparse for Megatron's flags and the config fields spelled as flags (every value
    SUPPRESSed unless given; no abbreviations). Flags of fields are typed; the ignored and
    refused ones take any number of values (their arity does not matter)."""
    p = _Parser(prog="python -m jmegatron.train", add_help=False, allow_abbrev=False,
                argument_default=argparse.SUPPRESS)
    hints = _field_hints(config_cls)
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    taken: set = set()

    def add(flag, **kw):
        if flag not in taken:
            taken.add(flag)
            p.add_argument(flag, **kw)

    spelled = {dest for dest, _ in CLI_SPELLINGS.values()}
    for flag, (dest, const) in CLI_SPELLINGS.items():
        target = dest if dest in hints else RENAMED.get(dest, dest)
        if const is VALUE:
            add(flag, dest=dest, **(_value_kw(target, hints) if target in hints else dict(type=str)))
        else:
            add(flag, dest=dest, action="store_const", const=const)
    for name, hint in hints.items():
        if hint is bool:
            add(flag_name(name), dest=name, action="store_const", const=True)
            if defaults.get(name) is True:
                add("--no-" + name.replace("_", "-"), dest=name, action="store_const", const=False)
        else:
            add(flag_name(name), dest=name, **_value_kw(name, hints))
    for dest, field in RENAMED.items():
        if field in hints and dest not in spelled:
            if hints[field] is bool:
                add(flag_name(dest), dest=dest, action="store_const", const=True)
            else:
                add(flag_name(dest), dest=dest, **_value_kw(field, hints))
    for dest, (kind, _) in SPECIAL.items():
        if dest in spelled:
            continue
        if kind == "flag":
            add(flag_name(dest), dest=dest, action="store_const", const=True)
        else:
            add(flag_name(dest), dest=dest, type=_FLAG_KINDS[kind])
    for dest in (*IGNORED, *REFUSED):
        if dest not in spelled:
            add(flag_name(dest), dest=dest, nargs="*")
    return p


def _value_kw(field: str, hints: dict) -> dict:
    inner, _ = _inner(hints[field])
    if field == "data_path":
        return dict(nargs="+")
    if field == "cp_comm_type":
        return dict(nargs="+")
    if inner is tuple:
        return dict(nargs="+")
    if inner is int:
        return dict(type=_int)
    if inner is float:
        return dict(type=float)
    return dict(type=str)


def parse_flags(argv: Sequence[str], config_cls, source: str = "command line") -> Resolution:
    """Megatron's flags (and config fields spelled as flags) in ``argv`` -> a Resolution.

    Raises MegatronArgumentError for a value of the wrong type or a flag missing its value
    (argparse's message). Unknown and refused flags are rows of the result; call
    :meth:`Resolution.check` to refuse them."""
    parser = build_parser(config_cls)
    ns, rest = parser.parse_known_args(list(argv))
    raw = vars(ns)
    order = _flag_order(parser, argv)
    raw = {d: raw[d] for d in sorted(raw, key=lambda d: order.get(d, 1 << 30))}
    fields, status = _translate(raw, config_cls, "flags")
    rows = []
    last = {}
    for i, (flag, dest, text) in enumerate(_given(parser, argv)):
        last[dest] = i
    for i, (flag, dest, text) in enumerate(_given(parser, argv)):
        spelling = f"{flag} {text}".strip()
        if last[dest] != i:
            rows.append(Row(spelling, "accepted", f"overridden by a later {flag} (argparse keeps the last)"))
            continue
        st, detail = status.get(dest, ("accepted", ""))
        rows.append(Row(spelling, st, detail))
    unknown: list = []  # [flag, values...] groups
    for token in rest:
        if token.startswith("-") or not unknown:
            unknown.append([token])
        else:
            unknown[-1].append(token)
    for group in unknown:
        head = group[0]
        detail = (_closest(head.split("=")[0], config_cls, flags=True) if head.startswith("-")
                  else "a value without a flag")
        rows.append(Row(" ".join(group), "unknown", detail))
    config_path = raw.get("yaml_cfg")
    return Resolution(source, fields, rows, config_path, _derived(raw, "flags", fields))


def _given(parser, argv) -> list:
    """(flag, dest, value text) of each known flag in ``argv``, in order."""
    actions = parser._option_string_actions
    out = []
    args = list(argv)
    i = 0
    while i < len(args):
        tok = args[i]
        name, eq, val = tok.partition("=")
        if tok.startswith("--") and name in actions:
            values = [val] if eq else []
            j = i + 1
            while not eq and j < len(args) and not (args[j].startswith("--") and args[j] != "--"):
                if actions[name].nargs == 0:
                    break
                values.append(args[j])
                j += 1
                if actions[name].nargs is None:
                    break
            out.append((name, actions[name].dest, " ".join(values)))
            i = j if not eq else i + 1
        else:
            i += 1
    return out


def _flag_order(parser, argv) -> dict:
    order: dict = {}
    for i, (_, dest, _) in enumerate(_given(parser, argv)):
        order.setdefault(dest, i)
    return order


_SHELL_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def read_args_file(path: str, environ: Optional[dict] = None) -> list:
    """The tokens of a stored argument list (``configs/bytemlperf/*.args``, what a ByteMLPerf
    script passes to ``pretrain_gpt.py``): shell words, ``#`` comments dropped, ``$NAME`` and
    ``${NAME}`` replaced by ``environ`` (default: the environment), as the script's shell does.
    Raises MegatronArgumentError naming the file, the word and the first variable that is not
    set; FileNotFoundError for a missing file."""
    environ = os.environ if environ is None else environ
    with open(path) as f:
        words = shlex.split(f.read(), comments=True)

    def value(m):
        name = m.group(1) or m.group(2)
        if name not in environ:
            raise MegatronArgumentError(f"args file {path!r}: {m.string!r} names the environment variable {name}, "
                                        f"which is not set; export {name}=... (the script's variable) and run again")
        return environ[name]

    return [_SHELL_VAR.sub(value, w) for w in words]


# ------------------------------------------------------------------ YAML

SECTIONS = ("language_model", "model_parallel")
_ENV = re.compile(r"\$\{([^}]*)\}")


def read_yaml(path: str, config_cls) -> Resolution:
    """Megatron's ``--yaml-cfg`` file at ``path`` -> a Resolution (``check()`` it).

    Raises MegatronArgumentError naming the file and the key: YAML syntax, a key in two
    sections, a section other than ``language_model`` / ``model_parallel``, an unset
    ``${VAR}``, a value of the wrong type."""
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise MegatronArgumentError(f"config file {path!r}{where}: not valid YAML "
                                    f"({getattr(e, 'problem', None) or e}); fix the syntax there") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise MegatronArgumentError(f"config file {path!r}: a YAML config is a mapping of keys to values "
                                    f"(Megatron's examples/gpt3/gpt_config.yaml), not a {type(doc).__name__}")
    flat: dict = {}
    where: dict = {}
    for key, value in doc.items():
        if key in SECTIONS and isinstance(value, dict):
            items = [(f"{key}.{k}", k, v) for k, v in value.items()]
        elif isinstance(value, dict):
            raise MegatronArgumentError(f"config file {path!r}: key {key!r} is a section; Megatron's YAML has the "
                                        f"sections {list(SECTIONS)} and top-level keys")
        else:
            items = [(str(key), key, value)]
        for shown, k, v in items:
            if not isinstance(k, str):
                raise MegatronArgumentError(f"config file {path!r}: key {k!r} is not a name")
            if k in flat:
                raise MegatronArgumentError(f"config file {path!r}: {k!r} is given twice ({where[k]} and {shown}); "
                                            f"keep one")
            flat[k], where[k] = _substitute_env(path, shown, v), shown
    fields, status = _translate(flat, config_cls, "yaml")
    rows = []
    for k in flat:
        st, detail = status.get(k, ("accepted", ""))
        if st == "unknown":
            detail = _closest(k, config_cls, flags=False)
        rows.append(Row(f"{where[k]}: {flat[k]!r}" if st == "refused" else where[k], st, detail))
    return Resolution(f"config file {path!r}", fields, rows)


def _substitute_env(path: str, key: str, value: Any) -> Any:
    """``${VAR}`` in a string value replaced by the environment variable (Megatron's
    yaml_arguments env_constructor); lists element by element."""
    if isinstance(value, list):
        return [_substitute_env(path, key, v) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    missing = [v for v in _ENV.findall(value) if v not in os.environ]
    if missing:
        raise MegatronArgumentError(f"config file {path!r}: {key}={value!r} names the environment variable "
                                    f"{missing[0]}, which is not set; export it or write the value")
    out = _ENV.sub(lambda m: os.environ[m.group(1)], value)
    try:
        parsed = yaml.safe_load(out)
    except yaml.YAMLError:
        return out
    return parsed if isinstance(parsed, (int, float)) and not isinstance(parsed, bool) else out


# ------------------------------------------------------------------ --help

def field_docs(config_cls) -> list:
    """(section, name, type text, default, one line) for every field of ``config_cls``, from
    the source of each dataclass that declares its fields (``config_cls`` and the groups it
    inherits, in :func:`dataclasses.fields` order): the section comments ``# --- name (...) ---``,
    the annotation, and the field's trailing comment, else the comment block right above it
    (its first sentence)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    out: list = []
    section = "general"
    for klass in reversed(config_cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass.__dict__.get("__annotations__"):
            section = _class_field_docs(klass, defaults, section, out)
    return out


def _class_field_docs(klass, defaults: dict, section: str, out: list) -> str:
    """Append :func:`field_docs`' rows for the fields ``klass``'s own body declares to
    ``out``; ``section``: the section in force before it. Returns the section in force after it."""
    source = inspect.getsource(klass)
    comments: dict = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    cls = ast.parse(source).body[0]
    in_header, group = False, None
    prev_end = cls.lineno
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            prev_end = node.end_lineno
            continue
        block: list = []
        for ln in range(prev_end + 1, node.lineno):
            text = comments.get(ln)
            if not lines[ln - 1].strip() or text is None:
                block, group = [], None
                continue
            if text.startswith("---") or in_header:  # a section header, maybe over several lines
                if text.startswith("---"):
                    section = re.sub(r"\s*\(.*", "", text.strip("- ")).strip() or section
                in_header = not text.endswith("---")
                block = []
                continue
            block.append(text)
        name = node.target.id
        doc = comments.get(node.lineno) or _first_sentence(" ".join(block))
        if block:
            group = (name, " ".join(block))
        elif not doc and group and _same_group(name, *group):
            doc = f"see {group[0]}"
        out.append((section, name, ast.unparse(node.annotation), defaults.get(name), _first_sentence(doc)))
        prev_end = node.end_lineno
    return section


def _same_group(name: str, head: str, text: str) -> bool:
    """Whether the comment block of field ``head`` (``text``) also describes ``name``: it
    names it (or its ``prefix_*``), or both share their first two name parts."""
    parts = name.split("_")
    return (name in text or f"{parts[0]}_*" in text or parts[:2] == head.split("_")[:2]
            or name.replace("_", "-") in text)


def _first_sentence(text: str, limit: int = 150) -> str:
    """``text`` up to its first ``.`` or ``;`` outside brackets (not "et al." / "e.g."),
    at most ``limit`` characters."""
    text = " ".join(text.split())
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and ch in ".;" and (i + 1 == len(text) or text[i + 1] == " "):
            word = text[:i].rsplit(" ", 1)[-1]
            if word not in ("al", "e.g", "i.e", "vs", "etc") and i < limit:
                text = text[:i]
                break
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def megatron_spellings(config_cls) -> dict:
    """field -> how the command line spells it: Megatron's flag where it differs from the
    field's name (``--disable-bias-linear`` for ``add_bias_linear``, ``--fp8-format`` for
    ``fp8``), else ``--<field>``, then Megatron's other names (``--num-experts``) and the
    YAML-only ones (``yaml: layernorm_epsilon``)."""
    hints = _field_hints(config_cls)
    out: dict = {}
    for name in hints:
        own = [flag for flag, (dest, const) in CLI_SPELLINGS.items()
               if dest == name and (const is VALUE or const is False)]
        out[name] = own or [flag_name(name)]
    for dest, field in RENAMED.items():
        if field in out and dest not in YAML_NAMES:
            out[field].append(flag_name(dest))
    for dest, field in YAML_NAMES.items():
        if field in out:
            out[field].append(f"(yaml: {dest})")
    return out


def help_text(config_cls, usage: str) -> str:
    """``usage`` and every field of ``config_cls``, by section: flag, type, default, one line."""
    spell = megatron_spellings(config_cls)
    rows = field_docs(config_cls)
    width = max(len(f"{n}: {t} = {d!r}") for _, n, t, d, _ in rows)
    parts = [usage, "",
             "Every config field, by section: --config.<field>=<value>, or the Megatron-LM flag shown",
             "(megatron/training/arguments.py spellings; python -m jmegatron.train accepts Megatron's flags",
             "as typed and refuses, by name, those for features jmegatron does not build).", ""]
    section = None
    for sec, name, typ, default, doc in rows:
        if sec != section:
            parts.append(f"{sec}:")
            section = sec
        head = f"{name}: {typ} = {default!r}"
        parts.append(f"  {head:<{width}}  {' | '.join(spell[name]):<40}  {doc}".rstrip())
    return "\n".join(parts)
