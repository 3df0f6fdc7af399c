"""Hash-based dropout masks (jmegatron.models.dropout): the right keep rate, independent
across keys and positions, the same under any sharding of the tensor, and the threefry
option still available."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.models.dropout import Dropout, dropout, hash_bits, keep_mask


def test_keep_rate_is_binomial():
    for rate in (0.1, 0.5):
        m = np.asarray(keep_mask(jax.random.key(0), rate, (16, 4, 128, 128)))
        n = m.size
        sd = np.sqrt(n * rate * (1 - rate))
        assert abs((~m).sum() - n * rate) < 5 * sd


def test_bits_look_uniform_and_independent():
    b = np.asarray(hash_bits(jax.random.key(1), (256, 1024)))
    bits = np.unpackbits(b.view(np.uint8)).reshape(-1, 32)
    assert np.all(np.abs(bits.mean(0) - 0.5) < 0.01)  # every bit position balanced (n = 262144)
    x = b.astype(np.float64).ravel() / 2**32
    n = x.size
    for lag in (1, 1024):  # neighbours along a row and along a column
        assert abs(np.corrcoef(x[:-lag], x[lag:])[0, 1]) < 5 / np.sqrt(n)
    y = np.asarray(hash_bits(jax.random.fold_in(jax.random.key(1), 1), (256, 1024))).astype(np.float64).ravel()
    assert abs(np.corrcoef(x, y / 2**32)[0, 1]) < 5 / np.sqrt(n)  # another key: another stream
    counts = np.bincount((b.ravel() >> 24).astype(np.int64), minlength=256)  # chi-square over 256 bins
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
    assert chi2 < 255 + 5 * np.sqrt(2 * 255)


def test_same_mask_under_any_sharding():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    key = jax.random.key(7)
    shape = (8, 4, 64, 64)
    ref = np.asarray(jax.jit(lambda k: keep_mask(k, 0.1, shape))(key))
    for spec in (P("a", "b"), P(None, "b", "a"), P(("a", "b"))):
        got = jax.jit(lambda k: keep_mask(k, 0.1, shape), out_shardings=NamedSharding(mesh, spec))(key)
        assert np.array_equal(np.asarray(got), ref), spec


def test_dropout_scales_and_module_matches_function():
    x = jnp.ones((4, 32, 16))
    y = np.asarray(dropout(x, 0.25, jax.random.key(2)))
    assert np.allclose(np.unique(y), [0.0, 1.0 / 0.75])
    assert np.array_equal(np.asarray(dropout(x, 0.0, None)), np.asarray(x))
    mod = Dropout(0.25)
    z = mod.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert z.shape == x.shape and np.isclose(float((np.asarray(z) == 0).mean()), 0.25, atol=0.05)
    assert np.array_equal(np.asarray(mod.apply({}, x, deterministic=True)), np.asarray(x))
    t = np.asarray(keep_mask(jax.random.key(2), 0.25, (64, 64), impl="threefry"))
    assert np.array_equal(t, np.asarray(jax.random.bernoulli(jax.random.key(2), 0.75, (64, 64))))
    with pytest.raises(ValueError, match="not one of"):
        keep_mask(jax.random.key(0), 0.1, (2,), impl="philox")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        keep_mask(jax.random.key(0), 1.0, (2,))
