"""Parity tests for jmegatron.distill against ModelOpt's own losses and balancer and, where
the code exists only in Megatron-LM, NumPy transcriptions of it.

ModelOpt's ``modelopt/torch/distill/plugins/megatron.py`` (``LogitsKLLoss`` with its
tensor-parallel branch, ``HiddenStateCosineLoss``, ``MSELoss``,
``LogitsAndIntermediatesLossBalancer``) runs here on the CPU torch, its gradients from
autograd. The ``megatron_*`` functions transcribe, in float64 NumPy, what only Megatron-LM
has: ``megatron/post_training/algos/distillation.py`` (2025-04, commit 6ed528b68d; 2024
original 1c2c7dc79d; its ``kl_div`` with ``log_target=False``, finite on ``-inf`` teacher
logits, where ModelOpt's ``log_target=True`` gives NaN) and ``cached_logits_loss.py``.
Gradients of the transcriptions are central finite differences in float64; the JAX side runs
with x64 enabled (jmegatron computes in at least float32, so float64 inputs stay float64).
ModelOpt's ``LogitsKLLoss`` computes in float32 (its ``.float()``), so comparisons with it
use a float32 tolerance.
"""

from __future__ import annotations

import dataclasses
import types

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, PartitionSpec as P
from modelopt.torch.distill.plugins import megatron as modelopt_megatron

from jmegatron.distill import (
    COSINE_EPSILON,
    HiddenStateCosineLoss,
    LogitsAndIntermediatesLossBalancer,
    LogitsKLLoss,
    MSELoss,
    ProjectionLayer,
    balance_losses,
    hidden_state_cosine_loss,
    intermediate_loss_from_name,
    logits_kl_loss,
    mse_loss,
)

TOL = 1e-6
TOL32 = 64 * float(np.finfo(np.float32).eps)  # ModelOpt's LogitsKLLoss computes in float32


# ============================================================================ ModelOpt's own


def _mcore_config(tp=1):
    """The two fields of megatron-core's TransformerConfig ModelOpt's losses read."""
    return types.SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=False)


def _stacked_collectives(monkeypatch):
    """ModelOpt's tensor-parallel branch with the tp ranks stacked on a leading axis of one
    tensor: ``torch.distributed.all_reduce(MAX)`` becomes a max over that axis (in place, as
    the collective), ``torch.distributed.nn``'s differentiable ``all_reduce`` a sum over it.
    Every other operation of the branch is elementwise or reduces the vocabulary axis, so each
    rank's slice computes what that rank computes."""
    monkeypatch.setattr(modelopt_megatron.parallel_state, "get_tensor_model_parallel_group", lambda: "tp")

    def all_reduce_max(t, op=None, group=None):
        assert op == torch.distributed.ReduceOp.MAX and group == "tp"
        t.copy_(t.amax(0, keepdim=True).expand_as(t))

    def all_reduce_sum(t, group=None):
        assert group == "tp"
        return t.sum(0, keepdim=True).expand_as(t)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce_max)
    monkeypatch.setattr(modelopt_megatron.dist_nn.functional, "all_reduce", all_reduce_sum)


def modelopt_kl(student, teacher, temperature=1.0, reverse=False, weights=None, tp=1, monkeypatch=None):
    """ModelOpt's ``LogitsKLLoss`` on [b, s, v] float64 logits (its layout is [s, b, v]):
    the per-token loss [b, s] (under ``tp`` > 1 the sum of the ranks' partials, the
    ``tp_reduce`` its caller does) and the gradient of ``sum(weights * loss)`` w.r.t. the
    student [b, s, v], from autograd."""
    loss_fn = modelopt_megatron.LogitsKLLoss(_mcore_config(tp), temperature=temperature, reverse=reverse)
    s = torch.tensor(np.ascontiguousarray(student.transpose(1, 0, 2)), requires_grad=True)
    t = torch.tensor(np.ascontiguousarray(teacher.transpose(1, 0, 2)))
    if tp == 1:
        loss, tp_reduce, _ = loss_fn(s, t)  # [b, s]
    else:
        _stacked_collectives(monkeypatch)
        stack = lambda x: torch.stack(torch.chunk(x, tp, dim=-1))  # noqa: E731  [tp, s, b, v / tp]
        per_rank, tp_reduce, _ = loss_fn(stack(s), stack(t))  # [s, tp, b] after its transpose(0, 1)
        loss = per_rank.sum(1).transpose(0, 1)
    assert tp_reduce
    w = torch.ones(loss.shape, dtype=loss.dtype) if weights is None else torch.tensor(weights, dtype=loss.dtype)
    (loss * w).sum().backward()
    return loss.detach().double().numpy(), s.grad.numpy().transpose(1, 0, 2)


