"""FP8 linear layers with delayed scaling, in pure JAX (runs on any backend; the CPU has
the float8 dtypes and their dots).

Megatron-LM trains its linear layers in FP8 through Transformer Engine
(megatron/core/fp8_utils.py, ``TransformerConfig.fp8`` / ``fp8_margin`` /
``fp8_amax_history_len`` / ``fp8_amax_compute_algo``, TE's ``DelayedScaling`` recipe).
This module is that recipe written out (the contract is docs/PRECISION.md, "FP8 meta"):

* Each FP8 linear layer holds among its parameters a subtree ``fp8_meta`` of float32
  leaves (:func:`init_fp8_meta`): ``{input,kernel,output_grad}_amax_history``
  ``[fp8_amax_history_len]`` (newest first) and ``{input,kernel,output_grad}_scale`` ``[]``
  (TE's ``scale``: ``x_fp8 = cast(x * scale)``, ``x = x_fp8 / scale``).
* :func:`fp8_dot_general`: the forward quantizes the input and the kernel to e4m3 with
  their current scales (values clipped to the format's largest finite value), contracts
  them in FP8 with float32 accumulation and rescales; the backward quantizes the output
  gradient (e4m3, or e5m2 for ``fp8="hybrid"``) and computes the input and weight
  gradients as FP8 dots. The "gradient" of each amax history is the amax observed this
  step at index 0 (zeros elsewhere), that of each scale zero: the train step combines them
  with **max** (:func:`combine`) over micro-batches and ranks, never a sum, and after the
  optimizer step :func:`update_fp8_meta` rolls the histories and recomputes the scales
  (TE's ``_default_sf_compute``). The optimizer, clipping, the grad norm and weight decay
  skip these leaves (:func:`is_fp8_meta`).

Carrying the observed amax as a cotangent is the approach of Flax's ``fp8_ops`` (its
``OVERWRITE_WITH_GRADIENT`` collection); unlike Flax and TE's JAX modules, which sum such
cotangents when a layer runs several times in one step (gradient accumulation, a scan
over layers), the step here takes their maximum, so accumulating micro-batches gives the
history a single batch would give.

Not built here (Transformer Engine's): current scaling, MXFP8, FP8 attention, FP8
grouped GEMMs for MoE experts, and FP8 layers under sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.parallel.rules import FP8_META, is_fp8_meta

Array = jax.Array

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
# Largest finite values (TE's Format: e4m3 448, e5m2 57344)
FP8_MAX = {jnp.dtype(E4M3): float(jnp.finfo(E4M3).max), jnp.dtype(E5M2): float(jnp.finfo(E5M2).max)}
TENSORS = ("input", "kernel", "output_grad")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")


def grad_dtype(fp8: str):
    """The output gradient's FP8 dtype for Megatron's ``--fp8-format``: e4m3 for "e4m3",
    e5m2 for "hybrid". Raises ValueError for another name."""
    if fp8 == "e4m3":
        return E4M3
    if fp8 == "hybrid":
        return E5M2
    raise ValueError(f"fp8={fp8!r} must be 'e4m3' or 'hybrid'")


def fp8_max(tensor: str, fp8: str) -> float:
    """The largest finite value of ``tensor``'s format ("input" / "kernel": e4m3;
    "output_grad": :func:`grad_dtype`)."""
    return FP8_MAX[jnp.dtype(E4M3 if tensor != "output_grad" else grad_dtype(fp8))]


def init_fp8_meta(amax_history_len: int) -> dict[str, Array]:
    """A layer's initial FP8 meta: histories zeros ``[amax_history_len]``, scales 1 (float32)."""
    out = {}
    for t in TENSORS:
        out[f"{t}_amax_history"] = jnp.zeros((amax_history_len,), jnp.float32)
        out[f"{t}_scale"] = jnp.ones((), jnp.float32)
    return out


def quantize(x: Array, scale: Array, dtype) -> Array:
    """``cast(clip(x * scale, -max, max), dtype)``: any float ``x`` to FP8 ``dtype`` (e4m3 /
    e5m2) with a float32 scalar ``scale``; values beyond the format's largest finite value
    saturate to it (TE's cast), so a stale scale never gives inf or NaN."""
    m = FP8_MAX[jnp.dtype(dtype)]
    return jnp.clip(x.astype(jnp.float32) * scale, -m, m).astype(dtype)


