"""The training command line as a library: ``--config PATH``, ``--config.<field>=<value>``
overrides, Megatron-LM's flags and ByteMLPerf's ``--args-file`` -> a validated
:class:`jmegatron.config.JMegatronConfig` (Megatron-LM's ``megatron/training/arguments.py``
``parse_args`` is the analogue). Every CLI that takes a training config parses it here
(:mod:`jmegatron.train`, :mod:`jmegatron.tools`, :mod:`jmegatron.bench`); the argument
syntax is :mod:`jmegatron.train`'s docstring.
"""

from __future__ import annotations

import ast
import os
import sys
import typing
from typing import Any, Optional, Sequence

from jmegatron.arguments import MegatronArgumentError, help_text, parse_flags, read_args_file
from jmegatron.checkpoint.views import checkpoint_view
from jmegatron.config import ConfigError, JMegatronConfig, check_names, load_config_file

USAGE = ("usage: python -m jmegatron.train --config CONFIG.py|.yaml|config.json [--config.<field>=<value> ...] "
         "[MEGATRON FLAGS]\n"
         "       python -m jmegatron.train [--args-file] FILE.args [MEGATRON FLAGS]  (ByteMLPerf's arguments, "
         "${NAME} from the environment)\n"
         "       python -m jmegatron.train --config.load=CKPT --config.use_checkpoint_args=True [--config.<field>=<value> ...]")
HINT = "python -m jmegatron.train --help lists every field (--config.<field>=<value>) and its Megatron flag"


def _parse_value(name: str, text: str) -> Any:
    hint = typing.get_type_hints(JMegatronConfig)[name]
    if typing.get_origin(hint) is typing.Union:
        if text in ("None", "none", "null"):
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"config.{name}={text!r} is not a boolean (use True or False).")
    if hint is str:
        return text
    if hint is Any:  # e.g. moe_layer_freq: a Python literal, else the text (validated by the config)
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    example = getattr(JMegatronConfig, name, None)
    if not isinstance(example, hint) or isinstance(example, bool):
        example = {int: 100, float: 0.5}.get(hint)
    fix = f"e.g. --config.{name}={example!r}" if example is not None else f"give a Python {hint.__name__} literal"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"config.{name}={text!r} is not a valid {hint.__name__}; {fix}.") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, hint) or isinstance(value, bool):
        raise ConfigError(f"config.{name}={text!r} is not a valid {hint.__name__}; {fix}.")
    return value


def expand_args_files(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--args-file FILE`` (or ``--args-file=FILE``) and each bare ``FILE.args``
    replaced by the file's arguments (:func:`jmegatron.arguments.read_args_file`: ByteMLPerf's
    argument lists, ``${NAME}`` from the environment), in place, so flags after it win as
    Megatron's argparse keeps the last. Raises ConfigError for a missing file or an unset
    variable (naming it)."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg, path = args[i], None
        if arg == "--args-file":
            if i + 1 >= len(args):
                raise ConfigError(f"--args-file needs a file; {USAGE}")
            path, i = args[i + 1], i + 1
        elif arg.startswith("--args-file="):
            path = arg.split("=", 1)[1]
        elif arg.endswith(".args") and not arg.startswith("-"):
            path = arg
        if path is None:
            out.append(arg)
        else:
            if not os.path.isfile(path):
                raise ConfigError(f"--args-file {path}: no such file")
            try:
                out += read_args_file(path)
            except MegatronArgumentError as e:
                raise ConfigError(str(e)) from None
        i += 1
    return out


def parse_args(argv: Sequence[str]) -> tuple[Optional[str], dict[str, Any]]:
    """(config path or None, overrides) from ``argv``: ``--config``, ``--config.<field>``
    and Megatron's flags (their fields merged into the overrides). ``--help`` prints
    :func:`jmegatron.arguments.help_text` and exits 0. Raises ConfigError on a bad argument."""
    path, overrides, _ = parse_argv(argv)
    return path, overrides


