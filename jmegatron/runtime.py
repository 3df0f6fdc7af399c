"""Process-level settings for running XLA's CPU backend fast: huge pages for ``malloc``.

XLA's CPU runtime allocates each execution's temporaries with ``malloc`` (for gpt_small's
train step about 1.2 GB, the ``[tokens, vocab]`` logits alone 128 MB) and frees them when
the step ends. glibc serves blocks that large with ``mmap`` and unmaps them on ``free``,
so every step faults all of that memory in again, 4 KiB page by page, each page zeroed by
the kernel: 305,000 minor page faults and 0.5 s of system time per gpt_small step on this
project's CPU (94,000 and 0.16 s for gpt_tiny), about 10% of the step
(docs/PERFORMANCE.md, attempt 15).

glibc's ``glibc.malloc.hugetlb=1`` tunable makes ``malloc`` ask for transparent huge pages
(``madvise(MADV_HUGEPAGE)``) on the memory it maps, so the same memory comes in 2 MiB
pages: 720 faults per gpt_small step and 2.33 instead of 2.5-2.6 s. (Keeping the memory
instead, with ``mallopt(M_MMAP_MAX, 0)``, fragmented the heap: RSS grew 1.2 GB per
step.) Tunables are read when the process starts, so :func:`reexec_with_host_tunables`
re-executes the interpreter with them set.

It is **opt-in** (``JMEGATRON_HOST_ALLOCATOR=hugepages``; ``python -m jmegatron.train``,
``python -m jmegatron.bench`` and the benchmark scripts honour it), because it has costs,
measured here: the first step after a few seconds idle spends about 0.7 s more in the
kernel; the process RSS moves in 23 MB jumps (the bench's RSS check saw 7.4% "growth"
over 1000 steps, against 0.096% with glibc's default); and
PyTorch eager ran slower under the same setting. Research code importing jmegatron's
step functions gets it by starting Python with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"
_REEXEC_MARK = "JMEGATRON_HOST_TUNABLES_SET"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def wanted() -> bool:
    """Whether huge pages for ``malloc`` apply here: ``JMEGATRON_HOST_ALLOCATOR=hugepages``,
    Linux with glibc, and transparent huge pages available."""
    if os.environ.get("JMEGATRON_HOST_ALLOCATOR", "default") != "hugepages":
        return False
    import platform
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    return transparent_huge_pages() in ("always", "madvise")


def host_tunables_env(env: Optional[dict] = None) -> dict:
    """``env`` (default ``os.environ``) with :data:`HUGETLB_TUNABLE` added to
    ``GLIBC_TUNABLES`` (other tunables kept), for starting a child process."""
    env = dict(os.environ if env is None else env)
    current = env.get("GLIBC_TUNABLES", "")
    if HUGETLB_TUNABLE.split("=")[0] not in current:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (current, HUGETLB_TUNABLE) if t)
    return env


def active() -> bool:
    """True when this process was started with the huge-page tunable."""
    return HUGETLB_TUNABLE.split("=")[0] in os.environ.get("GLIBC_TUNABLES", "")


def reexec_with_host_tunables() -> None:
    """Re-execute this Python process (same ``sys.orig_argv``) with the tunable in its
    environment, when :func:`wanted` and not already :func:`active`. Returns normally
    (without re-executing) otherwise, or when a previous re-execution did not take. Call
    it first thing in a command-line entry point: nothing before it may have side effects."""
    if active() or not wanted() or os.environ.get(_REEXEC_MARK):
        return
    env = host_tunables_env()
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(sys.orig_argv), env)
    except OSError:
        return
