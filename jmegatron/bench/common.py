"""Shared pieces of the bench subcommands: config arguments, output files, charts,
state hashing and the environment record every result carries."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
from typing import Any, Optional, Sequence

from jmegatron.command_line import config_from_argv
from jmegatron.config import ConfigError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_BENCH_DIR = os.path.join("runs", "bench")


class BenchError(ValueError):
    """Bad input to a bench subcommand; printed as ``error: ...`` with exit status 2."""


# ------------------------------------------------------------------ arguments
def add_command(sub, name: str, help: str, doc: str) -> argparse.ArgumentParser:
    """Adds subcommand ``name`` to the bench CLI's subparsers ``sub``: ``help`` in the command
    list, the module docstring ``doc`` as its ``--help`` text (formatted as written)."""
    return sub.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_config_arguments(parser, required: bool = True) -> None:
    """``--config PATH`` (the unparsed arguments: ``--config.<field>=<value>`` overrides,
    Megatron's flags and ``--args-file F.args`` / ``F.args``, the forms ``python -m
    jmegatron.train`` takes, are collected by :func:`jmegatron.bench.__main__.main`).
    ``required=False``: Megatron's flags or an ``.args`` file may stand for it."""
    parser.add_argument("--config", required=required, metavar="CONFIG.py|.yaml|config.json",
                        help="a jmegatron config file (.py, Megatron's YAML, a run's config.json); add "
                             "--config.<field>=<value> overrides, Megatron's flags or a ByteMLPerf .args file")


def add_out_argument(parser, command: str) -> None:
    """Add ``--out DIR`` (default ``runs/bench/<name>``) to a subcommand parser."""
    parser.add_argument("--out", default=os.path.join(DEFAULT_BENCH_DIR, command), metavar="DIR",
                        help=f"output directory (default {os.path.join(DEFAULT_BENCH_DIR, command)})")


def config_argv(args, **overrides) -> list[str]:
    """The ``--config F --config.x=y ...`` argument list of ``args`` with ``overrides``
    appended (later ones win), to rebuild the same config in another process."""
    argv = (["--config", args.config] if args.config else []) + list(getattr(args, "config_overrides", []))
    argv += [f"--config.{k}={v}" for k, v in overrides.items()]
    return argv


def load_config(args, **overrides):
    """The validated :class:`JMegatronConfig` of ``--config`` and its overrides, with
    ``overrides`` applied last (before validation, so derived fields such as
    ``lr_decay_iters`` follow them). Raises BenchError naming the bad argument."""
    try:
        return config_from_argv(config_argv(args), overrides)
    except (ConfigError, FileNotFoundError) as e:
        raise BenchError(str(e)) from None


def load_config_for_steps(args, steps: int, **overrides):
    """:func:`load_config` with ``train_iters`` = ``steps`` (raised to the config's
    ``lr_warmup_iters`` if needed: the benchmarks that only measure memory or time do not
    care about the schedule, and a warm-up longer than the run is a config error)."""
    base = load_config(args, **overrides)
    return load_config(args, train_iters=max(steps, base.lr_warmup_iters, 1), **overrides)


def bench_config(cfg, **changes):
    """``cfg`` for a bench run: nothing saved, no TensorBoard, no evaluation, no exit
    interval (unless ``changes`` say otherwise)."""
    base = dict(save=None, load=None, tensorboard_dir=None, eval_interval=0, exit_interval=None)
    base.update(changes)
    return cfg.replace(**base)


# ------------------------------------------------------------------ outputs
def out_dir(args) -> pathlib.Path:
    """The subcommand's output directory (created)."""
    path = pathlib.Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_json(path: os.PathLike, obj: Any) -> str:
    """Write ``obj`` as indented JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default, allow_nan=True)
        f.write("\n")
    return str(path)


def read_json(path: os.PathLike) -> Any:
    """The JSON object stored at ``path``."""
    with open(path) as f:
        return json.load(f)


def write_text(path: os.PathLike, text: str) -> str:
    """Write ``text`` to ``path``."""
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    return str(path)


def verdict(passed: bool) -> str:
    """A check's verdict in markdown: ``**PASS**`` or ``**FAIL**``."""
    return "**PASS**" if passed else "**FAIL**"


