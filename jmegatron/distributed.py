"""Multi-process start-up on JAX's own runtime (``jax.distributed``).

A process joins a multi-process run when these environment variables are set (the
launcher, ``python -m jmegatron.launch``, sets them; a cluster scheduler can too):

``JMEGATRON_COORDINATOR``   ``host:port`` of process 0's coordination service
``JMEGATRON_NUM_PROCESSES`` number of processes
``JMEGATRON_PROCESS_ID``    this process's rank, 0-based
``JMEGATRON_HEARTBEAT_TIMEOUT`` seconds without a peer's heartbeat before the run fails (default 30)

CPU collectives use gloo (``jax_cpu_collectives_implementation``). Without the
variables this is a no-op (one process).
"""

from __future__ import annotations

import os

ENV_COORDINATOR = "JMEGATRON_COORDINATOR"
ENV_NUM_PROCESSES = "JMEGATRON_NUM_PROCESSES"
ENV_PROCESS_ID = "JMEGATRON_PROCESS_ID"
ENV_HEARTBEAT = "JMEGATRON_HEARTBEAT_TIMEOUT"

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

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=pid,
                               heartbeat_timeout_seconds=int(os.environ.get(ENV_HEARTBEAT, "30")),
                               initialization_timeout=120, shutdown_timeout_seconds=30)
    _initialized = True
    return True


def is_main_process() -> bool:
    """True on process 0 (the one that writes logs and shared files)."""
    import jax

    return jax.process_index() == 0