def modelopt_hidden(cls, student, teacher, weights):
    """ModelOpt's ``HiddenStateCosineLoss`` / ``MSELoss`` on [b, s, h] float64 tensors: the
    per-token loss [b, s] and the gradient of ``sum(weights * loss)`` w.r.t. the student."""
    s = torch.tensor(np.ascontiguousarray(student.transpose(1, 0, 2)), requires_grad=True)
    t = torch.tensor(np.ascontiguousarray(teacher.transpose(1, 0, 2)))
    loss, _, _ = cls(_mcore_config())(s, t)
    (loss * torch.tensor(weights)).sum().backward()
    return loss.detach().numpy(), s.grad.numpy().transpose(1, 0, 2)


def modelopt_balancer_value_and_grad(loss_dict, kd_loss_scale, skip_original_loss):
    """ModelOpt's ``LogitsAndIntermediatesLossBalancer`` on float64 scalar losses (keys
    "student_loss", "LogitsKLLoss_0", ...): its total and the gradient w.r.t. each loss in
    ``loss_dict``'s order (its ``.detach()`` ratios are constants, as in training)."""
    balancer = modelopt_megatron.LogitsAndIntermediatesLossBalancer(kd_loss_scale, skip_original_loss)
    leaves = {k: torch.tensor(float(v), dtype=torch.float64, requires_grad=True) for k, v in loss_dict.items()}
    total = balancer(dict(leaves))["kd_loss"]
    grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    return float(total), np.array([0.0 if g is None else float(g) for g in grads])


# ============================================================================ Megatron-LM transcriptions


def np_log_softmax(x):
    y = x - x.max(-1, keepdims=True)
    return y - np.log(np.exp(y).sum(-1, keepdims=True))


def torch_kl_div(inp, target):
    """F.kl_div(input, target, reduction="none", log_target=False) (aten Loss.cpp)."""
    safe = np.where(target > 0, target, 1.0)
    return np.where(target > 0, target * (np.log(safe) - inp), 0.0)


def megatron_kl(student, teacher, temperature=1.0, reverse=False):
    """Megatron-LM's LogitsKLLoss.forward (distillation.py 6ed528b68d), tensor_model_parallel_size
    == 1 branch (without the transpose): ``kl_div`` of probabilities (``log_target=False``)."""
    out_t = teacher / temperature
    out_s = student / temperature
    if reverse:
        loss = torch_kl_div(np_log_softmax(out_t), np.exp(np_log_softmax(out_s)))
    else:
        loss = torch_kl_div(np_log_softmax(out_s), np.exp(np_log_softmax(out_t)))
    return loss.sum(-1)


class Item:
    """``tensor.item()`` for the transcriptions: records the values on a first pass and
    replays them on later passes, so finite differences treat them as constants, as
    autograd does."""

    def __init__(self, replay=None):
        self.replay, self.log, self.i = replay, [], 0

    def __call__(self, x):
        if self.replay is None:
            self.log.append(float(x))
            return float(x)
        self.i += 1
        return self.replay[self.i - 1]


def megatron_balancer_2025(loss_dict, kd_loss_scale, skip_original_loss, item):
    """LogitsAndIntermediatesLossBalancer.forward, Megatron-LM 6ed528b68d (2025-04-13).
    Keys: "student_loss", "LogitsKLLoss_0" and the intermediate losses."""
    loss_dict = dict(loss_dict)
    original_loss = loss_dict.pop("student_loss")
    for _key in loss_dict:
        if _key.startswith("LogitsKLLoss"):
            logits_key = _key
    logits_loss = loss_dict.pop(logits_key)
    intermediate_loss = sum(loss_dict.values()) / max(len(loss_dict), 1)
    if intermediate_loss > 0:
        dynamic_scale = item(logits_loss) / item(intermediate_loss)
        intermediate_loss_scaled = intermediate_loss * dynamic_scale
        kd_loss_scale = kd_loss_scale / 2.0
    else:
        intermediate_loss_scaled = intermediate_loss
    if skip_original_loss:
        total_loss = logits_loss + intermediate_loss_scaled
    else:
        kd_loss = (logits_loss + intermediate_loss_scaled) * kd_loss_scale
        dynamic_scale = item(original_loss) / item(kd_loss)
        total_loss = original_loss + kd_loss * dynamic_scale
    return {"kd_loss": total_loss, "logits_loss": logits_loss,
            "intermediate_loss": intermediate_loss}


def megatron_balancer_2024(loss_dict, kd_loss_scale, skip_original_loss, item):
    """LogitsAndIntermediatesLossBalancer.forward, Megatron-LM 1c2c7dc79d (2024-10-29)."""
    loss_dict = dict(loss_dict)
    original_loss = loss_dict.pop("student_loss")
    for _key, _loss in loss_dict.items():
        if _key.startswith("LogitsKLLoss"):
            logits_loss = _loss
    intermediate_loss = sum(loss_dict.values())
    if intermediate_loss > 0:
        dynamic_scale = item(logits_loss) / item(intermediate_loss)
        intermediate_loss *= dynamic_scale
        kd_loss_scale = kd_loss_scale / 2.0
    if skip_original_loss:
        total_loss = logits_loss + intermediate_loss
    else:
        kd_loss = (logits_loss + intermediate_loss) * kd_loss_scale
        dynamic_scale = item(original_loss) / item(kd_loss)
        total_loss = original_loss + kd_loss * dynamic_scale
    return total_loss


