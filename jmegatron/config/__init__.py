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

The fields live in groups, each declared once with its own checks:
:mod:`jmegatron.config.model` (the architecture with its rotary and MoE parts, and the
kernels), :mod:`jmegatron.config.parallel`, :mod:`jmegatron.config.training` (precision,
schedule, logging and checkpoints, distillation) and :mod:`jmegatron.config.data`;
:mod:`jmegatron.config.run` composes them into :class:`JMegatronConfig`, and
:mod:`jmegatron.config.files` reads configs from files. This package's namespace is the
public face of all of them.
"""

from jmegatron.config.common import ConfigError, ConfigGroup
from jmegatron.config.data import (REFUSED_TOKENIZER_TYPES, TIKTOKEN_DEFAULT_VOCAB_SIZE, TOKENIZER_FIELDS,
                                   TOKENIZER_NAME_FIELDS, TOKENIZER_TYPES, DataConfig, tokenizer_type_of,
                                   tokenizer_vocab_size)
from jmegatron.config.files import (IMPORTED_FIELDS_FILE, base_config, checkpoint_args, checkpoint_scheduler_args,
                                    from_configdict, from_json, get_config_of, imported_args, load_config_file,
                                    read_run_config, set_family)
from jmegatron.config.model import (ATTENTION_IMPLS, CROSS_ENTROPY_IMPLS, DROPOUT_IMPLS, FP8_AMAX_COMPUTE_ALGOS,
                                    FP8_FORMATS, FP8_RECIPES, LOAD_BALANCING_TYPES, MATMUL_IMPLS, NORMALIZATIONS,
                                    POSITION_EMBEDDING_TYPES, RECOMPUTE_GRANULARITIES, ROUTER_DTYPES, SCORE_FUNCTIONS,
                                    TOKEN_DISPATCHER_TYPES, TOKEN_DROP_POLICIES, TRANSFORMER_IMPLS, KernelConfig,
                                    MoEConfig, RotaryConfig, TransformerConfig, moe_layer_pattern,
                                    no_rope_layer_pattern, parse_moe_layer_freq, window_layer_pattern,
                                    yarn_concentration_factor, yarn_get_mscale)
from jmegatron.config.parallel import PIPELINE_SCHEDULES, ModelParallelConfig
from jmegatron.config.run import (MODEL_FIELDS, SCHEDULER_FIELDS, JMegatronConfig,
                                  check_names, field_types)
from jmegatron.config.training import (DISTILLATION_RESETS, LR_DECAY_STYLES, WSD_DECAY_STYLES, DistillationConfig,
                                       LoggingConfig, MixedPrecisionConfig, TrainingConfig)

__all__ = [
    "ATTENTION_IMPLS", "CROSS_ENTROPY_IMPLS", "DISTILLATION_RESETS", "DROPOUT_IMPLS", "FP8_AMAX_COMPUTE_ALGOS",
    "FP8_FORMATS", "FP8_RECIPES", "IMPORTED_FIELDS_FILE", "LOAD_BALANCING_TYPES", "LR_DECAY_STYLES", "MATMUL_IMPLS",
    "MODEL_FIELDS", "NORMALIZATIONS", "PIPELINE_SCHEDULES", "POSITION_EMBEDDING_TYPES",
    "RECOMPUTE_GRANULARITIES", "REFUSED_TOKENIZER_TYPES", "ROUTER_DTYPES", "SCHEDULER_FIELDS", "SCORE_FUNCTIONS",
    "TIKTOKEN_DEFAULT_VOCAB_SIZE", "TOKENIZER_FIELDS", "TOKENIZER_NAME_FIELDS", "TOKENIZER_TYPES",
    "TOKEN_DISPATCHER_TYPES", "TOKEN_DROP_POLICIES", "TRANSFORMER_IMPLS", "WSD_DECAY_STYLES", "ConfigError",
    "ConfigGroup", "DataConfig", "DistillationConfig", "JMegatronConfig", "KernelConfig", "LoggingConfig",
    "MixedPrecisionConfig", "MoEConfig", "ModelParallelConfig", "RotaryConfig", "TrainingConfig", "TransformerConfig",
    "base_config", "check_names", "checkpoint_args", "checkpoint_scheduler_args", "field_types", "from_configdict",
    "from_json", "get_config_of", "imported_args", "load_config_file", "moe_layer_pattern", "no_rope_layer_pattern", "parse_moe_layer_freq",
    "read_run_config", "set_family", "tokenizer_type_of", "tokenizer_vocab_size", "window_layer_pattern", "yarn_concentration_factor", "yarn_get_mscale",
]
