"""jmegatron.fusions against the functions they replace: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmegatron.fusions.fused_cross_entropy import softmax_cross_entropy
from jmegatron.fusions.fused_gelu import gelu, gelu_tanh


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_matches_optax(dtype):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    logits = (jax.random.normal(k1, (3, 7, 50)) * 4).astype(dtype)
    labels = jax.random.randint(k2, (3, 7), 0, 50)
    w = jax.random.normal(k3, (3, 7))

    def ref(z):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(z.astype(jnp.float32), labels) * w)

    def fused(z):
        return jnp.sum(softmax_cross_entropy(z, labels) * w)

    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(fused(logits), ref(logits), rtol=tol)
    g, g_ref = jax.grad(fused)(logits), jax.grad(ref)(logits)
    assert g.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32), rtol=tol, atol=tol * 1e-2)


def test_cross_entropy_saves_no_vocab_sized_softmax():
    """The backward's residuals are the logits, labels and the [tokens] log-sum-exp only."""
    logits, labels = jnp.zeros((4, 8, 64)), jnp.zeros((4, 8), jnp.int32)
    _, vjp = jax.vjp(lambda z: softmax_cross_entropy(z, labels), logits)
    shapes = sorted(tuple(x.shape) for x in jax.tree.leaves(vjp) if hasattr(x, "shape"))
    assert shapes.count((4, 8, 64)) == 1, shapes  # the logits themselves, no exp(z - max)


def test_gelu_matches_jax():
    x = jnp.linspace(-12.0, 12.0, 4001)
    np.testing.assert_allclose(gelu(x), jax.nn.gelu(x, approximate=False), rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda v: jnp.sum(gelu(v) * jnp.cos(v)))(x)
    g_ref = jax.grad(lambda v: jnp.sum(jax.nn.gelu(v, approximate=False) * jnp.cos(v)))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)
    xb = x.astype(jnp.bfloat16)
    assert gelu(xb).dtype == jnp.bfloat16 and jax.grad(lambda v: jnp.sum(gelu(v).astype(jnp.float32)))(xb).dtype == jnp.bfloat16


def test_tanh_gelu_is_megatrons_bias_gelu():
    """``gelu_tanh`` (``openai_gelu``, GPT-2's ``gelu_new``) against megatron-core's own fused
    ``bias_gelu`` (megatron/core/fusions/fused_bias_gelu.py), forward and backward."""
    import torch
    from megatron.core.fusions import fused_bias_gelu as fused
    x = np.linspace(-8.0, 8.0, 2001).astype(np.float32)
    w = np.cos(x).astype(np.float32)
    t = torch.tensor(x, requires_grad=True)
    y = fused.bias_gelu_impl(t, torch.zeros(()))
    (y * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(np.asarray(gelu_tanh(jnp.asarray(x))), y.detach().numpy(), atol=1e-6)
    g = jax.grad(lambda v: jnp.sum(gelu_tanh(v) * w))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), atol=1e-5)
    assert float(jnp.max(jnp.abs(gelu_tanh(jnp.asarray(x)) - gelu(jnp.asarray(x))))) > 1e-4  # not the erf GELU
