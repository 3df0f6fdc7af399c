"""The CPU attention kernel's ring-attention block forms (cpu_attention_block, cpu_block_grads)
and its document masks (cpu_attention(segment_ids=...)) against XLA references: the ring's
own block kernel (jmegatron.parallel.context_parallel) without segments, small explicit-mask
references here with them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jmegatron.kernels import cpu
from jmegatron.kernels.cpu.ops import cpu_attention, cpu_attention_block, cpu_block_grads
from jmegatron.kernels.xla.dropout import keep_mask
from jmegatron.kernels.xla.attention import attention_block, block_grads as _block_grads
from jmegatron.parallel.context_parallel import load_balance_index, merge_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def ids(rows):
    """int32 [b, n] from a list of per-batch-row sequences."""
    return jnp.asarray(np.stack([np.asarray(r) for r in rows]), jnp.int32)


def assert_close(got, want, rtol=1e-5):
    """float32 agreement to rtol, with an absolute floor at rtol x the largest reference value
    (gradients sum many terms of both signs); -inf entries must match exactly."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert np.all(np.isfinite(got[finite]))
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=rtol * max(1.0, np.abs(want[finite]).max()))


# --- the no-segment forms against context_parallel's XLA block kernel -------------------------

def _load_balanced(s, cp):
    """[cp, 2c] position ids of each rank's slots in Megatron's load-balanced split."""
    return load_balance_index(s, cp).reshape(cp, -1)


LB = _load_balanced(256, 2)  # rank 0: positions 0..63 and 192..255; rank 1: 64..191

BLOCK_CASES = {
    # name: (q [b, sq, nq, d], k/v [b, sk, nkv, d], q_positions, k_positions)
    "no_mask_gqa_sq_ne_sk": ((2, 100, 4, 16), (2, 70, 2, 16), None, None),
    "causal_offset_sees_all": ((1, 64, 2, 16), (1, 64, 2, 16), [np.arange(64, 128)], [np.arange(64)]),
    "causal_offset_diagonal": ((2, 130, 4, 8), (2, 130, 1, 8), [np.arange(64, 194)] * 2, [np.arange(64, 194)] * 2),
    "causal_sees_nothing_for_some_rows": ((2, 128, 2, 16), (2, 64, 2, 16), [np.arange(128), np.arange(128)[::-1]],
                                          [np.arange(32, 96), np.arange(32, 96)]),
    "load_balanced_local_block": ((1, 128, 4, 16), (1, 128, 2, 16), [LB[0]], [LB[0]]),
    "load_balanced_rank0_vs_rank1": ((1, 128, 2, 16), (1, 128, 2, 16), [LB[0]], [LB[1]]),
    "load_balanced_rank1_vs_rank0": ((1, 128, 2, 16), (1, 128, 2, 16), [LB[1]], [LB[0]]),
    "ring_earlier_2c_by_c": ((1, 128, 4, 16), (1, 64, 2, 16), [LB[1]], [LB[0][:64]]),
    "ring_later_c_by_2c": ((1, 64, 4, 16), (1, 128, 2, 16), [LB[0][64:]], [LB[1]]),
    "shuffled_positions": ((2, 90, 2, 8), (2, 77, 2, 8), [np.random.default_rng(1).permutation(90)] * 2,
                           [np.random.default_rng(2).permutation(77), np.random.default_rng(3).permutation(77)]),
}


