"""Softmax cross-entropy with integer labels whose backward recomputes the softmax, the
role of Megatron's megatron/core/fusions/fused_cross_entropy.py (``--cross-entropy-loss-fusion``).

Autodiff of ``logsumexp(z) - z[label]`` materialises ``exp(z - max)`` ``[tokens, vocab]``
in the forward and reads it back in the backward; here the forward is two reductions over
the logits (max, then the sum of exponentials, each fused with its exp, nothing of vocab
size written) and saves only the log-sum-exp ``[tokens]``; the backward writes
``g * (softmax(z) - onehot(label))`` in one pass. Less memory traffic and one fewer
``[tokens, vocab]`` activation kept alive (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token ``-log softmax(logits)[label]``: logits ``[..., V]`` (any float dtype,
    computed in float32), labels ``[...]`` integer in ``[0, V)`` -> float32 ``[...]``.
    Equals ``optax.softmax_cross_entropy_with_integer_labels`` to float32 rounding
    (out-of-range labels are not checked, as there)."""
    return _forward(logits, labels)[0]


def _forward(logits, labels):
    z = logits.astype(jnp.float32)
    zmax = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(z - zmax), axis=-1)) + zmax[..., 0]
    picked = jnp.take_along_axis(z, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - picked, lse


def _fwd(logits, labels):
    loss, lse = _forward(logits, labels)
    return loss, (logits, labels, lse)


def _bwd(res, g):
    logits, labels, lse = res
    z = logits.astype(jnp.float32)
    onehot = jnp.arange(z.shape[-1], dtype=jnp.int32) == labels[..., None].astype(jnp.int32)
    d = (jnp.exp(z - lse[..., None]) - onehot.astype(jnp.float32)) * g[..., None]
    # integer labels get no cotangent (float0, as JAX requires for integer inputs)
    return d.astype(logits.dtype), jax.numpy.zeros(labels.shape, jax.dtypes.float0)


softmax_cross_entropy.defvjp(_fwd, _bwd)
