"""AdamW with Megatron's learning-rate schedules and gradient clipping (optax).

Follows megatron/core/optimizer_param_scheduler.py (``OptimizerParamScheduler.get_lr``)
and megatron/core/optimizer/__init__.py (no weight decay on biases and norm parameters).
The schedule is a pure function of the number of optimizer steps already taken, so
iteration 1 uses ``lr(0)``, as in Megatron.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jmegatron.config import JMegatronConfig


def lr_schedule(cfg: JMegatronConfig) -> optax.Schedule:
    """``step (int, steps already taken) -> lr (float32)`` for ``cfg.lr_decay_style``.

    Linear warmup from 0 to ``lr`` over ``lr_warmup_iters``; then constant, linear,
    cosine, inverse-square-root, or WSD (warmup-stable-decay; the last
    ``lr_wsd_decay_iters`` of ``lr_decay_iters`` anneal with ``lr_wsd_decay_style``)
    down to ``min_lr``; ``min_lr`` after ``lr_decay_iters``.
    """
    max_lr, min_lr = float(cfg.lr), float(cfg.min_lr)
    warmup, decay = int(cfg.lr_warmup_iters), int(cfg.lr_decay_iters)
    style = cfg.lr_decay_style

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = max_lr * step / max(warmup, 1)
        if style == "constant":
            after = jnp.float32(max_lr)
        elif style == "inverse-square-root":
            after = jnp.maximum(min_lr, max_lr * jnp.sqrt(max(warmup, 1)) / jnp.sqrt(jnp.maximum(step, 1.0)))
        else:
            ratio = jnp.clip((step - warmup) / max(decay - warmup, 1), 0.0, 1.0)
            if style == "linear":
                coeff = 1.0 - ratio
            elif style == "cosine":
                coeff = 0.5 * (jnp.cos(jnp.pi * ratio) + 1.0)
            elif style == "WSD":
                anneal = int(cfg.lr_wsd_decay_iters)
                r = jnp.clip((step - (decay - anneal)) / max(anneal, 1), 0.0, 1.0)
                coeff = {
                    "linear": lambda: 1.0 - r,
                    "cosine": lambda: 0.5 * (jnp.cos(jnp.pi * r) + 1.0),
                    "exponential": lambda: 2.0 * jnp.power(0.5, r) - 1.0,
                    "minus_sqrt": lambda: 1.0 - jnp.sqrt(r),
                }[cfg.lr_wsd_decay_style]()
            else:  # pragma: no cover - validated by the config
                raise ValueError(f"lr_decay_style {style!r}")
            after = min_lr + coeff * (max_lr - min_lr)
        if style != "constant":
            after = jnp.where(step > decay, min_lr, after)
        return jnp.where((warmup > 0) & (step <= warmup), warm, after)

    return schedule


def weight_decay_mask(params: Any) -> Any:
    """True for matrices (``kernel``/``embedding`` leaves), False for biases and norm scales."""
    def decays(path, _):
        return getattr(path[-1], "key", None) in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: JMegatronConfig) -> optax.GradientTransformation:
    """Global-norm clipping (``clip_grad``; 0 disables) then AdamW in float32."""
    parts = []
    if cfg.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_grad))
    parts.append(optax.adamw(lr_schedule(cfg), b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, mask=weight_decay_mask))
    return optax.chain(*parts)
