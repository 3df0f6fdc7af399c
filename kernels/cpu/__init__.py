"""CPU kernels as XLA FFI custom calls (imported as ``jmegatron.kernels.cpu``).

XLA's CPU backend runs jmegatron's float32 train step at about 0.75x the tokens/s of a
lean PyTorch GPT on this project's CPU (docs/PERFORMANCE.md): its matmuls need their
operands in one layout, so every weight gradient pays a transposing copy, and its
attention is a chain of separate fusions over ``[b, h, s, s]`` buffers. These kernels are
the CPU counterpart of the cuBLAS / cuDNN custom calls JAX uses on a GPU:

* ``jmegatron_sgemm`` (``gemm.cc``): ``op(A) @ op(B)`` in float32 through OpenBLAS with
  the transposes as BLAS flags, on XLA's intra-op thread pool.
* ``jmegatron_grouped_sgemm`` / ``_wgrad`` (``grouped_gemm.cc``): the grouped GEMM of an
  MoE layer's experts (rows sorted by expert, one OpenBLAS call per group), where
  ``jax.lax.ragged_dot`` on XLA:CPU computes about every group's product over all rows.
* ``jmegatron_attention_fwd`` / ``_bwd`` (``attention.cc``): causal softmax attention
  with the hash dropout of :mod:`jmegatron.kernels.xla.dropout`, one (batch, head) pair per
  task, in the manner of FlashAttention's recomputation (Dao et al. 2022): only the
  log-sum-exp is saved, the probabilities are recomputed in the backward; optionally
  within documents (segment ids).
* ``jmegatron_attention_block_fwd`` / ``_bwd`` (``attention.cc``): one block of ring
  attention (a query block against a key/value block: no mask, causal by position ids,
  and/or same document), the log-sum-exp out of the forward and the final one into the
  backward.

Every handler checks each of its buffers (inputs and results) for dtype and shape, every
size against OpenBLAS's 32-bit int, and returns failed allocations and any C++ exception
(also from its pool tasks) as an ``ffi::Error`` naming the buffer or dimension (``checks.h``,
``parallel.h``; docs/RELIABILITY.md "Kernel hardening"). ``jmegatron_selftest``
(``selftest.cc``) exercises those failure paths for the tests.

Each has an XLA reference path (``matmul_impl="xla"``, ``attention_impl="xla"``) that
the tests compare against. The C++ is compiled on first use (g++, the XLA FFI headers
that ship with jaxlib, and the ``scipy-openblas32`` wheel's OpenBLAS) into a cache
directory, ``$JMEGATRON_KERNEL_CACHE`` or ``~/.cache/jmegatron/kernels``, keyed by a hash
of the sources and the library versions; concurrent builders (pytest-xdist workers)
serialise on a file lock.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("gemm.cc", "grouped_gemm.cc", "attention.cc", "selftest.cc")
HEADERS = ("parallel.h", "checks.h")
TARGETS = {
    "jmegatron_sgemm": "JmegatronSgemm",
    "jmegatron_grouped_sgemm": "JmegatronGroupedSgemm",
    "jmegatron_grouped_sgemm_wgrad": "JmegatronGroupedSgemmWgrad",
    "jmegatron_attention_fwd": "JmegatronAttentionFwd",
    "jmegatron_attention_bwd": "JmegatronAttentionBwd",
    "jmegatron_attention_block_fwd": "JmegatronAttentionBlockFwd",
    "jmegatron_attention_block_bwd": "JmegatronAttentionBlockBwd",
    "jmegatron_selftest": "JmegatronSelfTest",  # the failure paths, for tests/test_kernel_hardening.py
}

# g++ flags (part of the library's cache key). -fopenmp-simd: the `#pragma omp simd` row
# loops vectorise without -ffast-math (whose reassociation would change results).
CXXFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++17", "-w")

_state: dict = {}


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here; the message names the missing piece
    and the fix."""


def cache_dir() -> str:
    """Where built libraries are kept: ``$JMEGATRON_KERNEL_CACHE`` or ``~/.cache/jmegatron/kernels``."""
    return os.environ.get("JMEGATRON_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jmegatron", "kernels")


