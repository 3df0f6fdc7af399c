"""Read training logs: a Megatron-LM / ByteMLPerf / jmegatron stdout log, or JSON Lines.

ByteMLPerf compares a vendor's run with a GPU Megatron run through their stdout logs. The
lines read here are the ones Megatron-LM prints (megatron/training/training.py
``training_log`` and ``evaluate_and_print_results``, megatron/training/utils.py
``report_memory``; the ByteMLPerf fork, byte_train_perf/Megatron-LM/megatron/training/,
prints the same) and jmegatron's :class:`jmegatron.training.logging.MetricsLogger` writes:

* iteration lines, ``[2025-02-06 08:48:13] iteration        1/  500000 | consumed samples:
  256 | ... | global batch size:   256 | lm loss: 1.055584E+01 | load_balancing_loss:
  1.713958E+00 | loss scale: 1.0 | grad norm: 33.569 | num zeros: 0 | number of skipped
  iterations:   0 | number of nan iterations:   0 |``. Every ``key: value |`` field whose
  key is not one of Megatron's other fields (:data:`NON_LOSS_FIELDS`) is a loss, read by
  its printed name (``lm loss``, ``load_balancing_loss``, ``kd loss``, ...). The values are
  means over the log interval, at the logged iteration. Text after the last ``|`` is
  ignored (Megatron's rank 0 sometimes prints there, e.g. "Number of parameters ...").
* validation blocks, `` validation loss at iteration 10 | lm loss value: 6.1E+00 | lm loss
  PPL: 4.4E+02 |`` between two lines of dashes;
* memory lines, ``[Rank 0] (after 1 iterations) memory (MB) | allocated: 34595.14 | max
  allocated: 36827.01 | reserved: 40638.0 | max reserved: 40638.0``, optionally followed by
  jmegatron's `` | source: ...`` naming where the figures come from.

Any other line is skipped. JSON Lines (the first non-blank line starts with ``{``):
jmegatron's ``metrics.jsonl`` (``step_losses`` give every iteration's ``lm loss``; the
other losses by their report key, e.g. ``kd_loss`` -> ``kd loss``; the ``memory`` list of
a record) or one object per iteration with ``iteration`` and ``lm loss`` /
``lm_loss`` / ``loss``. A repeated iteration keeps its last value (a resumed run's).

Errors (:class:`LogFormatError`, a :class:`~jmegatron.bench.common.BenchError`) name the
file and line: a truncated iteration or memory line, a value that is not a number, a
line that is not JSON in a JSON Lines log, or a log with nothing to read (a foreign file).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

from jmegatron.bench import common

# Megatron's training_log fields that are not losses (upstream and the ByteMLPerf fork),
# and the throughput fields jmegatron appends after them.
NON_LOSS_FIELDS = frozenset({
    "consumed samples", "skipped samples", "elapsed time per iteration (ms)",
    "throughput per GPU (TFLOP/s/GPU)", "energy per GPU (J/iter/GPU)", "power per GPU (W/GPU)",
    "learning rate", "decoupled learning rate", "global batch size",
    "loss scale", "grad norm", "num zeros", "params norm", "number of skipped iterations",
    "number of nan iterations", "tokens/s", "TFLOP/s/device", "MFU", "MFU (theoretical peak)"})
# jmegatron report keys -> Megatron's printed loss names (jmegatron.training.logging).
JSONL_LOSS_NAMES = {"lm_loss": "lm loss", "kd_loss": "kd loss", "load_balancing_loss": "load_balancing_loss",
                    "logits_distillation_loss": "logits distillation loss",
                    "intermediate_distillation_loss": "intermediate distillation loss"}
JSONL_PLAIN_LOSS_KEYS = ("lm loss", "lm_loss", "loss")  # one-iteration-per-line JSONL: the first present
LAST_FIELD = "number of nan iterations"  # the field Megatron's iteration line always ends with

_ITERATION = re.compile(r"(?:^|\s)iteration\s+(\d+)/\s*(\d+)\s*\|")
_ITERATION_START = re.compile(r"^\s*(?:\[[0-9: -]+\]\s*)?iteration(?:\s|$)")
_TIMESTAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]\s*iteration\s")
_VALIDATION = re.compile(r"^\s*(validation|test) loss at (.*?) \|(.*)$")
_MEMORY_START = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\)")
_MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: (\S+) \| max allocated: (\S+)"
    r" \| reserved: (\S+) \| max reserved: ([0-9.eE+\-naif]+)(?: \| source: (.*?))?\s*$")


class LogFormatError(common.BenchError):
    """A log that cannot be read; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class MemoryRecord:
    """One memory line: MiB ("MB" in Megatron's text, bytes / 2**20) as printed, of one rank
    after ``iteration`` iterations; ``source`` is jmegatron's note on where the figures
    come from (None in a Megatron log: torch.cuda's caching allocator)."""

    rank: int
    iteration: int
    allocated: float
    max_allocated: float
    reserved: float
    max_reserved: float
    source: Optional[str] = None
    line: int = 0

    def value(self, kind: str) -> float:
        """``allocated``, ``max_allocated``, ``reserved``, ``max_reserved`` or
        ``fragment`` (reserved - allocated: what the allocator holds but does not use)."""
        if kind == "fragment":
            return self.reserved - self.allocated
        return float(getattr(self, kind))


