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

import os
import sys
from typing import Any, Optional, Sequence

from jmegatron.command_line import config_from_parsed, parse_argv
from jmegatron.config import ConfigError, get_config_of
from jmegatron.distributed import initialize_from_env
from jmegatron.runtime import reexec_with_host_allocator

# pretrain_gpt and checkpointing (JAX, Orbax) are imported inside main(): run() re-executes
# the interpreter with the host allocator first.


def _import_hf_load(path: Optional[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with a Hugging Face folder given as ``load`` replaced by its jmegatron
    checkpoint, imported once into ``<save>/hf_import``
    (:func:`jmegatron.export.imports.checkpoint_of`), and ``use_checkpoint_args`` True unless
    given (the architecture comes from the folder). Other ``load`` values pass unchanged.
    Raises ConfigError without a ``save`` (from the overrides or the config file)."""
    load = overrides.get("load")
    if not load or not os.path.isfile(os.path.join(load, "config.json")):
        return overrides
    from jmegatron.checkpoint.hf import is_hf_folder
    from jmegatron.export.imports import checkpoint_of

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
        path, overrides, from_flags = parse_argv(argv)
        cfg = config_from_parsed(path, _import_hf_load(path, overrides), from_flags)
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
