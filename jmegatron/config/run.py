"""The run's config, :class:`JMegatronConfig`: every setting of a jmegatron run, composed
of the groups (:mod:`jmegatron.config.model`, :mod:`jmegatron.config.parallel`,
:mod:`jmegatron.config.training`, :mod:`jmegatron.config.data`), each with its own fields
and checks; the checks across groups, the derived fields and the field tables live here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import typing
from typing import Any, Optional

from jmegatron.config.common import ConfigError, check_choices, refuse_with
from jmegatron.config.data import REFUSED_TOKENIZER_TYPES, DataConfig, tokenizer_type_of, tokenizer_vocab_size
from jmegatron.config.model import MTP_REFUSAL, KernelConfig, TransformerConfig
from jmegatron.config.training import (DISTILLATION_RESETS, DistillationConfig, LoggingConfig, MixedPrecisionConfig,
                                       TrainingConfig)

# REFUSED_TOKENIZER_TYPES is read from this module by jmegatron.arguments (the module of the
# config class it is given), which imports nothing of jmegatron.
__all__ = ["JMegatronConfig", "REFUSED_TOKENIZER_TYPES", "MODEL_FIELDS",
           "SCHEDULER_FIELDS", "check_names", "field_types"]


@dataclasses.dataclass(frozen=True)
class JMegatronConfig(DistillationConfig, DataConfig, LoggingConfig, TrainingConfig, MixedPrecisionConfig,
                      KernelConfig, TransformerConfig):
    """Every setting of a jmegatron run. ``None`` means "derive it" (see ``__post_init__``).

    Follows ``megatron/training/arguments.py``; the few jmegatron-only fields are
    marked as such. The fields are declared in the groups this class composes
    (:class:`jmegatron.config.model.TransformerConfig` with its rotary, MoE and parallel
    parts, :class:`jmegatron.config.model.KernelConfig`, the training groups of
    :mod:`jmegatron.config.training`, :class:`jmegatron.config.data.DataConfig`); each
    group checks its own fields, this class what spans groups. Raises ConfigError naming
    the field and the fix.
    """

    def __post_init__(self):
        for name in ("rampup_batch_size", "lr_decay_multi_step", "moe_layer_freq", "window_size",
                     "window_attn_skip_freq", "no_rope_freq"):  # JSON gives lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), field_types()[f.name])
        for klass in reversed(type(self).__mro__):
            check_choices(self, klass.__dict__.get("CHOICES", {}))
        self.check_training_length()
        train_iters = self.derived_train_iters()
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
        self.check_model()
        self.check_precision()
        self.check_training()
        self.check_logging()
        self.check_data()
        self.check_distillation()
        self._check_kernels()
        self._check_data_sources()
        self._check_distillation_layout()

    # ------------------------------------------------------------------ checks across groups
    def _check_kernels(self):
        """The kernels (KernelConfig) against the model, its precision and its tensor split."""
        for name, kernel in (("matmul_impl", "blas"), ("matmul_impl", "hybrid"), ("attention_impl", "cpu")):
            if getattr(self, name) == kernel and self.tensor_model_parallel_size > 1:
                raise ConfigError(
                    f"config.{name}={kernel!r} is a CPU custom call that GSPMD cannot partition, so it "
                    f"runs without tensor parallelism; set tensor_model_parallel_size=1 or {name}='auto'.")
        if self.multi_latent_attention and self.transformer_impl == "transformer_engine":
            raise ConfigError("config.multi_latent_attention=True with transformer_impl='transformer_engine' is not "
                              "built; set transformer_impl='local' (or 'auto').")
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

    def _check_data_sources(self):
        """The data and its tokenizer against the model's vocabulary and sequence, and a run
        that reads no data (kd_finalize)."""
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
        if not self.mock_data and self.data_path is None and not self.kd_finalize:  # finalize reads no data
            raise ConfigError("config.data_path is not set; give a preprocessed prefix "
                              "(python -m jmegatron.tools.preprocess_data) or set config.mock_data=True.")
        kind = tokenizer_type_of(self)
        has_tokenizer = kind is not None
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

    def _check_distillation_layout(self):
        """Distillation against the layout, the data and the checkpoint directories."""
        if self.mtp_num_layers is not None:
            refuse_with(self, f"mtp_num_layers={self.mtp_num_layers}",
                        dict(kd_teacher_load=self.kd_teacher_load is not None,
                             kd_teacher_logits_path=self.kd_teacher_logits_path is not None), *MTP_REFUSAL)
        if self.kd_finalize and (not self.save or not self.load or
                                 os.path.abspath(self.load) == os.path.abspath(self.save)):
            raise ConfigError("config.kd_finalize=True writes a plain student to a new directory: set "
                              "config.load to the distilled run and config.save to another directory.")
        if self.kd_finalize:
            return
        if self.kd_teacher_logits_path is not None:
            refuse_with(self, "kd_teacher_logits_path", dict(
                pipeline_model_parallel_size=self.pipeline_model_parallel_size > 1,
                context_parallel_size=self.context_parallel_size > 1,
                reset_attention_mask=self.reset_attention_mask, variable_data=self.variable_data),
                "offline distillation reads the cached rows into the unpipelined step's batch",
                "unset {name} or distil online (config.kd_teacher_load).")
        if self.kd_teacher_use_megatron_fsdp is not None:
            refuse_with(self, "kd_teacher_use_megatron_fsdp", dict(
                pipeline_model_parallel_size=self.pipeline_model_parallel_size > 1,
                context_parallel_size=self.context_parallel_size > 1),
                "the teacher on its own layout runs before the student's unpipelined micro-batch loop",
                "unset {name} or kd_teacher_use_megatron_fsdp (the teacher then takes the student's layout).")

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
        check_names(changes)
        return dataclasses.replace(self, **changes)


# Fields that describe the network's parameters: resuming with a different value fails.
# (The padded vocabulary is compared separately, so make_vocab_size_divisible_by may change.)
MODEL_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "max_position_embeddings", "position_embedding_type", "rotary_base",
    "rotary_seq_len_interpolation_factor", "rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
    "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
    "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int", "rotary_percent", "rotary_interleaved",
    "normalization", "norm_epsilon", "swiglu", "openai_gelu", "untie_embeddings_and_output_weights",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "apply_layernorm_1p", "gated_linear_unit", "softmax_scale",
    "attn_logit_softcapping", "final_logit_softcapping", "window_size", "window_attn_skip_freq",
    "rotary_base_local", "sandwich_norms", "scale_embeddings", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "no_rope_freq", "embedding_multiplier", "residual_multiplier", "logits_scaling",
    "qk_layernorm_across_heads", "pre_norms",
    "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "softmax_type",
)

# The learning-rate schedule Megatron's OptimizerParamScheduler checks on resume
# (optimizer_param_scheduler.py _check_and_set: max/min lr, warm-up, decay length and style,
# WSD) and use_checkpoint_opt_param_scheduler takes from the checkpoint, with the fields
# jmegatron derives them from (jmegatron.checkpoint.checkpointing.schedule_of).
SCHEDULER_FIELDS = ("lr", "min_lr", "lr_warmup_init", "lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples",
                    "lr_decay_iters", "lr_decay_samples", "lr_decay_style", "lr_decay_multi_step",
                    "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples")


@functools.cache
def field_types() -> dict[str, Any]:
    """Each :class:`JMegatronConfig` field's type hint, by name."""
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




def check_names(names) -> None:
    """Raise ConfigError for the first of ``names`` that is not a :class:`JMegatronConfig`
    field, with the closest field names suggested."""
    valid = [f.name for f in dataclasses.fields(JMegatronConfig)]
    for name in names:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, 3, 0.6)
            hint = f" Did you mean {close}?" if close else ""
            raise ConfigError(f"config.{name} is not a jmegatron config field.{hint}")