def _amax(x: Array) -> Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _dims_check(dims):
    (x_contract, k_contract), batch = dims
    if batch != ((), ()):
        raise ValueError(f"fp8_dot_general: batch dimensions {batch} are not supported (Linear has none)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_dot_general(x: Array, kernel: Array, meta: Mapping[str, Array], dims, fp8: str = "hybrid") -> Array:
    """``jax.lax.dot_general(x, kernel, dims)`` computed in FP8 with delayed scaling.

    ``x``, ``kernel``: any float dtype (the compute dtype), shapes as ``dot_general`` with no
    batch dimensions; ``meta``: one layer's FP8 meta (:func:`init_fp8_meta`: the scales
    are used, the histories only receive the cotangents); ``fp8``: "e4m3" | "hybrid" (the
    output gradient's format). Returns ``x.dtype``: ``dot(q(x), q(kernel)) / (sx * sk)``,
    the dot in FP8 with float32 accumulation (``preferred_element_type``).

    The VJP gives FP8 input / weight gradients (the output gradient quantized with
    ``output_grad_scale``) and, for ``meta``, the amaxes observed now: each
    ``*_amax_history`` cotangent holds its tensor's amax at index 0 and zeros elsewhere,
    each scale's is zero. Raises ValueError for batch dimensions.
    """
    return _fp8_fwd(x, kernel, meta, dims, fp8)[0]


def _fp8_fwd(x, kernel, meta, dims, fp8):
    _dims_check(dims)
    sx, sk = meta["input_scale"], meta["kernel_scale"]
    qx, qk = quantize(x, sx, E4M3), quantize(kernel, sk, E4M3)
    y = jax.lax.dot_general(qx, qk, dims, preferred_element_type=jnp.float32) / (sx * sk)
    res = (qx, qk, sx, sk, meta["output_grad_scale"], _amax(x), _amax(kernel), meta,
           jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype))
    return y.astype(x.dtype), res


def _fp8_bwd(dims, fp8, res, g):
    qx, qk, sx, sk, sg, x_amax, k_amax, meta, x_like, k_like = res
    (x_contract, k_contract), _ = dims
    qg = quantize(g, sg, grad_dtype(fp8))
    x_free = tuple(a for a in range(qx.ndim) if a not in x_contract)
    k_free = tuple(a for a in range(qk.ndim) if a not in k_contract)
    n_xf = len(x_free)
    g_kfree = tuple(range(n_xf, g.ndim))  # g = [x's free axes, kernel's free axes]
    # dgrad: contract g's kernel-free axes with the kernel's -> [x_free..., k_contract ascending]
    dx = jax.lax.dot_general(qg, qk, ((g_kfree, k_free), ((), ())), preferred_element_type=jnp.float32)
    k_sorted = sorted(k_contract)
    src = [None] * qx.ndim  # result axis of each x axis
    for i, a in enumerate(x_free):
        src[a] = i
    for a, b in zip(x_contract, k_contract):
        src[a] = n_xf + k_sorted.index(b)
    dx = jnp.transpose(dx, src) / (sg * sk)
    # wgrad: contract x's free axes with g's first ones -> [x_contract ascending, k_free...]
    dk = jax.lax.dot_general(qx, qg, ((x_free, tuple(range(n_xf))), ((), ())), preferred_element_type=jnp.float32)
    x_sorted = sorted(x_contract)
    srck = [None] * qk.ndim
    for i, b in enumerate(k_free):
        srck[b] = len(x_contract) + i
    for a, b in zip(x_contract, k_contract):
        srck[b] = x_sorted.index(a)
    dk = jnp.transpose(dk, srck) / (sx * sg)
    observed = {"input": x_amax, "kernel": k_amax, "output_grad": _amax(g)}
    dmeta = {}
    for name, leaf in meta.items():
        t = name[: -len("_amax_history")] if name.endswith("_amax_history") else None
        dmeta[name] = jnp.zeros_like(leaf) if t is None else jnp.zeros_like(leaf).at[0].set(observed[t])
    return dx.astype(x_like.dtype), dk.astype(k_like.dtype), dmeta


fp8_dot_general.defvjp(_fp8_fwd, _fp8_bwd)


