"""fp16 loss scaling: Megatron's ConstantGradScaler and DynamicGradScaler as pure functions.

Follows megatron/core/optimizer/grad_scaler.py. The scale multiplies the loss before the
backward pass; the optimizer divides the gradients by it (``inv_scale``), checks them for
inf/nan (``found_inf``) and skips the update when any is found. The dynamic scaler then
updates its scale:

* an overflowing iteration resets the growth tracker and decrements the hysteresis
  tracker; once that reaches 0 the scale is multiplied by ``backoff_factor`` (0.5),
  never below ``min_loss_scale``;
* a clean iteration increments the growth tracker; after ``loss_scale_window`` clean
  iterations in a row the scale is multiplied by ``growth_factor`` (2) and the
  hysteresis tracker is reset to ``hysteresis``.

The state is a pytree of scalars carried in the optimizer state (Megatron saves it with the
optimizer's state dict), so a resumed run continues with the same scale.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class GradScalerState:
    """``scale`` float32 []: the loss scale; ``growth_tracker`` / ``hysteresis_tracker``
    int32 []: Megatron's ``_growth_tracker`` / ``_hysteresis_tracker``."""

    scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array


@dataclasses.dataclass(frozen=True)
class GradScaler:
    """fp16 loss scaling. ``dynamic`` False: Megatron's ConstantGradScaler (the scale never
    changes); True: DynamicGradScaler with ``initial_scale``, ``min_scale``,
    ``growth_interval`` (``loss_scale_window``), ``hysteresis``, ``growth_factor`` 2 and
    ``backoff_factor`` 0.5 (Megatron's get_megatron_optimizer). Raises ValueError for a
    non-positive scale or interval."""

    initial_scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self):
        if not self.initial_scale > 0 or not self.min_scale > 0:
            raise ValueError(f"loss scales must be > 0: initial {self.initial_scale}, min {self.min_scale}")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"loss_scale_window ({self.growth_interval}) and hysteresis ({self.hysteresis}) must be >= 1")

    @classmethod
    def from_config(cls, cfg) -> Optional["GradScaler"]:
        """The scaler of a JMegatronConfig: None unless ``fp16``; constant with ``loss_scale``."""
        if not cfg.fp16:
            return None
        if cfg.loss_scale is not None:
            return cls(initial_scale=float(cfg.loss_scale), dynamic=False)
        return cls(initial_scale=float(cfg.initial_loss_scale), min_scale=float(cfg.min_loss_scale),
                   growth_interval=int(cfg.loss_scale_window), hysteresis=int(cfg.hysteresis))

    def init(self) -> GradScalerState:
        return GradScalerState(scale=jnp.float32(self.initial_scale), growth_tracker=jnp.int32(0),
                               hysteresis_tracker=jnp.int32(self.hysteresis))

    def update(self, state: GradScalerState, found_inf: jax.Array) -> GradScalerState:
        """The state after an iteration; ``found_inf`` bool []: its gradients were not finite.
        Traceable (no host round trip)."""
        if not self.dynamic:
            return state
        # overflow: reset growth, count down hysteresis, back off once it is exhausted
        hyst_inf = state.hysteresis_tracker - 1
        scale_inf = jnp.where(hyst_inf <= 0, jnp.maximum(state.scale * self.backoff_factor, self.min_scale),
                              state.scale)
        # clean: count up growth; after growth_interval clean iterations grow and reset hysteresis
        growth = state.growth_tracker + 1
        grow = growth == self.growth_interval
        scale_ok = jnp.where(grow, state.scale * self.growth_factor, state.scale)
        return GradScalerState(
            scale=jnp.where(found_inf, scale_inf, scale_ok).astype(jnp.float32),
            growth_tracker=jnp.where(found_inf, 0, jnp.where(grow, 0, growth)).astype(jnp.int32),
            hysteresis_tracker=jnp.where(found_inf, hyst_inf,
                                         jnp.where(grow, self.hysteresis, state.hysteresis_tracker)).astype(jnp.int32))
