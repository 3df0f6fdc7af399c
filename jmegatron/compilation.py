"""Announced compilation: a jitted function compiled explicitly, once per input signature,
each compilation printed with its time.

``jax.jit`` compiles silently on the first call with new shapes, so a new sequence length
under variable data, a new serve batch or the first evaluation shows only as a slow call.
:class:`AnnouncedJit` wraps a ``jax.jit`` function: on a call whose signature (the static
arguments' values; every other leaf's shape, dtype, weak type and sharding, and the
arguments' tree structure: what decides jit's own cache hit) is new, it prints

    [jmegatron] compiling <what> ...
    [jmegatron] compiled <what> in <seconds> s

around ``jitted.lower(...).compile()`` and keeps that program; later calls with the same
signature run the kept program. The seconds are added to :attr:`AnnouncedJit.compile_seconds`,
so a caller that times its calls (the training loop) can leave compilation out.
Lines go to stdout, from process 0 only (Megatron's ``print_rank_0``).

:func:`announced_jit` is the decorator form. Imports nothing of jmegatron.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from typing import Any, Callable, Optional, Sequence, Union

import jax

What = Union[str, Callable[[dict], str]]


def _leaf_signature(x: Any) -> Any:
    """What of one argument leaf decides the compiled program: shape, dtype, weak type and
    sharding of an array (``jax.Array``, ``jax.ShapeDtypeStruct``, numpy; the sharding only
    of a committed array or a ShapeDtypeStruct that names one: jit moves numpy and
    uncommitted arrays where the program wants them), the type of a Python scalar (jit
    traces it as a weakly typed 0-d value)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        sharding = getattr(x, "sharding", None) if getattr(x, "committed", True) else None
        # the dtype object itself: str(dtype) costs ~4 us a leaf, on every step's call
        return tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False)), sharding
    return type(x)


def shape_text(x: Any) -> str:
    """``[2, 1, 36]``: an array's (or ShapeDtypeStruct's) shape for an announcement."""
    return "[" + ", ".join(str(d) for d in x.shape) + "]"


class AnnouncedJit:
    """``jitted`` (a ``jax.jit`` function) compiled explicitly per input signature, each
    compilation announced (module docstring).

    Args:
        jitted: the ``jax.jit``-wrapped function.
        what: the program's name in the announcement, or ``what(arguments) -> str`` of the
            call's arguments by parameter name, defaults filled in (e.g. naming its batch
            shape).
        static_argnames: the names jit was given as ``static_argnames`` (their values key
            the programs; they are not passed to the compiled program).

    Calls take the jitted function's arguments. ``lower`` is the jitted function's;
    :meth:`compiled` returns (compiling and announcing when new) the program a call with
    these arguments runs; :meth:`_cache_size` counts the programs kept.
    """

    def __init__(self, jitted: Any, what: What, static_argnames: Sequence[str] = ()):
        self.jitted = jitted
        self.what = what
        self.static_argnames = frozenset(static_argnames)
        self.compile_seconds = 0.0  # every compilation's seconds, summed
        self._programs: dict = {}
        self._signature = inspect.signature(inspect.unwrap(jitted))
        params = list(self._signature.parameters.values())
        self._static_positions = {i: p.name for i, p in enumerate(params) if p.name in self.static_argnames}
        self._static_defaults = {p.name: p.default for p in params
                                 if p.name in self.static_argnames and p.default is not inspect.Parameter.empty}

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        """(dynamic positional args, dynamic keyword args, static values by name, defaults
        filled in: a static argument left out keys the same program as its default given)."""
        if not self.static_argnames:
            return args, kwargs, ()
        static = dict(self._static_defaults)
        static.update((name, args[i]) for i, name in self._static_positions.items() if i < len(args))
        static.update((k, v) for k, v in kwargs.items() if k in self.static_argnames)
        dyn_args = tuple(a for i, a in enumerate(args) if i not in self._static_positions)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return dyn_args, dyn_kwargs, tuple(sorted(static.items()))

    def _key(self, dyn_args: tuple, dyn_kwargs: dict, static: tuple) -> tuple:
        leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs))
        return static, treedef, tuple(_leaf_signature(x) for x in leaves)

    def describe(self, args: tuple, kwargs: dict) -> str:
        """The program's name for these arguments."""
        if isinstance(self.what, str):
            return self.what
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return self.what(dict(bound.arguments))

    def compiled(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled program (``jax.stages.Compiled``) for these arguments (arrays or
        ``jax.ShapeDtypeStruct``), compiled and announced when new."""
        dyn_args, dyn_kwargs, static = self._split(args, kwargs)
        return self._program(self._key(dyn_args, dyn_kwargs, static), args, kwargs)

    def _program(self, key: tuple, args: tuple, kwargs: dict) -> Any:
        program = self._programs.get(key)
        if program is None:
            what = self.describe(args, kwargs)
            announce(f"compiling {what} ...")
            start = time.perf_counter()
            program = self.jitted.lower(*args, **kwargs).compile()
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            announce(f"compiled {what} in {seconds:.1f} s")
            self._programs[key] = program
        return program

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dyn_args, dyn_kwargs, static = self._split(args, kwargs)
        program = self._program(self._key(dyn_args, dyn_kwargs, static), args, kwargs)
        return program(*dyn_args, **dyn_kwargs)

    def programs(self) -> list:
        """The compiled programs kept, in compilation order."""
        return list(self._programs.values())

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The jitted function's ``lower`` (``jax.stages.Lowered``; compiles nothing, keeps nothing)."""
        return self.jitted.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """The jitted function's ``trace`` (``jax.stages.Traced``; lowering for another
        platform starts here: kernels/gpu_target.py)."""
        return self.jitted.trace(*args, **kwargs)

    def _cache_size(self) -> int:
        """How many programs are kept (jit's ``_cache_size`` for these calls)."""
        return len(self._programs)


def announce(text: str) -> None:
    """Print ``[jmegatron] <text>`` on process 0 (stdout, flushed)."""
    if jax.process_index() == 0:
        print(f"[jmegatron] {text}", file=sys.stdout, flush=True)


def announced_jit(fun: Optional[Callable] = None, *, what: What, static_argnames: Sequence[str] = (),
                  **jit_kwargs: Any) -> Any:
    """``jax.jit(fun, static_argnames=..., **jit_kwargs)`` as an :class:`AnnouncedJit`
    named ``what``; usable as ``@announced_jit(what=..., ...)``."""
    if fun is None:
        return functools.partial(announced_jit, what=what, static_argnames=static_argnames, **jit_kwargs)
    jitted = jax.jit(fun, static_argnames=tuple(static_argnames) or None, **jit_kwargs)
    return AnnouncedJit(jitted, what, static_argnames)