def cached_logits_total(loss_lm, loss_kd, alpha):
    """megatron/training/distillation/cached_logits_loss.py LossFuncCallable (277c4f8040)."""
    return (1 - alpha) * loss_lm + alpha * loss_kd


def fd_grad(f, x, h=1e-6):
    """Central finite-difference gradient of scalar ``f`` at float64 array ``x``."""
    x = np.array(x, dtype=np.float64)
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        fp = f(x)
        flat[i] = old - h
        fm = f(x)
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * h)
    return g


def close(a, b, tol=TOL):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=tol, atol=tol)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def rand(seed, *shape, scale=1.0):
    return np.random.default_rng(seed).normal(size=shape) * scale


# ============================================================================ logits KL


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_kl_values_and_grads_match_modelopt(x64, reverse, temperature):
    s, t, w = rand(0, 2, 3, 16, scale=2.0), rand(1, 2, 3, 16, scale=2.0), rand(2, 2, 3)
    loss = logits_kl_loss(jnp.asarray(s), jnp.asarray(t), temperature, reverse)
    assert loss.shape == (2, 3) and loss.dtype == jnp.float64
    ref, g_ref = modelopt_kl(s, t, temperature, reverse, weights=w)
    close(loss, ref, tol=TOL32)

    g = jax.grad(lambda a: jnp.sum(jnp.asarray(w) * logits_kl_loss(
        a, jnp.asarray(t), temperature, reverse)))(jnp.asarray(s))
    close(g, g_ref, tol=TOL32)
    # forward KL: d/ds = (softmax(s/T) - softmax(t/T)) / T, the textbook gradient
    if not reverse:
        analytic = (np.exp(np_log_softmax(s / temperature)) -
                    np.exp(np_log_softmax(t / temperature))) / temperature * w[..., None]
        close(g, analytic)


def test_kl_float32_and_bf16():
    s, t = rand(3, 2, 5, 32), rand(4, 2, 5, 32)
    loss32 = logits_kl_loss(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32))
    assert loss32.dtype == jnp.float32
    close(loss32, modelopt_kl(s, t)[0], tol=1e-5)
    loss16 = logits_kl_loss(jnp.asarray(s, jnp.bfloat16), jnp.asarray(t, jnp.bfloat16))
    assert loss16.dtype == jnp.float32  # bf16 logits are upcast, as Megatron's .float()
    s16 = np.asarray(jnp.asarray(s, jnp.bfloat16).astype(jnp.float32), np.float64)
    t16 = np.asarray(jnp.asarray(t, jnp.bfloat16).astype(jnp.float32), np.float64)
    close(loss16, modelopt_kl(s16, t16)[0], tol=1e-5)


def test_kl_teacher_gets_no_gradient_and_zero_at_equality():
    s, t = jnp.asarray(rand(5, 2, 3, 8), jnp.float32), jnp.asarray(rand(6, 2, 3, 8), jnp.float32)
    for reverse in (False, True):
        gt = jax.grad(lambda b: jnp.sum(logits_kl_loss(s, b, reverse=reverse)))(t)
        assert not np.any(np.asarray(gt))
        np.testing.assert_allclose(logits_kl_loss(s, s, reverse=reverse), 0.0, atol=1e-6)


def test_kl_minus_inf_teacher_logits_are_finite(x64):
    # Zero-probability teacher entries (e.g. masked padding) contribute 0, as torch's
    # kl_div with log_target=False does on Megatron-LM's single-rank path (ModelOpt's
    # log_target=True form is NaN there, so Megatron-LM's transcription is the reference).
    s, t = rand(7, 2, 3, 8), rand(8, 2, 3, 8)
    t[..., -2:] = -np.inf
    assert np.all(np.isnan(modelopt_kl(s, t)[0]))
    loss = logits_kl_loss(jnp.asarray(s), jnp.asarray(t))
    close(loss, megatron_kl(s, t))
    g = jax.grad(lambda a: jnp.sum(logits_kl_loss(a, jnp.asarray(t))))(jnp.asarray(s))
    assert np.all(np.isfinite(np.asarray(g)))
    close(g, fd_grad(lambda a: np.sum(megatron_kl(a, t)), s))


