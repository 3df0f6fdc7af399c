"""Loss balancing for distillation: ``LogitsAndIntermediatesLossBalancer``, traced and pure.

Combines the student's own loss ``O``, the logits distillation loss ``L`` and the
intermediate-layer losses into one scalar, with no host synchronisation: every
data-dependent ratio is a ``jax.lax.stop_gradient`` value (Megatron uses ``.item()``),
and every branch is a ``jnp.where`` on traced values, so it runs under ``jax.jit`` and
``jax.grad`` with a static graph.

Input convention (a mapping of scalar losses, already reduced by the masked mean):

* ``"student_loss"`` -- ``O``, the student's language-model loss (ModelOpt's
  ``STUDENT_LOSS_KEY``). May be omitted only when ``skip_original_loss=True``.
* ``"logits_loss"`` -- ``L``, exactly one logits loss (Megatron finds it by the class
  name ``LogitsKLLoss`` in ModelOpt's ``"<ClassName>_<i>"`` keys; here the key is fixed).
* ``"intermediate_<name>"`` -- any number (zero or more) of intermediate losses, e.g.
  ``"intermediate_decoder.layers.3"``.

Any other key raises ValueError; a missing ``"logits_loss"`` (or ``"student_loss"`` when
it is needed) raises KeyError; a non-scalar value raises ValueError.

Semantics (default; Megatron-LM ``megatron/post_training/algos/distillation.py`` as
corrected in commit 6ed528b68d, 2025-04-13, "Pytorch-based Pipeline-parallel distillation
support")::

    I = mean_k(I_k)                         (0 when there are none)
    if I > 0:  I_s = I * sg(L / I);  s = kd_loss_scale / 2
    else:      I_s = sg(I);          s = kd_loss_scale      (Megatron: I.new_tensor(I))
    skip_original_loss:  total = L + I_s
    otherwise:           kd = (L + I_s) * s;   total = O + kd * sg(O / kd)

Note what the last line implies: the value is ``2 * O`` and the gradient is
``dO + O / (L + I_s) * d(L + I_s)`` -- ``s`` cancels, so ``kd_loss_scale`` (and its
halving) has no effect on values or gradients in this version either (it only avoids
the ``kd == 0`` division, which crashed Megatron with ZeroDivisionError; here
``kd <= 0`` gives ``total = O + kd``). The fix came later in ModelOpt's
``modelopt/torch/distill/plugins/megatron.py`` (commit 9aedfdf71, 2025-09-16, "Update
distill Megatron plugin"; the Megatron-LM copy was removed in 63d4e7db85, 2025-11-21, in
favour of that plugin), selected here by ``scale_after_normalization=True``::

    I_s as above (no halving);  kd = L + I_s
    kd_n = kd * sg(O / kd)  if kd > 0 and O > 0  else kd    (guard: ModelOpt 9e280f469)
    total = O + kd_n * kd_loss_scale

Offline-logits form (``kd_loss_alpha=a``; Megatron-LM
``megatron/training/distillation/cached_logits_loss.py``, ``LossFuncCallable``, commit
277c4f8040, 2026-06-12, where only the logits loss exists)::

    total = (1 - a) * O + a * (L + I_s)

The 2024 original (commit 1c2c7dc79d, 2024-10-29, ``megatron/inference/algos/
distillation.py``) popped only ``O``; it found ``L`` by iterating over the dict without
popping it, then set ``intermediate_loss = sum(loss_dict.values())``, i.e.
``I = L + sum_k I_k`` (a sum, not a mean, and including ``L``)::

    I > 0 (always, once L > 0):  I_s = I * (L.item() / I.item())  (value L);  s = kd_loss_scale / 2
    skip_original_loss:  total = L + I_s   -> value 2L; with no intermediates, gradient 2 dL
    otherwise:           kd = (L + I_s) * s;  total = O + kd * (O.item() / kd.item())

so the logits loss was counted twice, and ``kd_loss_scale`` was ignored: unused in the
skip branch (as its docstring says) and cancelled by the ``O / kd`` normalisation in the
other. It also returned the bare total rather than the report dict.

Returns ``(total, report)`` with ``report = {"kd_loss": total, "logits_loss": L,
"intermediate_loss": I}`` (Megatron's keys; ``"kd_loss"`` is the *total*, as upstream),
report values under ``stop_gradient``. All values are float32 (float64 for float64 input).
Zero or negative denominators never produce NaN or inf, in values or gradients (the
divisions use a denominator replaced by 1 where unused: the double-``where`` trick).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

STUDENT_LOSS_KEY = "student_loss"
LOGITS_LOSS_KEY = "logits_loss"
INTERMEDIATE_PREFIX = "intermediate_"


def _split_losses(losses: Mapping[str, Any], need_student: bool
                  ) -> tuple[Optional[Array], Array, tuple[Array, ...]]:
    unknown = [k for k in losses if k not in (STUDENT_LOSS_KEY, LOGITS_LOSS_KEY)
               and not (isinstance(k, str) and k.startswith(INTERMEDIATE_PREFIX))]
    if unknown:
        raise ValueError(f"unexpected loss keys {unknown}; expected {STUDENT_LOSS_KEY!r}, "
                         f"{LOGITS_LOSS_KEY!r} and {INTERMEDIATE_PREFIX!r}<name>")
    if LOGITS_LOSS_KEY not in losses:
        raise KeyError(f"losses has no {LOGITS_LOSS_KEY!r} entry (got {sorted(losses)})")
    if need_student and STUDENT_LOSS_KEY not in losses:
        raise KeyError(f"losses has no {STUDENT_LOSS_KEY!r} entry, needed unless "
                       f"skip_original_loss=True (got {sorted(losses)})")

    def scalar(key: str) -> Array:
        value = jnp.asarray(losses[key])
        if value.shape != ():
            raise ValueError(f"loss {key!r} must be a scalar, got shape {value.shape}")
        return value

    student = scalar(STUDENT_LOSS_KEY) if STUDENT_LOSS_KEY in losses else None
    inter = tuple(scalar(k) for k in sorted(losses) if k.startswith(INTERMEDIATE_PREFIX))
    return student, scalar(LOGITS_LOSS_KEY), inter


def _safe_ratio(num: Array, den: Array, use: Array) -> Array:
    """``stop_gradient(num / den)`` where ``use``, else 0; never NaN/inf, nor in gradients."""
    return jax.lax.stop_gradient(jnp.where(use, num / jnp.where(use, den, 1.0), 0.0))


@functools.partial(jax.jit, static_argnames=("kd_loss_scale", "skip_original_loss",
                                             "kd_loss_alpha", "scale_after_normalization"))
def _balance(student: Optional[Array], logits: Array, intermediates: tuple[Array, ...], *,
             kd_loss_scale: float, skip_original_loss: bool, kd_loss_alpha: Optional[float],
             scale_after_normalization: bool) -> tuple[Array, dict[str, Array]]:
    dtype = jnp.float32
    for x in (student, logits, *intermediates):
        if x is not None:
            dtype = jnp.promote_types(dtype, x.dtype)
    logits = logits.astype(dtype)
    student = jnp.zeros((), dtype) if student is None else student.astype(dtype)
    if intermediates:
        inter = sum(x.astype(dtype) for x in intermediates) / len(intermediates)
    else:
        inter = jnp.zeros((), dtype)

    has_inter = inter > 0
    # Megatron's else branch re-wraps I with ``new_tensor`` (detached): no gradient there.
    inter_scaled = jnp.where(has_inter, inter * _safe_ratio(logits, inter, has_inter),
                             jax.lax.stop_gradient(inter))
    kd_sum = logits + inter_scaled

    if skip_original_loss:
        total = kd_sum
    elif kd_loss_alpha is not None:
        total = (1.0 - kd_loss_alpha) * student + kd_loss_alpha * kd_sum
    elif scale_after_normalization:
        normalise = (kd_sum > 0) & (student > 0)
        kd = jnp.where(normalise, kd_sum * _safe_ratio(student, kd_sum, normalise), kd_sum)
        total = student + kd * kd_loss_scale
    else:
        scale = jnp.where(has_inter, kd_loss_scale / 2.0, kd_loss_scale).astype(dtype)
        kd = kd_sum * scale
        normalise = kd > 0
        total = student + jnp.where(normalise, kd * _safe_ratio(student, kd, normalise), kd)

    report = {"kd_loss": total, "logits_loss": logits, "intermediate_loss": inter}
    return total, jax.lax.stop_gradient(report)


def balance_losses(losses: Mapping[str, Any], *, kd_loss_scale: float = 1.0,
                   skip_original_loss: bool = False, kd_loss_alpha: Optional[float] = None,
                   scale_after_normalization: bool = False) -> tuple[Array, dict[str, Array]]:
    """Function form of :class:`LogitsAndIntermediatesLossBalancer` (see the module doc).

    Args:
      losses: scalar losses keyed ``"student_loss"``, ``"logits_loss"``,
        ``"intermediate_<name>"`` (arrays or Python numbers; traced values are fine).
      kd_loss_scale, skip_original_loss, kd_loss_alpha, scale_after_normalization: as the
        class fields.

    Returns:
      ``(total, {"kd_loss": total, "logits_loss": L, "intermediate_loss": I})``.

    Raises:
      KeyError / ValueError: bad keys or non-scalar values (module doc); ValueError for
      invalid settings (see the class).
    """
    _check_settings(kd_loss_scale, skip_original_loss, kd_loss_alpha, scale_after_normalization)
    need_student = not skip_original_loss
    student, logits, inter = _split_losses(losses, need_student)
    return _balance(student, logits, inter, kd_loss_scale=float(kd_loss_scale),
                    skip_original_loss=bool(skip_original_loss),
                    kd_loss_alpha=None if kd_loss_alpha is None else float(kd_loss_alpha),
                    scale_after_normalization=bool(scale_after_normalization))


def _check_settings(kd_loss_scale: float, skip_original_loss: bool,
                    kd_loss_alpha: Optional[float], scale_after_normalization: bool) -> None:
    if not kd_loss_scale > 0:
        raise ValueError(f"kd_loss_scale must be > 0 (as ModelOpt asserts), got {kd_loss_scale!r}")
    if kd_loss_alpha is not None:
        if not 0.0 <= kd_loss_alpha <= 1.0:
            raise ValueError(f"kd_loss_alpha must be in [0, 1], got {kd_loss_alpha!r}")
        if skip_original_loss or scale_after_normalization:
            raise ValueError("kd_loss_alpha is a separate weighting mode; it cannot be combined "
                             "with skip_original_loss or scale_after_normalization")


@dataclasses.dataclass(frozen=True)
class LogitsAndIntermediatesLossBalancer:
    """Frozen, hashable balancer config; ``balancer(losses) -> (total, report)``.

    Mirrors Megatron's ``LogitsAndIntermediatesLossBalancer(kd_loss_scale,
    skip_original_loss)`` -- the formulas, key convention and version history are in the
    module docstring. The computation is a jitted pure function (no ``.item()``, no
    Python branch on values).

    Fields:
      kd_loss_scale: weight of the distillation part (> 0). In the default (Megatron
        2025-04) formula it is halved when intermediate losses are present and then
        cancelled by the ``O / kd`` normalisation; with ``scale_after_normalization`` it
        multiplies the normalised KD loss (ModelOpt since 2025-09).
      skip_original_loss: ``total = L + I_s`` (Megatron's ``skip_lm_loss``); the student
        loss may then be absent from the dict.
      kd_loss_alpha: if set, ``total = (1 - a) * O + a * (L + I_s)`` (a in [0, 1]).
      scale_after_normalization: use ModelOpt's corrected placement of kd_loss_scale.

    Raises ValueError at construction for ``kd_loss_scale <= 0``, ``kd_loss_alpha``
    outside [0, 1], or ``kd_loss_alpha`` combined with another mode.
    """

    kd_loss_scale: float = 1.0
    skip_original_loss: bool = False
    kd_loss_alpha: Optional[float] = None
    scale_after_normalization: bool = False

    def __post_init__(self) -> None:
        _check_settings(self.kd_loss_scale, self.skip_original_loss, self.kd_loss_alpha,
                        self.scale_after_normalization)

    def __call__(self, losses: Mapping[str, Any]) -> tuple[Array, dict[str, Array]]:
        return balance_losses(losses, kd_loss_scale=self.kd_loss_scale,
                              skip_original_loss=self.skip_original_loss,
                              kd_loss_alpha=self.kd_loss_alpha,
                              scale_after_normalization=self.scale_after_normalization)
