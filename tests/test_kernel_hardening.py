"""Kernel hardening (issue 16 item 6): the CPU FFI kernels check every buffer, report failed
allocations and oversized dimensions as errors instead of terminating, and the attention
dropout hash does not wrap at heads x seq^2 >= 2^32 (docs/RELIABILITY.md, "Kernel hardening")."""

import ctypes
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")

F32, I32, U32 = jnp.float32, jnp.int32, jnp.uint32


def _sds(shape, dtype=F32):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _attn_attrs(segments=True):
    return dict(scale=np.float32(0.5), dropout_rate=np.float32(0.0), keep_scale=np.float32(1.0),
                threshold=np.int64(0), block=np.int64(64), segments=segments)


def _block_attrs():
    return dict(scale=np.float32(0.5), causal=True, segments=True, block=np.int64(64))


# Every kernel with valid operands and results: (target, [(name, operand)], [(name, result)], attrs).
# b=2, s=16 (block: sq=16, sk=8), nq=4, nkv=2, d=8; GEMMs M=6, K=5, N=3, E=2 groups.
def _cases():
    r = np.random.default_rng(0)

    def f(*shape):
        return jnp.asarray(r.standard_normal(shape), F32)

    pos16, pos8 = jnp.tile(jnp.arange(16, dtype=I32), (2, 1)), jnp.tile(jnp.arange(8, dtype=I32), (2, 1))
    seg16, seg8 = jnp.zeros((2, 16), I32), jnp.zeros((2, 8), I32)
    key = jnp.asarray([1, 2, 0], U32)
    q, k = f(2, 16, 4, 8), f(2, 16, 2, 8)
    kb = f(2, 8, 2, 8)
    return {
        "jmegatron_sgemm": ([("a", f(6, 5)), ("b", f(5, 3))], [("c", _sds((6, 3)))],
                            dict(trans_a=False, trans_b=False)),
        "jmegatron_grouped_sgemm": ([("a", f(6, 5)), ("b", f(2, 5, 3)), ("group_sizes", jnp.asarray([2, 4], I32))],
                                    [("c", _sds((6, 3)))], dict(trans_b=False)),
        "jmegatron_grouped_sgemm_wgrad": ([("a", f(6, 5)), ("g", f(6, 3)), ("group_sizes", jnp.asarray([2, 4], I32))],
                                          [("c", _sds((2, 5, 3)))], {}),
        "jmegatron_attention_fwd": ([("q", q), ("k", k), ("v", f(2, 16, 2, 8)), ("segment_ids", seg16),
                                     ("key", key)],
                                    [("out", _sds(q.shape)), ("lse", _sds((2, 4, 16)))], _attn_attrs()),
        "jmegatron_attention_bwd": ([("q", q), ("k", k), ("v", f(2, 16, 2, 8)), ("out", f(*q.shape)),
                                     ("dout", f(*q.shape)), ("lse", f(2, 4, 16)), ("segment_ids", seg16),
                                     ("key", key)],
                                    [("dq", _sds(q.shape)), ("dk", _sds(k.shape)), ("dv", _sds(k.shape))],
                                    _attn_attrs()),
        "jmegatron_attention_block_fwd": ([("q", q), ("k", kb), ("v", f(2, 8, 2, 8)), ("q_positions", pos16),
                                           ("k_positions", pos8), ("q_segments", seg16), ("k_segments", seg8)],
                                          [("out", _sds(q.shape)), ("lse", _sds((2, 16, 4)))], _block_attrs()),
        "jmegatron_attention_block_bwd": ([("q", q), ("k", kb), ("v", f(2, 8, 2, 8)), ("dout", f(*q.shape)),
                                           ("lse", f(2, 16, 4)), ("delta", f(2, 16, 4)), ("q_positions", pos16),
                                           ("k_positions", pos8), ("q_segments", seg16), ("k_segments", seg8)],
                                          [("dq", _sds(q.shape)), ("dk", _sds(kb.shape)), ("dv", _sds(kb.shape))],
                                          _block_attrs()),
    }


def _call(target, operands, results, attrs):
    cpu.load()
    out = jax.ffi.ffi_call(target, tuple(r for _, r in results))(*(x for _, x in operands), **attrs)
    return jax.block_until_ready(out)


def _wrong_shape(shape):
    return tuple(shape[:-1]) + (shape[-1] + 1,) if shape else (2,)


