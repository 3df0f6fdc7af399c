"""The Pallas FlashAttention-2 kernels (jmegatron.kernels.pallas.flash_attention) in Pallas
interpret mode on the CPU -- the kernel code a GPU compiles -- against the XLA reference paths:
the core (xla_attention: causal, GQA, document masks, the hash attention dropout, bf16), the
block forms context parallelism uses (context_parallel.attention_block / _block_grads:
positions, segments, log-sum-exp, BlockDropout), the context-parallel attentions with
block="pallas", and gpt_tiny steps with attention_impl="pallas"."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.kernels.pallas import flash_attention as fa
from jmegatron.kernels.xla import attention as xla_blocks
from jmegatron.kernels.xla.attention import xla_attention
from jmegatron.models.core_attention import CORE_ATTENTIONS

from test_context_parallel import _ring, grads_of
from test_cpu_attention_block import assert_close
from test_expert_parallel import assert_close as assert_tree_close
from test_train_step import tiny_cfg

B, S, D = 2, 32, 16


def _qkv(nq, nkv, s=S, sk=None, dtype=jnp.float32, seed=0):
    rs = np.random.RandomState(seed)
    sk = s if sk is None else sk
    q = rs.randn(B, s, nq, D).astype(np.float32)
    k, v = (rs.randn(B, sk, nkv, D).astype(np.float32) for _ in range(2))
    w = rs.randn(B, s, nq, D).astype(np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + (jnp.asarray(w),)


SEGMENTS = jnp.asarray(np.array([[0] * 5 + [1] * 19 + [2] * 8, [0] * 32]), jnp.int32)
DROPOUT = dict(dropout_rate=0.2, deterministic=False, dropout_rng=jax.random.key(7), sample_offset=5)


@pytest.mark.parametrize("nq,nkv,extra", [
    (4, 2, {}),  # GQA
    (4, 1, {"segment_ids": SEGMENTS}),  # MQA + document masks
    (4, 2, dict(DROPOUT, segment_ids=SEGMENTS)),  # the hash dropout drawn in the kernel
], ids=["gqa", "mqa-segments", "gqa-segments-dropout"])
def test_core_equals_xla_attention(nq, nkv, extra):
    """Values and q/k/v gradients equal xla_attention's (float32, rel ~1e-5), with several
    query and key blocks (8 x 16 tiles over 32 tokens) so the causal loop bounds matter."""
    q, k, v, w = _qkv(nq, nkv)
    kernel = functools.partial(fa.pallas_attention, block_q=8, block_k=16, **extra)
    out, vjp = jax.vjp(kernel, q, k, v)
    want, want_vjp = jax.vjp(functools.partial(xla_attention, **extra), q, k, v)
    assert out.shape == want.shape and out.dtype == jnp.float32
    assert_close(out, want)
    for a, e in zip(vjp(w), want_vjp(w)):
        assert_close(a, e)


def test_dropout_really_drops_and_follows_the_key():
    """The kernel's dropout is not a no-op: another key or sample offset changes the output;
    rate 0 equals no dropout."""
    q, k, v, _ = _qkv(4, 2)
    kernel = functools.partial(fa.pallas_attention, block_q=16, block_k=16)
    base = kernel(q, k, v, **DROPOUT)
    assert not np.allclose(base, kernel(q, k, v))
    assert not np.allclose(base, kernel(q, k, v, **dict(DROPOUT, sample_offset=6)))
    assert not np.allclose(base, kernel(q, k, v, **dict(DROPOUT, dropout_rng=jax.random.key(8))))
    np.testing.assert_array_equal(kernel(q, k, v, **dict(DROPOUT, dropout_rate=0.0)), kernel(q, k, v))


def test_bf16_close_to_xla():
    q, k, v, w = _qkv(4, 2, dtype=jnp.bfloat16)
    got = fa.pallas_attention(q, k, v, block_q=16, block_k=16)
    assert got.dtype == jnp.bfloat16
    want = xla_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    g = jax.grad(lambda q: jnp.sum(fa.pallas_attention(q, k, v, block_q=16, block_k=16).astype(jnp.float32) * w))(q)
    r = jax.grad(lambda q: jnp.sum(xla_attention(q, k, v).astype(jnp.float32) * w))(q)
    scale = float(jnp.max(jnp.abs(r.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=3e-2 * scale)


Q_POS = jnp.broadcast_to(jnp.arange(8, 24, dtype=jnp.int32), (B, 16))  # a query block at an offset
K_POS = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (B, 32))
Q_SEG = jnp.asarray([[0] * 4 + [1] * 12, [2] * 16], jnp.int32)  # row 1's queries see no key: lse -inf
K_SEG = jnp.asarray([[0] * 10 + [1] * 22, [1] * 32], jnp.int32)
BLOCK_CASES = {
    "whole": (),
    "causal-by-position": (Q_POS, K_POS),
    "positions-segments": (Q_POS, K_POS, Q_SEG, K_SEG),
    "segments-only": (None, None, Q_SEG, K_SEG),
}


@pytest.mark.parametrize("case,dropout", [("whole", True), ("causal-by-position", False),
                                          ("positions-segments", True), ("segments-only", False)])
def test_block_forms_equal_xla_blocks(case, dropout):
    """pallas_attention_block / pallas_block_grads (sq=16 queries against sk=32 keys, GQA)
    equal the XLA block kernel: output, log-sum-exp (-inf where a query sees no key), and the
    block's dq/dk/dv given a final lse and delta; with BlockDropout the one-device masks."""
    q, k, v, _ = _qkv(4, 2, s=16, sk=32, seed=1)
    ids = BLOCK_CASES[case]
    extra = {"dropout": xla_blocks.BlockDropout(jax.random.key(3), 0.2, 5, 64, Q_POS, K_POS)} if dropout else {}
    out, lse = fa.pallas_attention_block(q, k, v, *ids, block_q=8, block_k=8, **extra)
    want_out, want_lse = xla_blocks.attention_block(q, k, v, *ids, **extra)
    assert out.dtype == lse.dtype == jnp.float32 and lse.shape == (B, 16, 4)
    assert_close(out, want_out)
    assert_close(lse, want_lse)
    if case == "positions-segments":
        assert np.isneginf(np.asarray(lse)).any()
    rs = np.random.RandomState(2)
    dout = jnp.asarray(rs.randn(*q.shape).astype(np.float32))
    delta = jnp.asarray(rs.randn(*want_lse.shape).astype(np.float32))
    final_lse = want_lse + 0.25  # the final lse of a query over all blocks exceeds the block's
    got = fa.pallas_block_grads(q, k, v, dout, final_lse, delta, *ids, block_q=8, block_k=16, **extra)
    want = xla_blocks.block_grads(q, k, v, dout, final_lse, delta, *ids, **extra)
    for a, e in zip(got, want):
        assert_close(a, e)


