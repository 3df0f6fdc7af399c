"""bf16 / fp16 model parameters with float32 main parameters held by the optimizer.

Megatron's ``Float16OptimizerWithFloat16Params`` (megatron/core/optimizer/optimizer.py) and
its distributed counterpart: the model (``TrainState.params``) holds its parameters in the
compute dtype, the optimizer holds a float32 copy (the *main* parameters) and its moments;
each iteration the float32 main gradients are (fp16) unscaled and checked for inf/nan, the
optimizer updates the main parameters, and the model parameters are copied from them. Under
the distributed optimizer (ZeRO-1) the main parameters are sharded like the moments.

Where the gradients accumulate (float32 when ``accumulate_allreduce_grads_in_fp32``, else
the parameters' dtype) is the train step's business (:mod:`jmegatron.training.step`).

Leaves that must stay float32 in the model too (``keep_float32(path)``: the routers'
``expert_bias`` buffers, FP8 amax histories and scales) are not cast.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jmegatron.training.grad_scaler import GradScaler, GradScalerState


@flax.struct.dataclass
class Float16OptimizerState:
    """``main_params``: float32 copy of the parameters (the gradients' layout);
    ``inner``: the wrapped optax transformation's state of them; ``grad_scaler``:
    :class:`GradScalerState` under fp16, else None."""

    main_params: Any
    inner: Any
    grad_scaler: Optional[GradScalerState] = None


def _never(path) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Float16Optimizer:
    """``tx`` (optax, run on the float32 main parameters) with model parameters in
    ``params_dtype`` (bfloat16 or float16) and optional fp16 loss scaling
    (``grad_scaler``). Use through :func:`init` / :func:`model_params` /
    :func:`apply_gradients` (the train step and state initialisation do)."""

    tx: optax.GradientTransformation
    params_dtype: Any
    grad_scaler: Optional[GradScaler] = None
    keep_float32: Callable[[tuple], bool] = _never

    def init(self, params32: Any) -> Float16OptimizerState:
        """The optimizer state of float32 parameters (the main parameters are a copy)."""
        main = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params32)
        return Float16OptimizerState(main_params=main, inner=self.tx.init(main),
                                     grad_scaler=None if self.grad_scaler is None else self.grad_scaler.init())

    def model_params(self, main: Any) -> Any:
        """The model's parameters from the main ones: floating leaves cast to
        ``params_dtype`` (round to nearest even), ``keep_float32`` leaves unchanged. Works on
        arrays and on ShapeDtypeStructs."""
        def cast(path, p):
            if self.keep_float32(path) or not jnp.issubdtype(p.dtype, jnp.floating):
                return p
            if isinstance(p, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(p.shape, self.params_dtype, sharding=p.sharding)
            return p.astype(self.params_dtype)

        return jax.tree_util.tree_map_with_path(cast, main)

    def loss_scale(self, state: Float16OptimizerState) -> Optional[jax.Array]:
        """The loss scale (float32 []) the next backward multiplies by, or None (no scaling)."""
        return None if state.grad_scaler is None else state.grad_scaler.scale


def all_finite(tree: Any, exclude: Callable[[tuple], bool] = _never) -> jax.Array:
    """bool []: every floating leaf of ``tree`` is finite (no inf, no nan), leaves
    ``exclude(path)`` marks left out (FP8's observed amaxes); True for a tree without
    floating leaves. Traceable: under jit over sharded leaves XLA reduces each shard
    and all-reduces one bool (no host round trip)."""
    checked = [jnp.all(jnp.isfinite(x)) for path, x in jax.tree_util.tree_leaves_with_path(tree)
               if not exclude(path) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(checked)) if checked else jnp.bool_(True)


def keep_if(skip: jax.Array, new: Any, old: Any) -> Any:
    """``old`` where ``skip`` (bool []) is True, else ``new``, leaf by leaf (same
    structure): how a skipped iteration leaves parameters, moments and buffers unchanged
    (Megatron's optimizer returns before ``step()`` when ``found_inf``)."""
    return jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)


def apply_gradients(opt: Float16Optimizer, grads: Any, state: Float16OptimizerState,
                    finalize: Optional[Callable[[Any, Any], Any]] = None,
                    observed: Callable[[tuple], bool] = _never, check_finite: bool = False,
                    skip: Optional[jax.Array] = None):
    """One optimizer step on the main parameters.

    ``grads``: float32, scaled by the state's loss scale when there is one, laid out as the
    main parameters. Returns ``(model_params, new_state, grads, found_inf)``: ``grads``
    unscaled (what clipping and the grad norm saw); ``found_inf`` bool []: the iteration is
    skipped, because the unscaled gradients are not finite (checked under a grad scaler, as
    Megatron's ``_unscale_main_grads_and_check_for_nan``, or with ``check_finite``: Megatron's
    ``check_for_nan_in_loss_and_grad``) or because ``skip`` (bool [], optional: e.g. a
    non-finite loss) says so; always False without a scaler, ``check_finite`` or ``skip``.
    When it is True the main parameters and moments (the schedule's count among them) are
    kept (:func:`keep_if`) and only the scaler advances, backing off (Megatron skips the
    iteration). ``finalize(main, grads) -> main`` (optional) edits the updated main
    parameters before the model's are cast from them (buffers, FP8 meta; kept too on a
    skipped iteration). ``observed(path)`` marks leaves whose "gradient" is an observation
    (FP8's amaxes of the scaled backward): neither unscaled nor checked."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    found_inf = jnp.bool_(False)
    scaler = state.grad_scaler
    if scaler is not None:
        inv = 1.0 / scaler.scale
        grads = jax.tree_util.tree_map_with_path(lambda path, g: g if observed(path) else g * inv, grads)
    checking = scaler is not None or check_finite or skip is not None
    if scaler is not None or check_finite:
        found_inf = jnp.logical_not(all_finite(grads, observed))
    if skip is not None:
        found_inf = jnp.logical_or(found_inf, skip)
    if scaler is not None:
        scaler = opt.grad_scaler.update(scaler, found_inf)
    updates, inner = opt.tx.update(grads, state.inner, state.main_params)
    main = optax.apply_updates(state.main_params, updates)
    if finalize is not None:
        main = finalize(main, grads)
    if checking:  # skip the iteration: keep the main parameters and moments
        main = keep_if(found_inf, main, state.main_params)
        inner = keep_if(found_inf, inner, state.inner)
    new_state = Float16OptimizerState(main_params=main, inner=inner, grad_scaler=scaler)
    return opt.model_params(main), new_state, grads, found_inf
