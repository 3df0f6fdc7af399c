"""The Pallas fused cross-entropy (jmegatron.kernels.pallas.cross_entropy) in Pallas interpret
mode on the CPU against the XLA path (jmegatron.fusions.fused_cross_entropy) and optax:
values and logit gradients, float32 and bf16, vocab-parallel inside shard_map (check_vma on
and off) and under GSPMD, and a gpt_tiny step at tp 2 with cross_entropy_impl="pallas"."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.fusions.fused_cross_entropy import softmax_cross_entropy
from jmegatron.kernels.pallas.cross_entropy import lm_cross_entropy, pallas_softmax_cross_entropy
from jmegatron.models.backend import resolve_cross_entropy_impl
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.training.forward_step import gpt_forward_step
from jmegatron.training.losses import token_cross_entropy

from test_context_parallel import grads_of
from test_expert_parallel import assert_close as assert_tree_close
from test_train_step import tiny_cfg

V = 256


def _data(dtype=jnp.float32, seed=0):
    rs = np.random.RandomState(seed)
    logits = jnp.asarray((rs.randn(2, 8, V) * 3).astype(np.float32), dtype)
    labels = jnp.asarray(rs.randint(0, V, size=(2, 8)).astype(np.int32))
    weights = jnp.asarray(rs.rand(2, 8).astype(np.float32))
    return logits, labels, weights


def _loss(ce, logits, labels, weights):
    return jnp.sum(ce(logits, labels) * weights)


def test_equals_fused_cross_entropy_and_optax():
    """Per-token losses and logit gradients equal the XLA fused path and optax (float32),
    with several row and vocabulary tiles."""
    logits, labels, weights = _data()
    kernel = functools.partial(pallas_softmax_cross_entropy, block_rows=4, block_vocab=64)
    got = kernel(logits, labels)
    assert got.shape == labels.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, softmax_cross_entropy(logits, labels), rtol=1e-6)
    np.testing.assert_allclose(got, optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-5)
    g = jax.grad(functools.partial(_loss, kernel), argnums=0)(logits, labels, weights)
    want = jax.grad(functools.partial(_loss, softmax_cross_entropy), argnums=0)(logits, labels, weights)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_bf16_logits():
    """bf16 logits: computed in float32 (the loss equals the fused path's on the same bf16
    values), the gradient in bf16."""
    logits, labels, weights = _data(jnp.bfloat16)
    got = pallas_softmax_cross_entropy(logits, labels, block_vocab=128)
    np.testing.assert_allclose(got, softmax_cross_entropy(logits, labels), rtol=1e-6)
    g = jax.grad(functools.partial(_loss, functools.partial(pallas_softmax_cross_entropy, block_vocab=128)))(
        logits, labels, weights)
    want = jax.grad(functools.partial(_loss, softmax_cross_entropy))(logits, labels, weights)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(want, np.float32), atol=1e-2)


@pytest.mark.parametrize("check_vma", [True, False])
def test_vocab_parallel_in_shard_map(check_vma):
    """tensor_axis: four ranks each hold a quarter of the vocabulary (labels global); the loss
    is the unsplit one on every rank, and the gradient of each shard is the unsplit
    gradient's slice, with shard_map's check_vma on and off (autodiff through the psum)."""
    logits, labels, weights = _data(seed=1)
    mesh = jax.make_mesh((4,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
    ce = functools.partial(pallas_softmax_cross_entropy, tensor_axis="tensor", block_vocab=32)
    fn = jax.jit(jax.shard_map(functools.partial(_loss, ce), mesh=mesh, in_specs=(P(None, None, "tensor"), P(), P()),
                               out_specs=P(), check_vma=check_vma))
    want, want_g = jax.value_and_grad(functools.partial(_loss, softmax_cross_entropy))(logits, labels, weights)
    sharded = jax.device_put(logits, NamedSharding(mesh, P(None, None, "tensor")))
    got, got_g = jax.value_and_grad(fn)(sharded, labels, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-5, atol=1e-7)
    assert "all-gather" not in fn.lower(sharded, labels, weights).compile().as_text()  # logits never gathered


def test_lm_cross_entropy_splits_the_vocabulary_under_gspmd():
    """Under an automatic tensor axis (the train step's GSPMD tensor parallelism),
    lm_cross_entropy runs the kernels vocab-parallel in shard_maps: values and gradients equal
    the fused path's."""
    logits, labels, weights = _data(seed=2)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ce = functools.partial(lm_cross_entropy, block_vocab=64)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(logits, NamedSharding(mesh, P("data", None, "tensor")))
        got, got_g = jax.jit(jax.value_and_grad(functools.partial(_loss, ce)))(sharded, labels, weights)
    want, want_g = jax.value_and_grad(functools.partial(_loss, softmax_cross_entropy))(logits, labels, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-5, atol=1e-7)


def test_seam_and_refusals():
    logits, labels, _ = _data()
    assert resolve_cross_entropy_impl("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    np.testing.assert_allclose(token_cross_entropy(logits, labels, "pallas"), softmax_cross_entropy(logits, labels),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="cross_entropy_impl='fast'"):
        token_cross_entropy(logits, labels, "fast")
    with pytest.raises(ValueError, match="multiple of block_vocab=100"):
        pallas_softmax_cross_entropy(logits, labels, block_vocab=100)
    with pytest.raises(ValueError, match="without its last"):
        pallas_softmax_cross_entropy(logits, labels[:, :4])


@pytest.mark.slow  # a train step compiled twice (interpret-mode kernels inside)
def test_gpt_tiny_tp2_step_with_pallas_cross_entropy_equals_xla():
    """A gpt_tiny gradient computation at tp 2 x dp 2 (logits split over the vocabulary) with
    cross_entropy_impl="pallas" equals "xla"."""
    kw = dict(micro_batch_size=2, global_batch_size=4, tensor_model_parallel_size=2, num_layers=1,
              attention_impl="xla", matmul_impl="xla")
    cfg = tiny_cfg(cross_entropy_impl="pallas", **kw)
    model = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
    assert gpt_forward_step(cfg, model, None, 0).pipeline_stages.keywords == {"cross_entropy_impl": "pallas"}
    g, report, tokens, _ = grads_of(cfg, 4)
    g1, report1, tokens1, _ = grads_of(tiny_cfg(cross_entropy_impl="xla", **kw), 4)
    assert tokens == tokens1
    np.testing.assert_allclose(report["lm_loss"], report1["lm_loss"], rtol=1e-6)
    assert_tree_close(g, g1)
