"""AdamW with Megatron's learning-rate schedules and gradient clipping (optax).

Follows megatron/core/optimizer_param_scheduler.py (``OptimizerParamScheduler.get_lr``),
``get_optimizer_param_scheduler`` in megatron/training/training.py and
megatron/core/optimizer/__init__.py (no weight decay on biases and norm parameters); the
``multi-step`` decay is ByteMLPerf's (byte_train_perf/Megatron-LM, same file).

Megatron counts its schedule in samples: ``lr_warmup_steps = lr_warmup_iters *
global_batch_size`` (or ``lr_warmup_samples`` when ``train_samples`` is set), likewise the
decay lengths, and ``step(increment=<the iteration's global batch>)`` after each optimizer
step. Here the schedule is a pure function of the optimizer steps already taken (iteration 1
uses ``lr(0)``, as in Megatron): the samples consumed before step ``k`` follow from the
config (the global batch, or Megatron's batch-size ramp-up), so nothing but ``TrainState.step``
is carried and a resumed run gets the same rates. Every branch decision (still warming up,
which multi-step stage, past the decay) is precomputed on the host as a step threshold with
Megatron's float64 arithmetic, so the jitted schedule switches at exactly Megatron's
iterations; the values within a branch are float32.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmegatron.config import JMegatronConfig
from jmegatron.models.fp8 import FP8_META, fp8_labels
from jmegatron.num_microbatches_calculator import consumed_samples_at, global_batch_stages
from jmegatron.training.float16_optimizer import Float16Optimizer
from jmegatron.training.grad_scaler import GradScaler


def schedule_in_samples(cfg: JMegatronConfig, global_batch_size: int) -> dict:
    """Megatron's scheduler arguments in samples (``get_optimizer_param_scheduler``):
    ``init_lr``, ``max_lr``, ``min_lr``, ``lr_warmup_steps``, ``lr_decay_steps``,
    ``wsd_decay_steps`` (None unless WSD), ``lr_decay_style``, ``lr_wsd_decay_style``,
    ``multi_step`` (the three ratios)."""
    g = int(global_batch_size)
    if cfg.train_samples is None:  # iteration-based: lengths in iterations x the global batch
        decay = cfg.lr_decay_iters * g
        warmup = cfg.lr_warmup_iters * g
        wsd = cfg.lr_wsd_decay_iters * g if cfg.lr_wsd_decay_iters is not None else None
    else:
        decay = cfg.lr_decay_samples
        warmup = cfg.lr_warmup_samples
        wsd = cfg.lr_wsd_decay_samples
    if cfg.lr_warmup_fraction is not None:
        warmup = cfg.lr_warmup_fraction * decay
    return {"init_lr": float(cfg.lr_warmup_init), "max_lr": float(cfg.lr), "min_lr": float(cfg.min_lr),
            "lr_warmup_steps": warmup, "lr_decay_steps": decay, "wsd_decay_steps": wsd,
            "lr_decay_style": cfg.lr_decay_style, "lr_wsd_decay_style": cfg.lr_wsd_decay_style,
            "multi_step": tuple(float(r) for r in cfg.lr_decay_multi_step)}


def _last_step_where(pred: Callable[[int], bool], consumed: Callable[[int], int]) -> int:
    """The largest optimizer step ``s >= 0`` with ``pred(consumed(s))`` true (-1 if none), for a
    predicate true on a prefix of the steps (consumed samples grow with the step)."""
    if not pred(consumed(0)):
        return -1
    hi = 1
    while pred(consumed(hi)):
        hi *= 2
        if hi > 2 ** 31:
            return 2 ** 31 - 1
    lo = hi // 2  # pred(lo) true, pred(hi) false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(consumed(mid)):
            lo = mid
        else:
            hi = mid
    return lo


def lr_schedule(cfg: JMegatronConfig, global_batch_size: Optional[int] = None) -> optax.Schedule:
    """``step (int, optimizer steps taken) -> lr (float32)`` for ``cfg.lr_decay_style``.

    Megatron's get_lr of the samples consumed before the step: linear warm-up from
    ``lr_warmup_init`` to ``lr`` over the warm-up samples; then constant, linear, cosine,
    inverse-square-root, WSD (the last ``lr_wsd_decay_*`` of the decay anneal with
    ``lr_wsd_decay_style``) or ByteMLPerf's multi-step (``lr`` while the decay ratio <= r1,
    ``lr / sqrt(10)`` while <= r1 + r2, else ``lr * 0.1``, never below ``min_lr``) down to
    ``min_lr``; ``min_lr`` after the decay samples.

    ``global_batch_size``: the run's final global batch (default ``cfg.global_batch_size``).
    When neither is known (iteration-based, no ramp-up) the schedule is evaluated in units of
    one global batch, which equals Megatron's except inverse-square-root without warm-up
    (Megatron's ``max(num_steps, 1)`` is then one sample, not one iteration).
    """
    g = global_batch_size or cfg.global_batch_size or 1
    p = schedule_in_samples(cfg, g)
    stages = global_batch_stages(g, cfg.rampup_batch_size)
    consumed = lambda s: consumed_samples_at(stages, s)  # noqa: E731 - exact, Python ints
    max_lr, min_lr, init_lr = p["max_lr"], p["min_lr"], p["init_lr"]
    warmup, decay, wsd = p["lr_warmup_steps"], p["lr_decay_steps"], p["wsd_decay_steps"]
    style = p["lr_decay_style"]

    def ratio(n):  # Megatron's decay_ratio, float64
        return float(n - warmup) / float(decay - warmup) if decay != warmup else math.inf

    # step thresholds (last step where the condition holds), decided in float64 like Megatron
    last_warm = _last_step_where(lambda n: warmup > 0 and n <= warmup, consumed)
    last_decay = _last_step_where(lambda n: n <= decay, consumed)
    r1, r2, _ = p["multi_step"]
    last_stage1 = _last_step_where(lambda n: ratio(n) <= r1, consumed)
    last_stage2 = _last_step_where(lambda n: ratio(n) <= r1 + r2, consumed)
    anneal_start = decay - wsd if wsd is not None else 0
    last_stable = _last_step_where(lambda n: n <= anneal_start, consumed)

    # consumed samples in units of the final global batch, float32 (= the step when constant)
    first_steps = np.array([s[0] for s in stages], np.int32)
    first_units = np.array([s[1] / g for s in stages], np.float32)
    unit_per_step = np.array([s[2] / g for s in stages], np.float32)
    w_u, d_u = np.float32(warmup / g), np.float32(decay / g)
    one_sample = np.float32(1.0 / g)
    # denominators of the branches' values; a zero one belongs to a branch never taken
    warm_den = w_u if w_u > 0 else np.float32(1.0)
    decay_den = d_u - w_u if d_u > w_u else np.float32(1.0)

    def schedule(step):
        step = jnp.asarray(step, jnp.int32)
        steps_, units_, per_step_ = jnp.asarray(first_steps), jnp.asarray(first_units), jnp.asarray(unit_per_step)
        i = jnp.searchsorted(steps_, step, side="right") - 1
        x = units_[i] + (step - steps_[i]).astype(jnp.float32) * per_step_[i]
        warm = init_lr + (max_lr - init_lr) * x / warm_den
        if style == "constant":
            after = jnp.float32(max_lr)
        elif style == "inverse-square-root":
            after = jnp.maximum(min_lr, max_lr * jnp.sqrt(jnp.maximum(w_u, one_sample))
                                / jnp.sqrt(jnp.maximum(x, one_sample)))
        elif style == "multi-step":
            lr = jnp.where(step <= last_stage2, max_lr * (1 / math.sqrt(10)), max_lr * 0.1)
            after = jnp.where(step <= last_stage1, max_lr, jnp.maximum(min_lr, lr))
        else:
            r = jnp.clip((x - w_u) / decay_den, 0.0, 1.0)
            if style == "linear":
                coeff = 1.0 - r
            elif style == "cosine":
                coeff = 0.5 * (jnp.cos(jnp.pi * r) + 1.0)
            elif style == "WSD":
                a_u, wsd_u = np.float32(anneal_start / g), np.float32(wsd / g)
                rw = jnp.clip((x - a_u) / (wsd_u if wsd_u > 0 else np.float32(1.0)), 0.0, 1.0)
                coeff = {
                    "linear": lambda: 1.0 - rw,
                    "cosine": lambda: 0.5 * (jnp.cos(jnp.pi * rw) + 1.0),
                    "exponential": lambda: 2.0 * jnp.power(0.5, rw) - 1.0,
                    "minus_sqrt": lambda: 1.0 - jnp.sqrt(rw),
                }[p["lr_wsd_decay_style"]]()
                coeff = jnp.where(step <= last_stable, 1.0, coeff)
            else:  # pragma: no cover - validated by the config
                raise ValueError(f"lr_decay_style {style!r}")
            after = min_lr + coeff * (max_lr - min_lr)
        if style != "constant":
            after = jnp.where(step > last_decay, min_lr, after)
        return jnp.where(step <= last_warm, warm, after).astype(jnp.float32)

    return schedule


def weight_decay_mask(params: Any) -> Any:
    """True for matrices (``kernel``/``embedding`` leaves), False for biases and norm scales."""
    def decays(path, _):
        return getattr(path[-1], "key", None) in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: JMegatronConfig, global_batch_size: Optional[int] = None,
                   keep_float32: Optional[Callable[[tuple], bool]] = None):
    """Global-norm clipping (``clip_grad``; 0 disables) then AdamW in float32, the rate from
    :func:`lr_schedule` (``global_batch_size``: the run's final global batch).

    Returns the optax transformation; under ``bf16`` / ``fp16`` a
    :class:`~jmegatron.training.float16_optimizer.Float16Optimizer` around it (model
    parameters in that dtype, float32 main parameters, fp16's grad scaler), which leaves
    the parameters ``keep_float32(path)`` marks in float32 in the model too. With ``fp8``
    the ``fp8_meta`` leaves (:mod:`jmegatron.models.fp8`: amax histories and scales, which
    the train step sets after the update) get no update, no moments and stay out of the
    clipping norm and weight decay (``optax.multi_transform`` with ``set_to_zero``)."""
    parts = []
    if cfg.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_grad))
    parts.append(optax.adamw(lr_schedule(cfg, global_batch_size), b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, mask=weight_decay_mask))
    tx = optax.chain(*parts)
    if cfg.fp8 is not None:
        tx = optax.multi_transform({"params": tx, FP8_META: optax.set_to_zero()}, fp8_labels)
    if not (cfg.bf16 or cfg.fp16):
        return tx
    return Float16Optimizer(tx=tx, params_dtype=jnp.bfloat16 if cfg.bf16 else jnp.float16,
                            grad_scaler=GradScaler.from_config(cfg), keep_float32=keep_float32 or (lambda path: False))


def optimizer_steps(opt_state: Any, default: Any) -> Any:
    """Optimizer updates applied so far (int32 []): the learning-rate schedule's count
    (iterations minus the skipped ones: Megatron steps its scheduler only after a successful
    update), or ``default`` when the state has no schedule count."""
    found = [x.count for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
             if isinstance(x, optax.ScaleByScheduleState)]
    return found[0] if found else default