def test_kl_errors():
    a = jnp.zeros((2, 3, 8))
    with pytest.raises(ValueError, match="shape"):
        logits_kl_loss(a, jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="temperature"):
        logits_kl_loss(a, a, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        LogitsKLLoss(temperature=-1.0)
    with pytest.raises(TypeError, match="floating"):
        logits_kl_loss(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(NameError):
        logits_kl_loss(a, a, tensor_axis="tensor")  # unbound outside shard_map


# ---------------------------------------------------------------------------- tensor parallel


def _sharded_kl(mesh, temperature, reverse, check_vma, batch_axis=None):
    spec = P(batch_axis, None, "tensor")
    return jax.jit(jax.shard_map(
        lambda s, t: logits_kl_loss(s, t, temperature, reverse, tensor_axis="tensor"),
        mesh=mesh, in_specs=(spec, spec), out_specs=P(batch_axis), check_vma=check_vma))


@pytest.mark.parametrize("tp,reverse,check_vma", [
    (2, False, True), (2, True, True), (4, False, True), (4, True, True),
    (2, True, False), (4, False, False)])
def test_kl_tensor_parallel_grads_equal_unsharded(tp, reverse, check_vma, monkeypatch):
    temperature = 1.7
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tensor",))
    s_np, t_np = rand(10, 2, 3, 32, scale=3.0), rand(11, 2, 3, 32, scale=3.0)
    s, t = jnp.asarray(s_np, jnp.float32), jnp.asarray(t_np, jnp.float32)
    mask = jnp.asarray(np.random.default_rng(12).uniform(size=(2, 3)) > 0.3, jnp.float32)
    sharded = _sharded_kl(mesh, temperature, reverse, check_vma)

    def masked_mean(kl_fn, a):  # the caller's loss_func: masked token mean
        return jnp.sum(kl_fn(a, t) * mask) / jnp.sum(mask)

    unsharded = lambda a, b: logits_kl_loss(a, b, temperature, reverse)
    close(sharded(s, t), unsharded(s, t))
    close(sharded(s, t), modelopt_kl(s_np, t_np, temperature, reverse, tp=tp, monkeypatch=monkeypatch)[0], tol=1e-5)
    g_sharded = jax.jit(jax.grad(lambda a: masked_mean(sharded, a)))(s)
    g_ref = jax.grad(lambda a: masked_mean(unsharded, a))(s)
    assert np.max(np.abs(np.asarray(g_ref))) > 1e-3  # a non-trivial gradient
    close(g_sharded, g_ref)  # in particular: not multiplied by tp


def test_kl_tensor_parallel_matches_modelopts_tp_branch_x64(x64, monkeypatch):
    """Values and student gradients of the vocabulary-sharded loss equal ModelOpt's
    tensor-parallel branch over the same shards (its collectives over stacked ranks)."""
    s, t = rand(13, 2, 3, 16, scale=2.0), rand(14, 2, 3, 16, scale=2.0)
    for tp in (2, 4):
        mesh = Mesh(np.array(jax.devices()[:tp]), ("tensor",))
        for reverse in (False, True):
            f = _sharded_kl(mesh, 1.3, reverse, True)
            out = f(jnp.asarray(s), jnp.asarray(t))
            ref, g_ref = modelopt_kl(s, t, 1.3, reverse, tp=tp, monkeypatch=monkeypatch)
            close(out, ref, tol=TOL32)
            close(out, logits_kl_loss(jnp.asarray(s), jnp.asarray(t), 1.3, reverse))
            g = jax.jit(jax.grad(lambda a: jnp.sum(f(a, jnp.asarray(t)))))(jnp.asarray(s))
            close(g, g_ref, tol=TOL32)


def test_kl_tensor_parallel_never_gathers_and_is_replicated():
    mesh = Mesh(np.array(jax.devices()[:4]), ("tensor",))
    s = jnp.asarray(rand(15, 2, 3, 32), jnp.float32)
    t = jnp.asarray(rand(16, 2, 3, 32), jnp.float32)
    f = _sharded_kl(mesh, 1.0, False, True)
    hlo = jax.jit(jax.grad(lambda a: jnp.sum(f(a, t)))).lower(s).as_text()
    assert "all_gather" not in hlo and "all-gather" not in hlo
    # every tensor rank holds the same, already-global per-token loss
    per_rank = jax.jit(jax.shard_map(
        lambda a, b: logits_kl_loss(a, b, tensor_axis="tensor")[None],
        mesh=mesh, in_specs=(P(None, None, "tensor"),) * 2, out_specs=P("tensor"),
        check_vma=False))(s, t)
    assert per_rank.shape == (4, 2, 3)
    for r in range(1, 4):
        np.testing.assert_array_equal(per_rank[r], per_rank[0])
    close(per_rank[0], logits_kl_loss(s, t))


def test_kl_tensor_parallel_with_data_axis():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    s = jnp.asarray(rand(17, 4, 3, 32), jnp.float32)
    t = jnp.asarray(rand(18, 4, 3, 32), jnp.float32)
    f = _sharded_kl(mesh, 1.0, False, True, batch_axis="data")
    close(f(s, t), logits_kl_loss(s, t))
    g = jax.jit(jax.grad(lambda a: jnp.mean(f(a, t))))(s)
    close(g, jax.grad(lambda a: jnp.mean(logits_kl_loss(a, t)))(s))


# ============================================================================ hidden-state losses


def test_cosine_values_and_grads_match_modelopt(x64):
    s, t, w = rand(20, 2, 3, 12), rand(21, 2, 3, 12), rand(22, 2, 3)
    s[0, 0] = 1e-7 * t[0, 0]  # tiny norm: the 1e-12-per-squared-norm semantics matter here
    s[1, 2] = 0.0             # zero vector
    loss = hidden_state_cosine_loss(jnp.asarray(s), jnp.asarray(t))
    assert loss.shape == (2, 3)
    ref, g_ref = modelopt_hidden(modelopt_megatron.HiddenStateCosineLoss, s, t, w)
    close(loss, ref)
    assert abs(float(loss[1, 2]) - 1.0) < 1e-12
    g = jax.grad(lambda a: jnp.sum(jnp.asarray(w) * hidden_state_cosine_loss(
        a, jnp.asarray(t))))(jnp.asarray(s))
    assert np.all(np.isfinite(np.asarray(g)))
    # rows with tiny / zero norm have gradients of order 1e6: compared relative to their scale
    ok = np.ones((2, 3), bool)
    ok[0, 0] = ok[1, 2] = False
    g = np.asarray(g)
    close(g[ok], g_ref[ok])
    scale = np.abs(g_ref[~ok]).max()
    assert scale > 1e4
    close(g[~ok] / scale, g_ref[~ok] / scale)
    assert COSINE_EPSILON == 1e-12


def test_cosine_float32_and_teacher_no_grad():
    s, t = jnp.asarray(rand(23, 2, 4, 16), jnp.bfloat16), jnp.asarray(rand(24, 2, 4, 16))
    loss = hidden_state_cosine_loss(s, t)
    assert loss.dtype == jnp.float32
    gt = jax.grad(lambda b: jnp.sum(hidden_state_cosine_loss(s.astype(jnp.float32), b)))(t)
    assert not np.any(np.asarray(gt))
    with pytest.raises(ValueError, match="ProjectionLayer"):
        hidden_state_cosine_loss(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3, 16)))


