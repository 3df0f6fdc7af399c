"""Which decoder layers each pipeline stage holds, and in which order they are stored.

Under pipeline parallelism the decoder layers' parameters are stacked ``[slots, ...]``
(the ``scan_layers`` layout, logical axis ``layers``) and the stack is split over the
``pipeline`` mesh axis in equal contiguous blocks, one per stage. Megatron's placement
(megatron/core/transformer/transformer_layer.py ``get_transformer_layer_offset``,
transformer_block.py ``get_num_layers_to_build``):

* **even** (the default): every stage holds ``L / p`` layers; with v interleaved model
  chunks per stage, stage ``s``'s chunk ``c`` is model chunk ``c * p + s`` of
  ``Lc = L / (p * v)`` layers, so a stage's layers are not contiguous;
* **uneven** (``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``,
  Megatron's ``--decoder-first/last-pipeline-num-layers``): the first and/or last stage
  hold the given numbers and the other stages split the rest evenly; each stage's layers
  are split evenly over its v chunks, and chunk ``c`` of stage ``s`` starts at model layer
  ``c * T + (layers per chunk of the stages before s)``, ``T = L / v``.

Storage: each stage owns ``v * K`` slots of the stack, ``K`` = the largest chunk, chunk
``c`` of stage ``s`` at slots ``[(s * v + c) * K, ... + K)``; a chunk with fewer layers
than ``K`` leaves *padding slots*, which hold zeros (parameters, gradients and optimizer
moments stay zero: Adam's update of a zero gradient is zero) and are skipped by the
forward (:func:`jmegatron.models.gpt.apply_layers` ``num_valid``). Even layouts have no
padding. Checkpoints record the layout's fields so a restore into another layout moves
the layers (:mod:`jmegatron.checkpoint.layout`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

PAD = -1  # the model layer of a padding slot


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """The placement of ``num_layers`` decoder layers on ``pipeline_size`` stages of
    ``virtual_size`` chunks; ``first_stage_layers`` / ``last_stage_layers`` (None: even)
    as Megatron's ``decoder_first_pipeline_num_layers`` / ``decoder_last_...``.

    Raises ValueError (naming Megatron's argument) when the layers do not split: an even
    layout needs ``p * v`` to divide L; an uneven one needs first/last in [1, L), each a
    multiple of v, and the remaining layers split evenly over the middle stages in
    multiples of v (none left when no middle stage remains)."""

    num_layers: int
    pipeline_size: int = 1
    virtual_size: int = 1
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    def __post_init__(self):
        L, p, v = self.num_layers, self.pipeline_size, self.virtual_size
        if p <= 0 or v <= 0:
            raise ValueError(f"pipeline_size={p} and virtual_size={v} must be > 0")
        if not self.uneven:
            if L % (p * v):
                raise ValueError(f"num_layers={L} must split into pipeline_size={p} x virtual_size={v} equal "
                                 f"chunks (or set decoder_first/last_pipeline_num_layers)")
            return
        if p == 1:
            raise ValueError("decoder_first/last_pipeline_num_layers need pipeline_model_parallel_size > 1")
        for name, n in (("decoder_first_pipeline_num_layers", self.first_stage_layers),
                        ("decoder_last_pipeline_num_layers", self.last_stage_layers)):
            if n is not None and not (1 <= n < L and n % v == 0):
                raise ValueError(f"{name}={n} must be in [1, num_layers={L}) and a multiple of the "
                                 f"virtual pipeline size {v}")
        middle_stages = p - (self.first_stage_layers is not None) - (self.last_stage_layers is not None)
        middle = L - (self.first_stage_layers or 0) - (self.last_stage_layers or 0)
        if middle_stages == 0:
            if middle != 0:
                raise ValueError(f"decoder_first_pipeline_num_layers + decoder_last_pipeline_num_layers = "
                                 f"{L - middle} must equal num_layers={L} with pipeline_model_parallel_size=2")
        elif middle <= 0 or middle % (middle_stages * v):
            raise ValueError(f"decoder_first/last_pipeline_num_layers leave {middle} layers, which must split "
                             f"evenly over the {middle_stages} middle stages x virtual size {v}")

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layers(self) -> np.ndarray:
        """int64 ``[p]``: decoder layers on each stage."""
        L, p = self.num_layers, self.pipeline_size
        counts = np.full(p, L // p, np.int64)
        if self.uneven:
            first, last = self.first_stage_layers, self.last_stage_layers
            middle_stages = p - (first is not None) - (last is not None)
            middle = L - (first or 0) - (last or 0)
            counts[:] = middle // middle_stages if middle_stages else 0
            if first is not None:
                counts[0] = first
            if last is not None:
                counts[-1] = last
        return counts

    def chunk_layers(self) -> np.ndarray:
        """int64 ``[p, v]``: layers in each stage's chunks (a stage's layers split evenly)."""
        per = self.stage_layers() // self.virtual_size
        return np.repeat(per[:, None], self.virtual_size, axis=1)

    def chunk_first_layer(self) -> np.ndarray:
        """int64 ``[p, v]``: the model index of each chunk's first layer (Megatron's
        ``get_transformer_layer_offset``)."""
        per = self.stage_layers() // self.virtual_size  # [p]
        before = np.concatenate([[0], np.cumsum(per)[:-1]])  # [p]
        total = int(per.sum())  # = L / v
        return np.arange(self.virtual_size)[None, :] * total + before[:, None]

    @property
    def slots_per_chunk(self) -> int:
        """K: stored slots per chunk (the largest chunk's layers)."""
        return int(self.chunk_layers().max())

    @property
    def num_slots(self) -> int:
        """Stored slots of the stack, ``p * v * K`` (= num_layers when even)."""
        return self.pipeline_size * self.virtual_size * self.slots_per_chunk

    def order(self) -> np.ndarray:
        """int64 ``[num_slots]``: the model layer at each stored slot, :data:`PAD` for padding."""
        k = self.slots_per_chunk
        counts, first = self.chunk_layers(), self.chunk_first_layer()
        j = np.arange(k)
        out = np.where(j[None, None, :] < counts[:, :, None], first[:, :, None] + j[None, None, :], PAD)
        return out.reshape(-1).astype(np.int64)

    def key(self) -> tuple:
        """What identifies the stored order (equal keys: identical stacks)."""
        return tuple(self.order())


def take_slots(stack, index: np.ndarray):
    """``stack[index]`` along the leading axis with zeros where ``index`` is :data:`PAD`:
    a stack moved between layouts (:func:`gather_index`). ``stack``: a numpy array (result
    numpy) or a jax array / tracer (result jax)."""
    index = np.asarray(index)
    pad = index == PAD
    safe = np.where(pad, 0, index)
    if isinstance(stack, (np.ndarray, np.generic)):
        out = stack[safe]
        if pad.any():
            out[pad] = 0
        return out
    import jax.numpy as jnp

    out = jnp.take(stack, jnp.asarray(safe), axis=0)
    if pad.any():
        keep = jnp.asarray(~pad).reshape((-1,) + (1,) * (out.ndim - 1))
        out = jnp.where(keep, out, jnp.zeros((), out.dtype))
    return out


def stage_layer_order(num_layers: int, pipeline_size: int, virtual_size: int = 1) -> np.ndarray:
    """int64 ``[num_layers]``: the model layer at each stored position of an even layout's
    stack (identity when ``virtual_size`` is 1). Raises ValueError unless
    ``pipeline_size * virtual_size`` divides ``num_layers``."""
    return PipelineLayout(num_layers, pipeline_size, virtual_size).order()


def gather_index(source: PipelineLayout, target: PipelineLayout) -> np.ndarray:
    """int64 ``[target.num_slots]``: for each slot of ``target``'s stack, the slot of
    ``source``'s stack holding the same model layer, :data:`PAD` for target padding slots
    (fill them with zeros): ``stack_target = where(idx >= 0, stack_source[idx], 0)``."""
    if source.num_layers != target.num_layers:
        raise ValueError(f"layouts of {source.num_layers} and {target.num_layers} layers")
    src = source.order()
    position_of = np.empty(source.num_layers, np.int64)
    real = src != PAD
    position_of[src[real]] = np.nonzero(real)[0]
    tgt = target.order()
    return np.where(tgt != PAD, position_of[np.maximum(tgt, 0)], PAD)


def reorder(num_layers: int, source: tuple[int, int], target: tuple[int, int]) -> np.ndarray:
    """:func:`gather_index` for even layouts given as (pipeline_size, virtual_size)."""
    return gather_index(PipelineLayout(num_layers, *source), PipelineLayout(num_layers, *target))
