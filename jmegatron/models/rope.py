"""Rotary position embeddings (Su et al. 2021, RoFormer) and their long-context scalings.

Follows megatron/core/models/common/embeddings/rotary_pos_embedding.py (``RotaryEmbedding``:
the rotate-half layout of Hugging Face Llama, ``seq_len_interpolation_factor``, and the
Llama-3.x ``rope_scaling``) and yarn_rotary_pos_embedding.py (``YarnRotaryEmbedding``: YaRN,
Peng et al. 2023, arXiv:2309.00071). The same numbers as transformers'
``modeling_rope_utils`` ("default", "linear", "llama3" and "yarn" rope types).

Two layouts of the rotated channels, as megatron-core's ``apply_rotary_pos_emb_bshd``:
partial RoPE (``rotary_percent``: the first ``int(kv_channels * rotary_percent)`` channels of
each head rotate, the rest pass through; transformers' ``partial_rotary_factor``, Phi-3's
``apply_rotary_pos_emb``), and interleaved RoPE (``rotary_interleaved``: channel pairs
``(2i, 2i + 1)`` rotate by frequency ``i`` instead of the halves ``(i, i + d/2)``;
transformers' Cohere ``rotate_half`` with ``repeat_interleave``d frequencies).

:class:`RotaryEmbedding` holds the rotary group of a run's config
(:class:`jmegatron.config.model.RotaryConfig`) and the head width; its
:meth:`RotaryEmbedding.inverse_frequencies` are computed once in numpy (constants of the
compiled step), and :meth:`RotaryEmbedding.cos_sin` turns integer position ids into the
tables :func:`apply_rope` rotates queries and keys by.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.config import RotaryConfig, yarn_concentration_factor

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
    """The rotary frequencies of ``kv_channels``-wide heads under ``config``, the rotary group
    of a run's config (:class:`jmegatron.config.model.RotaryConfig`: ``"rope"`` with optional
    Llama-3.x ``rope_scaling`` or linear interpolation, or ``"yarn"``)."""

    kv_channels: int
    config: RotaryConfig = RotaryConfig(position_embedding_type="rope")

    @classmethod
    def from_config(cls, cfg: Any) -> Optional["RotaryEmbedding"]:
        """The rotary embedding of ``cfg`` (a run's config or the model's: ``kv_channels`` and
        the :class:`RotaryConfig` fields); None when its ``position_embedding_type`` is not
        rotary."""
        if cfg.position_embedding_type not in ("rope", "yarn"):
            return None
        return cls(cfg.kv_channels, RotaryConfig.of(cfg))

    @property
    def rotary_dims(self) -> int:
        """The channels of each head that rotate: ``int(kv_channels * rotary_percent)``
        (megatron-core RotaryEmbedding's ``dim``; transformers' ``int(head_dim *
        partial_rotary_factor)``)."""
        return int(self.kv_channels * self.config.rotary_percent)

    def inverse_frequencies(self) -> np.ndarray:
        """float32 ``[rotary_dims / 2]``: ``1 / base^(2i / d)`` with ``d`` = :attr:`rotary_dims`,
        rescaled by ``rope_scaling`` (megatron-core ``RotaryEmbedding._apply_scaling``) or by
        YaRN's ramp between interpolated and extrapolated frequencies
        (``YarnRotaryEmbedding.get_emb``)."""
        d = self.rotary_dims
        exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
        inv_freq = (1.0 / np.float32(self.config.rotary_base) ** exponents).astype(np.float32)
        if self.config.position_embedding_type == "yarn":
            return _yarn_inverse_frequencies(self.config, d, inv_freq)
        if self.config.rope_scaling:
            return _llama3_inverse_frequencies(self.config, inv_freq)
        return inv_freq

    def mscale(self) -> float:
        """The factor cos and sin are multiplied by: YaRN's attention (concentration) factor
        ``(0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)`` for scaling factor ``s > 1``
        (megatron-core ``_yarn_get_concentration_factor``), else 1."""
        if self.config.position_embedding_type != "yarn":
            return 1.0
        c = self.config
        return yarn_concentration_factor(c.yarn_rotary_scaling_factor, c.yarn_mscale, c.yarn_mscale_all_dim)

    def cos_sin(self, position_ids: Array) -> tuple[Array, Array]:
        """cos/sin tables ``[b, s, 1, rotary_dims]`` (float32) for integer ``position_ids [b, s]``
        (divided by ``rotary_seq_len_interpolation_factor`` when set), times :meth:`mscale`:
        the frequencies twice, ``[f, f]`` (rotate-half) or ``[f0, f0, f1, f1, ...]``
        (``rotary_interleaved``)."""
        positions = position_ids.astype(jnp.float32)
        if self.config.rotary_seq_len_interpolation_factor is not None:
            positions = positions / self.config.rotary_seq_len_interpolation_factor
        freqs = positions[..., None] * jnp.asarray(self.inverse_frequencies())  # [b, s, d/2]
        if self.config.rotary_interleaved:
            emb = jnp.repeat(freqs, 2, axis=-1)[:, :, None, :]
        else:
            emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
        m = self.mscale()
        if m == 1.0:
            return jnp.cos(emb), jnp.sin(emb)
        return jnp.cos(emb) * m, jnp.sin(emb) * m


def apply_rope(x: Array, cos: Array, sin: Array, interleaved: bool = False) -> Array:
    """Rotate ``x [b, s, n, d]`` by the tables ``[b, s, 1, r]`` of
    :meth:`RotaryEmbedding.cos_sin`, in float32, returned in ``x``'s dtype: the first ``r``
    channels rotate (``r < d``: partial RoPE, the other ``d - r`` pass through unchanged, as
    megatron-core's ``apply_rotary_pos_emb_bshd`` and transformers' Phi-3), in the
    rotate-half layout (pairs ``(i, i + r/2)``) or, with ``interleaved`` (the tables of a
    ``rotary_interleaved`` embedding), the pairs ``(2i, 2i + 1)``."""
    r = cos.shape[-1]
    x32 = x.astype(jnp.float32)
    x_rot, x_pass = (x32, None) if r == x.shape[-1] else (x32[..., :r], x32[..., r:])
    if interleaved:
        rotated = jnp.stack([-x_rot[..., 1::2], x_rot[..., 0::2]], axis=-1).reshape(x_rot.shape)
    else:
        rotated = jnp.concatenate([-x_rot[..., r // 2:], x_rot[..., :r // 2]], axis=-1)
    out = x_rot * cos + rotated * sin
    if x_pass is not None:
        out = jnp.concatenate([out, x_pass], axis=-1)
    return out.astype(x.dtype)


def _llama3_inverse_frequencies(r: RotaryConfig, inv_freq: np.ndarray) -> np.ndarray:
    # wavelengths above original/low_freq_factor are divided by the factor, those below
    # original/high_freq_factor kept, and the band between interpolated smoothly
    factor, low, high = r.rope_scaling_factor, r.rope_scaling_low_freq_factor, r.rope_scaling_high_freq_factor
    context = r.rope_scaling_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) & ~(wavelen > context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_correction_dim(rotations: float, d: int, base: float, context: int) -> float:
    # the dimension whose frequency turns ``rotations`` times over ``context`` positions
    return d * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn_inverse_frequencies(r: RotaryConfig, d: int, inv_freq: np.ndarray) -> np.ndarray:
    base, context = r.rotary_base, r.yarn_original_max_position_embeddings
    low = _yarn_correction_dim(r.yarn_beta_fast, d, base, context)
    high = _yarn_correction_dim(r.yarn_beta_slow, d, base, context)
    if r.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1.0 - ramp  # 1: the dimension keeps its frequency, 0: interpolated by the factor
    interpolated = inv_freq / np.float32(r.yarn_rotary_scaling_factor)
    return (interpolated * (1 - extrapolate) + inv_freq * extrapolate).astype(np.float32)