def finish(out: pathlib.Path, command: str, result: dict, chart, markdown, passed: bool, summary: str) -> int:
    """Ends a checking command: writes ``<command>.json`` (``result``), ``<command>.png``
    (``chart(result, path)``) and ``<command>.md`` (``markdown(result)``) under ``out``, prints
    ``[bench <command>] PASS|FAIL: <summary>; results in <out>`` and returns the exit status
    (0 when ``passed``, else 1)."""
    write_json(out / f"{command}.json", result)
    chart(result, out / f"{command}.png")
    write_text(out / f"{command}.md", markdown(result))
    print(f"[bench {command}] {'PASS' if passed else 'FAIL'}: {summary}; results in {out}")
    return 0 if passed else 1


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: os.PathLike) -> None:
    """Lays out the matplotlib figure ``fig``, writes it to ``path`` (PNG, 110 dpi) and closes it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def mib(n_bytes: Optional[float]) -> float:
    """Bytes as MiB (float)."""
    return float("nan") if n_bytes is None else n_bytes / 2 ** 20


def fmt(x: Optional[float], digits: int = 4) -> str:
    """A number for a markdown table (``-`` for None / NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:.{digits}g}"


def pct(fraction: Optional[float]) -> str:
    """A fraction as a percentage with 3 significant digits (``2.4e-05%`` for tiny ones)."""
    if fraction is None or (isinstance(fraction, float) and math.isnan(fraction)):
        return "-"
    return f"{100 * fraction:.3g}%"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table from a header row and data rows."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |")
    return "\n".join(lines)


def summary_page(title: str, intro: str, rows: Sequence[Sequence[Any]], *more: str) -> str:
    """A result's markdown page: ``# title``, the ``intro`` paragraph, the (quantity, value)
    ``rows`` as a table, then the lines ``more`` (notes, an image)."""
    return "\n".join([f"# {title}", "", intro, "", markdown_table(["", "value"], rows), "", *more])


def environment() -> dict:
    """Where and with what a result was measured (recorded in every JSON)."""
    import jax

    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    dev = jax.devices()[0]
    return {"time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "hostname": platform.node(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "jax_version": jax.__version__, "platform": dev.platform, "device_kind": dev.device_kind,
            "num_devices": jax.device_count(), "git_commit": commit, "argv": sys.argv}


# ------------------------------------------------------------------ state hashing
def tree_digest(tree: Any) -> str:
    """sha256 over every leaf of ``tree`` in flattening order: its key path, dtype, shape
    and raw bytes (sharded arrays are gathered to the host first). Bit-identical trees,
    and only those, give the same digest."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]:
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ memory layouts
def layout_rows(layouts: list) -> list:
    """One table row per compiled layout of a ``bench memory`` result (its ``layouts``):
    compiled memory against the theory, MiB (columns: :data:`LAYOUT_HEADER`)."""
    rows = []
    for lr in layouts:
        t, c, s = lr["theoretical"], lr["compiled"], lr["state_bytes_per_device"]
        transient = t["gradients"] + t["activations"] + t.get("fsdp_gathered", 0.0)
        rows.append([lr["layout"], mib(t["weights"] + t["optimizer_state"]),
                     mib(s["params"] + s["opt_state"]),
                     mib(c["argument_size_in_bytes"] - lr["batch_bytes_per_device"]),
                     mib(transient), mib(c["temp_size_in_bytes"]),
                     f"{c['temp_size_in_bytes'] / transient:.2f}" if transient else "-",
                     mib(t["total"]), mib(c["peak_estimate_bytes"]),
                     mib(c["generated_code_size_in_bytes"])])
    return rows


LAYOUT_HEADER = ["layout", "theory weights+opt MiB", "exact state MiB", "compiled args-batch MiB",
                 "theory grads+act(+FSDP gathered) MiB", "compiled temp MiB", "temp / theory",
                 "theory total MiB", "compiled peak MiB", "code MiB"]


def add_log_arguments(p, command: str) -> None:
    """``-b/--baseline``, ``-i/--input`` and ``-o/--out`` (ByteMLPerf's argument names)."""
    p.add_argument("-b", "--baseline", required=True, metavar="BASELINE_LOG",
                   help="the reference run's stdout log or metrics.jsonl (e.g. GPU Megatron)")
    p.add_argument("-i", "--input", required=True, metavar="INPUT_LOG", help="the run judged")
    p.add_argument("-o", "--out", default=os.path.join(DEFAULT_BENCH_DIR, command), metavar="OUTDIR",
                   help=f"output directory (default {os.path.join(DEFAULT_BENCH_DIR, command)})")