def test_mse_values_and_grads_match_modelopt(x64):
    s, t, w = rand(25, 2, 3, 12), rand(26, 2, 3, 12), rand(27, 2, 3)
    loss = mse_loss(jnp.asarray(s), jnp.asarray(t))
    assert loss.shape == (2, 3)
    ref, g_ref = modelopt_hidden(modelopt_megatron.MSELoss, s, t, w)
    close(loss, ref)
    g = jax.grad(lambda a: jnp.sum(jnp.asarray(w) * mse_loss(a, jnp.asarray(t))))(jnp.asarray(s))
    close(g, g_ref)
    close(g, 2 * (s - t) / s.shape[-1] * w[..., None])
    gt = jax.grad(lambda b: jnp.sum(mse_loss(jnp.asarray(s), b)))(jnp.asarray(t))
    assert not np.any(np.asarray(gt))
    with pytest.raises(ValueError, match="ProjectionLayer"):
        mse_loss(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3, 16)))


def test_projection_layer():
    x = jnp.asarray(rand(30, 2, 3, 64), jnp.float32)
    same = ProjectionLayer(64, 64)
    variables = same.init(jax.random.PRNGKey(0), x)
    assert not jax.tree_util.tree_leaves(variables)
    np.testing.assert_array_equal(same.apply(variables, x), x)

    proj = ProjectionLayer(64, 128)
    params = nn_unbox(proj.init(jax.random.PRNGKey(0), x))["params"]
    (kernel, bias) = (params["Linear_0"]["kernel"], params["Linear_0"]["bias"])
    assert kernel.shape == (64, 128) and bias.shape == (128,)
    assert not np.any(np.asarray(bias))
    assert abs(float(jnp.std(kernel)) - 0.01) < 0.0005 and abs(float(jnp.mean(kernel))) < 5e-4
    y = proj.apply({"params": params}, x)
    assert y.shape == (2, 3, 128)
    close(y, np.asarray(x, np.float64) @ np.asarray(kernel, np.float64), tol=1e-5)
    with pytest.raises(ValueError, match="student_hidden_size"):
        proj.init(jax.random.PRNGKey(0), jnp.zeros((2, 3, 32)))

    # the projection is trained through the intermediate loss; the teacher is not
    teacher = jnp.asarray(rand(31, 2, 3, 128), jnp.float32)
    grads = jax.grad(lambda p: jnp.mean(HiddenStateCosineLoss()(
        proj.apply({"params": p}, x), teacher)))(params)
    assert np.any(np.asarray(grads["Linear_0"]["kernel"]))


def nn_unbox(tree):
    return flax.linen.meta.unbox(tree)


# ============================================================================ config objects


