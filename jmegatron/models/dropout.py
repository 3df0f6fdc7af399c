"""Dropout as a Flax module, its masks drawn by the counter-based hash of
:mod:`jmegatron.kernels.xla.dropout` (or ``jax.random``), so every parallel layout draws the
one-device run's masks.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax

from jmegatron.kernels.xla.dropout import dropout


class Dropout(nn.Module):
    """Flax module form of :func:`jmegatron.kernels.xla.dropout.dropout` (the ``"dropout"``
    RNG collection), a drop-in for ``nn.Dropout(rate, deterministic)`` with the mask
    generator chosen by ``impl``.

    ``__call__(x [batch, ...], deterministic=None, sample_offset=0, positions=None)``:
    ``sample_offset`` is the global sample number of ``x[0]`` (see
    :mod:`jmegatron.kernels.xla.dropout`); ``positions`` (int ``[b, s]``, optional, for
    ``x [b, s, ...]``): each slot's sequence position (context parallelism's load-balanced
    order, the batch's ``positions``), the masks then the one-device run's."""

    rate: float
    deterministic: Optional[bool] = None
    impl: str = "hash"

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: Optional[bool] = None, sample_offset=0,
                 positions: Optional[jax.Array] = None) -> jax.Array:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"), self.impl, sample_offset, positions)
