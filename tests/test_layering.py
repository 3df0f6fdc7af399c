"""The package's layering, checked on the source (AST only: nothing is imported).

Every .py file of ``jmegatron/``, ``kernels/`` (installed as ``jmegatron.kernels``) and
``export/`` (as ``jmegatron.export``) is parsed, and each of its imports of a jmegatron
module, function-local ones included, is checked against these rules:

* ``kernels``: kernels import only kernels (and third-party packages): the XLA reference
  of every kernel is ``jmegatron.kernels.xla``, below the models that call them.
* ``parallel-models``: ``parallel`` never imports ``models``.
* ``below-training``: nothing below the training loop (kernels, fusions, parallel, models,
  data, reporting, config, checkpoint, conversion) imports ``training`` or anything above it
  (distill, inference, bench, tools, export, the command-line entry points).
* ``conversion``: the weight mappings (``jmegatron.conversion``) import only themselves and
  ``jmegatron.config`` among jmegatron's modules, and only numpy and the standard library
  besides (:func:`test_conversion_imports_numpy_only`).
* ``loop``: only the command-line entry points, ``tools``, ``bench`` and ``pretrain_gpt``
  import ``jmegatron.training.loop``.
* ``leaf``: commands and CLIs are leaves: no jmegatron module imports one, except a
  package's own ``__main__`` registering its commands. The commands are the ``python -m``
  entry points (:data:`LEAF_CLIS`) and each module of ``tools``, ``export`` and ``bench``
  defining ``register(sub)`` or ``main`` (a module of theirs without either, such as
  ``bench.common`` or ``tools.gpu_lower``, is a library). Their shared code lives in a library
  module (``jmegatron.command_line`` parses the training command line, ``export.imports``
  brings weights in).
* ``local-import``: no function-local import of a jmegatron module (a lazy import is for an
  optional third-party dependency only: torch, transformer_engine, modelopt, ...).
* ``cycle``: the import graph of jmegatron modules (every import, local or not) has no cycle.

Each failure names file:line and the rule. :data:`KNOWN` lists the violations still present
whose fix belongs to another change; an entry that no longer occurs fails too, so the list
only shrinks.
"""

from __future__ import annotations

import ast
import collections
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# directory -> the package name it is installed as (pyproject.toml's package-dir)
PACKAGES = {"jmegatron": "jmegatron", "kernels": "jmegatron.kernels", "export": "jmegatron.export"}
BELOW_TRAINING = {"kernels", "fusions", "parallel", "models", "data", "reporting", "config", "checkpoint",
                  "conversion"}
CONVERSION_IMPORTS = {"conversion", "config"}  # the jmegatron parts the weight mappings may import
CLIS = {"pretrain_gpt", "train", "evaluate", "generate", "launch"}
TRAINING_AND_ABOVE = {"training", "distill", "inference", "bench", "tools", "export"} | CLIS
LEAF_CLIS = {"jmegatron.train", "jmegatron.evaluate", "jmegatron.generate", "jmegatron.serve", "jmegatron.launch"}
COMMAND_PACKAGES = {"jmegatron.tools", "jmegatron.export", "jmegatron.bench"}
LOOP = "jmegatron.training.loop"
LOOP_IMPORTERS = {"tools", "bench"} | CLIS

# Violations still present, as (rule, importing module, imported module or None for every
# target), each with why it stays for now; an entry that no longer occurs fails the test.
KNOWN: set[tuple[str, str, object]] = {
    # --devices N sets XLA_FLAGS before JAX starts (bench.common._set_devices refuses once JAX is
    # loaded): these commands import the JAX-using modules after it. Moving to
    # jax.config.update("jax_num_cpu_devices", N) would let them import at module level.
    *{("local-import", m, None) for m in (
        "jmegatron.bench.determinism", "jmegatron.bench.memory", "jmegatron.bench.mfu",
        "jmegatron.bench.peak", "jmegatron.bench.precision", "jmegatron.tools.comm_report",
        "jmegatron.tools.pipeline_report")},
    # train.run() re-executes the interpreter with the host allocator before the loop is imported
    ("local-import", "jmegatron.train", None),
}


