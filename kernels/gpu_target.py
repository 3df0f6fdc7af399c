"""The NVIDIA GPU a program is built for: the real one, or one named to lower for it here.

:func:`lowering_for` names a GPU (its ``device_kind``) for the code traced inside, on a
machine that has none: the Pallas kernels emit Triton instead of running in interpret
mode (:func:`jmegatron.kernels.pallas.common.default_interpret`), the backend choice sees a
GPU (``jmegatron.models.backend.detect_backend``), and JAX's cuDNN attention checks see the
named GPU's compute capability and :data:`CUDNN_VERSION`. The program is meant to be
lowered (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``), not run.

:func:`compute_capability` is the named GPU's inside, else the first local CUDA device's,
else None.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional
from unittest import mock

import jax

# device_kind words -> compute capability (NVIDIA's CUDA GPUs table, developer.nvidia.com/cuda-gpus)
COMPUTE_CAPABILITIES = (
    ("GH200", (9, 0)), ("GB200", (10, 0)), ("B200", (10, 0)), ("B100", (10, 0)), ("H200", (9, 0)),
    ("H100", (9, 0)), ("H800", (9, 0)), ("H20", (9, 0)), ("L40", (8, 9)), ("L4", (8, 9)),
    ("A100", (8, 0)), ("A800", (8, 0)), ("A10", (8, 6)), ("V100", (7, 0)),
)
# the cuDNN version JAX's checks see inside lowering_for (9.10: what the GPU image's jax 0.11 wheels
# bundle or newer; it gates multi-latent attention's differing head dims)
CUDNN_VERSION = 91000
DEFAULT_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A named GPU: ``device_kind`` as ``jax.devices()[0].device_kind`` spells it and its
    compute capability ``(major, minor)``."""

    device_kind: str
    compute_capability: tuple[int, int]


_TARGET: contextvars.ContextVar[Optional[GpuTarget]] = contextvars.ContextVar("jmegatron_gpu_target", default=None)


def compute_capability_of(device_kind: str) -> tuple[int, int]:
    """The compute capability of an NVIDIA ``device_kind`` ("NVIDIA H100 80GB HBM3" ->
    (9, 0)). Raises ValueError naming the known kinds for another name."""
    words = device_kind.upper().replace("-", " ").split()
    for name, cc in COMPUTE_CAPABILITIES:
        if name in words:
            return cc
    known = ", ".join(n for n, _ in COMPUTE_CAPABILITIES)
    raise ValueError(f"device kind {device_kind!r}: compute capability unknown (known GPUs: {known}); "
                     f"name one of them, e.g. {DEFAULT_DEVICE_KIND!r}")


def current() -> Optional[GpuTarget]:
    """The GPU named by the innermost :func:`lowering_for`, else None."""
    return _TARGET.get()


def is_gpu() -> bool:
    """True inside :func:`lowering_for` or where JAX's default backend is a GPU."""
    return _TARGET.get() is not None or jax.default_backend() == "gpu"


def compute_capability() -> Optional[tuple[int, int]]:
    """The named GPU's compute capability inside :func:`lowering_for`, else the first local
    CUDA device's (``Device.compute_capability``), else None (no NVIDIA GPU)."""
    target = _TARGET.get()
    if target is not None:
        return target.compute_capability
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    cc = getattr(devices[0], "compute_capability", None) if devices else None
    return tuple(int(x) for x in str(cc).split(".")[:2]) if cc else None


@contextlib.contextmanager
def lowering_for(device_kind: str = DEFAULT_DEVICE_KIND) -> Iterator[GpuTarget]:
    """Inside, code is traced for ``device_kind`` (see the module docstring). Functions must
    be traced afresh inside: a ``jit`` traced before keeps what it chose then. JAX's cuDNN
    checks (``jax._src.cudnn.fused_attention_stablehlo``: the cuDNN version and the compute
    capability, read from the local GPU) are replaced for the duration, where this JAX has
    them; elsewhere cuDNN attention fails to trace without a GPU, by JAX's own error. From
    jax 0.11 on, Pallas's Triton lowering asks for the GPU's hardware info
    (``jax._src.pallas.triton.gpu_info.get_gpu_info``, read from the local or abstract
    device): it is answered for ``device_kind``.
    Raises ValueError for an unknown ``device_kind``."""
    target = GpuTarget(device_kind, compute_capability_of(device_kind))
    token = _TARGET.set(target)
    try:
        with contextlib.ExitStack() as stack:
            _patch_cudnn_checks(stack, target.compute_capability)
            _patch_triton_gpu_info(stack, device_kind)
            yield target
    finally:
        _TARGET.reset(token)


def _patch_cudnn_checks(stack: contextlib.ExitStack, cc: tuple[int, int]) -> None:
    try:  # JAX's private module: absent in some version, the patch is skipped
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        return
    checks = {"check_cudnn_version": lambda: CUDNN_VERSION,
              "check_compute_capability": lambda c: cc >= _parse(c),
              "is_cuda_compute_capability_equal": lambda c: cc == _parse(c)}
    for name, fn in checks.items():
        if hasattr(fa, name):
            stack.enter_context(mock.patch.object(fa, name, fn))


def _patch_triton_gpu_info(stack: contextlib.ExitStack, device_kind: str) -> None:
    try:  # JAX's private module, jax >= 0.11 (0.10's Triton lowering needs no GPU info)
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return
    names = ("get_gpu_info", "gpu_version_from_device_kind", "get_gpu_info_from_version")
    if not all(hasattr(gpu_info, n) for n in names):
        return
    version = gpu_info.gpu_version_from_device_kind(device_kind)
    if version is not None:
        stack.enter_context(mock.patch.object(gpu_info, "get_gpu_info",
                                              lambda: gpu_info.get_gpu_info_from_version(version)))


def _parse(capability: str) -> tuple[int, ...]:
    return tuple(int(x) for x in capability.split("."))
