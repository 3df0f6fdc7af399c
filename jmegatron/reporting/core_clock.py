"""The CPU core's actual clock, measured with a chain of dependent integer adds.

Under a hypervisor the guest often has no cpufreq in sysfs and ``/proc/cpuinfo``'s
``cpu MHz`` shows the nominal clock, while the host runs the core at its boost clock:
on this project's VM, "cpu MHz" says 2.596 GHz and the cores run at 3.675 GHz, so a
theoretical peak from the nominal clock sits below what a GEMM measures (an MFU above
100% against the theoretical peak). A dependent add has a latency of one cycle on every
x86-64 and Arm core (Agner Fog's instruction tables; Arm's software optimisation
guides), so ``N`` dependent adds take ``N`` cycles: the fastest of many short samples
(each ~30 ms, so some run without being preempted on a shared machine) gives the clock.

Only ``bench peak`` measures it (stored with its record, keyed to the machine); the
trainer never times anything at start-up. Needs a C compiler (``cc``) and x86-64 or
AArch64; elsewhere :func:`measure_core_clock_ghz` raises :class:`ClockUnavailable`.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile

ADDS_PER_ITERATION = 4

_SOURCE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int main(int argc, char **argv) {
  int samples = atoi(argv[1]);
  uint64_t n = strtoull(argv[2], 0, 10);
  uint64_t x = 0;
  for (int r = 0; r < samples; r++) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (uint64_t i = 0; i < n; i++) {
      __asm__ volatile(ADD ADD ADD ADD : "+r"(x));
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.9f\n", (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec));
  }
  return x == 42;  /* uses x, so the adds stay */
}
"""
_ADD = {"x86_64": r'"add $1, %0\n\t"', "aarch64": r'"add %0, %0, #1\n\t"'}


class ClockUnavailable(RuntimeError):
    """The clock cannot be measured here (no C compiler, another architecture, the
    program failed); the message says which."""


def measure_core_clock_ghz(samples: int = 200, iterations: int = 20_000_000) -> dict:
    """The core clock in GHz: ``ADDS_PER_ITERATION * iterations`` dependent adds per sample,
    ``samples`` samples, the fastest sample wins (preemption only ever slows a sample).

    Returns ``{"ghz": float, "median_ghz": float, "samples": int, "method": str}``.
    Raises ValueError for non-positive arguments, ClockUnavailable when it cannot run.
    """
    if samples <= 0 or iterations <= 0:
        raise ValueError(f"samples={samples} and iterations={iterations} must be > 0")
    arch = platform.machine()
    if arch not in _ADD:
        raise ClockUnavailable(f"no dependent-add loop for architecture {arch!r} (x86_64, aarch64 only)")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise ClockUnavailable("no C compiler (cc/gcc) on PATH to build the clock loop")
    with tempfile.TemporaryDirectory(prefix="jmegatron_clock_") as tmp:
        src, exe = os.path.join(tmp, "clock.c"), os.path.join(tmp, "clock")
        with open(src, "w") as f:
            f.write(_SOURCE.replace("ADD", _ADD[arch]))
        try:
            subprocess.run([cc, "-O1", "-o", exe, src], check=True, capture_output=True, text=True, timeout=60)
            out = subprocess.run([exe, str(samples), str(iterations)], check=True, capture_output=True,
                                 text=True, timeout=600).stdout
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            raise ClockUnavailable(f"the clock loop failed to build or run: {detail}") from None
    seconds = sorted(float(line) for line in out.split())
    cycles = ADDS_PER_ITERATION * iterations
    return {"ghz": cycles / seconds[0] / 1e9, "median_ghz": cycles / seconds[len(seconds) // 2] / 1e9,
            "samples": samples,
            "method": f"fastest of {samples} samples of {cycles:,} dependent adds (1 cycle each)"}
