"""jmegatron.models.rope against megatron-core's own RotaryEmbedding (Llama-3.x
``rope_scaling``) and YaRN helpers (megatron/core/models/common/embeddings/), on the CPU."""

import math

import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.models.rope import RotaryEmbedding, yarn_concentration_factor

torch = pytest.importorskip("torch")
rotary = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
yarn = pytest.importorskip("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")


@pytest.mark.parametrize("d, base, factor", [(128, 500000, 8.0), (64, 10000, 32.0)])
def test_llama3_scaling_is_megatrons(d, base, factor):
    ref = rotary.RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_base=base, rope_scaling=True,
                                 rope_scaling_factor=factor, use_cpu_initialization=True).inv_freq.numpy()
    ours = RotaryEmbedding(d, base, rope_scaling=True, rope_scaling_factor=factor).inverse_frequencies()
    plain = RotaryEmbedding(d, base).inverse_frequencies()
    assert np.any(ours != plain)  # the scaling changes some frequencies and keeps others
    np.testing.assert_allclose(ours, ref, rtol=1e-6)


@pytest.mark.parametrize("d, base, factor, original, mscale, mscale_all_dim", [
    (128, 10000, 40.0, 4096, 1.0, 1.0),  # DeepSeek-V3's
    (64, 1000000, 4.0, 32768, 1.0, 0.0),  # Qwen3's (transformers' default attention factor)
])
def test_yarn_is_megatrons(d, base, factor, original, mscale, mscale_all_dim):
    low, high = yarn._yarn_find_correction_range(32.0, 1.0, d, base, original, True)
    mask = 1.0 - yarn._yarn_linear_ramp_mask(low, high, d // 2, device="cpu").numpy()
    extra = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float32) / d)
    ref = extra / factor * (1 - mask) + extra * mask
    r = RotaryEmbedding(d, base, position_embedding_type="yarn", yarn_rotary_scaling_factor=factor,
                        yarn_original_max_position_embeddings=original, yarn_mscale=mscale,
                        yarn_mscale_all_dim=mscale_all_dim)
    np.testing.assert_allclose(r.inverse_frequencies(), ref, rtol=1e-6)
    assert r.mscale() == pytest.approx(yarn._yarn_get_concentration_factor(factor, mscale, mscale_all_dim))
    assert yarn_concentration_factor(factor, 1.0, 0.0) == pytest.approx(0.1 * math.log(factor) + 1.0)


def test_cos_sin_interpolate_positions_and_scale():
    import jax.numpy as jnp

    pos = jnp.arange(8, dtype=jnp.int32)[None]
    cos, sin = RotaryEmbedding(16, 10000, rotary_seq_len_interpolation_factor=4.0).cos_sin(pos)
    # position p under factor 4 is position p / 4 without it
    ref = RotaryEmbedding(16, 10000).inverse_frequencies()[None, :] * (np.arange(8)[:, None] / 4.0)
    np.testing.assert_allclose(np.asarray(cos)[0, :, 0, :8], np.cos(ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin)[0, :, 0, 8:], np.sin(ref), rtol=1e-6, atol=1e-6)
    assert cos.shape == sin.shape == (1, 8, 1, 16)
    y = RotaryEmbedding(16, 10000, position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0)
    c, s = y.cos_sin(pos)
    assert float(jnp.max(c[0, 0])) == pytest.approx(y.mscale())  # position 0: cos = 1 times the factor


@pytest.mark.parametrize("fields, match", [
    (dict(position_embedding_type="learned_absolute", rope_scaling=True), "rope_scaling=True .* needs position_embedding_type='rope'"),
    (dict(position_embedding_type="rope", rope_scaling=True, rope_scaling_factor=0.5), "rope_scaling_factor=0.5 must be >= 1"),
    (dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=0.5), "yarn_rotary_scaling_factor=0.5"),
    (dict(position_embedding_type="learned_absolute", rotary_seq_len_interpolation_factor=2.0),
     "rotary_seq_len_interpolation_factor needs position_embedding_type"),
    (dict(swiglu=True, openai_gelu=True), "openai_gelu=True with swiglu=True"),
])
def test_bad_rotary_fields_are_refused_by_name(fields, match):
    from test_train_step import tiny_cfg

    with pytest.raises(ConfigError, match=match):
        tiny_cfg(**fields)