def _modules() -> dict[str, str]:
    """module name -> file path, for every .py file of the three package directories."""
    mods = {}
    for top, name in PACKAGES.items():
        base = os.path.join(ROOT, top)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                    rel = "" if rel == "__init__" else rel.removesuffix(".__init__")
                    mods[name + ("." + rel if rel else "")] = os.path.join(dirpath, f)
    return mods


def _targets(mods: dict, module: str, is_package: bool, node) -> list[str]:
    """The jmegatron modules an import statement names (a ``from pkg import sub`` names
    ``pkg.sub`` when that is a module)."""
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            parts = module.split(".")[: None if is_package else -1]
            base = ".".join(parts[: len(parts) - (node.level - 1)]) + ("." + node.module if node.module else "")
        else:
            base = node.module or ""
        names = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
    out = []
    for n in names:
        while n and n not in mods and "." in n:
            n = n.rsplit(".", 1)[0]
        if n in mods and n not in out:
            out.append(n)
    return out


Import = collections.namedtuple("Import", "source target path line local")


def _imports() -> tuple[dict, list[Import]]:
    mods = _modules()
    found = []
    for module, path in sorted(mods.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")

        def visit(node, local):
            for child in ast.iter_child_nodes(node):
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(mods, module, is_package, child):
                        if target != module:
                            found.append(Import(module, target, os.path.relpath(path, ROOT), child.lineno, local))
                visit(child, inner)

        visit(tree, False)
    return mods, found


def commands(mods: dict) -> set[str]:
    """The command and CLI modules among ``mods`` (module name -> path): :data:`LEAF_CLIS`
    and each module of :data:`COMMAND_PACKAGES` whose source defines a top-level
    ``register`` or ``main`` function."""
    out = set()
    for name, path in mods.items():
        package = name.rsplit(".", 1)[0]
        if name in LEAF_CLIS:
            out.add(name)
        elif package in COMMAND_PACKAGES and not path.endswith("__init__.py"):
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            if any(isinstance(n, ast.FunctionDef) and n.name in ("register", "main") for n in tree.body):
                out.add(name)
    return out


def leaf_violation(commands_: set[str], source: str, target: str) -> bool:
    """Whether ``source`` importing ``target`` breaks the leaf rule: ``target`` is a command and
    ``source`` is not the ``__main__`` of ``target``'s own package."""
    return target in commands_ and source != target.rsplit(".", 1)[0] + ".__main__"


def _part(module: str) -> str:
    """The top-level part of jmegatron a module belongs to ("models", "config", "train", ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(mods, found) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    edges = collections.defaultdict(set)
    for imp in found:
        edges[imp.source].add(imp.target)
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(mods):
        if v not in index:
            strong(v)
    return sccs


def violations() -> list[tuple[tuple, str]]:
    """Every rule violation as ((rule, source, target), "file:line: message")."""
    mods, found = _imports()
    leaves = commands(mods)
    out = []
    for imp in found:
        src, dst = _part(imp.source), _part(imp.target)
        where = f"{imp.path}:{imp.line}"
        if src == "kernels" and dst != "kernels":
            out.append((("kernels", imp.source, imp.target),
                        f"{where}: [kernels] {imp.source} imports {imp.target}: kernels import only kernels"))
        if src == "parallel" and dst == "models":
            out.append((("parallel-models", imp.source, imp.target),
                        f"{where}: [parallel-models] {imp.source} imports {imp.target}: parallel never imports models"))
        if src in BELOW_TRAINING and dst in TRAINING_AND_ABOVE:
            out.append((("below-training", imp.source, imp.target),
                        f"{where}: [below-training] {imp.source} imports {imp.target}: {src} sits below training"))
        if src == "conversion" and dst not in CONVERSION_IMPORTS:
            out.append((("conversion", imp.source, imp.target),
                        f"{where}: [conversion] {imp.source} imports {imp.target}: the weight mappings import "
                        f"only {sorted(CONVERSION_IMPORTS)}"))
        if imp.target == LOOP and src not in LOOP_IMPORTERS:
            out.append((("loop", imp.source, imp.target),
                        f"{where}: [loop] {imp.source} imports {LOOP}: only the entry points, tools and bench do"))
        if leaf_violation(leaves, imp.source, imp.target):
            out.append((("leaf", imp.source, imp.target),
                        f"{where}: [leaf] {imp.source} imports {imp.target}: commands and CLIs are leaves; move "
                        f"what is shared to a library module"))
        if imp.local:
            out.append((("local-import", imp.source, imp.target),
                        f"{where}: [local-import] {imp.source} imports {imp.target} inside a function: "
                        f"import jmegatron modules at module level"))
    for scc in _cycles(mods, found):
        inside = [imp for imp in found if imp.source in scc and imp.target in scc]
        lines = ", ".join(f"{imp.path}:{imp.line} ({imp.source} -> {imp.target})" for imp in inside)
        out.append((("cycle", scc[0], None), f"[cycle] import cycle among {scc}: {lines}"))
    return out


def _known(key: tuple) -> object:
    """The KNOWN entry covering violation ``key``, or None."""
    rule, source, target = key
    for entry in ((rule, source, target), (rule, source, None)):
        if entry in KNOWN:
            return entry
    return None


def test_layering_rules():
    found = violations()
    new = [msg for key, msg in found if _known(key) is None]
    assert not new, "layering violations:\n" + "\n".join(new)
    stale = KNOWN - {_known(key) for key, _ in found}
    assert not stale, f"KNOWN entries that no longer occur (remove them): {sorted(map(str, stale))}"


def _third_party_imports(path: str) -> list[tuple[int, str]]:
    """(line, top-level name) of each import in ``path`` that is neither jmegatron, numpy nor
    the standard library (function-local imports included)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    allowed = set(sys.stdlib_module_names) | {"__future__", "numpy", "jmegatron"}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        out += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] not in allowed]
    return out


