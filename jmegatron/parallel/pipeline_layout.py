"""Which decoder layers each pipeline stage holds, and in which order they are stored.

Under pipeline parallelism the decoder layers' parameters are stacked ``[num_layers, ...]``
(the ``scan_layers`` layout, logical axis ``layers``) and the stack is split over the
``pipeline`` mesh axis in equal contiguous blocks. With one model chunk per stage (v = 1)
block ``s`` is layers ``[s * L / p, (s + 1) * L / p)``, the model's own order. Megatron's
interleaved schedule gives stage ``s`` the chunks ``s, s + p, s + 2p, ...``
(megatron/core/transformer/transformer_block.py, ``get_num_layers_to_build`` /
``_get_layer_offset``), which are not contiguous; the stack is then stored in *stage
order*: stored position ``j = s * (v * Lc) + c * Lc + k`` (stage ``s``, its ``c``-th chunk,
layer ``k`` of the chunk, ``Lc = L / (p * v)`` layers per chunk) holds model layer
``(c * p + s) * Lc + k``. Checkpoints record (p, v) so a restore into another layout can
reorder the stack (:func:`stage_layer_order`).
"""

from __future__ import annotations

import numpy as np


def stage_layer_order(num_layers: int, pipeline_size: int, virtual_size: int = 1) -> np.ndarray:
    """int64 ``[num_layers]``: the model layer at each stored position of the stacked layers
    for ``pipeline_size`` stages of ``virtual_size`` chunks each (identity when
    ``virtual_size`` is 1). Raises ValueError unless ``pipeline_size * virtual_size``
    divides ``num_layers``."""
    p, v = pipeline_size, virtual_size
    if p <= 0 or v <= 0 or num_layers % (p * v):
        raise ValueError(f"num_layers={num_layers} must split into pipeline_size={p} x virtual_size={v} "
                         f"equal chunks")
    lc = num_layers // (p * v)
    s, c, k = np.meshgrid(np.arange(p), np.arange(v), np.arange(lc), indexing="ij")
    return ((c * p + s) * lc + k).reshape(-1)


def reorder(num_layers: int, source: tuple[int, int], target: tuple[int, int]) -> np.ndarray:
    """int64 ``[num_layers]`` index ``idx`` such that ``stack_target = stack_source[idx]``
    for stacks stored in the stage order of ``source`` = (pipeline_size, virtual_size) and
    ``target``."""
    src = stage_layer_order(num_layers, *source)
    tgt = stage_layer_order(num_layers, *target)
    position_of = np.empty(num_layers, np.int64)
    position_of[src] = np.arange(num_layers)
    return position_of[tgt]
