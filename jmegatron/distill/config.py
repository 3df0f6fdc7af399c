"""Megatron's distillation YAML (``--export-kd-cfg``) and its layer names.

Schema (megatron/post_training/algos/distillation.py, ``load_distillation_config``)::

    logit_layers: ["output_layer", "output_layer"]        # [student, teacher]
    intermediate_layer_pairs:                             # [student, teacher(, loss)]
      - ["decoder.final_layernorm", "decoder.final_layernorm"]
      - ["decoder.layers.3.input_layernorm", "decoder.layers.7.input_layernorm", "mse"]
    skip_lm_loss: true
    kd_loss_scale: 1.0
    logit_kl_temperature: 1.0
    kd_loss_alpha: 0.5          # optional: (1 - a) * lm + a * kd instead of the balancer
    logit_kl_topk: 1024         # optional: the KL over the teacher's top-K tokens only
    cross_tokenizer_loss: uld   # jmegatron: across tokenizers, "uld" or "hybrid" (GOLD)

``logit_kl_topk`` is ModelOpt's ``DistillationConfig.logit_kl_topk`` (its
``TopKLogitsKLLoss``: :func:`jmegatron.distill.losses.top_k_kl_loss`).
``cross_tokenizer_loss`` (jmegatron's; a cache built across tokenizers,
:mod:`jmegatron.distill.cross_tokenizer`): ``uld`` (Universal Logit Distillation,
:func:`jmegatron.distill.losses.uld_loss`) or ``hybrid`` (TRL GOLD's: the KL over the
teacher's top-K tokens that the student's vocabulary also has, plus ULD,
:func:`jmegatron.distill.losses.matched_top_k_kl_loss`). Missing keys take
Megatron's defaults (logits only, ``skip_lm_loss: true``,
``kd_loss_scale: 1.0``, temperature 1). The third entry of a pair selects the loss, in
either spelling in use: ``hidden_cosine`` (Megatron-LM 48d7275's
``load_distillation_config``) or ``cosine`` (ModelOpt's
``modelopt/torch/distill/plugins/megatron.py``, which Megatron-LM uses since 8463257),
both HiddenStateCosineLoss, the default for a two-entry pair; or ``mse`` (MSELoss,
both).

Layer names resolve to the values jmegatron's GPTModel sows into its ``intermediates``
collection (the output of the named module, as Megatron's forward hooks capture):

================================== ===========================================
Megatron name                      jmegatron intermediate
================================== ===========================================
``output_layer``                   the logits (model output)
``decoder.final_layernorm``        ``final_layernorm_output``
``decoder.layers.N.input_layernorm``   ``decoder_layers_N/input_layernorm_output``
``decoder.layers.N.pre_mlp_layernorm`` ``decoder_layers_N/pre_mlp_layernorm_output``
================================== ===========================================

(with ``scan_layers`` the per-layer values are stacked and ``N`` indexes them).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional

import yaml

OUTPUT_LAYER = "output_layer"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(input_layernorm|pre_mlp_layernorm)$")
KEYS = ("logit_layers", "intermediate_layer_pairs", "skip_lm_loss", "kd_loss_scale",
        "logit_kl_temperature", "kd_loss_alpha", "logit_kl_topk", "cross_tokenizer_loss")
CROSS_TOKENIZER_LOSSES = ("uld", "hybrid")
# every intermediate-loss spelling Megatron-LM or ModelOpt accepts (jmegatron.distill.losses
# maps each to its loss)
LOSS_NAMES = ("cosine", "hidden_cosine", "mse")


class DistillConfigError(ValueError):
    """A bad distillation YAML: the message names the key and the valid choices."""


@dataclasses.dataclass(frozen=True)
class IntermediatePair:
    """One ``intermediate_layer_pairs`` entry: Megatron layer names and the loss name."""

    student: str
    teacher: str
    loss: str = "cosine"


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """The parsed YAML, Megatron's defaults filled in."""

    logit_layers: tuple[str, str] = (OUTPUT_LAYER, OUTPUT_LAYER)
    intermediate_layer_pairs: tuple[IntermediatePair, ...] = ()
    skip_lm_loss: bool = True
    kd_loss_scale: float = 1.0
    logit_kl_temperature: float = 1.0
    kd_loss_alpha: Optional[float] = None
    logit_kl_topk: Optional[int] = None  # None: the KL over the whole vocabulary
    cross_tokenizer_loss: str = "uld"  # a cache built across tokenizers: "uld" or "hybrid"


def valid_layer_names(num_layers: int) -> list[str]:
    """Every Megatron layer name a model with ``num_layers`` layers can resolve."""
    names = [OUTPUT_LAYER, "decoder.final_layernorm"]
    for i in range(num_layers):
        names += [f"decoder.layers.{i}.input_layernorm", f"decoder.layers.{i}.pre_mlp_layernorm"]
    return names


