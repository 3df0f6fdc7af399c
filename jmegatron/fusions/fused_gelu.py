"""Exact (erf) GELU with a one-pass backward, the role of Megatron's
megatron/core/fusions/fused_bias_gelu.py (which fuses the tanh approximation with the
bias add; here the erf form of ``torch.nn.functional.gelu``, Megatron's default
activation for GPT).

Autodiff of ``x * Phi(x)`` keeps the erf's intermediates for the backward and XLA's CPU
backend computes the forward in three passes over ``[tokens, ffn]`` (docs/PERFORMANCE.md); with this custom VJP the forward is one fused pass that saves only ``x``, and
the backward ``g * (Phi(x) + x * phi(x))`` is another.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """``x * Phi(x)`` (Phi the standard normal CDF, via erf): same shape and dtype as ``x``;
    equals ``jax.nn.gelu(x, approximate=False)`` to float32 rounding. Gradient
    ``Phi(x) + x * phi(x)``, computed in ``x``'s dtype (float32 inside for bfloat16)."""
    return _gelu(x)


def _gelu(x):
    xf = x.astype(jnp.float32)
    return (xf * 0.5 * (1.0 + jax.lax.erf(xf * _INV_SQRT2))).astype(x.dtype)


def _gelu_fwd(x):
    return _gelu(x), x


def _gelu_bwd(x, g):
    xf = x.astype(jnp.float32)
    cdf = 0.5 * (1.0 + jax.lax.erf(xf * _INV_SQRT2))
    pdf = jnp.exp(-0.5 * xf * xf) * _INV_SQRT_2PI
    return ((g.astype(jnp.float32) * (cdf + xf * pdf)).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