def _block_inputs(case):
    qs, ks, qp, kp = BLOCK_CASES[case]
    q, k, v = rand(*qs), rand(*ks, seed=1), rand(*ks, seed=2)
    pos = () if qp is None else (ids(qp), ids(kp))
    return q, k, v, pos


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_block_forward_and_grads_match_context_parallel(case):
    q, k, v, pos = _block_inputs(case)
    want_out, want_lse = jax.jit(attention_block)(q, k, v, *pos)
    out, lse = jax.jit(cpu_attention_block)(q, k, v, *pos)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and out.dtype == lse.dtype == jnp.float32
    assert_close(out, want_out)
    assert_close(lse, want_lse)
    if pos and "nothing" in case:
        assert np.isneginf(np.asarray(lse)).any() and not np.isneginf(np.asarray(lse)).all()
        np.testing.assert_array_equal(np.asarray(out)[np.isneginf(np.asarray(lse))], 0.0)
    # The block as the only block: the final lse is its own (rows seeing nothing: -inf).
    dout = rand(*q.shape, seed=3)
    delta = jnp.sum(dout * want_out, -1)
    got = jax.jit(cpu_block_grads)(q, k, v, dout, want_lse, delta, *pos)
    for g, w in zip(got, jax.jit(_block_grads)(q, k, v, dout, want_lse, delta, *pos)):
        assert_close(g, w)


def test_block_grads_with_the_final_lse_of_two_blocks_sum_to_the_whole():
    """A ring step's view: the final lse merges two key blocks (a load-balanced rank's local
    block and the next rank's), each block's grads use it, and dq summed over the blocks
    equals the gradient of the attention over both blocks together (jax.grad)."""
    q, k0, v0 = rand(1, 128, 4, 16), rand(1, 128, 2, 16, seed=1), rand(1, 128, 2, 16, seed=2)
    k1, v1 = rand(1, 128, 2, 16, seed=3), rand(1, 128, 2, 16, seed=4)
    qp, kp0, kp1 = ids([LB[1]]), ids([LB[1]]), ids([LB[0]])
    o0, l0 = cpu_attention_block(q, k0, v0, qp, kp0)
    o1, l1 = cpu_attention_block(q, k1, v1, qp, kp1)
    out, lse = merge_blocks(o0, l0, o1, l1)
    dout = rand(*q.shape, seed=5)
    delta = jnp.sum(dout * out, -1)
    g0 = cpu_block_grads(q, k0, v0, dout, lse, delta, qp, kp0)
    g1 = cpu_block_grads(q, k1, v1, dout, lse, delta, qp, kp1)

    def whole(q, k0, v0, k1, v1):
        o, _ = attention_block(q, jnp.concatenate([k0, k1], 1), jnp.concatenate([v0, v1], 1),
                               qp, jnp.concatenate([kp0, kp1], 1))
        return jnp.sum(o * dout)

    want = jax.jit(jax.grad(whole, argnums=(0, 1, 2, 3, 4)))(q, k0, v0, k1, v1)
    assert_close(g0[0] + g1[0], want[0])
    for got, w in zip((g0[1], g0[2], g1[1], g1[2]), want[1:]):
        assert_close(got, w)


# --- segment (document) masks against an explicit-mask reference -----------------------------

@jax.jit
def masked_block(q, k, v, visible):
    """Reference block attention with an explicit bool visible [b, sq, sk]: (out, lse) as
    attention_block (out 0 and lse -inf for a row that sees nothing)."""
    b, sq, nq, d = q.shape
    nkv = k.shape[2]
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, sq, nkv, nq // nkv, d), k) / jnp.sqrt(jnp.float32(d))
    vis = visible[:, None, None]
    peak = jnp.max(jnp.where(vis, scores, -jnp.inf), -1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    p = jnp.where(vis, jnp.exp(scores - peak), 0.0)
    total = jnp.sum(p, -1, keepdims=True)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p / jnp.where(total > 0, total, 1.0), v).reshape(b, sq, nq, d)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + peak, -jnp.inf)[..., 0]
    return out, jnp.moveaxis(lse, 3, 1).reshape(b, sq, nq)