def test_conversion_imports_numpy_only():
    """The weight mappings are numpy code: no torch, safetensors, transformers, jax, ... (the
    files are read and written by jmegatron.checkpoint and the export commands)."""
    mods = _modules()
    files = [path for name, path in mods.items() if _part(name) == "conversion"]
    assert len(files) >= 4, files
    bad = [f"{os.path.relpath(path, ROOT)}:{line}: imports {name}" for path in files
           for line, name in _third_party_imports(path)]
    assert not bad, "the weight mappings import only numpy and the standard library:\n" + "\n".join(bad)
    this = os.path.join(ROOT, "tests", "test_layering.py")  # imports pytest: the check can fail
    assert "pytest" in [name for _, name in _third_party_imports(this)]


def test_the_checker_sees_what_it_checks():
    """The walk finds the three packages and classifies imports as the rules need: a
    function-local import is marked local, a relative import resolves, a package's own
    submodule import is an edge."""
    mods, found = _imports()
    assert {"jmegatron.kernels.xla.attention", "jmegatron.export.common", "jmegatron.models.gpt"} <= set(mods)
    edges = {(i.source, i.target) for i in found}
    assert ("jmegatron.models.gpt", "jmegatron.models.transformer_config") in edges
    assert ("jmegatron.kernels.cpu.ops", "jmegatron.kernels.xla.attention") in edges
    leaves = commands(mods)
    assert {"jmegatron.train", "jmegatron.tools.model_report", "jmegatron.export.convert",
            "jmegatron.bench.mfu"} <= leaves
    assert not {"jmegatron.bench.common", "jmegatron.command_line", "jmegatron.export.common",
                "jmegatron.tools.gpu_lower"} & leaves
    assert leaf_violation(leaves, "jmegatron.tools.demo", "jmegatron.train")
    assert not leaf_violation(leaves, "jmegatron.bench.__main__", "jmegatron.bench.mfu")
    assert not leaf_violation(leaves, "jmegatron.train", "jmegatron.command_line")
    tree = ast.parse("from .b import c\n")
    assert _targets({"p.a": "", "p.b": "", "p.b.c": ""}, "p.a", False, tree.body[0]) == ["p.b", "p.b.c"]
    with pytest.raises(AssertionError):
        assert not _cycles({"a": "", "b": ""}, [Import("a", "b", "a.py", 1, False), Import("b", "a", "b.py", 1, True)])


def test_every_package_is_in_pyproject():
    """setuptools' ``packages`` list (pyproject.toml) names every package directory: a package
    missing from it is left out of a non-editable install."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {name for name, path in _modules().items() if path.endswith("__init__.py")}
    assert found == listed, f"not listed: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
