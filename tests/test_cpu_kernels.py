"""The CPU kernels (jmegatron/kernels/cpu) against their XLA reference paths."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.kernels import cpu
from jmegatron.kernels.cpu.ops import blas_dot_general, cpu_attention, grouped_matmul, sgemm
from jmegatron.kernels.xla.attention import xla_attention
from jmegatron.models.transformer_config import ModelConfig

from conftest import REPO
from test_parallel_equivalence import trajectory
from test_train_step import tiny_cfg

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (130, 64, 3), (300, 33, 257)])
def test_sgemm_matches_numpy(trans_a, trans_b, m, k, n):
    a = rand(*((k, m) if trans_a else (m, k)))
    b = rand(*((n, k) if trans_b else (k, n)), seed=1)
    want = (np.asarray(a).T if trans_a else np.asarray(a)) @ (np.asarray(b).T if trans_b else np.asarray(b))
    got = jax.jit(lambda a, b: sgemm(a, b, trans_a, trans_b))(a, b)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_sgemm_refuses_bad_operands():
    with pytest.raises(ValueError, match="contracting sizes differ"):
        sgemm(rand(4, 5), rand(6, 3))
    with pytest.raises(ValueError, match="float32 matrices"):
        sgemm(rand(4, 5).astype(jnp.bfloat16), rand(5, 3))


@pytest.mark.parametrize("x_shape,w_shape,dims", [
    ((4, 6, 16), (16, 24), (((2,), (0,)), ((), ()))),                  # Linear [K, N]
    ((4, 6, 16), (16, 2, 12), (((2,), (0,)), ((), ()))),               # fused QKV / SwiGLU fc1
    ((4, 6, 2, 8), (2, 8, 16), (((2, 3), (0, 1)), ((), ()))),          # linear_proj over (heads, kv)
    ((4, 6, 16), (40, 16), (((2,), (1,)), ((), ()))),                  # tied output layer [N, K]
])
def test_blas_dot_general_values_and_gradients_match_xla(x_shape, w_shape, dims):
    x, w = rand(*x_shape), rand(*w_shape, seed=1)
    np.testing.assert_allclose(np.asarray(jax.jit(blas_dot_general, static_argnums=2)(x, w, dims)),
                               np.asarray(jax.lax.dot_general(x, w, dims)), rtol=1e-5, atol=1e-5)
    f = lambda dot: lambda x, w: jnp.sum(jnp.sin(dot(x, w, dims)))  # noqa: E731
    want = jax.grad(f(jax.lax.dot_general), argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(f(blas_dot_general), argnums=(0, 1)))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [(100, 0, 37, 91), (0, 0, 0, 0), (228, 0, 0, 0), (50, 50, 50, 40)])
def test_grouped_matmul_matches_ragged_dot(sizes):
    """The MoE experts' grouped GEMM against jax.lax.ragged_dot (its XLA reference path): values
    and both gradients, with empty groups and rows past the groups (zeros, no gradient)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (228, 48))
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 48, 72))
    gs = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(grouped_matmul(x, w, gs), jax.lax.ragged_dot(x, w, gs), rtol=1e-5, atol=1e-4)

    def grads(fn):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w, gs))), argnums=(0, 1)))(x, w)

    for got, want in zip(grads(grouped_matmul), grads(jax.lax.ragged_dot)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # bf16 (no kernel) falls back to ragged_dot itself
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    np.testing.assert_array_equal(grouped_matmul(xb, wb, gs), jax.lax.ragged_dot(xb, wb, gs))


def test_blas_dot_general_falls_back_to_xla_for_other_forms():
    x, w = rand(3, 4, 5), rand(3, 5, 6, seed=1)
    batched = (((2,), (1,)), ((0,), (0,)))
    jaxpr = str(jax.make_jaxpr(lambda x, w: blas_dot_general(x, w, batched))(x, w))
    assert "ffi_call" not in jaxpr
    bf = str(jax.make_jaxpr(lambda x, w: blas_dot_general(x, w, (((2,), (0,)), ((), ()))))(
        rand(3, 4, 5).astype(jnp.bfloat16), rand(5, 6).astype(jnp.bfloat16)))
    assert "ffi_call" not in bf
    f32 = str(jax.make_jaxpr(lambda x, w: blas_dot_general(x, w, (((2,), (0,)), ((), ()))))(rand(3, 4, 5), rand(5, 6)))
    assert "ffi_call" in f32


@pytest.mark.parametrize("b,s,nq,nkv,d,rate", [
    (2, 37, 4, 2, 16, 0.0),     # GQA, one partial block
    (2, 200, 4, 4, 32, 0.1),    # two blocks, the second partial
    (1, 300, 6, 2, 64, 0.3),    # GQA with dropout over three blocks
    (2, 1, 2, 1, 8, 0.1),       # one token
])
def test_cpu_attention_matches_xla(b, s, nq, nkv, d, rate):
    q, k, v = rand(b, s, nq, d), rand(b, s, nkv, d, seed=1), rand(b, s, nkv, d, seed=2)
    key = jax.random.key(7)
    # batch row 0 is global sample 5 (a data-parallel rank's rows): both paths add the offset
    kw = dict(dropout_rate=rate, dropout_rng=key, deterministic=False, sample_offset=5)
    want = xla_attention(q, k, v, **kw)
    got = jax.jit(lambda q, k, v: cpu_attention(q, k, v, **kw))(q, k, v)
    # The same dropout mask: element-wise agreement, not just statistics.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=2e-5)
    f = lambda attn: lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v, **kw)))  # noqa: E731
    grads_want = jax.grad(f(xla_attention), argnums=(0, 1, 2))(q, k, v)
    grads_got = jax.jit(jax.grad(f(cpu_attention), argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads_got, grads_want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=2e-5)


def test_cpu_attention_rows_with_sample_offset_match_the_whole_batch():
    """Rows 2..3 of a batch given sample_offset=2 drop what the whole batch drops there
    (the data-parallel rule), forward and backward; offset 0 drops other elements."""
    q, k, v = rand(4, 70, 4, 16), rand(4, 70, 2, 16, seed=1), rand(4, 70, 2, 16, seed=2)
    kw = dict(dropout_rate=0.2, dropout_rng=jax.random.key(9), deterministic=False)
    attn = jax.jit(lambda q, k, v, off: cpu_attention(q, k, v, sample_offset=off, **kw))
    whole = np.asarray(attn(q, k, v, 0))
    part = np.asarray(attn(q[2:], k[2:], v[2:], 2))
    np.testing.assert_array_equal(part, whole[2:])
    assert not np.allclose(np.asarray(attn(q[2:], k[2:], v[2:], 0)), whole[2:], atol=1e-3)
    loss = lambda q, k, v, off: jnp.sum(jnp.sin(cpu_attention(q, k, v, sample_offset=off, **kw)))  # noqa: E731
    g_whole = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, 0)
    g_part = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q[2:], k[2:], v[2:], 2)
    for a, b in zip(g_part, g_whole):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[2:])