@jax.jit
def masked_block_grads(q, k, v, dout, lse, delta, visible):
    """Reference block backward (FlashAttention Alg. 4's formulas) with an explicit mask."""
    b, sq, nq, d = q.shape
    nkv = k.shape[2]
    qg, dg = q.reshape(b, sq, nkv, nq // nkv, d), dout.reshape(b, sq, nkv, nq // nkv, d)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    heads = lambda x: jnp.moveaxis(x.reshape(b, sq, nkv, nq // nkv), 1, 3)[..., None]  # noqa: E731
    keep = visible[:, None, None] & heads(jnp.isfinite(lse))
    p = jnp.where(keep, jnp.exp(jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale - heads(jnp.where(
        jnp.isfinite(lse), lse, 0.0))), 0.0)
    ds = p * (jnp.einsum("bqhgd,bkhd->bhgqk", dg, v) - heads(delta)) * scale
    return (jnp.einsum("bhgqk,bkhd->bqhgd", ds, k).reshape(q.shape), jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg),
            jnp.einsum("bhgqk,bqhgd->bkhd", p, dg))


def _documents(positions, bounds):
    """Segment id of each position: the index of the document [bounds[i], bounds[i + 1]) holding it."""
    return np.searchsorted(np.asarray(bounds), np.asarray(positions), side="right") - 1


