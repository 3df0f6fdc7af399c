"""No Hugging Face config field is ignored silently: for every family of
tests/test_hf_families.py, each field of its transformers config (the nested
``rope_parameters`` entries included) is changed in turn, transformers builds the changed
model (random weights, the same draw), and the import must then either give transformers'
logits (float32, 1e-4) or raise ValueError naming the field.

Each field takes the first change transformers accepts (its config and model build, the
logits are finite). Changes
that leave jmegatron's config and weight shapes as they were reuse the unchanged import's
logits, so only a field that changes jmegatron's model runs jmegatron again (eagerly,
``jax.disable_jit``: one compiled program per change would cost minutes).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterator

import numpy as np
import pytest

import torch
import transformers

import jax

from jmegatron.conversion import hf
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig

from test_hf_families import FAMILIES, TOL, hf_model, jmegatron_cfg, tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

# Strings tried in place of a string field's value (the first that transformers takes).
STRING_CHOICES = {
    "hidden_act": ("gelu", "relu", "silu"),
    "hidden_activation": ("gelu", "silu"),
    "activation_function": ("relu", "gelu", "silu"),
    "rope_type": ("linear", "dynamic", "default"),
    "scoring_func": ("softmax", "sigmoid"),
    "topk_method": ("greedy", "noaux_tc"),
}
# Fields no change of which is a model: the config's bookkeeping.
NOT_A_MODEL = {"model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
               "output_hidden_states", "output_attentions", "return_dict", "use_cache"}


def changes(key: str, value: Any) -> Iterator[Any]:
    """Values to try in place of ``value`` for field ``key``, most telling first."""
    if isinstance(value, bool):
        yield not value
    elif isinstance(value, int):
        yield from (value + 1, 2 * value if value else 2, max(value - 1, 1))
    elif isinstance(value, float):
        yield from ((value * 1.5 if value else 0.1), value + 0.5)
    elif isinstance(value, str):
        yield from (c for c in STRING_CHOICES.get(key, ()) if c != value)
    elif value is None:
        yield from (4, 0.5, True)
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        kinds = sorted(set(value) | {"full_attention", "sliding_attention"})
        yield [kinds[(kinds.index(value[0]) + 1) % len(kinds)]] + value[1:]
    elif isinstance(value, list) and all(isinstance(v, int) for v in value):
        yield value[:-1] if value else [0]


def field_changes(conf: dict) -> Iterator[tuple[str, list[tuple[str, dict]]]]:
    """(field name as an error should name it, [(label, the changed config dict)] in the
    order :func:`changes` gives) for each field and nested ``rope_parameters`` /
    ``rope_scaling`` entry of ``conf``."""
    for key, value in conf.items():
        if key in NOT_A_MODEL or key.endswith("_token_id") or key == "id2label" or key == "label2id":
            continue
        if isinstance(value, dict):
            for sub, sv in value.items():
                yield sub, [(f"{key}.{sub}={new!r}", {**conf, key: {**value, sub: new}}) for new in changes(sub, sv)]
            continue
        yield key, [(f"{key}={new!r}", {**conf, key: new}) for new in changes(key, value)]


def transformers_logits(family: str, conf: dict):
    """(model, logits) of transformers' model of ``conf`` (None when transformers rejects it)."""
    config_cls = getattr(transformers, FAMILIES[family][0])
    try:
        config = config_cls.from_dict(copy.deepcopy(conf))
        model = hf_model(family, config)
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens().astype(np.int64))).logits.numpy()
    except Exception:  # noqa: BLE001 - transformers refuses the change: not a case
        return None, None
    if not np.all(np.isfinite(logits)):
        return None, None
    return model, logits


def jmegatron_logits(cfg, params) -> np.ndarray:
    model = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
    with jax.disable_jit():
        return np.asarray(model.apply({"params": params}, tokens()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_field_is_read_or_refused(family):
    base_model, base_hf = transformers_logits(family, hf_model(family).config.to_dict())
    base_conf = base_model.config.to_dict()
    ran: dict[str, np.ndarray] = {}
    silent, tried, refused = [], 0, 0
    for key, candidates in field_changes(base_conf):
        for label, conf in candidates:  # the first change transformers takes
            model, theirs = transformers_logits(family, conf)
            if model is not None:
                break
        else:
            continue
        tried += 1
        try:
            fields = hf.config_fields_from_hf(model.config.to_dict())
            cfg = jmegatron_cfg(fields)
            params = hf.from_hf_state_dict(model.state_dict(), cfg)
        except ValueError as e:
            if key in str(e):
                refused += 1
                continue
            silent.append(f"{label}: refused without naming {key!r}: {e}")
            continue
        shapes = json.dumps({k: str(v.shape) for k, v in model.state_dict().items()}, sort_keys=True)
        run_key = json.dumps(fields, sort_keys=True, default=str) + shapes
        if run_key not in ran:
            ran[run_key] = jmegatron_logits(cfg, params)
        diff = float(np.max(np.abs(ran[run_key][..., :theirs.shape[-1]] - theirs)))
        if not diff <= TOL:
            silent.append(f"{label}: imported, logits off by {diff:.3g}")
    print(f"{family}: {tried} changes, {refused} refused by name, {len(ran)} jmegatron models")
    assert tried > 10 and not silent, "\n".join(silent)
