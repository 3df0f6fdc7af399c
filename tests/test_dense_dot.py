"""dense_dot_general (models/layers.py): autodiff's values and gradients, for the kernel
layouts the models use (Linear with one or several contracted axes, several output axes,
Embed.attend's [vocab, hidden] table) and a permuted one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.kernels.xla.dense import dense_dot_general

CASES = [((2, 5, 6), (6, 7), (((2,), (0,)), ((), ()))),
         ((2, 5, 3, 4), (3, 4, 7), (((2, 3), (0, 1)), ((), ()))),  # linear_proj [nq, d, h]
         ((2, 5, 6), (9, 6), (((2,), (1,)), ((), ()))),  # attend: x [b, s, h] . table [V, h]
         ((2, 5, 6), (6, 2, 7), (((2,), (0,)), ((), ()))),  # swiglu fc1 [h, 2, ffn]
         ((2, 5, 3, 4), (4, 3, 7), (((2, 3), (1, 0)), ((), ())))]


@pytest.mark.parametrize("xs, ks, dims", CASES)
def test_matches_autodiff(xs, ks, dims):
    r = np.random.RandomState(0)
    x, k = jnp.asarray(r.randn(*xs), jnp.float32), jnp.asarray(r.randn(*ks), jnp.float32)
    np.testing.assert_array_equal(dense_dot_general(x, k, dims), jax.lax.dot_general(x, k, dims))
    ours = jax.grad(lambda a, b: jnp.sum(jnp.sin(dense_dot_general(a, b, dims))), (0, 1))(x, k)
    ref = jax.grad(lambda a, b: jnp.sum(jnp.sin(jax.lax.dot_general(a, b, dims))), (0, 1))(x, k)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_weight_gradient_contracts_x_with_g():
    # the point of the custom VJP: the weight-gradient dot takes x [b, s, h] as its left
    # operand and g [b, s, out] as its right one (autodiff's rule puts g first)
    x, k = jnp.ones((2, 5, 6)), jnp.ones((6, 7))
    dims = (((2,), (0,)), ((), ()))

    def weight_grad_dots(f):
        jaxpr = jax.make_jaxpr(jax.grad(lambda b: jnp.sum(f(x, b, dims))))(k).jaxpr
        return [[v.aval.shape for v in e.invars] for e in jaxpr.eqns
                if e.primitive.name == "dot_general" and e.outvars[0].aval.shape == (6, 7)]

    assert weight_grad_dots(dense_dot_general) == [[(2, 5, 6), (2, 5, 7)]]
    assert weight_grad_dots(jax.lax.dot_general) != [[(2, 5, 6), (2, 5, 7)]]