def resolve_layer(name: str, num_layers: int, role: str) -> tuple[Optional[int], str]:
    """(layer index or None, sown name) for a Megatron layer name; ``output_layer`` gives
    (None, "output_layer"). Raises DistillConfigError listing the valid names."""
    if name == "decoder.final_layernorm":
        return None, "final_layernorm"
    if name == OUTPUT_LAYER:
        return None, OUTPUT_LAYER
    m = _LAYER_RE.match(name)
    if m and int(m.group(1)) < num_layers:
        return int(m.group(1)), m.group(2)
    raise DistillConfigError(
        f"unknown {role} layer {name!r} (the {role} has {num_layers} layers); valid names: "
        f"{', '.join(valid_layer_names(num_layers)[:6])}, ... decoder.layers.{num_layers - 1}.pre_mlp_layernorm")


def parse_distill_config(data: Optional[dict[str, Any]]) -> DistillConfig:
    """Validate a YAML mapping (or None: all defaults). Raises DistillConfigError."""
    data = dict(data or {})
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise DistillConfigError(f"unknown distillation config keys {unknown}; valid keys: {list(KEYS)}")
    out: dict[str, Any] = {}
    if "logit_layers" in data:
        layers = data["logit_layers"]
        if not (isinstance(layers, (list, tuple)) and len(layers) == 2):
            raise DistillConfigError(f"logit_layers must be [student_layer, teacher_layer], got {layers!r}")
        if tuple(layers) != (OUTPUT_LAYER, OUTPUT_LAYER):
            raise DistillConfigError(f"logit_layers must name {OUTPUT_LAYER!r} for both models, got {layers!r}")
        out["logit_layers"] = tuple(layers)
    pairs = []
    for entry in data.get("intermediate_layer_pairs") or ():
        if not (isinstance(entry, (list, tuple)) and len(entry) in (2, 3)):
            raise DistillConfigError(f"intermediate_layer_pairs entries are [student, teacher] or "
                                     f"[student, teacher, {'|'.join(LOSS_NAMES)}], got {entry!r}")
        loss = entry[2] if len(entry) == 3 else "cosine"
        if loss not in LOSS_NAMES:
            raise DistillConfigError(f"intermediate loss {loss!r} in {entry!r} is not one of {list(LOSS_NAMES)}")
        pairs.append(IntermediatePair(str(entry[0]), str(entry[1]), loss))
    out["intermediate_layer_pairs"] = tuple(pairs)
    for key, typ in (("skip_lm_loss", bool), ("kd_loss_scale", (int, float)), ("logit_kl_temperature", (int, float))):
        if key in data:
            if not isinstance(data[key], typ) or (typ is not bool and isinstance(data[key], bool)):
                raise DistillConfigError(f"{key}={data[key]!r} has the wrong type")
            out[key] = data[key]
    if data.get("kd_loss_alpha") is not None:
        a = data["kd_loss_alpha"]
        if not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise DistillConfigError(f"kd_loss_alpha={a!r} must be a number in [0, 1]")
        out["kd_loss_alpha"] = float(a)
    if data.get("logit_kl_topk") is not None:
        k = data["logit_kl_topk"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise DistillConfigError(f"logit_kl_topk={k!r} must be a positive integer (or null: the whole vocabulary)")
        out["logit_kl_topk"] = k
    if "cross_tokenizer_loss" in data:
        if data["cross_tokenizer_loss"] not in CROSS_TOKENIZER_LOSSES:
            raise DistillConfigError(f"cross_tokenizer_loss={data['cross_tokenizer_loss']!r} must be one of "
                                     f"{list(CROSS_TOKENIZER_LOSSES)}")
        out["cross_tokenizer_loss"] = data["cross_tokenizer_loss"]
    if out.get("logit_kl_temperature", 1.0) <= 0 or out.get("kd_loss_scale", 1.0) <= 0:
        raise DistillConfigError("logit_kl_temperature and kd_loss_scale must be > 0")
    return DistillConfig(**out)


def load_distill_config(path: Optional[str]) -> DistillConfig:
    """Read ``kd_cfg`` (None: Megatron's defaults). Raises FileNotFoundError, DistillConfigError."""
    if path is None:
        return DistillConfig()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config.kd_cfg={path!r} does not exist")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise DistillConfigError(f"config.kd_cfg={path!r} is not valid YAML: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise DistillConfigError(f"config.kd_cfg={path!r} must hold a mapping, got {type(data).__name__}")
    return parse_distill_config(data)


def check_layers(cfg: DistillConfig, student_layers: int, teacher_layers: int) -> None:
    """Resolve every layer name now (before compiling); raises DistillConfigError."""
    for pair in cfg.intermediate_layer_pairs:
        resolve_layer(pair.student, student_layers, "student")
        resolve_layer(pair.teacher, teacher_layers, "teacher")
