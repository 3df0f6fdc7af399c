"""Process-level settings for running XLA's CPU backend fast: the host memory allocator.

XLA's CPU runtime allocates each execution's temporaries with ``malloc`` and frees them
when the step ends. glibc serves blocks that large with ``mmap`` and unmaps them on
``free``, so every step faults all of that memory in again, 4 KiB page by page, each page
zeroed by the kernel: for gpt_tiny about 92,000 minor faults and 0.15-0.2 s of system time
per train step (``benchmarks/step_faults.py``). A caching allocator keeps the memory
mapped between steps instead:

* ``mimalloc`` (Microsoft's, from PyPI's ``cmeel-mimalloc``, a dependency of jmegatron, so
  every install has it), loaded with ``LD_PRELOAD`` and ``MIMALLOC_PURGE_DELAY=-1`` (freed
  pages are kept, not returned to the OS; with mimalloc's default delay the purges cost
  up to 0.9 s of system time in some steps);
* ``tcmalloc`` / ``jemalloc`` (gperftools' and jemalloc's, Debian's ``libtcmalloc-minimal4``
  / ``libjemalloc2``, used when installed; jemalloc with its decay off);
* ``hugepages``: glibc with ``glibc.malloc.hugetlb=1`` (transparent huge pages for what it
  maps: 2 MiB faults instead of 4 KiB);
* ``default``: glibc's malloc as it is.

``$JMEGATRON_HOST_ALLOCATOR`` chooses one (default :data:`DEFAULT_ALLOCATOR`). The library
and its settings must be in place when the process starts, so the command-line entry
points (``python -m jmegatron.train``, ``python -m jmegatron.bench``, the benchmark
scripts) call :func:`reexec_with_host_allocator` first thing: it re-executes the
interpreter with the allocator's environment (:func:`allocator_env`) unless that is
already in force. Research code importing jmegatron's step functions gets the same by
starting Python with the environment that ``python -m jmegatron.runtime`` prints.
A requested allocator that is not installed falls back to glibc's, with one line saying
so. Measured effects: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from typing import Optional

ALLOCATOR_ENV = "JMEGATRON_HOST_ALLOCATOR"
ALLOCATORS = ("mimalloc", "tcmalloc", "jemalloc", "hugepages", "default")
DEFAULT_ALLOCATOR = "mimalloc"
HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_REEXEC_MARK = "JMEGATRON_HOST_ALLOCATOR_SET"  # the allocator this process was started with
# Settings that keep freed memory mapped (the point of a caching allocator here).
_SETTINGS = {
    "mimalloc": {"MIMALLOC_PURGE_DELAY": "-1"},
    "jemalloc": {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"},
    "tcmalloc": {},
}
_SYSTEM_LIBS = {"tcmalloc": ("tcmalloc_minimal", "libtcmalloc_minimal.so.4"),
                "jemalloc": ("jemalloc", "libjemalloc.so.2")}


class AllocatorUnavailable(RuntimeError):
    """The requested allocator cannot be used here; the message says why and the fix."""


def transparent_huge_pages() -> Optional[str]:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), or None
    when unknown (not Linux)."""
    try:
        with open(THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def requested(env: Optional[dict] = None) -> str:
    """The allocator ``$JMEGATRON_HOST_ALLOCATOR`` asks for (default
    :data:`DEFAULT_ALLOCATOR`). Raises AllocatorUnavailable for an unknown name."""
    name = (env if env is not None else os.environ).get(ALLOCATOR_ENV, DEFAULT_ALLOCATOR)
    if name not in ALLOCATORS:
        raise AllocatorUnavailable(f"${ALLOCATOR_ENV}={name!r} is not one of {list(ALLOCATORS)}")
    return name


def library_path(name: str) -> str:
    """The shared library to preload for ``name`` (mimalloc, tcmalloc, jemalloc).
    Raises AllocatorUnavailable when it is not installed (names the package to install)."""
    if name == "mimalloc":
        from importlib import metadata

        try:
            files = metadata.files("cmeel-mimalloc") or []
        except metadata.PackageNotFoundError:
            raise AllocatorUnavailable("mimalloc needs the PyPI package cmeel-mimalloc "
                                       "(pip install cmeel-mimalloc)") from None
        for f in files:
            if f.name == "libmimalloc.so":
                return str(f.locate())
        raise AllocatorUnavailable("cmeel-mimalloc is installed without libmimalloc.so")
    if name in _SYSTEM_LIBS:
        short, soname = _SYSTEM_LIBS[name]
        for candidate in (ctypes.util.find_library(short), soname):
            if candidate:
                for d in ("", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
                    path = os.path.join(d, candidate) if d else candidate
                    if os.path.isabs(path) and os.path.exists(path):
                        return path
        package = "libtcmalloc-minimal4" if name == "tcmalloc" else "libjemalloc2"
        raise AllocatorUnavailable(f"{name} is not installed (Debian/Ubuntu: apt-get install {package})")
    raise AllocatorUnavailable(f"{name!r} is not a preloadable allocator ({list(_SETTINGS)})")


def allocator_env(name: str, env: Optional[dict] = None) -> dict:
    """``env`` (default ``os.environ``) set up for a child process using allocator ``name``:
    ``LD_PRELOAD`` (the library first, others kept) and its settings, or glibc's huge-page
    tunable (other tunables kept), and :data:`ALLOCATOR_ENV` set to ``name``. Raises
    AllocatorUnavailable when ``name`` is unknown or not installed, or huge pages are not
    available (not Linux/glibc, or transparent huge pages "never")."""
    env = dict(os.environ if env is None else env)
    if name not in ALLOCATORS:
        raise AllocatorUnavailable(f"allocator {name!r} is not one of {list(ALLOCATORS)}")
    env[ALLOCATOR_ENV] = env[_REEXEC_MARK] = name
    if name == "hugepages":
        import platform

        if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc" \
                or transparent_huge_pages() not in ("always", "madvise"):
            raise AllocatorUnavailable("huge pages for malloc need Linux with glibc and transparent huge pages "
                                       f"(mode {transparent_huge_pages()!r})")
        current = env.get("GLIBC_TUNABLES", "")
        if HUGETLB_TUNABLE.split("=")[0] not in current:
            env["GLIBC_TUNABLES"] = ":".join(t for t in (current, HUGETLB_TUNABLE) if t)
    elif name != "default":
        if not sys.platform.startswith("linux"):
            raise AllocatorUnavailable(f"{name} is preloaded with LD_PRELOAD, which needs Linux")
        lib = library_path(name)
        others = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p != lib]
        env["LD_PRELOAD"] = " ".join([lib, *others])
        env.update(_SETTINGS[name])
    return env


def active() -> Optional[str]:
    """The allocator this process was started with by :func:`reexec_with_host_allocator`
    or a parent that used :func:`allocator_env`, else None."""
    return os.environ.get(_REEXEC_MARK)


def reexec_with_host_allocator() -> None:
    """Re-execute this Python process (same ``sys.orig_argv``) with the requested
    allocator's environment, unless it is already in force. Returns normally (without
    re-executing) when the allocator is "default" or already active, or after printing one
    line when it cannot be used (glibc's malloc then). Call it first thing in a
    command-line entry point: nothing before it may have side effects."""
    try:
        name = requested()
    except AllocatorUnavailable as e:
        print(f"[jmegatron] {e}; using glibc's malloc", file=sys.stderr, flush=True)
        return
    if active() is not None or name == "default":
        return
    try:
        env = allocator_env(name)
    except AllocatorUnavailable as e:
        os.environ[_REEXEC_MARK] = "default"  # children do not retry
        print(f"[jmegatron] host allocator {name}: {e}; using glibc's malloc", file=sys.stderr, flush=True)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(sys.orig_argv), env)
    except OSError as e:
        os.environ[_REEXEC_MARK] = "default"
        print(f"[jmegatron] could not restart with {name}: {e}; using glibc's malloc", file=sys.stderr, flush=True)


def main() -> int:
    """``python -m jmegatron.runtime [NAME]``: print the environment (shell ``export``
    lines) that starts Python with allocator NAME (default: the requested one)."""
    name = sys.argv[1] if len(sys.argv) > 1 else requested()
    try:
        env = allocator_env(name, {})
    except AllocatorUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for key, value in env.items():
        print(f"export {key}='{value}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