@dataclasses.dataclass
class TrainingLog:
    """What :func:`read_log` found. ``losses``: loss name -> {iteration: value};
    ``validation``: loss name -> {iteration: value}; ``memory``: rank -> records in log
    order; ``fields``: iteration -> the iteration line's other fields (name -> float);
    ``train_iters``: the ``N`` of ``iteration i/N`` (None in JSON Lines); ``format``:
    ``"text"`` or ``"jsonl"``."""

    path: str
    format: str
    losses: dict = dataclasses.field(default_factory=dict)
    validation: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)
    fields: dict = dataclasses.field(default_factory=dict)
    train_iters: Optional[int] = None
    lines: int = 0

    def loss(self, name: str = "lm loss") -> dict:
        """``{iteration: value}`` of one loss. Raises LogFormatError naming the losses the
        log has when it lacks ``name``."""
        if name not in self.losses:
            raise LogFormatError(f"{self.path} has no {name!r} per iteration (it has: "
                                 f"{sorted(self.losses) or 'no losses'})")
        return self.losses[name]


def _number(text: str, path: str, lineno: int, key: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise LogFormatError(f"{path}:{lineno}: {key!r} has {text.strip()!r}, not a number "
                             "(is the line truncated or edited?)") from None


def parse_iteration_line(line: str, path: str = "<log>", lineno: int = 0) -> Optional[tuple[int, int, dict, dict]]:
    """``(iteration, train_iters, losses, fields)`` of a Megatron iteration line, or None
    when the line is not one. ``losses``/``fields``: name -> float. Raises LogFormatError
    when the line is truncated (no ``number of nan iterations: N |``) or a value is not a
    number."""
    m = _ITERATION.search(line)
    if not m:
        if _ITERATION_START.match(line):
            raise LogFormatError(f"{path}:{lineno}: truncated iteration line (no ' iteration i/N |'): "
                                 f"{line.strip()[:160]!r}")
        return None
    segments = line[m.end():].split("|")[:-1]  # text after the last '|' is someone else's print
    losses, fields = {}, {}
    ts = _TIMESTAMP.search(line)
    if ts:
        fields["timestamp"] = ts.group(1)
    for seg in segments:
        key, sep, value = seg.partition(":")
        key = key.strip()
        if not sep or not key:
            continue
        if key == "MFU" or key.startswith("MFU"):
            value = value.strip().rstrip("%")
        number = _number(value, path, lineno, key)
        (fields if key in NON_LOSS_FIELDS else losses)[key] = number
    if LAST_FIELD not in fields:
        raise LogFormatError(f"{path}:{lineno}: iteration {m.group(1)}'s line is truncated: it does not reach "
                             f"'{LAST_FIELD}: N |' (Megatron's training_log ends every iteration line with it)")
    return int(m.group(1)), int(m.group(2)), losses, fields


def parse_memory_line(line: str, path: str = "<log>", lineno: int = 0) -> Optional[MemoryRecord]:
    """The :class:`MemoryRecord` of a ``[Rank r] (after N iterations) memory (MB) | ...``
    line, or None when the line is not one. Raises LogFormatError for a truncated one."""
    if not _MEMORY_START.search(line):
        return None
    m = _MEMORY.search(line)
    if not m:
        raise LogFormatError(f"{path}:{lineno}: truncated memory line (Megatron's report_memory prints "
                             "'| allocated: X | max allocated: X | reserved: X | max reserved: X'): "
                             f"{line.strip()[:160]!r}")
    keys = ("allocated", "max allocated", "reserved", "max reserved")
    values = [_number(v, path, lineno, k) for v, k in zip(m.groups()[2:6], keys)]
    return MemoryRecord(int(m.group(1)), int(m.group(2)), *values, source=m.group(7), line=lineno)


def _read_text(path: str, text: list[str]) -> TrainingLog:
    log = TrainingLog(path, "text", lines=len(text))
    for lineno, line in enumerate(text, 1):
        parsed = parse_iteration_line(line, path, lineno)
        if parsed is not None:
            it, n, losses, fields = parsed
            log.train_iters = n
            for name, value in losses.items():
                log.losses.setdefault(name, {})[it] = value
            log.fields[it] = fields
        mem = parse_memory_line(line, path, lineno)
        if mem is not None:
            log.memory.setdefault(mem.rank, []).append(mem)
        v = _VALIDATION.search(line)
        if v and v.group(1) == "validation":
            at = re.search(r"iteration (\d+)", v.group(2))
            for seg in v.group(3).split("|"):
                key, sep, value = seg.partition(":")
                if sep and key.strip().endswith(" value") and at:
                    name = key.strip()[: -len(" value")]
                    log.validation.setdefault(name, {})[int(at.group(1))] = _number(value, path, lineno, key.strip())
    return log


def _jsonl_float(value) -> float:
    """A metrics.jsonl value as a float: jmegatron writes a non-finite one as ``null``
    (strict JSON), read back as NaN."""
    return float("nan") if value is None else float(value)


def _read_jsonl(path: str, text: list[str]) -> TrainingLog:
    log = TrainingLog(path, "jsonl", lines=len(text))
    for lineno, line in enumerate(text, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise LogFormatError(f"{path}:{lineno} is not JSON ({e.msg}); a JSON Lines log needs one object per "
                                 "line with 'iteration' and 'lm loss'/'lm_loss'/'loss' (or jmegatron's "
                                 "metrics.jsonl; a truncated last line gives this too)") from None
        if not isinstance(rec, dict) or "iteration" not in rec:
            continue
        it = int(rec["iteration"])
        for m in rec.get("memory") or ():
            log.memory.setdefault(int(m["rank"]), []).append(MemoryRecord(
                int(m["rank"]), it, float(m["allocated_mb"]), float(m["max_allocated_mb"]), float(m["reserved_mb"]),
                float(m["max_reserved_mb"]), m.get("source"), lineno))
        if "val_loss" in rec:
            log.validation.setdefault("lm loss", {})[it] = _jsonl_float(rec["val_loss"])
        if isinstance(rec.get("step_losses"), list):
            steps = rec["step_losses"]
            lm = log.losses.setdefault("lm loss", {})
            for k, value in enumerate(steps):
                lm[it - len(steps) + 1 + k] = _jsonl_float(value)
            for key, name in JSONL_LOSS_NAMES.items():
                if key != "lm_loss" and key in rec:
                    log.losses.setdefault(name, {})[it] = _jsonl_float(rec[key])
            log.fields[it] = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k not in JSONL_LOSS_NAMES}
            continue
        key = next((k for k in JSONL_PLAIN_LOSS_KEYS if k in rec), None)
        if key is not None:
            log.losses.setdefault("lm loss", {})[it] = _jsonl_float(rec[key])
    return log


def read_log(path: str, option: str = "log") -> TrainingLog:
    """Read a stdout log or JSON Lines log (module docstring). ``option`` names the
    command-line option in errors. Raises LogFormatError (file and line) for a missing,
    truncated or foreign file."""
    if not os.path.isfile(path):
        raise LogFormatError(f"{option} {path!r} does not exist (give a Megatron/jmegatron stdout log or a "
                             "metrics.jsonl)")
    with open(path, errors="replace") as f:
        text = f.read().splitlines()
    first = next((i for i, l in enumerate(text) if l.strip()), None)
    if first is None:
        raise LogFormatError(f"{path}:1: the log is empty")
    log = (_read_jsonl if text[first].lstrip().startswith("{") else _read_text)(path, text)
    if not log.losses and not log.memory:
        what = ("no per-iteration losses (records need 'iteration' and one of "
                f"{list(JSONL_PLAIN_LOSS_KEYS)}, or jmegatron's 'step_losses')" if log.format == "jsonl" else
                "no Megatron iteration line (' iteration i/N | ... | lm loss: X | ... | number of nan "
                "iterations: N |') and no memory line ('[Rank r] (after N iterations) memory (MB) | ...')")
        raise LogFormatError(f"{path} has {what} in its {len(text)} lines; line {first + 1} reads "
                             f"{text[first].strip()[:120]!r}: not a Megatron/jmegatron training log?")
    return log
