"""A run's config from its sources: :func:`base_config` (the defaults as a locked
ConfigDict, a model family's fields over them), config files (Python, Megatron's YAML, a
run's config.json) with command-line overrides (:func:`load_config_file`), and what a
checkpoint's config.json gives a run that resumes or reads it."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import typing
from typing import Any, Optional

import ml_collections

from jmegatron.arguments import MegatronArgumentError, read_yaml
from jmegatron.config.common import ConfigError
from jmegatron.config.data import TOKENIZER_FIELDS, TOKENIZER_NAME_FIELDS
from jmegatron.config.run import MODEL_FIELDS, SCHEDULER_FIELDS, JMegatronConfig, check_names, field_types
from jmegatron.presets import FAMILIES


def base_config(family: Optional[str] = None) -> ml_collections.ConfigDict:
    """The defaults as a locked, type-safe ConfigDict for config files to modify.

    ``family`` (a key of :data:`jmegatron.presets.FAMILIES`: "gpt2", "llama", "llama3",
    "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3", "deepseek_v3")
    sets that family's architecture fields over the defaults (:func:`set_family`).
    Optional fields are typed placeholders, so ``--config.save=DIR`` type-checks.
    Raises ConfigError for an unknown family.
    """
    fields = {}
    hints = field_types()
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
    check_names(d)
    return JMegatronConfig(**d)


def from_json(text: str) -> JMegatronConfig:
    """Read a config saved by :meth:`JMegatronConfig.to_json` (checkpoints store one)."""
    return from_configdict(json.loads(text))


def _configdict_with(values: dict, source: str) -> ml_collections.ConfigDict:
    """:func:`base_config` with ``values`` set (JSON lists as tuples), unvalidated. Raises
    ConfigError naming ``source`` and the key: an unknown field, a value of the wrong type."""
    try:
        check_names(values)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    cd = base_config()
    for key, value in values.items():
        try:
            setattr(cd, key, tuple(value) if isinstance(value, list) else value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: {key}={value!r} has the wrong type ({e}); give a "
                              f"{field_types()[key]} value.") from None
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
            check_names([key])
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