def parse_argv(argv: Sequence[str]) -> tuple[Optional[str], dict[str, Any], bool]:
    """(config path or None, overrides, whether Megatron flags were given) from ``argv``, as
    :func:`parse_args` reads it (``--args-file`` expanded, ``--help`` printed). Raises
    ConfigError on a bad argument."""
    path: Optional[str] = None
    overrides: dict[str, Any] = {}
    megatron: list[str] = []
    args = expand_args_files(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            print(help_text(JMegatronConfig, USAGE))
            raise SystemExit(0)
        if not (arg == "--config" or arg.startswith(("--config=", "--config."))):
            megatron.append(arg)  # Megatron's flags and their values
            i += 1
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value; {USAGE}")
            value = args[i + 1]
            i += 1
        if key == "config":
            path = value
        else:
            name = key[len("config."):]
            check_names([name])
            overrides[name] = _parse_value(name, value)
        i += 1
    if megatron:
        path = _merge_megatron(megatron, path, overrides)
    return path, overrides, bool(megatron)


def _merge_megatron(argv: list[str], path: Optional[str], overrides: dict[str, Any]) -> Optional[str]:
    """Megatron's flags in ``argv`` into ``overrides`` (in place); returns the config path
    (``--yaml-cfg`` stands for ``--config``). Prints the ignored flags on one line to stderr.
    Raises ConfigError (one line) for unknown or refused flags, bad values, or a field given
    two different values."""
    try:
        resolution = parse_flags(argv, JMegatronConfig)
        resolution.check()
    except MegatronArgumentError as e:
        raise ConfigError(f"{e}. {HINT}") from None
    for name, value in resolution.fields.items():
        if name in resolution.derived and name in overrides:  # a value given beats Megatron's derivation
            continue
        if name in overrides and overrides[name] != value:
            raise ConfigError(f"config.{name} is given twice: --config.{name}={overrides[name]!r} and a Megatron flag "
                              f"setting {value!r}; keep one.")
        overrides[name] = value
    if resolution.config_path is not None:
        if path is not None and path != resolution.config_path:
            raise ConfigError(f"--config {path} and --yaml-cfg {resolution.config_path} are both given; keep one.")
        path = resolution.config_path
    note = resolution.ignored_note()
    if note:
        print(note, file=sys.stderr, flush=True)
    return path


def config_from_argv(argv: Sequence[str], overrides: Optional[dict[str, Any]] = None) -> JMegatronConfig:
    """``--config F [--config.<field>=<value> ...] [Megatron flags] [--args-file F.args | F.args]``
    -> a validated config (every CLI that takes a training config uses this); ``overrides``
    (field -> value) are applied last, before validation. Raises ConfigError or FileNotFoundError."""
    path, parsed, from_flags = parse_argv(argv)
    return config_from_parsed(path, {**parsed, **(overrides or {})}, from_flags)


def config_from_parsed(path: Optional[str], overrides: dict[str, Any], from_flags: bool = False) -> JMegatronConfig:
    """The validated config of :func:`parse_argv`'s result (``from_flags``: Megatron flags were
    given, so no ``--config`` is needed); ``kd_finalize`` reads the distilled run's config.json.
    Raises ConfigError (no config given, a bad field) or FileNotFoundError."""
    path, overrides = _finalize_config(path, overrides)
    if path is None and not overrides.get("use_checkpoint_args") and not from_flags:
        raise ConfigError(f"--config is required (or --config.load=CKPT --config.use_checkpoint_args=True, or "
                          f"Megatron's flags); {USAGE}")
    return load_config_file(path, overrides, allow_no_file=from_flags)


def _finalize_config(path: Optional[str], overrides: dict[str, Any]) -> tuple[Optional[str], dict[str, Any]]:
    """``kd_finalize`` without ``--config``: the distilled run's own ``config.json`` (in
    ``load``) is the config, so the student's architecture, precision and tokenizer are the
    checkpoint's; its distillation settings and load options are reset
    (the ``read`` view of :mod:`jmegatron.checkpoint.views`) and ``overrides`` apply on top. With
    ``--config``: ``use_checkpoint_args`` unless given (the architecture and tokenizer from
    ``load``). Other arguments pass unchanged."""
    load = overrides.get("load")
    if not overrides.get("kd_finalize") or not load:
        return path, overrides
    if path is not None:
        return path, {"use_checkpoint_args": True, **overrides}
    saved = os.path.join(load, "config.json")
    if not os.path.isfile(saved):
        raise ConfigError(f"config.kd_finalize=True without --config reads the student's config from "
                          f"config.load={load!r}, which has no config.json (a distillation run's config.save); "
                          f"give --config too")
    return saved, {**checkpoint_view("read"), **overrides}

