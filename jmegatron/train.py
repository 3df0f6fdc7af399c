"""``python -m jmegatron.train --config configs/gpt_tiny.py --config.train_iters=200 ...``

Arguments: ``--config PATH`` (a Python file with ``get_config()``, Megatron's YAML layout
``.yaml`` (also ``--yaml-cfg PATH``), or a run's ``config.json``), then any number of
``--config.<field>=<value>`` (or ``--config.<field> <value>``) overrides, the
ml_collections convention, mixed freely with Megatron-LM's own flags as they are typed
(``--num-layers 24 --bf16 --disable-bias-linear --data-path 1.0 PREFIX``;
:mod:`jmegatron.arguments`): a flag for a feature jmegatron does not build is refused by
name, one that changes only logging, launch or kernels is named as ignored. Megatron flags
alone (no ``--config``) start from jmegatron's defaults. A field set both ways must agree.
ByteMLPerf's argument lists run as they are: ``--args-file FILE.args`` or a bare ``FILE.args``
stands for the file's flags (``${NAME}`` / ``$NAME`` from the environment, an unset one an
error naming it), and flags after it win.
``--help`` lists every field with its type, default, flag and meaning. ``--config.load=CKPT --config.use_checkpoint_args=True`` takes
the architecture from a checkpoint (an ``import-hf`` one too), and then ``--config`` may be
left out (jmegatron's defaults for the rest). ``--config.load`` may also be a Hugging Face
folder: it is imported once into ``<config.save>/hf_import`` (``import-hf``), which becomes
``load``, with ``use_checkpoint_args`` unless it is given; the folder's other settings
(dropouts, ``init_method_std``, router settings) are kept unless given
(:func:`jmegatron.config.imported_args`). ``--config.kd_finalize=True --config.load=DISTILLED
--config.save=OUT`` needs no ``--config`` and no data: the distilled run's config.json is the config. Values are parsed by the field's type (``True``/``False``,
ints, floats, ``None``). Every field is validated before anything compiles; an unknown
field fails with the closest valid names. SIGTERM or Ctrl-C saves a checkpoint and exits 0.
"""

from __future__ import annotations

import ast
import os
import sys
import typing
from typing import Any, Optional, Sequence

from jmegatron.arguments import MegatronArgumentError, help_text, parse_flags, read_args_file
from jmegatron.checkpoint.views import checkpoint_view
from jmegatron.config import ConfigError, JMegatronConfig, check_names, get_config_of, load_config_file
from jmegatron.distributed import initialize_from_env
from jmegatron.runtime import reexec_with_host_allocator

# pretrain_gpt and checkpointing (JAX, Orbax) are imported inside main(): run() re-executes
# the interpreter with the host allocator first, and this module stays light for the CLIs
# and tools that only parse configs (parse_args, config_from_argv).

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
    path, overrides, _ = _parse(argv)
    return path, overrides


def _parse(argv: Sequence[str]) -> tuple[Optional[str], dict[str, Any], bool]:
    """(config path or None, overrides, whether Megatron flags were given)."""
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
    path, parsed, from_flags = _parse(argv)
    return _config(path, {**parsed, **(overrides or {})}, from_flags)


def _config(path: Optional[str], overrides: dict[str, Any], from_flags: bool = False) -> JMegatronConfig:
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


def _import_hf_load(path: Optional[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with a Hugging Face folder given as ``load`` replaced by its jmegatron
    checkpoint, imported once into ``<save>/hf_import``
    (:func:`jmegatron.export.convert.checkpoint_of`), and ``use_checkpoint_args`` True unless
    given (the architecture comes from the folder). Other ``load`` values pass unchanged.
    Raises ConfigError without a ``save`` (from the overrides or the config file)."""
    load = overrides.get("load")
    if not load or not os.path.isfile(os.path.join(load, "config.json")):
        return overrides
    from jmegatron.checkpoint.hf import is_hf_folder
    from jmegatron.export.convert import checkpoint_of

    if not is_hf_folder(load):
        return overrides
    save = overrides.get("save") or (get_config_of(path).get("save") if path else None)
    if not save:
        raise ConfigError(f"config.load={load!r} is a Hugging Face folder: set config.save (the run's directory; "
                          f"the folder is imported into <save>/hf_import once, and the run starts from it)")
    out = os.path.join(save, "hf_import")
    print(f"[jmegatron] config.load={load} is a Hugging Face folder: its jmegatron checkpoint is {out} "
          f"(import-hf, once)", flush=True)
    with checkpoint_of(load, out) as imported:  # kept: out is the run's own directory
        return dict(overrides, load=imported, use_checkpoint_args=overrides.get("use_checkpoint_args", True))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The training CLI; returns the exit status (0, 1 for a non-finite loss, 2 for bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    from jmegatron.export.common import ExportError

    try:
        path, overrides, from_flags = _parse(argv)
        cfg = _config(path, _import_hf_load(path, overrides), from_flags)
    except (ConfigError, FileNotFoundError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jmegatron.checkpoint.checkpointing import CheckpointError
    from jmegatron.pretrain_gpt import pretrain

    try:
        initialize_from_env()
        summary = pretrain(cfg)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:  # incl. DistillConfigError
        # bad sizes for the devices, a missing/corrupt/incompatible checkpoint, missing data,
        # bad distributed settings: the message names the field and the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"error: {e} (the last checkpoint is intact; lower config.lr or check the data)", file=sys.stderr)
        return 1
    import jax

    if summary["interrupted"] and jax.process_index() == 0:
        saved = f"; checkpoint saved in {cfg.save}" if cfg.save else " (config.save is not set: nothing saved)"
        print(f"[jmegatron] stopped by signal at iteration {summary['iteration']}{saved}", flush=True)
    return 0


def run() -> None:
    """The console entry point: restarts the interpreter with the host allocator
    (``$JMEGATRON_HOST_ALLOCATOR``, default mimalloc;
    :func:`jmegatron.runtime.reexec_with_host_allocator`), then :func:`main`."""
    reexec_with_host_allocator()
    sys.exit(main())


if __name__ == "__main__":
    run()