@dataclasses.dataclass(frozen=True)
class Fp8DotGeneral:
    """The ``dot_general`` of an FP8 :class:`jmegatron.models.layers.Linear`: Linear calls
    :meth:`for_layer` inside its own scope, which creates the layer's ``fp8_meta``
    parameter (float32 leaves, logical axes replicated: ``(None,)`` / ``()``; stacked
    ``[layers, ...]`` under ``nn.scan`` like every layer parameter) and returns the bound
    :func:`fp8_dot_general`. ``fp8``: "e4m3" | "hybrid"; ``amax_history_len`` >= 1."""

    fp8: str = "hybrid"
    amax_history_len: int = 1

    def for_layer(self, module: nn.Module) -> Callable:
        """``(x, kernel, dims, precision=None, preferred_element_type=None) -> y`` for the
        Linear ``module`` (called inside its compact ``__call__``)."""
        grad_dtype(self.fp8)  # validates the name

        def init(_):
            return {name: nn.LogicallyPartitioned(value, (None,) * value.ndim)
                    for name, value in init_fp8_meta(self.amax_history_len).items()}

        meta = module.param(FP8_META, init)

        def dot_general(x, kernel, dims, precision=None, preferred_element_type=None):
            del precision, preferred_element_type  # FP8: float32 accumulation, the output in x's dtype
            return fp8_dot_general(x, kernel, meta, dims, self.fp8)

        return dot_general

    def __call__(self, *args, **kwargs):
        raise TypeError("Fp8DotGeneral holds per-layer parameters: pass it as Linear's dot_general "
                        "(Linear calls for_layer in its scope)")


def meta_flags(tree: Any) -> Any:
    """``tree``'s structure with True at the leaves inside ``fp8_meta`` subtrees."""
    return jax.tree_util.tree_map_with_path(lambda p, _: is_fp8_meta(p), tree)


def fp8_labels(params: Any) -> Any:
    """``optax.multi_transform`` labels: ``"fp8_meta"`` for the meta leaves, ``"params"`` else."""
    return jax.tree_util.tree_map_with_path(lambda p, _: FP8_META if is_fp8_meta(p) else "params", params)


def combine(a: Any, b: Any) -> Any:
    """Two gradient trees of the same structure combined: ``max`` for ``fp8_meta`` leaves
    (observed amaxes), ``a + b`` for every other leaf (gradient accumulation)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x, y: jnp.maximum(x, y) if is_fp8_meta(p) else x + y, a, b)


def has_fp8_meta(tree: Any) -> bool:
    """Whether any leaf of ``tree`` lies inside an ``fp8_meta`` subtree."""
    return any(is_fp8_meta(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree))


def update_layer_meta(meta: Mapping[str, Array], observed: Mapping[str, Array], *, fp8: str,
                      margin: int = 0, amax_compute_algo: str = "most_recent") -> dict:
    """One layer's meta after a step (leaves may be stacked ``[..., H]`` / ``[...]``):
    ``history = [observed[..., 0], history[..., :-1]]``; ``amax = max(history)`` ("max") or
    ``history[..., 0]`` ("most_recent"); ``scale = fp8_max / amax / 2**margin`` where
    ``amax`` is > 0 and finite, else the old scale (TE's ``_default_sf_compute``).
    ``observed``: the combined cotangents of :func:`fp8_dot_general` (index 0 of each history
    leaf). Raises ValueError for an unknown ``amax_compute_algo``."""
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"fp8_amax_compute_algo={amax_compute_algo!r} must be one of {AMAX_COMPUTE_ALGOS}")
    out = dict(meta)
    for t in TENSORS:
        hist = meta[f"{t}_amax_history"]
        new = jnp.concatenate([observed[f"{t}_amax_history"][..., :1].astype(jnp.float32), hist[..., :-1]], axis=-1)
        amax = jnp.max(new, axis=-1) if amax_compute_algo == "max" else new[..., 0]
        old = meta[f"{t}_scale"]
        ok = (amax > 0.0) & jnp.isfinite(amax)
        scale = fp8_max(t, fp8) / jnp.where(ok, amax, 1.0) / (2.0 ** margin)
        out[f"{t}_amax_history"] = new
        out[f"{t}_scale"] = jnp.where(ok, scale, old).astype(jnp.float32)
    return out


def update_fp8_meta(params: Any, grads: Any, *, fp8: str, margin: int = 0,
                    amax_compute_algo: str = "most_recent") -> Any:
    """``params`` with every ``fp8_meta`` subtree advanced by :func:`update_layer_meta`
    from the same subtree of ``grads`` (the step's combined observations); other leaves
    unchanged. ``params`` / ``grads``: nested dicts of the same structure. Megatron: TE's
    amax and scale update after each optimizer step (fp8_margin, fp8_amax_compute_algo)."""
    def visit(p, g):
        if not isinstance(p, Mapping):
            return p
        return {k: (update_layer_meta(v, g[k], fp8=fp8, margin=margin, amax_compute_algo=amax_compute_algo)
                    if k == FP8_META else visit(v, g[k])) for k, v in p.items()}

    return visit(params, grads)
