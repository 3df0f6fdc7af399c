"""Exact (erf) GELU, and its tanh approximation (:func:`gelu_tanh`), each with a one-pass backward, the role of Megatron's
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


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


@jax.custom_vjp
def gelu_tanh(x: jax.Array) -> jax.Array:
    """The tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (Hendrycks &
    Gimpel 2016; Megatron's ``openai_gelu`` and the GELU of its fused_bias_gelu.py, Hugging
    Face's ``gelu_new`` / ``gelu_pytorch_tanh``): same shape and dtype as ``x``; equals
    ``jax.nn.gelu(x, approximate=True)`` to float32 rounding, with the same one-pass forward
    and backward as :func:`gelu` (float32 inside)."""
    return _gelu_tanh(x)


def _tanh_inner(xf):
    return jnp.tanh(_SQRT_2_OVER_PI * xf * (1.0 + _TANH_CUBIC * xf * xf))


def _gelu_tanh(x):
    xf = x.astype(jnp.float32)
    return (0.5 * xf * (1.0 + _tanh_inner(xf))).astype(x.dtype)


def _gelu_tanh_fwd(x):
    return _gelu_tanh(x), x


def _gelu_tanh_bwd(x, g):
    xf = x.astype(jnp.float32)
    t = _tanh_inner(xf)
    dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * xf * xf)
    grad = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * dinner
    return ((g.astype(jnp.float32) * grad).astype(x.dtype),)


gelu_tanh.defvjp(_gelu_tanh_fwd, _gelu_tanh_bwd)
