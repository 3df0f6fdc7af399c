"""Distillation losses: logits KL, hidden-state cosine and MSE, and the student projection.

Pure functions on ``[batch, seq, ...]`` arrays that return a per-token loss
``[batch, seq]`` (every leading axis is kept; only the last, feature axis is reduced).
The masked mean over tokens is the caller's loss function's job, as in Megatron, where
``BaseLoss.post_forward`` hands the unreduced ``[b, s]`` loss to ``loss_func._mask_loss``.

Followed: Megatron-LM ``megatron/post_training/algos/distillation.py`` (classes
``LogitsKLLoss``, ``HiddenStateCosineLoss``, ``MSELoss``, ``ProjectionLayer``; first
added 2024-10-29 as ``megatron/inference/algos/distillation.py``, commit 1c2c7dc79d, and
moved in 2025-11 to NVIDIA ModelOpt's ``modelopt/torch/distill/plugins/megatron.py``).
Differences from Megatron, all deliberate:

* Layout ``[batch, seq, ...]`` instead of Megatron's ``[seq, batch, ...]`` followed by a
  transpose; there is no ``model_config`` argument (the tensor-parallel case is selected
  by ``tensor_axis``, a mesh axis name, instead of ``tensor_model_parallel_size > 1``).
* Math is done in at least float32 (bf16/fp16 inputs are upcast, float64 stays float64).
* The teacher side is always under ``jax.lax.stop_gradient`` (Megatron: ``.detach()``).
* Zero-probability vocabulary entries contribute exactly 0 to the KL on every path
  (torch's ``kl_div`` with ``log_target=False`` does this on Megatron's single-rank
  path; its tensor-parallel ``log_target=True`` path gives NaN for ``-inf`` logits).
* Projection of the student hidden state is not hidden inside the loss: apply
  :class:`ProjectionLayer` first (it owns parameters; the losses here are parameter-free).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.models.layers import Linear

Array = jax.Array

# ``constexpr float EPSILON = 1e-12`` in PyTorch's aten/src/ATen/native/Loss.cpp, added to
# each squared norm by ``cosine_embedding_loss`` (which Megatron's HiddenStateCosineLoss
# calls). Not ``F.cosine_similarity``'s eps=1e-8, which clamps the product of the norms.
COSINE_EPSILON = 1e-12


# ----------------------------------------------------------------------------- helpers


def _compute_dtype(*arrays: Array) -> Any:
    """At least float32: bf16/fp16 -> float32; float32 -> float32; float64 -> float64."""
    dtype = jnp.dtype(jnp.float32)
    for a in arrays:
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"distillation losses need floating-point inputs, got {a.dtype}")
        dtype = jnp.promote_types(dtype, a.dtype)
    return dtype


def _check_pair(name: str, student: Array, teacher: Array, *, hint: str = "") -> None:
    if student.ndim < 1:
        raise ValueError(f"{name}: inputs need a last (feature) axis, got a scalar")
    if student.shape != teacher.shape:
        raise ValueError(f"{name}: student shape {student.shape} != teacher shape "
                         f"{teacher.shape}{hint}")


def _check_temperature(temperature: Any) -> None:
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _axis_max(x: Array, axis_name: Optional[str]) -> Array:
    return x if axis_name is None else jax.lax.pmax(x, axis_name)


def _axis_sum(x: Array, axis_name: Optional[str]) -> Array:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _log_softmax(x: Array, axis_name: Optional[str]) -> Array:
    """log softmax over the last axis, which may be split over mesh axis ``axis_name``.

    The shift is the (global) max under ``stop_gradient`` -- any constant shift leaves
    the result unchanged, so it must carry no gradient (Megatron detaches the student
    max for the same reason). The denominator is a differentiable ``psum``: its
    cotangent, which differs per rank, is summed over the ranks by the transpose (the
    job of Megatron's ``all_reduce_autograd``). Logits are never gathered.
    """
    shift = _axis_max(jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)), axis_name)
    shifted = x - shift
    denom = _axis_sum(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True), axis_name)
    return shifted - jnp.log(denom)


def _kl_terms(log_p: Array, log_q: Array) -> Array:
    """Elementwise ``p * (log p - log q)``, exactly 0 where ``p == 0`` (values and grads).

    Double ``where``: both logs are replaced by 0 where ``p == 0`` so that neither the
    value nor the gradient of the discarded branch can produce ``0 * inf = NaN``.
    """
    p = jnp.exp(log_p)
    live = p > 0
    safe_log_p = jnp.where(live, log_p, 0.0)
    safe_log_q = jnp.where(live, log_q, 0.0)
    return jnp.where(live, p * (safe_log_p - safe_log_q), 0.0)


# ----------------------------------------------------------------------------- losses


def logits_kl_loss(student_logits: Array, teacher_logits: Array, temperature: float = 1.0,
                   reverse: bool = False, tensor_axis: Optional[str] = None) -> Array:
    """Per-token KL divergence between softmax(teacher / T) and softmax(student / T).

    Megatron's ``LogitsKLLoss.forward``: both logits are divided by ``temperature`` and
    upcast; forward (default) is ``KL(teacher || student) = sum_v p_t (log p_t - log p_s)``,
    ``reverse=True`` is ``KL(student || teacher)``. Summed over the vocabulary, not
    averaged, and **no** ``T**2`` factor (ModelOpt's ``LogitsDistillationLoss`` multiplies
    by ``T**2``; Megatron's loss does not).

    Args:
      student_logits: ``[batch, seq, vocab]`` (any leading axes), any float dtype.
      teacher_logits: same shape; treated as a constant (``stop_gradient``).
      temperature: softening temperature ``T > 0`` (a Python number is checked).
      reverse: compute ``KL(student || teacher)`` instead.
      tensor_axis: mesh axis name over which the vocabulary (last) axis is split, for
        use inside ``jax.shard_map`` (``in_specs`` like ``P(..., "tensor")``). The
        log-sum-exp is global: ``pmax`` of the stop-gradient'ed local max, ``psum`` of
        the local sums of exponentials, and ``psum`` of the per-shard KL partial sums.
        The logits are never gathered. The returned loss is already global and
        identical on every rank of ``tensor_axis`` (``out_specs`` may leave the axis
        unmentioned); do not all-reduce it again -- Megatron needs a separate
        ``tp_reduce`` step in ``loss_func`` because it returns per-rank partial sums.
        Gradients equal the unsharded ones (tested for tp2/tp4, with and without
        ``check_vma``).

    Returns:
      ``[batch, seq]`` (the input shape without its last axis), float32 (float64 if an
      input is float64).

    Raises:
      ValueError: shapes differ, scalar inputs, or ``temperature <= 0``.
      TypeError: non-floating inputs.
      NameError: ``tensor_axis`` is not bound (called outside ``shard_map``).
    """
    student_logits = jnp.asarray(student_logits)
    teacher_logits = jnp.asarray(teacher_logits)
    _check_pair("logits_kl_loss", student_logits, teacher_logits)
    _check_temperature(temperature)
    dtype = _compute_dtype(student_logits, teacher_logits)

    student = student_logits.astype(dtype) / temperature
    teacher = jax.lax.stop_gradient(teacher_logits.astype(dtype) / temperature)
    log_p_student = _log_softmax(student, tensor_axis)
    log_p_teacher = _log_softmax(teacher, tensor_axis)
    if reverse:
        terms = _kl_terms(log_p_student, log_p_teacher)
    else:
        terms = _kl_terms(log_p_teacher, log_p_student)
    return _axis_sum(jnp.sum(terms, axis=-1), tensor_axis)


def teacher_top_k(teacher_logits: Array, top_k: int, vocab_shards: int = 1) -> tuple[Array, Array]:
    """The teacher's ``top_k`` largest logits per token and their vocabulary ids:
    ``([..., k] logits in their dtype, [..., k] int32 ids)``, largest first.

    Vocabulary-parallel as ModelOpt's ``TopKLogitsKLLoss`` (the top-K each tensor rank
    holds, then the top-K of those candidates): the vocabulary axis is viewed as
    ``[vocab_shards, vocab / vocab_shards]`` (under GSPMD, the split of a vocab-sharded
    axis over ``vocab_shards`` tensor ranks), each shard's ``min(top_k, vocab /
    vocab_shards)`` are taken where they lie, and only those candidates are compared
    across shards. The result equals ``jax.lax.top_k`` over the whole vocabulary (ties
    aside). Raises ValueError for ``top_k`` < 1 or above the vocabulary, or a vocabulary
    ``vocab_shards`` does not divide."""
    vocab = teacher_logits.shape[-1]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"logit_kl_topk={top_k} must be in [1, vocabulary {vocab}]")
    if vocab % vocab_shards:
        raise ValueError(f"vocabulary {vocab} does not split into {vocab_shards} shards")
    per = vocab // vocab_shards
    local = min(top_k, per)
    shards = teacher_logits.reshape(teacher_logits.shape[:-1] + (vocab_shards, per))
    vals, idx = jax.lax.top_k(shards, local)  # [..., shards, local], within each shard
    idx = idx + (jnp.arange(vocab_shards, dtype=idx.dtype) * per)[:, None]
    vals = vals.reshape(vals.shape[:-2] + (vocab_shards * local,))
    idx = idx.reshape(idx.shape[:-2] + (vocab_shards * local,))
    vals, pick = jax.lax.top_k(vals, top_k)
    return vals, jnp.take_along_axis(idx, pick, axis=-1).astype(jnp.int32)


def top_k_kl_loss(student_logits: Array, teacher_values: Array, teacher_ids: Array, temperature: float = 1.0,
                  reverse: bool = False) -> Array:
    """Per-token KL over the teacher's top-K vocabulary entries, ModelOpt's
    ``TopKLogitsKLLoss`` (modelopt/torch/distill/plugins/megatron.py, the top-K loss
    Megatron-LM's distillation runs with ``logit_kl_topk``): the student's logits at the
    teacher's ids and the teacher's values, each divided by ``temperature`` and
    log-softmax'ed over those K entries, then ``KL(teacher || student)`` summed over them
    (``reverse``: ``KL(student || teacher)``). The tail mass outside the K entries is
    dropped on both sides (both distributions are renormalised over the K ids), and there
    is no ``T**2`` factor, as there.

    ``teacher_values`` may be the teacher's logits or its log-probabilities at those ids
    (they differ by a per-token constant, which the renormalisation removes): the same
    function serves online (:func:`teacher_top_k`) and offline (cached top-K
    log-probabilities) distillation.

    Args:
      student_logits: ``[..., vocab]``, any float dtype (vocabulary-sharded under GSPMD:
        the gather at K ids per token is what crosses the shards).
      teacher_values: ``[..., K]`` logits or log-probabilities (``stop_gradient``).
      teacher_ids: ``[..., K]`` integer vocabulary ids.

    Returns ``[...]`` float32 (float64 for float64 inputs). Raises ValueError for
    mismatched shapes or ``temperature <= 0``, TypeError for non-float logits."""
    student_logits, teacher_values = jnp.asarray(student_logits), jnp.asarray(teacher_values)
    if teacher_values.shape != teacher_ids.shape or student_logits.shape[:-1] != teacher_values.shape[:-1]:
        raise ValueError(f"top_k_kl_loss: student {student_logits.shape}, teacher values {teacher_values.shape} and "
                         f"ids {teacher_ids.shape} must agree on the leading axes (values and ids [..., K])")
    _check_temperature(temperature)
    dtype = _compute_dtype(student_logits, teacher_values)
    student = jnp.take_along_axis(student_logits, teacher_ids.astype(jnp.int32), axis=-1).astype(dtype) / temperature
    teacher = jax.lax.stop_gradient(teacher_values.astype(dtype) / temperature)
    log_s, log_t = _log_softmax(student, None), _log_softmax(teacher, None)
    terms = _kl_terms(log_s, log_t) if reverse else _kl_terms(log_t, log_s)
    return jnp.sum(terms, axis=-1)


def top_k_logits_kl_loss(student_logits: Array, teacher_logits: Array, top_k: int, temperature: float = 1.0,
                         reverse: bool = False, vocab_shards: int = 1) -> Array:
    """:func:`top_k_kl_loss` over :func:`teacher_top_k` of ``teacher_logits`` (online
    top-K distillation). Shapes and errors as theirs; ``[...]`` float32."""
    _check_pair("top_k_logits_kl_loss", student_logits, teacher_logits)
    values, ids = teacher_top_k(jax.lax.stop_gradient(jnp.asarray(teacher_logits)), top_k, vocab_shards)
    return top_k_kl_loss(student_logits, values, ids, temperature, reverse)


def uld_loss(student_logits: Array, teacher_logprobs: Array, vocab_shards: int = 1) -> Array:
    """Per-token Universal Logit Distillation distance (Boizard, El Haddad, Hudelot and
    Colombo 2024, "Towards Cross-Tokenizer Distillation: the Universal Logit Distillation
    Loss for LLMs", arXiv 2402.12030, section 3): the Wasserstein-1 distance between the
    student's and the teacher's next-token distributions under a uniform transport cost,
    which in closed form is the L1 distance of the two probability vectors each sorted in
    decreasing order, the smaller vocabulary padded with zeros:
    ``sum_i |p_s[sigma_s(i)] - p_t[sigma_t(i)]|``. It compares the distributions' shapes
    only, so the two vocabularies need share no token.

    The teacher is given by its ``K`` largest probabilities (log, decreasing; a cache holds
    those): the student's ``K`` largest are compared rank by rank and the mass outside
    each side's ``K`` as one more entry, ``|(1 - sum_K p_s) - (1 - sum_K p_t)|``. With ``K``
    at least both vocabularies this is the paper's formula exactly; with a smaller ``K`` it
    is a lower bound of it (the tails' entries merged). Temperature 1, as the teacher's
    cached probabilities are.

    Args:
      student_logits: ``[..., vocab_s]`` (vocabulary-parallel over ``vocab_shards``
        tensor ranks: the student's top K is taken as :func:`teacher_top_k` takes it;
        ``K > vocab_s``: padded with zeros).
      teacher_logprobs: ``[..., K]`` the teacher's K largest log-probabilities, decreasing
        (``stop_gradient``).

    Returns ``[...]`` float32. Raises ValueError for mismatched leading axes."""
    student_logits, teacher_logprobs = jnp.asarray(student_logits), jnp.asarray(teacher_logprobs)
    if student_logits.shape[:-1] != teacher_logprobs.shape[:-1]:
        raise ValueError(f"uld_loss: student {student_logits.shape} and teacher {teacher_logprobs.shape} must agree "
                         f"on the leading axes")
    k, vocab = teacher_logprobs.shape[-1], student_logits.shape[-1]
    dtype = _compute_dtype(student_logits, teacher_logprobs)
    p_s = jnp.exp(_log_softmax(student_logits.astype(dtype), None))
    top_s, _ = teacher_top_k(p_s, min(k, vocab), vocab_shards)
    if k > vocab:  # the smaller vocabulary padded with zeros
        top_s = jnp.pad(top_s, [(0, 0)] * (top_s.ndim - 1) + [(0, k - vocab)])
    p_t = jax.lax.stop_gradient(jnp.exp(teacher_logprobs.astype(dtype)))
    tails = (1.0 - jnp.sum(top_s, axis=-1)) - (1.0 - jnp.sum(p_t, axis=-1))
    return jnp.sum(jnp.abs(top_s - p_t), axis=-1) + jnp.abs(tails)


def matched_top_k_kl_loss(student_logits: Array, teacher_logprobs: Array, student_ids: Array) -> Array:
    """Per-token ``KL(teacher || student)`` over the teacher's top-K tokens that the
    student's vocabulary also has (``student_ids`` >= 0: the same token string), both
    distributions renormalised over those entries, as :func:`top_k_kl_loss` over the
    matched ids; 0 where none matches. With :func:`uld_loss` it is TRL's GOLD hybrid
    (``trl/experimental/gold``: a KL on the tokens the two vocabularies share, ULD for the
    distributions' shapes).

    Args:
      student_logits: ``[..., vocab_s]``.
      teacher_logprobs: ``[..., K]`` (``stop_gradient``).
      student_ids: ``[..., K]`` int, each teacher token's id in the student's vocabulary,
        -1 where it has none.

    Returns ``[...]`` float32; finite values and gradients whatever matches."""
    student_logits, teacher_logprobs = jnp.asarray(student_logits), jnp.asarray(teacher_logprobs)
    dtype = _compute_dtype(student_logits, teacher_logprobs)
    valid = student_ids >= 0
    some = jnp.any(valid, axis=-1, keepdims=True)
    use = valid & some  # (rows without a match: every entry unused, safe values below)
    neg = jnp.asarray(-jnp.inf, dtype)
    s = jnp.take_along_axis(student_logits, jnp.maximum(student_ids, 0).astype(jnp.int32), axis=-1).astype(dtype)
    s = jnp.where(use, s, neg)
    t = jnp.where(use, jax.lax.stop_gradient(teacher_logprobs.astype(dtype)), neg)
    s, t = jnp.where(some, s, 0.0), jnp.where(some, t, 0.0)
    log_s, log_t = _log_softmax(s, None), _log_softmax(t, None)
    log_s, log_t = jnp.where(use, log_s, 0.0), jnp.where(use, log_t, 0.0)
    return jnp.sum(jnp.where(use, jnp.exp(log_t) * (log_t - log_s), 0.0), axis=-1)


def _hidden_pair(fn: str, student_hidden: Array, teacher_hidden: Array) -> tuple[Array, Array]:
    """The hidden-state losses' operands: the two arrays checked as a pair of one shape
    (ValueError / TypeError naming ``fn``, as :func:`_check_pair`), cast to their compute
    dtype (:func:`_compute_dtype`), the teacher's under ``stop_gradient``."""
    student_hidden = jnp.asarray(student_hidden)
    teacher_hidden = jnp.asarray(teacher_hidden)
    _check_pair(fn, student_hidden, teacher_hidden,
                hint=" (project the student with ProjectionLayer when hidden sizes differ)")
    dtype = _compute_dtype(student_hidden, teacher_hidden)
    return student_hidden.astype(dtype), jax.lax.stop_gradient(teacher_hidden.astype(dtype))


def hidden_state_cosine_loss(student_hidden: Array, teacher_hidden: Array) -> Array:
    """Per-token ``1 - cos(student, teacher)`` over the last (hidden) axis.

    Megatron's ``HiddenStateCosineLoss`` calls ``F.cosine_embedding_loss(x, y, target=1,
    reduction="none")``, which (aten/src/ATen/native/Loss.cpp) computes
    ``1 - <x, y> / sqrt((|x|^2 + 1e-12) * (|y|^2 + 1e-12))``: :data:`COSINE_EPSILON`
    added to each squared norm -- not ``F.cosine_similarity``'s ``eps=1e-8`` clamp. This
    is what is computed here (as ``sqrt(a) * sqrt(b)``, equal to ``sqrt(a * b)`` but
    without float32 overflow for very large activations). Zero vectors give loss 1 and
    finite gradients.

    Args:
      student_hidden: ``[batch, seq, hidden]`` (any leading axes), already projected to
        the teacher's hidden size (:class:`ProjectionLayer`).
      teacher_hidden: same shape; treated as a constant (``stop_gradient``).
      The hidden axis must be whole on every device (like Megatron, which requires
      full-hidden tensors, e.g. LayerNorm outputs); sharding leading axes is fine.

    Returns:
      ``[batch, seq]``, float32 (float64 for float64 input), in ``[0, 2]``.

    Raises:
      ValueError: shapes differ (use :class:`ProjectionLayer`) or scalar inputs.
      TypeError: non-floating inputs.
    """
    x, y = _hidden_pair("hidden_state_cosine_loss", student_hidden, teacher_hidden)
    dot = jnp.sum(x * y, axis=-1)
    sq_x = jnp.sum(x * x, axis=-1) + COSINE_EPSILON
    sq_y = jnp.sum(y * y, axis=-1) + COSINE_EPSILON
    return 1.0 - dot / (jnp.sqrt(sq_x) * jnp.sqrt(sq_y))


def mse_loss(student_hidden: Array, teacher_hidden: Array) -> Array:
    """Per-token mean over the hidden axis of ``(student - teacher)^2``.

    Megatron's ``MSELoss``: ``F.mse_loss(predictions, targets, reduction="none")``
    followed by ``.mean(dim=-1)`` -- the mean over the hidden axis only, leaving
    ``[s, b]`` (transposed to ``[b, s]``) for the masked token mean.

    Args:
      student_hidden: ``[batch, seq, hidden]`` (any leading axes), already projected.
      teacher_hidden: same shape; treated as a constant (``stop_gradient``).

    Returns:
      ``[batch, seq]``, float32 (float64 for float64 input).

    Raises:
      ValueError: shapes differ (use :class:`ProjectionLayer`) or scalar inputs.
      TypeError: non-floating inputs.
    """
    x, y = _hidden_pair("mse_loss", student_hidden, teacher_hidden)
    diff = x - y
    return jnp.mean(jnp.square(diff), axis=-1)


# ----------------------------------------------------------------------------- projection


class ProjectionLayer(nn.Module):
    """Projects student activations to the teacher's hidden size (Megatron's ProjectionLayer).

    Identity (no parameters) when the sizes are equal; otherwise a Linear
    ``student_hidden_size -> teacher_hidden_size`` with bias, weight ~ N(0, 0.01) and
    bias 0 (Megatron's ``_init_weights``). Megatron shares one projection among all
    intermediate layer pairs; so should the caller.

    ``x``: ``[..., student_hidden_size]`` -> ``[..., teacher_hidden_size]`` in ``dtype``
    (an identity returns ``x`` unchanged). Params: ``Linear_0/kernel``
    ``[student, teacher]`` (logical axes ``("embed", None)``), ``Linear_0/bias``.

    Raises ValueError if ``x``'s last axis is not ``student_hidden_size``.
    """

    student_hidden_size: int
    teacher_hidden_size: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        if x.shape[-1] != self.student_hidden_size:
            raise ValueError(f"ProjectionLayer: input hidden size {x.shape[-1]} != "
                             f"student_hidden_size {self.student_hidden_size}")
        if self.student_hidden_size == self.teacher_hidden_size:
            return x
        return Linear(
            features=(self.teacher_hidden_size,), kernel_axes=("embed", None), use_bias=True,
            dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(stddev=0.01), bias_init=nn.initializers.zeros,
        )(x)


# ----------------------------------------------------------------------------- config objects


@dataclasses.dataclass(frozen=True)
class LogitsKLLoss:
    """Frozen, hashable config for :func:`logits_kl_loss` (Megatron's ``LogitsKLLoss``).

    ``LogitsKLLoss(temperature, reverse, tensor_axis)(student_logits, teacher_logits)``
    -> ``[batch, seq]``. Raises ValueError at construction if ``temperature <= 0``.
    """

    temperature: float = 1.0
    reverse: bool = False
    tensor_axis: Optional[str] = None

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)

    def __call__(self, student_logits: Array, teacher_logits: Array) -> Array:
        return logits_kl_loss(student_logits, teacher_logits, temperature=self.temperature,
                              reverse=self.reverse, tensor_axis=self.tensor_axis)


@dataclasses.dataclass(frozen=True)
class HiddenStateCosineLoss:
    """Frozen, hashable config for :func:`hidden_state_cosine_loss` (Megatron's class).

    ``HiddenStateCosineLoss()(student_hidden, teacher_hidden)`` -> ``[batch, seq]``.
    """

    def __call__(self, student_hidden: Array, teacher_hidden: Array) -> Array:
        return hidden_state_cosine_loss(student_hidden, teacher_hidden)


@dataclasses.dataclass(frozen=True)
class MSELoss:
    """Frozen, hashable config for :func:`mse_loss` (Megatron's ``MSELoss``).

    ``MSELoss()(student_hidden, teacher_hidden)`` -> ``[batch, seq]``.
    """

    def __call__(self, student_hidden: Array, teacher_hidden: Array) -> Array:
        return mse_loss(student_hidden, teacher_hidden)


_INTERMEDIATE_LOSSES: dict[str, Callable[[], Any]] = {
    "hidden_cosine": HiddenStateCosineLoss,  # Megatron's distillation YAML name
    "cosine": HiddenStateCosineLoss,         # ModelOpt's DistillationConfig name
    "mse": MSELoss,
}


def intermediate_loss_from_name(name: str) -> HiddenStateCosineLoss | MSELoss:
    """The intermediate loss named in a distillation config's third pair entry.

    ``"hidden_cosine"`` (Megatron) or ``"cosine"`` (ModelOpt) -> HiddenStateCosineLoss;
    ``"mse"`` -> MSELoss. Raises ValueError for any other name.
    """
    try:
        return _INTERMEDIATE_LOSSES[name]()
    except KeyError:
        raise ValueError(f"unknown intermediate distillation loss {name!r}; "
                         f"expected one of {sorted(_INTERMEDIATE_LOSSES)}") from None