def _wrong_dtype(dtype):
    return jnp.float16 if dtype != jnp.float16 else jnp.float32


# A wrong last dimension of one operand is reported on the buffer it disagrees with, whose
# expected shape the message gives from the first (b must be [K=6, N] (a's contracting size);
# c must be [6, 4] after b's N changed; k must be [b, sk, nkv, d=9] after q's d changed).
_BLAMED = {("jmegatron_sgemm", "a"): "b", ("jmegatron_sgemm", "b"): "c",
           ("jmegatron_grouped_sgemm", "a"): "b", ("jmegatron_grouped_sgemm", "b"): "c",
           ("jmegatron_grouped_sgemm_wgrad", "a"): "c", ("jmegatron_grouped_sgemm_wgrad", "g"): "c",
           **{(t, "q"): "k" for t in ("jmegatron_attention_fwd", "jmegatron_attention_bwd",
                                       "jmegatron_attention_block_fwd", "jmegatron_attention_block_bwd")}}


@pytest.mark.parametrize("target", sorted(_cases()))
def test_every_buffer_of_every_kernel_is_checked_by_name(target):
    """Each input and each result (out, lse, dq, dk, dv, c...) given a wrong last dimension
    and then a wrong dtype, through jax.ffi.ffi_call with deliberately wrong operands or
    result_shape_dtypes (the Python wrappers' checks bypassed): a Python exception naming the
    kernel, the buffer and what it must be; afterwards the same process still computes."""
    operands, results, attrs = _cases()[target]
    good = _call(target, operands, results, attrs)  # the valid call works
    checked = []
    for i, (name, x) in enumerate(operands):
        for bad, blamed in ((jnp.zeros(_wrong_shape(x.shape), x.dtype), _BLAMED.get((target, name), name)),
                            (x.astype(_wrong_dtype(x.dtype)), name)):
            ops = list(operands)
            ops[i] = (name, bad)
            with pytest.raises(Exception, match=rf"{target}: {blamed} must be .*, got "):
                _call(target, ops, results, attrs)
        checked.append(name)
    for i, (name, r) in enumerate(results):
        for bad in (_sds(_wrong_shape(r.shape), r.dtype), _sds(r.shape, _wrong_dtype(r.dtype))):
            res = list(results)
            res[i] = (name, bad)
            with pytest.raises(Exception, match=rf"{target}: {name} must be {'float32'}\[.*\], got "):
                _call(target, operands, res, attrs)
        checked.append(name)
    assert len(checked) == len(operands) + len(results)
    again = _call(target, operands, results, attrs)  # the process survived and still computes
    for a, b in zip(jax.tree.leaves(good), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_attention_attributes_out_of_range_are_errors():
    operands, results, attrs = _cases()["jmegatron_attention_fwd"]
    for bad in (dict(threshold=np.int64(-1)), dict(threshold=np.int64(2**32)),
                dict(dropout_rate=np.float32(1.0)), dict(keep_scale=np.float32(0.0)),
                dict(block=np.int64(0))):
        with pytest.raises(Exception, match="jmegatron_attention_fwd: (dropout attributes out of range|block must)"):
            _call("jmegatron_attention_fwd", operands, results, {**attrs, **bad})


def test_the_blas_int_check_names_the_dimension():
    """Every size is checked against scipy-openblas32's 32-bit blasint before it is narrowed
    (checks.h BlasInts). An operand with a 2^31 dimension needs 8 GiB, so the check itself is
    called through its exported C form; the kernels call it on M, N, K, the leading
    dimensions, sq, sk, d, nq and nq x d."""
    lib = cpu.load()
    check = lib.JmegatronCheckBlasInt
    check.restype = ctypes.c_int
    check.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
    buf = ctypes.create_string_buffer(512)
    assert check(b"K", 2**31 - 1, buf, 512) == 1 and buf.value == b""
    assert check(b"K", 0, buf, 512) == 1
    for value in (2**31, 2**40, -1):
        assert check(b"K", value, buf, 512) == 0
        assert buf.value.decode() == (f"jmegatron_check_blas_int: K = {value} does not fit OpenBLAS's 32-bit int "
                                      f"(at most 2147483647); split the operands (a smaller batch, sequence or "
                                      f"hidden size)")
    assert check(b"sq", 2**31, buf, 8) == 0 and buf.value == b"jmegatr"  # cut to the capacity


def test_failures_inside_pool_tasks_and_allocations_are_errors_not_crashes():
    """jmegatron_selftest (kernels/cpu/selftest.cc) throws std::bad_alloc / runtime_error
    inside a task on XLA's pool, and asks for 2^62 floats before dispatching: each comes back
    as a Python exception, and the process (a subprocess here: a terminate would show as its
    exit code) goes on to compute correctly."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jmegatron.kernels import cpu
        cpu.load()
        x = jnp.arange(64, dtype=jnp.float32)
        def call(mode, count=0):
            return jax.block_until_ready(jax.ffi.ffi_call("jmegatron_selftest", jax.ShapeDtypeStruct((64,), jnp.float32))(
                x, mode=np.int64(mode), count=np.int64(count)))
        assert (np.asarray(call(0)) == 2 * np.arange(64)).all()
        for mode, count in ((1, 0), (2, 0), (3, 2**62)):
            try:
                call(mode, count)
                print("NO ERROR", mode)
            except Exception as e:
                print(f"mode {mode}: {type(e).__name__}: {e}".splitlines()[0])
        assert (np.asarray(call(0)) == 2 * np.arange(64)).all()
        print("survived")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines == [
        "mode 1: JaxRuntimeError: RESOURCE_EXHAUSTED: jmegatron_selftest: out of host memory (std::bad_alloc); "
        "use smaller operands",
        "mode 2: JaxRuntimeError: INTERNAL: jmegatron_selftest: selftest task 5 failed",
        "mode 3: JaxRuntimeError: RESOURCE_EXHAUSTED: jmegatron_selftest: cannot allocate the selftest scratch "
        "(4611686018427387904 x 4 bytes) of host memory; use smaller operands",
        "survived",
    ], proc.stdout + proc.stderr[-2000:]


# ----------------------------------------------------------------------------- dropout hash

_S = 65536  # heads x S^2 = 2^33 for 2 heads: the old 32-bit linear index wrapped at head 1


def _old_linear_index(h, i, j, s):
    """The hash input before issue 16: the row-major index over [heads, S, S], mod 2^32."""
    return ((h * s + i) * s + j) % 2**32


def test_the_old_counter_collided_and_the_new_words_are_distinct():
    """(head 0, i, j) and (head 1, i, j) at S = 65536 had the same old hash input (S^2 = 2^32);
    the new words (row = head * S + i, col = j) differ, and so do the hashes."""
    from jmegatron.kernels.xla.dropout import mask_hash
    i, j = np.arange(_S - 64, _S), np.arange(0, _S, 1024)
    assert (_old_linear_index(0, i[:, None], j, _S) == _old_linear_index(1, i[:, None], j, _S)).all()
    k0, k1 = jnp.uint32(0x12345678), jnp.uint32(0x9ABCDEF0)
    rows = jnp.asarray(np.stack([0 * _S + i, 1 * _S + i]), U32)[:, :, None]  # [2 heads, 64, 1]
    bits = np.asarray(mask_hash(k0, k1, jnp.uint32(7), rows, jnp.asarray(j, U32)[None, None, :]))
    assert not (bits[0] == bits[1]).any()  # 4096 pairs: an equal pair has probability ~1e-6
    # Every (row, col) word pair of the largest row word is hashed, none wrapped.
    top = np.asarray(mask_hash(k0, k1, jnp.uint32(7), jnp.uint32(2**32 - 1), jnp.arange(8, dtype=U32)))
    assert len(set(top.tolist())) == 8


def test_attention_keep_mask_and_the_pallas_hash_agree_past_the_old_wrap():
    """At rows/columns near S = 65536 with 2 heads (where the old masks of head 0 and head 1
    were identical) attention_keep_mask and the Pallas kernel's in-kernel hash draw the same
    bits, and heads 0 and 1 differ."""
    from jmegatron.kernels.pallas.flash_attention import _dropout_cfg, _keep, _seed
    from jmegatron.kernels.xla.dropout import attention_keep_mask
    key = jax.random.key(4)
    rows = jnp.asarray([np.arange(_S - 64, _S)], jnp.int32)       # [b=1, 64]
    cols = jnp.asarray([np.arange(_S - 128, _S, 2)], jnp.int32)   # [b=1, 64]
    mask = np.asarray(attention_keep_mask(key, 0.5, (1, 2, 1, 64, 64), rows, cols, _S, sample_offset=3))
    assert (mask[0, 0, 0] != mask[0, 1, 0]).any()
    seed = _seed(key, 3)
    cfg = _dropout_cfg(0.5, _S, "refs", heads=2)
    for head in (0, 1):
        got = np.asarray(_keep(seed, jnp.int32(0), jnp.int32(head), rows[0], cols[0], cfg))
        np.testing.assert_array_equal(got, mask[0, head, 0])


def test_cpu_kernel_dropout_past_the_old_wrap_matches_the_shared_hash():
    """The C++ kernel at S = 65536 with 2 heads: one 64-token document per 64 rows (segment
    ids), so only [64, 64] blocks are computed. With the same q/k/v in both heads the heads'
    outputs differ only through their dropout masks: identical under the old wrapping counter,
    different now; and the last document equals a reference computed with
    attention_keep_mask at its global rows and columns."""
    from jmegatron.kernels.cpu.ops import cpu_attention
    from jmegatron.kernels.xla.dropout import attention_keep_mask
    r = np.random.default_rng(1)
    d, doc = 4, 64
    one = r.standard_normal((1, _S, 1, d)).astype(np.float32)
    q, k, v = (jnp.asarray(np.repeat(x, 2, axis=2)) for x in (one, r.standard_normal(one.shape).astype(np.float32),
                                                               r.standard_normal(one.shape).astype(np.float32)))
    segments = jnp.asarray(np.arange(_S)[None] // doc, jnp.int32)
    key, rate = jax.random.key(5), 0.3
    out = np.asarray(cpu_attention(q, k, v, dropout_rate=rate, dropout_rng=key, deterministic=False,
                                   sample_offset=2, segment_ids=segments))
    last = slice(_S - doc, _S)
    assert not np.allclose(out[0, last, 0], out[0, last, 1])
    pos = jnp.asarray([np.arange(_S - doc, _S)], jnp.int32)
    keep = np.asarray(attention_keep_mask(key, rate, (1, 2, 1, doc, doc), pos, pos, _S, sample_offset=2))[0, :, 0]
    qs, ks, vs = (np.asarray(x)[0, last] for x in (q, k, v))  # [doc, 2, d]
    for h in range(2):
        scores = qs[:, h] @ ks[:, h].T / np.sqrt(np.float32(d))
        scores = np.where(np.tril(np.ones((doc, doc), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
        want = np.where(keep[h], p / np.float32(1 - rate), 0) @ vs[:, h]
        np.testing.assert_allclose(out[0, last, h], want, rtol=2e-5, atol=2e-6)


def test_shapes_whose_hash_words_would_wrap_are_refused():
    """Beyond 2^32 row or column words the hash would collide: refused with a ValueError at
    trace time (jax.eval_shape: nothing allocated), by hash_bits, attention_keep_mask, the CPU
    attention wrapper and the Pallas configuration."""
    from jmegatron.kernels.cpu.ops import cpu_attention
    from jmegatron.kernels.pallas.flash_attention import _dropout_cfg
    from jmegatron.kernels.xla.dropout import attention_keep_mask, hash_bits
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"hash_bits: the dropout hash indexes at most 2\^32 rows"):
        hash_bits(key, (1, 2**17, 2**16, 8))
    with pytest.raises(ValueError, match=r"hash_bits: .* at most 2\^32 columns per sample, got 8589934592"):
        hash_bits(key, (1, 2**33))
    ids = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"attention_keep_mask: .* rows \(heads 4096 x seq_length 2097152\)"):
        attention_keep_mask(key, 0.1, (1, 64, 64, 2, 2), ids, ids, 2**21)
    s, nq = 2**21, 2**11 + 1  # nq x s just above 2^32
    q = jax.ShapeDtypeStruct((1, s, nq, 1), F32)
    with pytest.raises(ValueError, match=r"cpu_attention: .* rows \(heads 2049 x seq 2097152\)"):
        jax.eval_shape(lambda q: cpu_attention(q, q, q, dropout_rate=0.1, dropout_rng=key, deterministic=False), q)
    with pytest.raises(ValueError, match=r"pallas attention dropout: .* rows"):
        _dropout_cfg(0.1, s, "index", heads=nq)
    # The largest shapes that fit are accepted (no arrays are built for the checks).
    assert _dropout_cfg(0.1, 2**21, "index", heads=2**11) is not None