DOCS = [0, 37, 90, 100, 200, 256]  # five packed documents over positions 0..255
SEGMENT_CASES = {
    # name: (q shape, k shape, q_positions, k_positions, q_segments, k_segments); None: that mask off
    "segments_only_gqa_sq_ne_sk": ((2, 100, 4, 16), (2, 70, 2, 16), None, None,
                                   [np.arange(100) // 30, np.arange(100) // 7],
                                   [np.arange(70) // 30, np.arange(70) // 5]),
    "segments_causal_local_block": ((1, 128, 4, 16), (1, 128, 2, 16), [LB[0]], [LB[0]],
                                    [_documents(LB[0], DOCS)], [_documents(LB[0], DOCS)]),
    "segments_causal_earlier_block": ((1, 128, 2, 16), (1, 64, 2, 16), [LB[1]], [LB[0][:64]],
                                      [_documents(LB[1], DOCS)], [_documents(LB[0][:64], DOCS)]),
    "segments_causal_later_block": ((2, 64, 2, 8), (2, 128, 1, 8), [LB[0][64:]] * 2, [LB[1]] * 2,
                                    [_documents(LB[0][64:], DOCS), _documents(LB[0][64:], [0, 128, 256])],
                                    [_documents(LB[1], DOCS), _documents(LB[1], [0, 128, 256])]),
    "segments_unsorted_some_rows_see_nothing": ((1, 80, 2, 8), (1, 66, 2, 8), None, None,
                                                [np.random.default_rng(4).integers(0, 6, 80)],
                                                [np.random.default_rng(5).integers(0, 4, 66)]),
}


@pytest.mark.parametrize("case", sorted(SEGMENT_CASES))
def test_block_with_segments_matches_explicit_mask(case):
    qs, ks, qp, kp, qseg, kseg = SEGMENT_CASES[case]
    q, k, v = rand(*qs), rand(*ks, seed=1), rand(*ks, seed=2)
    qseg, kseg = ids(qseg), ids(kseg)
    visible = qseg[:, :, None] == kseg[:, None, :]
    if qp is not None:
        qp, kp = ids(qp), ids(kp)
        visible = visible & (qp[:, :, None] >= kp[:, None, :])
    want_out, want_lse = masked_block(q, k, v, visible)
    out, lse = jax.jit(cpu_attention_block)(q, k, v, qp, kp, qseg, kseg)
    assert_close(out, want_out)
    assert_close(lse, want_lse)
    if "nothing" in case:
        assert np.isneginf(np.asarray(lse)).any()
    dout = rand(*q.shape, seed=3)
    delta = jnp.sum(dout * want_out, -1)
    got = jax.jit(cpu_block_grads)(q, k, v, dout, want_lse, delta, qp, kp, qseg, kseg)
    for g, w in zip(got, masked_block_grads(q, k, v, dout, want_lse, delta, visible)):
        assert_close(g, w)


def test_explicit_mask_reference_grads_are_autodiffs():
    """The reference backward's formulas equal jax.grad of the reference forward when the
    block is the whole attention (rows that see nothing included)."""
    q, k, v = rand(1, 40, 2, 8), rand(1, 30, 1, 8, seed=1), rand(1, 30, 1, 8, seed=2)
    visible = np.random.default_rng(6).random((1, 40, 30)) < 0.2
    visible[:, ::7] = False  # rows that see nothing
    visible = jnp.asarray(visible)
    dout = rand(*q.shape, seed=3)
    out, lse = masked_block(q, k, v, visible)
    want = jax.grad(lambda q, k, v: jnp.sum(masked_block(q, k, v, visible)[0] * dout), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(masked_block_grads(q, k, v, dout, lse, jnp.sum(dout * out, -1), visible), want):
        assert_close(g, w)


def test_block_kernels_inside_shard_map():
    """Inside shard_map over a context axis (the ring's setting), each rank's blocks carry
    the operands' varying axes and equal the reference."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    q, k, v = rand(2, 256, 2, 8), rand(2, 256, 2, 8, seed=1), rand(2, 256, 2, 8, seed=2)
    pos = ids([load_balance_index(256, 2)] * 2)
    seg = ids([_documents(load_balance_index(256, 2), DOCS)] * 2)
    dout = rand(2, 256, 2, 8, seed=3)
    spec = P(None, "context")

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec,) * 4)
    def local(q, k, v, pos, seg, dout):
        out, lse = cpu_attention_block(q, k, v, pos, pos, seg, seg)
        dq, _, _ = cpu_block_grads(q, k, v, dout, lse, jnp.sum(dout * out, -1), pos, pos, seg, seg)
        return out, lse, dq, jax.lax.axis_index("context") + jnp.zeros(pos.shape, jnp.int32)

    out, lse, dq, _ = jax.jit(local)(q, k, v, pos, seg, dout)
    for r in range(2):
        sl = slice(128 * r, 128 * (r + 1))
        visible = (seg[:, sl, None] == seg[:, None, sl]) & (pos[:, sl, None] >= pos[:, None, sl])
        o, l = masked_block(q[:, sl], k[:, sl], v[:, sl], visible)
        assert_close(out[:, sl], o)
        assert_close(lse[:, sl], l)
        d = masked_block_grads(q[:, sl], k[:, sl], v[:, sl], dout[:, sl], l, jnp.sum(dout[:, sl] * o, -1), visible)
        assert_close(dq[:, sl], d[0])


# --- document masking in the whole-sequence kernel ---------------------------------------------

@functools.partial(jax.jit, static_argnames="dropout_rate")
def document_attention(q, k, v, segment_ids, dropout_rate=0.0, dropout_rng=None, sample_offset=0):
    """XLA reference: causal and same-document softmax attention with the hash dropout, the
    formula of jmegatron.models.attention.xla_attention with Megatron's block-diagonal mask."""
    b, s, nq, d = q.shape
    nkv = k.shape[2]
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, s, nkv, nq // nkv, d), k) * (1.0 / jnp.sqrt(jnp.float32(d)))
    same_document = segment_ids[:, :, None] == segment_ids[:, None, :]
    visible = jnp.tril(jnp.ones((s, s), jnp.bool_)) & same_document[:, None, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, jnp.finfo(jnp.float32).min), axis=-1)
    if dropout_rate > 0.0:
        keep = keep_mask(dropout_rng, dropout_rate, probs.shape, "hash", sample_offset)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, s, nq, d)


@pytest.mark.parametrize("b,s,nq,nkv,d,rate,bounds", [
    (2, 150, 4, 2, 16, 0.0, [[0, 40, 41, 150], [0, 64, 128, 150]]),    # GQA; one-token, tile-aligned documents
    (2, 260, 6, 2, 16, 0.3, [[0, 77, 99, 230, 260], [0, 10, 250, 260]]),  # GQA with dropout over five tiles
])
def test_cpu_attention_with_segment_ids_matches_xla(b, s, nq, nkv, d, rate, bounds):
    q, k, v = rand(b, s, nq, d), rand(b, s, nkv, d, seed=1), rand(b, s, nkv, d, seed=2)
    seg = ids([_documents(np.arange(s), bs) for bs in bounds])
    kw = dict(dropout_rate=rate, dropout_rng=jax.random.key(11), sample_offset=3)
    want = document_attention(q, k, v, seg, **kw)
    attn = lambda q, k, v: cpu_attention(q, k, v, segment_ids=seg, deterministic=False, **kw)  # noqa: E731
    assert_close(jax.jit(attn)(q, k, v), want)
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    want_g = jax.jit(jax.grad(loss(lambda q, k, v: document_attention(q, k, v, seg, **kw)), argnums=(0, 1, 2)))(q, k, v)
    got_g = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got_g, want_g):
        assert_close(g, w, rtol=2e-5)


def test_packed_documents_equal_each_document_alone():
    """Megatron's reset_attention_mask: a packed row equals attending each document separately."""
    lengths = [50, 1, 77, 64]
    q, k, v = rand(1, 192, 4, 16), rand(1, 192, 2, 16, seed=1), rand(1, 192, 2, 16, seed=2)
    seg = ids([np.repeat(np.arange(len(lengths)), lengths)])
    packed = np.asarray(jax.jit(lambda q, k, v: cpu_attention(q, k, v, segment_ids=seg))(q, k, v))
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = np.asarray(cpu_attention(q[:, sl], k[:, sl], v[:, sl]))
        np.testing.assert_allclose(packed[:, sl], alone, rtol=1e-5, atol=1e-6)
        start += n
    # one document over the whole row is plain causal attention, bit for bit
    one = cpu_attention(q, k, v, segment_ids=jnp.zeros((1, 192), jnp.int32))
    np.testing.assert_array_equal(np.asarray(one), np.asarray(cpu_attention(q, k, v)))


# --- bad input ---------------------------------------------------------------------------------

def test_python_wrappers_name_the_bad_argument():
    q, k, v = rand(2, 64, 4, 8), rand(2, 32, 2, 8, seed=1), rand(2, 32, 2, 8, seed=2)
    qp, kp = ids([np.arange(64)] * 2), ids([np.arange(32)] * 2)
    with pytest.raises(ValueError, match="nkv dividing q's 4 heads"):
        cpu_attention_block(q, rand(2, 32, 3, 8), rand(2, 32, 3, 8))
    with pytest.raises(ValueError, match="q must be float32"):
        cpu_attention_block(q.astype(jnp.bfloat16), k, v)
    with pytest.raises(ValueError, match="k_positions"):
        cpu_attention_block(q, k, v, qp, None)
    with pytest.raises(ValueError, match=r"k_positions must be integer \[b, sk\] = \[2, 32\]"):
        cpu_attention_block(q, k, v, qp, qp)
    with pytest.raises(ValueError, match="q_segments must be integer"):
        cpu_attention_block(q, k, v, q_segments=qp.astype(jnp.float32), k_segments=kp)
    with pytest.raises(ValueError, match=r"delta must be float32 \[2, 64, 4\]"):
        cpu_block_grads(q, k, v, q, jnp.zeros((2, 64, 4)), jnp.zeros((2, 64, 1)))
    with pytest.raises(ValueError, match=r"cpu_attention: segment_ids must be integer \[b, s\] = \[2, 64\], "
                                         r"got int32\[2, 63\]"):
        cpu_attention(q, q, q, segment_ids=jnp.zeros((2, 63), jnp.int32))
    with pytest.raises(ValueError, match="q's sequence length 64"):
        cpu_attention(q, k, v)


def _raw_block_fwd(q, k, v, *id_ops, out_shape=None, lse_shape=None, causal=True, segments=False):
    cpu.load()
    b, sq, nq, d = q.shape
    shapes = (jax.ShapeDtypeStruct(out_shape or q.shape, jnp.float32),
              jax.ShapeDtypeStruct(lse_shape or (b, sq, nq), jnp.float32))
    return jax.ffi.ffi_call("jmegatron_attention_block_fwd", shapes)(
        q, k, v, *id_ops, scale=np.float32(1.0), causal=causal, segments=segments, block=np.int64(64))


@pytest.mark.parametrize("bad,message", [
    ("k_positions", r"k_positions must be int32\[2, 32\], got int32\[2, 31\]"),
    ("k_positions_dtype", r"k_positions must be int32\[2, 32\], got uint32\[2, 32\]"),
    ("segments_placeholder", r"q_segments must be the empty int32\[0\] placeholder"),
    ("v", r"v must be float32\[2, 32, 2, 8\], got float32\[2, 33, 2, 8\]"),
    ("lse", r"lse must be float32\[2, 64, 4\], got float32\[2, 4, 64\]"),
])
def test_the_kernel_checks_every_buffer_by_name(bad, message):
    """The C++ handler's own checks (the wrappers' are bypassed): an error naming the buffer."""
    q, k, v = rand(2, 64, 4, 8), rand(2, 32, 2, 8, seed=1), rand(2, 32, 2, 8, seed=2)
    qp, kp, none = ids([np.arange(64)] * 2), ids([np.arange(32)] * 2), jnp.zeros((0,), jnp.int32)
    kw = {}
    if bad == "k_positions":
        kp = kp[:, :31]
    elif bad == "k_positions_dtype":
        kp = kp.astype(jnp.uint32)
    elif bad == "v":
        v = rand(2, 33, 2, 8)
    elif bad == "lse":
        kw["lse_shape"] = (2, 4, 64)
    segs = (qp, kp) if bad == "segments_placeholder" else (none, none)
    with pytest.raises(Exception, match="jmegatron_attention_block_fwd: " + message):
        jax.block_until_ready(_raw_block_fwd(q, k, v, qp, kp, *segs, **kw))


def test_the_whole_sequence_and_backward_kernels_check_their_new_buffers_by_name():
    cpu.load()
    q = rand(2, 64, 4, 8)
    attrs = dict(scale=np.float32(1.0), dropout_rate=np.float32(0.0), keep_scale=np.float32(1.0),
                 threshold=np.int64(0), block=np.int64(64), segments=True)
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((2, 4, 64), jnp.float32))
    bad_segments = jnp.zeros((2, 65), jnp.int32)
    with pytest.raises(Exception, match=r"jmegatron_attention_fwd: segment_ids must be int32\[2, 64\], "
                                        r"got int32\[2, 65\]"):
        jax.block_until_ready(jax.ffi.ffi_call("jmegatron_attention_fwd", shapes)(
            q, q, q, bad_segments, jnp.zeros((3,), jnp.uint32), **attrs))
    k = rand(2, 32, 2, 8)
    none = jnp.zeros((0,), jnp.int32)
    grads = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, jnp.float32),
             jax.ShapeDtypeStruct((2, 32, 2, 9), jnp.float32))
    with pytest.raises(Exception, match=r"jmegatron_attention_block_bwd: dv must be float32\[2, 32, 2, 8\]"):
        jax.block_until_ready(jax.ffi.ffi_call("jmegatron_attention_block_bwd", grads)(
            q, k, k, q, jnp.zeros((2, 64, 4)), jnp.zeros((2, 64, 4)), none, none, none, none,
            scale=np.float32(1.0), causal=False, segments=False, block=np.int64(64)))