def test_heads_split_over_an_automatic_tensor_axis():
    """Under a GSPMD tensor axis the kernels run per rank on its heads (no all-gather of
    q/k/v in the compiled step) and the dropout masks are the one-device ones."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    q, k, v, w = _qkv(4, 2)
    extra = dict(DROPOUT, segment_ids=SEGMENTS)
    loss = lambda f, q, k, v: jnp.sum(f(q, k, v, **extra) * w)  # noqa: E731
    want, want_g = jax.value_and_grad(functools.partial(loss, xla_attention), argnums=(0, 1, 2))(q, k, v)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    kernel = functools.partial(fa.pallas_attention, block_q=8, block_k=16)
    with jax.set_mesh(mesh):
        split = NamedSharding(mesh, P("data", None, "tensor"))
        fn = jax.jit(jax.value_and_grad(functools.partial(loss, kernel), argnums=(0, 1, 2)))
        got, got_g = fn(*(jax.device_put(x, split) for x in (q, k, v)))
        assert "all-gather" not in fn.lower(q, k, v).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, e in zip(got_g, want_g):
        assert_close(a, e)


def test_refusals_name_the_argument():
    q, k, v, _ = _qkv(4, 2)
    with pytest.raises(ValueError, match="multiple of block_q=12"):
        fa.pallas_attention(q, k, v, block_q=12)
    with pytest.raises(ValueError, match="dropout_impl='threefry'.*dropout_impl='hash'"):
        fa.pallas_attention(q, k, v, **dict(DROPOUT, dropout_impl="threefry"))
    with pytest.raises(ValueError, match="segment_ids must be integer"):
        fa.pallas_attention(q, k, v, segment_ids=SEGMENTS[:, :16])
    with pytest.raises(ValueError, match="give both q_positions and k_positions"):
        fa.pallas_attention_block(q, k, v, Q_POS)
    with pytest.raises(ValueError, match="nkv dividing"):
        fa.pallas_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))


def test_default_tiles_per_dtype():
    # 16-bit inputs: 128 x 128 tiles; float32: 64 x 64 (128 x 128 float32 tiles exceed an H200's
    # shared memory at head_dim 64); an explicit block is kept; every tile is cut to the sequence
    assert fa._block_size("block_q", None, fa.BLOCK_Q, 1024, jnp.bfloat16) == 128
    assert fa._block_size("block_q", None, fa.BLOCK_Q, 1024, jnp.float32) == fa.BLOCK_F32 == 64
    assert fa._block_size("block_q", 128, fa.BLOCK_Q, 1024, jnp.float32) == 128
    assert fa._block_size("block_k", None, fa.BLOCK_K, 32, jnp.float32) == 32


@pytest.mark.parametrize("cp,kind", [(2, "all_gather")])
def test_context_parallel_with_pallas_blocks_equals_one_device(cp, kind):
    """The cp attentions with block="pallas" (all_gather: the whole-block kernel under
    _kernel_attention's VJP; the ring with attention dropout: the cp2 step below) equal
    xla_attention on the whole sequence."""
    q, k, v, w = _qkv(4, 2)
    loss = lambda f, q, k, v: jnp.sum(f(q, k, v) * w)  # noqa: E731
    ring = jax.jit(jax.value_and_grad(functools.partial(loss, functools.partial(_ring, cp, kind=kind, block="pallas")),
                                      argnums=(0, 1, 2)))
    (got, got_g), (want, want_g) = ring(q, k, v), jax.value_and_grad(
        functools.partial(loss, xla_attention), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, e in zip(got_g, want_g):
        assert_close(a, e)


@pytest.mark.slow  # a train step compiled twice (interpret-mode kernels inside)
def test_gpt_tiny_tp2_step_with_pallas_attention_equals_xla():
    """One gpt_tiny gradient computation (1 layer, GQA, dropout on, two micro-batches) at
    tensor parallelism 2 with attention_impl="pallas" (the kernels per rank on its heads,
    dropout hashing global head numbers) equals attention_impl="xla"."""
    assert "pallas" in CORE_ATTENTIONS
    kw = dict(micro_batch_size=2, global_batch_size=4, num_query_groups=2, attention_dropout=0.1,
              hidden_dropout=0.1, matmul_impl="xla", num_layers=1, tensor_model_parallel_size=2)
    g, report, tokens, run = grads_of(tiny_cfg(attention_impl="pallas", **kw), 2)
    assert run.model.cfg.attention_impl == "pallas" and dict(run.mesh.shape)["tensor"] == 2
    g1, report1, tokens1, _ = grads_of(tiny_cfg(attention_impl="xla", **kw), 2)
    np.testing.assert_allclose(report["lm_loss"], report1["lm_loss"], rtol=1e-5)
    assert_tree_close(g, g1)


@pytest.mark.slow  # a train step compiled twice (interpret-mode kernels inside)
def test_cp2_step_with_pallas_attention_equals_one_device():
    """gpt_tiny (1 layer) at context_parallel_size 2 with attention_impl="pallas" (the p2p ring's
    blocks are the Pallas kernels'; attention dropout on: each block draws XLA's one-device
    masks) equals one device with XLA's attention."""
    kw = dict(micro_batch_size=2, global_batch_size=2, attention_dropout=0.1, matmul_impl="xla", num_layers=1)
    g, report, _, run = grads_of(tiny_cfg(attention_impl="pallas", context_parallel_size=2, **kw), 2)
    assert dict(run.mesh.shape)["context"] == 2
    g1, report1, _, _ = grads_of(tiny_cfg(attention_impl="xla", **kw), 1)
    np.testing.assert_allclose(report["lm_loss"], report1["lm_loss"], rtol=1e-5)
    assert_tree_close(g, g1)


def test_sequences_that_are_not_a_power_of_two_are_padded():
    """With the default tiles, 100 tokens run as 128 (the float32 query tile is 64: two tiles;
    one 128-key tile): the sequence is zero-padded, the padded keys hidden by causality,
    document masks and dropout unchanged; values and gradients equal xla_attention's. 20
    tokens run as one 32-row tile (the same padding, one tile each way)."""
    s = 100
    rs = np.random.RandomState(5)
    q, k, v, w = (jnp.asarray(rs.randn(1, s, n, D).astype(np.float32)) for n in (4, 2, 2, 4))
    seg = jnp.asarray((np.arange(s) >= s // 3).astype(np.int32))[None]
    kw = dict(segment_ids=seg, **DROPOUT)
    out, vjp = jax.vjp(functools.partial(fa.pallas_attention, **kw), q, k, v)
    want, want_vjp = jax.vjp(functools.partial(xla_attention, **kw), q, k, v)
    assert out.shape == (1, s, 4, D)
    assert_close(out, want)
    for a, e in zip(vjp(w), want_vjp(w)):
        assert_close(a, e)
    assert fa._default_tiles(100, jnp.float32) == (64, 128) and fa._default_tiles(100, jnp.bfloat16) == (128, 128)
    assert fa._default_tiles(20, jnp.float32) == fa._default_tiles(20, jnp.bfloat16) == (32, 32)


def test_head_dims_that_are_not_powers_of_two_are_padded():
    """Triton's tiles are powers of two: a head dimension of 24 runs padded to 32 with zero
    columns (the scores' scale stays 1 / sqrt(24)); values and gradients equal xla_attention's,
    and so do the block forms'."""
    rs = np.random.RandomState(4)
    q, k, v, w = (jnp.asarray(rs.randn(B, S, n, 24).astype(np.float32)) for n in (4, 2, 2, 4))
    out, vjp = jax.vjp(functools.partial(fa.pallas_attention, block_q=8, block_k=16, **DROPOUT), q, k, v)
    want, want_vjp = jax.vjp(functools.partial(xla_attention, **DROPOUT), q, k, v)
    assert out.shape == (B, S, 4, 24)
    assert_close(out, want)
    for a, e in zip(vjp(w), want_vjp(w)):
        assert a.shape[-1] == 24
        assert_close(a, e)
    out, lse = fa.pallas_attention_block(q, k, v, block_q=8, block_k=8)
    want_out, want_lse = xla_blocks.attention_block(q, k, v)
    assert_close(out, want_out)
    assert_close(lse, want_lse)
    delta = jnp.sum(w * want_out, -1)
    for a, e in zip(fa.pallas_block_grads(q, k, v, w, want_lse, delta, block_q=8, block_k=8),
                    xla_blocks.block_grads(q, k, v, w, want_lse, delta)):
        assert_close(a, e)
