"""jmegatron.models.rope against megatron-core's own RotaryEmbedding (Llama-3.x
``rope_scaling``) and YarnRotaryEmbedding (megatron/core/models/common/embeddings/), on the CPU."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from megatron.core.models.common.embeddings import rotary_pos_embedding as rotary
from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

from jmegatron.config import ConfigError, RotaryConfig
from jmegatron.config import yarn_concentration_factor
from jmegatron.models.rope import RotaryEmbedding, apply_rope


@pytest.mark.parametrize("d, base, factor", [(128, 500000, 8.0), (64, 10000, 32.0)])
def test_llama3_scaling_is_megatrons(d, base, factor):
    ref = rotary.RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_base=base, rope_scaling=True,
                                 rope_scaling_factor=factor, use_cpu_initialization=True).inv_freq.numpy()
    ours = RotaryEmbedding(d, RotaryConfig(position_embedding_type="rope", rotary_base=base, rope_scaling=True,
                                        rope_scaling_factor=factor)).inverse_frequencies()
    plain = RotaryEmbedding(d, RotaryConfig(position_embedding_type="rope", rotary_base=base)).inverse_frequencies()
    assert np.any(ours != plain)  # the scaling changes some frequencies and keeps others
    np.testing.assert_allclose(ours, ref, rtol=1e-6)


@pytest.mark.parametrize("d, base, factor, original, mscale, mscale_all_dim", [
    (128, 10000, 40.0, 4096, 1.0, 1.0),  # DeepSeek-V3's
    (64, 1000000, 4.0, 32768, 1.0, 0.0),  # Qwen3's (transformers' default attention factor)
])
def test_yarn_is_megatrons(d, base, factor, original, mscale, mscale_all_dim, monkeypatch):
    """Frequencies, concentration factor and the cos / sin tables (the factor included) of
    megatron-core's YarnRotaryEmbedding, at positions 0..127."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # its tables move to the GPU
    ref = yarn.YarnRotaryEmbedding(kv_channels=d, rotary_base=base, scaling_factor=factor,
                                   original_max_position_embeddings=original, mscale=mscale,
                                   mscale_all_dim=mscale_all_dim, use_cpu_initialization=True)
    emb, ref_mscale = ref.get_emb(128)  # [s, 1, 1, d]: positions x frequencies, twice
    r = RotaryEmbedding(d, RotaryConfig(rotary_base=base, position_embedding_type="yarn",
                                        yarn_rotary_scaling_factor=factor, yarn_original_max_position_embeddings=original,
                                        yarn_mscale=mscale, yarn_mscale_all_dim=mscale_all_dim))
    np.testing.assert_allclose(r.inverse_frequencies(), emb[1, 0, 0, :d // 2].numpy(), rtol=1e-6)
    assert r.mscale() == pytest.approx(ref_mscale)
    cos, sin = r.cos_sin(jnp.arange(128, dtype=jnp.int32)[None])
    want_cos, want_sin = ref.get_cached_cos_sin(128, dtype=torch.float32)
    # angles up to 128 rad in float32: each side rounds them by up to 128 x eps
    atol = 4 * 128 * float(np.finfo(np.float32).eps) * ref_mscale
    np.testing.assert_allclose(np.asarray(cos)[0, :, 0], want_cos[:, 0, 0].numpy(), rtol=0, atol=atol)
    np.testing.assert_allclose(np.asarray(sin)[0, :, 0], want_sin[:, 0, 0].numpy(), rtol=0, atol=atol)
    assert yarn_concentration_factor(factor, 1.0, 0.0) == pytest.approx(0.1 * math.log(factor) + 1.0)


def test_cos_sin_interpolate_positions_and_scale():
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    cos, sin = RotaryEmbedding(16, RotaryConfig(position_embedding_type="rope", rotary_seq_len_interpolation_factor=4.0)).cos_sin(pos)
    # position p under factor 4 is position p / 4 without it
    ref = RotaryEmbedding(16, RotaryConfig(position_embedding_type="rope")).inverse_frequencies()[None, :] * (np.arange(8)[:, None] / 4.0)
    np.testing.assert_allclose(np.asarray(cos)[0, :, 0, :8], np.cos(ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin)[0, :, 0, 8:], np.sin(ref), rtol=1e-6, atol=1e-6)
    assert cos.shape == sin.shape == (1, 8, 1, 16)
    y = RotaryEmbedding(16, RotaryConfig(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0))
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


def _qk(d=16, s=9, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, s, 3, d)).astype(np.float32), rng.standard_normal((2, s, 3, d)).astype(np.float32),
            np.broadcast_to(np.arange(3, 3 + s), (2, s)).astype(np.int32))


def _ours(d, fields, q, k, pos):
    r = RotaryEmbedding(d, RotaryConfig(position_embedding_type="rope", **fields))
    cos, sin = r.cos_sin(jnp.asarray(pos))
    interleaved = r.config.rotary_interleaved
    return [np.asarray(apply_rope(jnp.asarray(x), cos, sin, interleaved)) for x in (q, k)], (cos, sin)


