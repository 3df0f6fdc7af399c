"""One ``jax.sharding.Mesh`` from Megatron's parallel sizes.

Axis order follows Megatron's default rank order ``tp-cp-ep-dp-pp``
(megatron/core/parallel_state.py, ``RankGenerator``): tensor is the innermost
(fastest-varying, neighbouring devices) axis and pipeline the outermost. The data
axis takes whatever devices the other sizes leave.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jmegatron.config import JMegatronConfig

# Outermost first, as jax.sharding.Mesh lays devices out (last axis = contiguous devices).
MESH_AXES = ("pipeline", "data", "expert", "context", "tensor")


def mesh_shape(cfg: JMegatronConfig, num_devices: int) -> dict[str, int]:
    """Sizes of each mesh axis. Raises ConfigError if the sizes do not divide ``num_devices``."""
    return {
        "pipeline": cfg.pipeline_model_parallel_size,
        "data": cfg.data_parallel_size(num_devices),
        "expert": cfg.expert_model_parallel_size,
        "context": cfg.context_parallel_size,
        "tensor": cfg.tensor_model_parallel_size,
    }


def create_mesh(cfg: JMegatronConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A Mesh with axes :data:`MESH_AXES` over ``devices`` (default: all, every process).

    Raises ConfigError naming the sizes when they do not divide the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    grid = np.array(devices, dtype=object).reshape([shape[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)
