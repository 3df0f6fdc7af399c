"""Multi-process start-up on JAX's own runtime (``jax.distributed``).

A process joins a multi-process run when these environment variables are set (the
launcher, ``python -m jmegatron.launch``, sets them; a cluster scheduler can too):

``JMEGATRON_COORDINATOR``   ``host:port`` of process 0's coordination service
``JMEGATRON_NUM_PROCESSES`` number of processes
``JMEGATRON_PROCESS_ID``    this process's rank, 0-based
``JMEGATRON_HEARTBEAT_TIMEOUT`` seconds without a peer's heartbeat before the run fails (default 30)

``JMEGATRON_LOCAL_DEVICE_IDS`` comma-separated GPU ids this process drives (the
launcher's ``--devices-per-proc`` on a GPU machine); unset: every visible GPU

On the CPU platform the collectives use gloo (``jax_cpu_collectives_implementation``);
on GPUs XLA's own (NCCL). Without the variables this is a no-op (one process).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from typing import Mapping, Optional

ENV_COORDINATOR = "JMEGATRON_COORDINATOR"
ENV_NUM_PROCESSES = "JMEGATRON_NUM_PROCESSES"
ENV_PROCESS_ID = "JMEGATRON_PROCESS_ID"
ENV_HEARTBEAT = "JMEGATRON_HEARTBEAT_TIMEOUT"
ENV_LOCAL_DEVICE_IDS = "JMEGATRON_LOCAL_DEVICE_IDS"


def nvidia_gpu_count() -> int:
    """The NVIDIA GPUs this machine has, without starting JAX (a GPU client would reserve
    most of the GPU's memory in the launcher): ``/proc/driver/nvidia/gpus/*``, else
    ``nvidia-smi -L``; 0 when neither shows one. ``CUDA_VISIBLE_DEVICES`` is not applied."""
    found = glob.glob("/proc/driver/nvidia/gpus/*")
    if found:
        return len(found)
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return 0
        return sum(line.startswith("GPU ") for line in out.splitlines())
    return 0


def target_platform(env: Optional[Mapping[str, str]] = None, gpu_count: Optional[int] = None) -> str:
    """The platform a process started with ``env`` runs on: the first of ``JAX_PLATFORMS``
    when set ("cuda" reported as "gpu"), else "gpu" where :func:`nvidia_gpu_count` (or
    ``gpu_count``) finds one, else "cpu"."""
    env = os.environ if env is None else env
    platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return "gpu" if platforms[0] in ("cuda", "gpu", "rocm") else platforms[0]
    return "gpu" if (nvidia_gpu_count() if gpu_count is None else gpu_count) > 0 else "cpu"

_initialized = False


def initialize_from_env() -> bool:
    """Call ``jax.distributed.initialize`` from the environment; True if multi-process.

    Raises ValueError naming the variable when the settings are incomplete or malformed.
    """
    global _initialized
    coordinator = os.environ.get(ENV_COORDINATOR)
    if not coordinator:
        return False
    if _initialized:
        return True
    try:
        num = int(os.environ[ENV_NUM_PROCESSES])
        pid = int(os.environ[ENV_PROCESS_ID])
    except KeyError as e:
        raise ValueError(f"{ENV_COORDINATOR} is set but {e.args[0]} is not; set both "
                         f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}") from None
    except ValueError:
        raise ValueError(f"{ENV_NUM_PROCESSES}={os.environ[ENV_NUM_PROCESSES]!r} and {ENV_PROCESS_ID}="
                         f"{os.environ[ENV_PROCESS_ID]!r} must be integers") from None
    if not 0 <= pid < num:
        raise ValueError(f"{ENV_PROCESS_ID}={pid} is not in [0, {ENV_NUM_PROCESSES}={num})")
    import jax

    local_ids = os.environ.get(ENV_LOCAL_DEVICE_IDS)
    try:
        local_ids = [int(i) for i in local_ids.split(",")] if local_ids else None
    except ValueError:
        raise ValueError(f"{ENV_LOCAL_DEVICE_IDS}={os.environ[ENV_LOCAL_DEVICE_IDS]!r} must be comma-separated "
                         f"integers (GPU ids)") from None
    if target_platform() == "cpu":  # XLA's CPU client has no collectives of its own across processes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=pid,
                               local_device_ids=local_ids,
                               heartbeat_timeout_seconds=int(os.environ.get(ENV_HEARTBEAT, "30")),
                               initialization_timeout=120, shutdown_timeout_seconds=30)
    _initialized = True
    return True


def is_main_process() -> bool:
    """True on process 0 (the one that writes logs and shared files)."""
    import jax

    return jax.process_index() == 0