def test_config_objects_frozen_hashable_and_callable():
    kl = LogitsKLLoss(temperature=2.0, reverse=True)
    assert kl == LogitsKLLoss(2.0, True) and hash(kl) == hash(LogitsKLLoss(2.0, True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        kl.temperature = 1.0  # type: ignore[misc]
    s, t = jnp.asarray(rand(40, 2, 3, 8), jnp.float32), jnp.asarray(rand(41, 2, 3, 8), jnp.float32)
    close(kl(s, t), logits_kl_loss(s, t, 2.0, True))
    close(HiddenStateCosineLoss()(s, t), hidden_state_cosine_loss(s, t))
    close(MSELoss()(s, t), mse_loss(s, t))
    assert len({HiddenStateCosineLoss(), HiddenStateCosineLoss(), MSELoss()}) == 2
    bal = LogitsAndIntermediatesLossBalancer(kd_loss_scale=0.5)
    assert hash(bal) == hash(LogitsAndIntermediatesLossBalancer(0.5))

    # usable as static arguments of jit
    apply = jax.jit(lambda fn, a, b: jnp.mean(fn(a, b)), static_argnums=0)
    for fn in (kl, HiddenStateCosineLoss(), MSELoss()):
        close(apply(fn, s, t), jnp.mean(fn(s, t)))

    assert intermediate_loss_from_name("hidden_cosine") == HiddenStateCosineLoss()
    assert intermediate_loss_from_name("cosine") == HiddenStateCosineLoss()
    assert intermediate_loss_from_name("mse") == MSELoss()
    with pytest.raises(ValueError, match="unknown"):
        intermediate_loss_from_name("l1")


# ============================================================================ balancer


def _megatron_dict(values):
    """Our dict -> ModelOpt's "<ClassName>_<i>" dict (ModelOpt's balancer and the
    transcriptions take it), in the same order."""
    out = {"student_loss": values["student_loss"], "LogitsKLLoss_0": values["logits_loss"]}
    for i, k in enumerate(sorted(k for k in values if k.startswith("intermediate_"))):
        out[f"HiddenStateCosineLoss_{i + 1}"] = values[k]
    return out


def _ref_value_and_grad(ref_fn, keys, x):
    """Value of ``ref_fn`` (a transcription taking (dict, item)) at ``x`` and its
    finite-difference gradient with the .item() values frozen, as autograd treats them."""
    item = Item()
    value = ref_fn(dict(zip(keys, x)), item)

    def f(v):
        return ref_fn(dict(zip(keys, v)), Item(item.log))

    return value, fd_grad(f, np.array(x, np.float64))


def _our_value_and_grad(balancer, keys, x):
    def total(v):
        return balancer(dict(zip(keys, v)))

    (value, report), grad = jax.jit(jax.value_and_grad(total, has_aux=True))(jnp.asarray(x))
    return value, grad, report


@pytest.mark.parametrize("n_inter", [0, 1, 3])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_balancer_matches_megatron_2025(x64, n_inter, skip, scale):
    keys = ["student_loss", "logits_loss"] + [f"intermediate_layer{i}" for i in range(n_inter)]
    x = np.random.default_rng(50 + n_inter).uniform(0.2, 3.0, size=len(keys))
    ours = LogitsAndIntermediatesLossBalancer(kd_loss_scale=scale, skip_original_loss=skip)
    value, grad, report = _our_value_and_grad(ours, keys, x)

    def ref(d, item):
        return megatron_balancer_2025(_megatron_dict(d), scale, skip, item)["kd_loss"]

    ref_value, ref_grad = _ref_value_and_grad(ref, keys, x)
    close(value, ref_value)
    close(grad, ref_grad)
    full = megatron_balancer_2025(_megatron_dict(dict(zip(keys, x))), scale, skip, Item())
    close(report["kd_loss"], full["kd_loss"])
    close(report["logits_loss"], full["logits_loss"])
    close(report["intermediate_loss"], full["intermediate_loss"])


@pytest.mark.parametrize("n_inter", [0, 2])
@pytest.mark.parametrize("skip", [False, True])
def test_balancer_scale_after_normalization_matches_modelopt(x64, n_inter, skip):
    keys = ["student_loss", "logits_loss"] + [f"intermediate_{i}" for i in range(n_inter)]
    x = np.random.default_rng(60 + n_inter).uniform(0.2, 3.0, size=len(keys))
    ours = LogitsAndIntermediatesLossBalancer(kd_loss_scale=0.4, skip_original_loss=skip,
                                              scale_after_normalization=True)
    value, grad, _ = _our_value_and_grad(ours, keys, x)
    ref_value, ref_grad = modelopt_balancer_value_and_grad(_megatron_dict(dict(zip(keys, x))), 0.4, skip)
    close(value, ref_value)
    close(grad, ref_grad)
    # and on zero losses (ModelOpt's guard: no O / kd ratio unless both are positive)
    for zkeys, cases in ZERO_CASES.items():
        for case in cases:
            value, grad, _ = _our_value_and_grad(ours, list(zkeys), np.array(case))
            ref_value, ref_grad = modelopt_balancer_value_and_grad(_megatron_dict(dict(zip(zkeys, case))), 0.4, skip)
            close(value, ref_value)
            close(grad, ref_grad)


def test_balancer_alpha_matches_cached_logits_loss(x64):
    keys = ["student_loss", "logits_loss"]
    x = np.array([2.3, 0.7])
    for alpha in (0.0, 0.25, 1.0):
        ours = LogitsAndIntermediatesLossBalancer(kd_loss_alpha=alpha)
        value, grad, _ = _our_value_and_grad(ours, keys, x)
        close(value, cached_logits_total(x[0], x[1], alpha))
        close(grad, [1 - alpha, alpha])
    # with intermediates: (1 - a) O + a (L + I * sg(L / I))
    keys = ["student_loss", "logits_loss", "intermediate_a", "intermediate_b"]
    x = np.array([2.3, 0.7, 0.2, 0.6])
    value, grad, _ = _our_value_and_grad(LogitsAndIntermediatesLossBalancer(kd_loss_alpha=0.25),
                                         keys, x)
    inter = 0.4
    close(value, 0.75 * 2.3 + 0.25 * (0.7 + 0.7))
    close(grad, [0.75, 0.25, 0.25 * 0.7 / inter / 2, 0.25 * 0.7 / inter / 2])


def test_balancer_2024_version_counted_logits_twice_and_ignored_scale(x64):
    """Documents the 2024 bug (transcription of 1c2c7dc79d) against our corrected version."""
    keys = ["student_loss", "logits_loss"]
    x = [1.9, 0.6]
    d = dict(zip(keys, x))
    # skip_original_loss, no intermediates: 2024 -> 2L (logits counted twice), now -> L
    old = megatron_balancer_2024(_megatron_dict(d), 1.0, True, Item())
    close(old, 2 * 0.6)
    close(LogitsAndIntermediatesLossBalancer(skip_original_loss=True)(d)[0], 0.6)
    _, g_old = _ref_value_and_grad(
        lambda dd, item: megatron_balancer_2024(_megatron_dict(dd), 1.0, True, item), keys, x)
    close(g_old, [0.0, 2.0])
    # kd_loss_scale has no effect on either version's value or gradient (it cancels in
    # O + kd * sg(O / kd)); scale_after_normalization is the form where it does act.
    keys3 = ["student_loss", "logits_loss", "intermediate_x"]
    x3 = [1.9, 0.6, 0.35]
    results = []
    for scale in (0.2, 1.0, 5.0):
        v_old, g_old = _ref_value_and_grad(
            lambda dd, item: megatron_balancer_2024(_megatron_dict(dd), scale, False, item),
            keys3, x3)
        v, g, _ = _our_value_and_grad(LogitsAndIntermediatesLossBalancer(kd_loss_scale=scale),
                                      keys3, np.array(x3))
        results.append((v_old, g_old, float(v), np.asarray(g)))
        v2, g2, _ = _our_value_and_grad(LogitsAndIntermediatesLossBalancer(
            kd_loss_scale=scale, scale_after_normalization=True), keys3, np.array(x3))
        close(v2, 1.9 + 1.9 * scale)
    for r in results[1:]:
        close(r[0], results[0][0])
        close(r[1], results[0][1])
        close(r[2], results[0][2])
        close(r[3], results[0][3])
    close(results[0][2], 2 * 1.9)  # value 2 * O
    # 2024 sums the logits loss into "intermediate": I = L + I_x, so its gradient
    # weights differ from the corrected mean-of-intermediates version.
    assert not np.allclose(results[0][1], results[0][3])


# Zero / degenerate inputs, grouped by dict structure: (O, L), (O, L, I_a), (O, L, I_a, I_b).
ZERO_CASES = {
    ("student_loss", "logits_loss"): [
        [0.0, 0.0], [1.5, 0.0], [0.0, 0.8]],
    ("student_loss", "logits_loss", "intermediate_a"): [
        [0.0, 0.0, 0.0], [1.5, 0.0, 0.7], [0.0, 0.0, 0.7], [1.5, 0.9, 0.0], [0.0, 0.9, 0.0]],
    ("student_loss", "logits_loss", "intermediate_a", "intermediate_b"): [
        [1.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.4]],
}
MODES = [
    {},
    {"kd_loss_scale": 0.5},
    {"skip_original_loss": True},
    {"scale_after_normalization": True},
    {"kd_loss_alpha": 0.3},
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(m) or "default")
def test_balancer_zero_denominators_finite(mode):
    balancer = LogitsAndIntermediatesLossBalancer(**mode)
    for keys, cases in ZERO_CASES.items():
        x = jnp.asarray(cases, jnp.float32)

        def total(v, keys=keys):
            return balancer(dict(zip(keys, v)))

        # vmapped over the cases: one compile per structure; also shows vmap-compatibility
        value, report = jax.jit(jax.vmap(total))(x)
        grad = jax.jit(jax.vmap(jax.grad(lambda v: total(v)[0])))(x)
        assert np.all(np.isfinite(np.asarray(value))), (keys, value)
        assert all(np.all(np.isfinite(np.asarray(r))) for r in report.values())
        assert np.all(np.isfinite(np.asarray(grad))), (keys, grad)
        # the student loss keeps its unit weight unless skipped or alpha-weighted
        if not mode.get("skip_original_loss") and "kd_loss_alpha" not in mode:
            np.testing.assert_array_equal(np.asarray(grad[:, 0]), 1.0)
        # and the unbatched call agrees
        for i, case in enumerate(cases):
            assert float(total(jnp.asarray(case, jnp.float32))[0]) == pytest.approx(
                float(value[i]))


def test_balancer_matches_megatron_on_zero_edges(x64):
    keys = ["student_loss", "logits_loss", "intermediate_a"]
    # O == 0: Megatron's O / kd is 0, no special case; both branches stable under FD.
    for skip in (False, True):
        ours = LogitsAndIntermediatesLossBalancer(kd_loss_scale=0.7, skip_original_loss=skip)
        x = [0.0, 0.9, 0.4]
        value, grad, _ = _our_value_and_grad(ours, keys, np.array(x))
        ref_value, ref_grad = _ref_value_and_grad(
            lambda d, item: megatron_balancer_2025(_megatron_dict(d), 0.7, skip,
                                                   item)["kd_loss"], keys, x)
        close(value, ref_value)
        close(grad, ref_grad)
    # I == 0 with L > 0: Megatron takes the else branch (no halving) and re-wraps I with
    # new_tensor, so the intermediate loss gets no gradient.
    x = [1.5, 0.9, 0.0]
    for skip in (False, True):
        ours = LogitsAndIntermediatesLossBalancer(kd_loss_scale=0.7, skip_original_loss=skip)
        value, grad, _ = _our_value_and_grad(ours, keys, np.array(x))
        ref = megatron_balancer_2025(_megatron_dict(dict(zip(keys, x))), 0.7, skip, Item())
        close(value, ref["kd_loss"])
        assert float(grad[2]) == 0.0
    # kd == 0 (L == 0 and L / I == 0): Megatron divides by kd.item() == 0.0 and raises;
    # here total = O + kd, finite.
    x = [1.5, 0.0, 0.7]
    with pytest.raises(ZeroDivisionError):
        megatron_balancer_2025(_megatron_dict(dict(zip(keys, x))), 0.7, False, Item())
    value, grad, _ = _our_value_and_grad(LogitsAndIntermediatesLossBalancer(kd_loss_scale=0.7),
                                         keys, np.array(x))
    close(value, 1.5)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_balancer_jit_grad_no_host_sync():
    balancer = LogitsAndIntermediatesLossBalancer(kd_loss_scale=0.5)
    losses = {"student_loss": jnp.float32(2.0), "logits_loss": jnp.float32(0.5),
              "intermediate_0": jnp.float32(0.3), "intermediate_1": jnp.float32(0.1)}
    eager_total, _ = balancer(losses)
    # No device-to-host transfer anywhere (Megatron's .item() would need one).
    with jax.transfer_guard_device_to_host("disallow"):
        total, report = balancer(losses)
        jitted_total, _ = jax.jit(balancer)(losses)
        grads = jax.jit(jax.grad(lambda d: balancer(d)[0]))(losses)
    assert float(total) == pytest.approx(float(eager_total))
    assert float(jitted_total) == pytest.approx(float(eager_total))
    assert float(report["kd_loss"]) == pytest.approx(float(total))
    assert float(grads["student_loss"]) == pytest.approx(1.0)
    # and end to end: per-token losses -> masked means -> balancer, under jit + grad
    s = jnp.asarray(rand(70, 2, 3, 16), jnp.float32)
    t = jnp.asarray(rand(71, 2, 3, 16), jnp.float32)
    hs, ht = jnp.asarray(rand(72, 2, 3, 8), jnp.float32), jnp.asarray(rand(73, 2, 3, 8), jnp.float32)
    mask = jnp.asarray([[1, 1, 0], [1, 0, 1]], jnp.float32)

    def loss_fn(student_logits, student_hidden):
        mean = lambda per_token: jnp.sum(per_token * mask) / jnp.sum(mask)
        return balancer({"student_loss": jnp.float32(2.0),
                         "logits_loss": mean(LogitsKLLoss()(student_logits, t)),
                         "intermediate_h": mean(HiddenStateCosineLoss()(student_hidden, ht))})[0]

    with jax.transfer_guard_device_to_host("disallow"):
        g = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(s, hs)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g)


def test_balancer_errors():
    with pytest.raises(KeyError, match="logits_loss"):
        balance_losses({"student_loss": 1.0})
    with pytest.raises(KeyError, match="student_loss"):
        balance_losses({"logits_loss": 1.0})
    total, report = balance_losses({"logits_loss": 1.0, "intermediate_x": 2.0},
                                   skip_original_loss=True)
    assert float(total) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unexpected"):
        balance_losses({"student_loss": 1.0, "logits_loss": 1.0, "LogitsKLLoss_0": 1.0})
    with pytest.raises(ValueError, match="scalar"):
        balance_losses({"student_loss": 1.0, "logits_loss": jnp.ones(3)})
    with pytest.raises(ValueError, match="kd_loss_scale"):
        LogitsAndIntermediatesLossBalancer(kd_loss_scale=0.0)
    with pytest.raises(ValueError, match="kd_loss_alpha"):
        LogitsAndIntermediatesLossBalancer(kd_loss_alpha=1.5)
    with pytest.raises(ValueError, match="kd_loss_alpha"):
        LogitsAndIntermediatesLossBalancer(kd_loss_alpha=0.5, skip_original_loss=True)