def test_cpu_attention_underflow_and_dropout_scale_match_xla():
    """Large scores (probabilities below exp(-87) are exactly 0, as XLA's) and a rate whose
    float32 keep-scale differs from 1.0f - float32(rate) in the last bit."""
    q, k, v = rand(1, 100, 2, 16) * 20, rand(1, 100, 1, 16, seed=1) * 20, rand(1, 100, 1, 16, seed=2)
    kw = dict(dropout_rate=0.058, dropout_rng=jax.random.key(3), deterministic=False)
    got, want = jax.jit(lambda q, k, v: cpu_attention(q, k, v, **kw))(q, k, v), xla_attention(q, k, v, **kw)
    np.testing.assert_array_equal(np.asarray(got) == 0, np.asarray(want) == 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_cpu_attention_without_dropout_ignores_the_rng():
    q, k, v = rand(1, 20, 2, 8), rand(1, 20, 2, 8, seed=1), rand(1, 20, 2, 8, seed=2)
    a = cpu_attention(q, k, v, dropout_rate=0.5, deterministic=True)
    np.testing.assert_allclose(np.asarray(a), np.asarray(xla_attention(q, k, v)), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def xla_dp8():
    """XLA's ops at dp 8, dropout on: 3 steps of losses and gradients. ZeRO-1 and FSDP give
    the same trajectory (test_parallel_equivalence), so it is every layout's reference."""
    return trajectory(tiny_cfg(micro_batch_size=1, matmul_impl="xla", attention_impl="xla",
                               hidden_dropout=0.1, attention_dropout=0.1), 8)


# (dp 8 + "blas": the ZeRO-1 "blas" case runs the same kernels in the same data-parallel shard_map;
# ZeRO-1 changes only the optimizer's layout, test_parallel_equivalence's dp8_distopt)
@pytest.mark.parametrize("layout,matmul", [(dict(), "hybrid"),
                                           (dict(use_distributed_optimizer=True), "blas"),
                                           (dict(use_megatron_fsdp=True), "hybrid")])
def test_train_step_with_kernels_matches_xla_on_8_devices(layout, matmul, xla_dp8):
    """dp 8 (the kernels inside the data-parallel shard_map), ZeRO-1 and FSDP: 3 steps of
    losses and gradients as with XLA's ops, dropout on; matmul_impl "blas" and "hybrid"."""
    ref_losses, ref_grads, _ = xla_dp8
    cfg = tiny_cfg(micro_batch_size=1, matmul_impl=matmul, attention_impl="cpu",
                   hidden_dropout=0.1, attention_dropout=0.1, **layout)
    losses, grads, run_k = trajectory(cfg, 8)
    assert (run_k.model.cfg.matmul_impl, run_k.model.cfg.attention_impl) == (matmul, "cpu")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5 * np.max(np.abs(b)))


def test_auto_resolution_and_refusals():
    cfg = tiny_cfg()
    m = ModelConfig.from_config(cfg, cfg.padded_vocab_size())
    assert (m.matmul_impl, m.attention_impl) == ("hybrid", "cpu")
    tp = tiny_cfg(tensor_model_parallel_size=2)
    m = ModelConfig.from_config(tp, tp.padded_vocab_size())
    assert (m.matmul_impl, m.attention_impl) == ("xla", "xla")
    bf = tiny_cfg(bf16=True)
    assert ModelConfig.from_config(bf, bf.padded_vocab_size()).matmul_impl == "xla"
    with pytest.raises(ConfigError, match="matmul_impl='blas'.*tensor_model_parallel_size=1"):
        tiny_cfg(tensor_model_parallel_size=2, matmul_impl="blas")
    with pytest.raises(ConfigError, match="attention_impl='cpu'"):
        tiny_cfg(tensor_model_parallel_size=2, attention_impl="cpu")


@pytest.mark.parametrize("broken", ["compiler", "cache"])
def test_without_a_compiler_auto_falls_back_and_explicit_choice_says_why(tmp_path, broken):
    code = (
        "import jax\n"
        "from jmegatron.kernels import cpu\n"
        "from jmegatron.kernels.cpu.ops import sgemm\n"
        "from jmegatron.models.transformer_config import ModelConfig\n"
        "import sys; sys.path.insert(0, 'tests')\n"
        "from test_train_step import tiny_cfg\n"
        "c = tiny_cfg()\n"
        "m = ModelConfig.from_config(c, c.padded_vocab_size())\n"
        "print('RESOLVED', m.matmul_impl, m.attention_impl)\n"
        "try:\n"
        "    sgemm(jax.numpy.ones((2, 2)), jax.numpy.ones((2, 2)))\n"
        "except cpu.KernelUnavailable as e:\n"
        "    print('ERROR', e)\n")
    if broken == "compiler":
        env = dict(os.environ, CXX="/nonexistent/g++", JMEGATRON_KERNEL_CACHE=str(tmp_path))
        reason = "ERROR building the CPU kernels failed"
    else:  # a cache directory that cannot be created
        env = dict(os.environ, JMEGATRON_KERNEL_CACHE="/proc/jmegatron-kernels")
        reason = "ERROR the CPU kernels could not be built or loaded"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "RESOLVED xla xla" in out.stdout
    assert reason in out.stdout
    assert out.stderr.count("CPU kernels unavailable, using XLA's ops") == 1