def _bhsd(x):
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))


def test_interleaved_rope_is_cohere_apply_rotary_pos_emb():
    """``rotary_interleaved``: the pairs (2i, 2i + 1) rotate by frequency i, as transformers'
    Cohere ``apply_rotary_pos_emb`` with CohereRotaryEmbedding's interleaved tables."""
    from transformers import CohereConfig
    from transformers.models.cohere import modeling_cohere as cohere

    d = 16
    q, k, pos = _qk(d)
    (oq, ok), (cos, sin) = _ours(d, dict(rotary_base=10000, rotary_interleaved=True), q, k, pos)
    conf = CohereConfig(hidden_size=3 * d, num_attention_heads=3, rope_parameters=dict(rope_type="default",
                                                                                       rope_theta=10000.0))
    tcos, tsin = cohere.CohereRotaryEmbedding(conf)(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos).long())
    np.testing.assert_allclose(np.asarray(cos)[:, :, 0], tcos.numpy(), rtol=0, atol=1e-6)
    tq, tk = cohere.apply_rotary_pos_emb(_bhsd(q), _bhsd(k), tcos, tsin)
    np.testing.assert_allclose(oq, tq.numpy().transpose(0, 2, 1, 3), rtol=0, atol=1e-5)
    np.testing.assert_allclose(ok, tk.numpy().transpose(0, 2, 1, 3), rtol=0, atol=1e-5)
    halves, _ = _ours(d, dict(rotary_base=10000), q, k, pos)
    assert np.max(np.abs(halves[0] - oq)) > 0.1  # the two layouts differ


def test_partial_rope_is_phi3_apply_rotary_pos_emb():
    """``rotary_percent`` 0.5: the first half of each head rotates with frequencies of an 8-wide
    RoPE, the rest passes through unchanged, as transformers' Phi-3 (``partial_rotary_factor``)."""
    from transformers import Phi3Config
    from transformers.models.phi3 import modeling_phi3 as phi3

    d = 16
    q, k, pos = _qk(d)
    (oq, ok), (cos, _) = _ours(d, dict(rotary_base=10000, rotary_percent=0.5), q, k, pos)
    assert cos.shape[-1] == 8
    conf = Phi3Config(hidden_size=3 * d, num_attention_heads=3, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    tcos, tsin = phi3.Phi3RotaryEmbedding(conf)(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos).long())
    tq, tk = phi3.apply_rotary_pos_emb(_bhsd(q), _bhsd(k), tcos, tsin)
    np.testing.assert_allclose(oq, tq.numpy().transpose(0, 2, 1, 3), rtol=0, atol=1e-5)
    np.testing.assert_allclose(ok, tk.numpy().transpose(0, 2, 1, 3), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(oq[..., 8:], q[..., 8:])


@pytest.mark.parametrize("percent, interleaved", [(0.5, True), (1.0, True), (0.5, False)])
def test_partial_and_interleaved_rope_are_megatrons(percent, interleaved, monkeypatch):
    """Both layouts and their combination against megatron-core's own RotaryEmbedding
    (``rotary_percent``, ``rotary_interleaved``) and ``_apply_rotary_pos_emb_bshd``."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # its tables move to the GPU
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    d, s = 16, 9
    q, k, _ = _qk(d, s)
    pos = np.broadcast_to(np.arange(s), (2, s)).astype(np.int32)
    (oq, _), _ = _ours(d, dict(rotary_base=10000, rotary_percent=percent, rotary_interleaved=interleaved), q, k, pos)
    ref = rotary.RotaryEmbedding(kv_channels=d, rotary_percent=percent, rotary_interleaved=interleaved,
                                 rotary_base=10000, use_cpu_initialization=True)
    freqs = ref(s)  # [s, 1, 1, dim]
    want = _apply_rotary_pos_emb_bshd(torch.from_numpy(np.ascontiguousarray(q.transpose(1, 0, 2, 3))), freqs,
                                      rotary_interleaved=interleaved)
    np.testing.assert_allclose(oq, want.numpy().transpose(1, 0, 2, 3), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fields, match", [
    (dict(position_embedding_type="rope", rotary_percent=1.5), "rotary_percent=1.5 must be in \\(0, 1\\]"),
    (dict(position_embedding_type="rope", kv_channels=16, rotary_percent=0.2), "rotary_percent=0.2 with "
                                                                               "kv_channels=16 rotates"),
    (dict(position_embedding_type="learned_absolute", rotary_interleaved=True), "rotary_interleaved=True needs "
                                                                                "position_embedding_type"),
])
def test_bad_partial_or_interleaved_rope_is_refused_by_name(fields, match):
    from test_train_step import tiny_cfg

    with pytest.raises(ConfigError, match=match):
        tiny_cfg(**fields)
