"""Hash-based dropout masks (jmegatron.models.dropout): the right keep rate, independent
across keys and positions, the same under any sharding of the tensor and for any split of
the batch (sample_offset), and the threefry option still available."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.kernels.xla.dropout import dropout, hash_bits, keep_mask
from jmegatron.models.dropout import Dropout


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


@pytest.mark.parametrize("impl", ["hash", "threefry"])
def test_same_mask_under_any_sharding(impl):
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    key = jax.random.key(7)
    shape = (8, 4, 64, 64)
    ref = np.asarray(jax.jit(lambda k: keep_mask(k, 0.1, shape, impl, sample_offset=3))(key))
    for spec in (P("a", "b"), P(None, "b", "a"), P(("a", "b"))):
        got = jax.jit(lambda k: keep_mask(k, 0.1, shape, impl, sample_offset=3),
                      out_shardings=NamedSharding(mesh, spec))(key)
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
    # threefry: one bernoulli draw per global sample, under fold_in(key, sample)
    t = np.asarray(keep_mask(jax.random.key(2), 0.25, (4, 64), impl="threefry", sample_offset=3))
    for i in range(4):
        want = jax.random.bernoulli(jax.random.fold_in(jax.random.key(2), 3 + i), 0.75, (64,))
        assert np.array_equal(t[i], np.asarray(want))
    assert 0.2 < 1 - t.mean() < 0.3
    with pytest.raises(ValueError, match="not one of"):
        keep_mask(jax.random.key(0), 0.1, (2,), impl="philox")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        keep_mask(jax.random.key(0), 1.0, (2,))


@pytest.mark.parametrize("impl", ["hash", "threefry"])
def test_rows_of_a_split_batch_draw_the_global_batch_masks(impl):
    """A slice of the batch given its sample_offset draws exactly the rows of the whole
    batch's mask; another offset draws other masks."""
    key, shape = jax.random.key(5), (8, 3, 16, 16)
    whole = np.asarray(keep_mask(key, 0.3, shape, impl))
    for start, n in ((0, 8), (2, 3), (7, 1)):
        part = np.asarray(keep_mask(key, 0.3, (n,) + shape[1:], impl, sample_offset=start))
        assert np.array_equal(part, whole[start:start + n]), (start, n)
    shifted = np.asarray(keep_mask(key, 0.3, shape, impl, sample_offset=1))
    assert np.array_equal(shifted[:-1], whole[1:]) and not np.array_equal(shifted, whole)


def test_data_parallel_shards_with_offsets_draw_the_one_device_masks():
    """Inside a data-parallel shard_map each rank's rows, offset by rank * local rows, drop
    the same elements as one device holding the whole batch (the train step's rule); a key
    folded with the rank (the old rule) does not."""
    mesh = jax.make_mesh((8,), ("data",))
    key, x = jax.random.key(11), jnp.ones((16, 32, 24))

    def drop(x, rng, offset):
        return Dropout(0.1).apply({}, x, deterministic=False, rngs={"dropout": rng}, sample_offset=offset)

    want = np.asarray(drop(x, key, 0))
    assert 0.05 < (want == 0).mean() < 0.15

    def local(x, fold_rank):
        rank = jax.lax.axis_index("data")
        if fold_rank:
            return drop(x, jax.random.fold_in(key, rank), 0)
        return drop(x, key, rank * x.shape[0])

    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    for fold_rank in (False, True):
        got = jax.jit(jax.shard_map(lambda x: local(x, fold_rank), mesh=mesh, in_specs=P("data"),
                                    out_specs=P("data")))(xs)
        assert np.array_equal(np.asarray(got), want) != fold_rank, fold_rank


def test_attention_keep_mask_is_the_whole_sequence_mask_at_block_positions():
    """A context-parallel block's attention-dropout mask (rows and columns at global sequence
    positions) is the one-device mask of the whole ``[b, nkv, g, s, s]`` probabilities."""
    from jmegatron.kernels.xla.dropout import attention_keep_mask

    key = jax.random.PRNGKey(3)
    b, h, g, s = 2, 2, 3, 16
    full = keep_mask(key, 0.3, (b, h, g, s, s), "hash", 5)
    rows, cols = np.array([[3, 9, 12], [0, 15, 8]]), np.array([[0, 4, 15, 7], [2, 2, 3, 11]])
    part = attention_keep_mask(key, 0.3, (b, h, g, 3, 4), jnp.asarray(rows), jnp.asarray(cols), s, 5)
    want = np.stack([np.asarray(full)[i][:, :, rows[i]][:, :, :, cols[i]] for i in range(b)])
    np.testing.assert_array_equal(part, want)
    with pytest.raises(ValueError, match="dropout rate 1.0"):
        attention_keep_mask(key, 1.0, (b, h, g, 3, 4), jnp.asarray(rows), jnp.asarray(cols), s)
