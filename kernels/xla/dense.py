"""The dense layers' matmul in XLA ops with a weight gradient that leaves the output gradient
in place: the reference of :func:`jmegatron.kernels.cpu.ops.blas_dot_general` and the default
``dot_general`` of :class:`jmegatron.models.layers.Linear`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense_dot_general(x: Array, kernel: Array, dims) -> Array:
    """``jax.lax.dot_general(x, kernel, dims)`` whose weight gradient is ``dot_general(x, g)``.

    For ``y = x @ W`` (tokens ``T`` = every axis of ``x`` not contracted) autodiff's
    weight-gradient matmul transposes the output gradient ``g [T, out]``; XLA's CPU
    backend fuses ``g``'s whole elementwise producer chain (residual adds, LayerNorm and
    dropout backward of every layer above) into that transposing copy and re-runs it per
    layer: a third of gpt_tiny's step (docs/PERFORMANCE.md). Contracting ``x`` with ``g``
    in this order transposes ``x`` instead (a saved activation, one operand) and leaves
    ``g`` in its natural ``[K = T, N]`` layout, so it is computed once. The kernel's
    contracting axes must lead, in the order of ``x``'s (as in :class:`jmegatron.models.layers.Linear` and
    :meth:`jmegatron.models.layers.Embed.attend` after a transpose); other layouts use autodiff's rule.

    Shapes as ``jax.lax.dot_general`` with no batch dimensions; any float dtype.
    """
    return jax.lax.dot_general(x, kernel, dims)


def _dense_fwd(x, kernel, dims):
    return jax.lax.dot_general(x, kernel, dims), (x, kernel)


def _dense_bwd(dims, res, g):
    x, kernel = res
    (x_contract, k_contract), batch = dims
    dx = jax.vjp(lambda a: jax.lax.dot_general(a, kernel, dims), x)[1](g)[0]
    x_free = tuple(a for a in range(x.ndim) if a not in x_contract)
    k_free = tuple(a for a in range(kernel.ndim) if a not in k_contract)
    order = sorted(range(len(x_contract)), key=lambda i: x_contract[i])
    if batch != ((), ()):
        dk = jax.vjp(lambda w: jax.lax.dot_general(x, w, dims), kernel)[1](g)[0]
        return dx, dk
    # dot_general(x, g) -> [x's contracting axes (ascending), g's free axes = kernel's free axes]
    dk = jax.lax.dot_general(x, g, ((x_free, tuple(range(len(x_free)))), ((), ())))
    # axis j of dk is kernel axis k_contract[order[j]] for j < n, then the free kernel axes
    src = [k_contract[i] for i in order] + list(k_free)
    dk = jnp.transpose(dk, [src.index(a) for a in range(kernel.ndim)])
    return dx, dk.astype(kernel.dtype)


dense_dot_general.defvjp(_dense_fwd, _dense_bwd)


def dense_dot_general_fn(x: Array, kernel: Array, dims, precision=None, preferred_element_type=None) -> Array:
    """:func:`dense_dot_general` with ``jax.lax.dot_general``'s signature (the default
    ``dot_general`` of :class:`jmegatron.models.layers.Linear` and the models)."""
    if precision is not None or preferred_element_type is not None:
        return jax.lax.dot_general(x, kernel, dims, precision=precision,
                                   preferred_element_type=preferred_element_type)
    return dense_dot_general(x, kernel, dims)
