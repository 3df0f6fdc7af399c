"""The collectives of a compiled XLA program, read from its HLO text: kind, the mesh axes
each replica group spans, result shape and bytes, executions per step (while loops' known
trip counts multiply their bodies). Used by ``tools/comm_report.py`` (against Megatron's
analytic counts) and ``tools/pipeline_report.py`` (the pipeline's ppermutes)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

__all__ = ["COLLECTIVES", "Collective", "parse_collectives", "replica_groups"]

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE_RE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_OP_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_WHILE_RE = re.compile(r"\swhile\(.*?condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS_RE = re.compile(r"(?:calls|to_apply|branch_computations|true_computation|false_computation)=\{?%?([\w.\-, %]+)\}?")


@dataclasses.dataclass
class Collective:
    """One collective of the compiled step: kind, the mesh axes its groups span, its
    result shape, group size, executions per train step and the HLO computation."""

    kind: str
    axes: tuple[str, ...]
    result_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    group_size: int
    per_step: int  # executions per train step
    computation: str

    @property
    def elements(self) -> int:
        """Elements of the full (unsharded) tensor moved: the result for all-reduce and
        all-gather, result x group size for reduce-scatter."""
        n = sum(math.prod(d) for _, d in self.result_shapes)
        return n * self.group_size if self.kind == "reduce-scatter" else n

    @property
    def bytes(self) -> int:
        per = sum(math.prod(d) * _DTYPE_BYTES[t] for t, d in self.result_shapes)
        return per * self.group_size if self.kind == "reduce-scatter" else per


def _shapes(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((t, tuple(int(x) for x in dims.split(",") if x)) for t, dims in _SHAPE_RE.findall(text))


_IOTA = r"\[[0-9,]+\](?:<=\[[0-9,]+\])?(?:T\([0-9,]+\))?"


def _iota(spec: str) -> np.ndarray:
    """Devices of XLA's iota tile format ``[a,b]<=[n,m]T(1,0)`` (``<=[..]`` optional)."""
    m = re.match(r"\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?", spec)
    out = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(out)


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective instruction (explicit, iota or mesh-axes format;
    for a collective-permute, the connected sets of its ``source_target_pairs``)."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        groups: dict[int, set] = {}
        for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)):
            merged = groups.get(int(a), {int(a)}) | groups.get(int(b), {int(b)})
            for d in merged:
                groups[d] = merged
        return [sorted(g) for g in {id(g): g for g in groups.values()}.values()] or [[0]]
    m = re.search(r"replica_groups=(\{\{[0-9,{} ]*\}\})", line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", m.group(1)[1:-1])]
    m = re.search(r"replica_groups=(" + _IOTA + ")", line)
    if m:
        return _iota(m.group(1)).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((" + _IOTA + r")\))?\s*\{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names = [a for a, _ in axes]
        shape = [int(s) for _, s in axes]
        chosen = re.findall(r"'(\w+)'", m.group(3))
        ids = _iota(m.group(2)).reshape(shape) if m.group(2) else np.arange(math.prod(shape)).reshape(shape)
        keep = [names.index(c) for c in chosen]
        rest = [i for i in range(len(names)) if i not in keep]
        return ids.transpose(rest + keep).reshape(-1, math.prod(shape[i] for i in keep) if keep else 1).tolist()
    if "replica_groups={}" in line or "replica_groups" not in line:
        return [list(range(num_devices))]
    raise ValueError(f"cannot parse replica groups of: {line[:200]}")


def _group_axes(group: list[int], mesh) -> tuple[str, ...]:
    coords = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
    pts = np.array([coords[i] for i in group])
    return tuple(name for k, name in enumerate(mesh.axis_names) if len(set(pts[:, k])) > 1)


def parse_collectives(hlo_text: str, mesh) -> list[Collective]:
    """Every collective in a compiled HLO module, with executions per step."""
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        m = _COMP_RE.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is not None:
            comps[current].append(line)
    # multiplicity of each computation: calls from its callers, while bodies x trip count
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            w = _WHILE_RE.search(line)
            if w:
                trip = _TRIP_RE.search(line)
                edges[name].append((w.group(2), int(trip.group(1)) if trip else 1))
                edges[name].append((w.group(1), int(trip.group(1)) if trip else 1))
                continue
            for c in _CALLS_RE.findall(line):
                for callee in re.split(r"[,\s]+", c.replace("%", "")):
                    if callee in comps:
                        edges[name].append((callee, 1))
    mult: dict[str, int] = defaultdict(int)

    def visit(name, factor):
        mult[name] += factor
        for callee, trip in edges.get(name, ()):
            visit(callee, factor * trip)

    visit(entry, 1)
    n_dev = mesh.devices.size
    out = []
    for name, lines in comps.items():
        for line in lines:
            m = _OP_RE.match(line)
            if not m or not mult.get(name):
                continue
            groups = replica_groups(line, n_dev)
            axes = _group_axes(groups[0], mesh)
            # A tuple collective is XLA combining several: count each member on its own.
            for shape in _shapes(m.group(2)):
                out.append(Collective(kind=m.group(3), axes=axes, result_shapes=(shape,),
                                      group_size=len(groups[0]), per_step=mult[name], computation=name))
    return out