def _toolchain():
    try:
        import scipy_openblas32
    except ImportError as e:
        raise KernelUnavailable(
            "the CPU kernels need OpenBLAS from the scipy-openblas32 wheel: pip install scipy-openblas32 "
            "(a dependency of jmegatron), or set matmul_impl='xla' and attention_impl='xla'") from e
    import jax
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise KernelUnavailable("the CPU kernels are compiled on first use and no C++ compiler was found "
                                "(install g++ or set $CXX), or set matmul_impl='xla' and attention_impl='xla'")
    return compiler, jax.ffi.include_dir(), scipy_openblas32


def _cpu_model() -> str:
    # -march=native: a library built for one CPU's instruction set is not reused on another
    # (a shared home directory): the model name and the whole feature list are in the key.
    import platform
    seen = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen[key] = line.strip()
    except OSError:
        pass
    return platform.machine() + " " + " ".join(seen[k] for k in sorted(seen))


def _build() -> str:
    compiler, ffi_include, blas = _toolchain()
    import jax
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        with open(os.path.join(_HERE, name), "rb") as f:
            digest.update(f.read())
    try:
        version = subprocess.run([compiler, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    except OSError:
        version = ""
    digest.update(f"{jax.__version__} {blas.get_openblas_config()} {compiler} {version} {CXXFLAGS} "
                  f"{_cpu_model()}".encode())
    out_dir = cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.join(out_dir, f"libjmegatron_cpu_{digest.hexdigest()[:16]}.so")
    if os.path.exists(lib):
        return lib
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(lib):
            return lib
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [compiler, *CXXFLAGS, "-I", ffi_include, "-I", blas.get_include_dir(),
               *[os.path.join(_HERE, s) for s in SOURCES],
               "-L", blas.get_lib_dir(), f"-l{blas.get_library()}",
               f"-Wl,-rpath,{blas.get_lib_dir()}", "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            error = proc.stderr[-4000:] if proc.returncode else None
        except OSError as e:
            error = str(e)
        if error is not None:
            os.unlink(tmp)
            raise KernelUnavailable(f"building the CPU kernels failed ({' '.join(cmd)}): {error}\n"
                                    "Install g++ (or set $CXX), or set matmul_impl='xla' and attention_impl='xla'.")
        os.replace(tmp, lib)
    return lib


def load() -> ctypes.CDLL:
    """Build (once per source version) and load the kernels, and register their FFI
    targets with JAX for the CPU platform. Raises :class:`KernelUnavailable`."""
    if "lib" in _state:
        return _state["lib"]
    if "error" in _state:
        raise KernelUnavailable(_state["error"])
    try:
        import jax
        try:
            lib = ctypes.CDLL(_build())
            lib.JmegatronBlasInit()  # single-threaded BLAS calls: the threads are XLA's
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        except (OSError, AttributeError) as e:  # cache not writable, library not loadable, ...
            raise KernelUnavailable(f"the CPU kernels could not be built or loaded ({type(e).__name__}: {e}); "
                                    f"set $JMEGATRON_KERNEL_CACHE to a writable directory, or set "
                                    f"matmul_impl='xla' and attention_impl='xla'") from e
    except KernelUnavailable as e:
        _state["error"] = str(e)
        raise
    _state["lib"] = lib
    return lib


def available() -> bool:
    """True when :func:`load` succeeds (builds the library if needed)."""
    try:
        load()
        return True
    except KernelUnavailable:
        return False


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False, or None."""
    return None if available() else _state.get("error")


def use_by_default(tensor_model_parallel_size: int, float32: bool) -> bool:
    """Whether ``"auto"`` resolves to these kernels: JAX's default backend is the CPU, the
    compute dtype is float32, no tensor parallelism (the custom calls are opaque to
    GSPMD, which would gather their tensor-sharded operands), and the library loads."""
    import jax
    if jax.default_backend() != "cpu" or not float32 or tensor_model_parallel_size != 1:
        return False
    if not available():
        if not _state.get("warned"):
            print(f"jmegatron: CPU kernels unavailable, using XLA's ops: {_state.get('error')}", file=sys.stderr)
            _state["warned"] = True
        return False
    return True
