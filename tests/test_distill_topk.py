"""Top-K logits distillation (``logit_kl_topk``): :func:`jmegatron.distill.losses.top_k_kl_loss`
against a hand-written NumPy reference and against ModelOpt's own ``TopKLogitsKLLoss`` (the
top-K loss Megatron-LM's distillation runs; torch on the CPU), the vocabulary-parallel
selection against ``lax.top_k`` over the whole vocabulary, and a distillation train step with
``logit_kl_topk`` under tp2 equal to one device."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.distill.config import DistillConfigError, parse_distill_config
from jmegatron.distill.losses import teacher_top_k, top_k_kl_loss, top_k_logits_kl_loss


def _logits(seed, shape=(2, 5, 64)):
    rs = np.random.RandomState(seed)
    return rs.randn(*shape).astype(np.float64) * 2.0


def reference(student, teacher, k, temperature, reverse=False):
    """By hand: the teacher's k largest logits per token, both sides' logits at those ids
    over T, a softmax over the k entries each (the tail dropped), KL(teacher || student)."""
    out = np.zeros(student.shape[:-1])
    for idx in np.ndindex(*student.shape[:-1]):
        ids = np.argsort(-teacher[idx])[:k]
        t, s = teacher[idx][ids] / temperature, student[idx][ids] / temperature
        pt = np.exp(t - t.max()); pt /= pt.sum()
        ps = np.exp(s - s.max()); ps /= ps.sum()
        out[idx] = np.sum(ps * np.log(ps / pt)) if reverse else np.sum(pt * np.log(pt / ps))
    return out


@pytest.mark.parametrize("k,temperature,reverse", [(1, 1.0, False), (8, 1.0, False), (8, 2.0, True), (64, 0.5, False)])
def test_top_k_kl_matches_the_hand_reference(k, temperature, reverse):
    s, t = _logits(0), _logits(1)
    got = top_k_logits_kl_loss(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), k, temperature, reverse)
    np.testing.assert_allclose(np.asarray(got), reference(s, t, k, temperature, reverse), rtol=2e-5, atol=1e-6)
    if k == 1:
        assert np.all(np.asarray(got) == 0.0)  # one entry: both renormalise to probability 1


def test_top_k_kl_matches_modelopts_top_k_loss():
    """Values and student gradients equal ModelOpt 0.47's ``TopKLogitsKLLoss`` (tp 1) on
    the same logits; its layout is [s, b, vocab] and its per-token loss [b, s]."""
    import torch
    from modelopt.torch.distill.plugins import megatron
    s, t = _logits(2, (3, 4, 96)), _logits(3, (3, 4, 96))
    cfg = types.SimpleNamespace(tensor_model_parallel_size=1)
    for k, temperature in ((16, 1.0), (40, 1.7)):
        loss = megatron.TopKLogitsKLLoss(cfg, temperature=temperature, top_k=k)
        ts = torch.tensor(s.transpose(1, 0, 2), requires_grad=True)
        want, _, _ = loss(ts, torch.tensor(t.transpose(1, 0, 2)))
        want.sum().backward()
        per_token = top_k_logits_kl_loss(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), k, temperature)
        np.testing.assert_allclose(np.asarray(per_token), want.detach().numpy(), rtol=2e-5, atol=1e-6)
        grad = jax.grad(lambda x: top_k_logits_kl_loss(x, jnp.asarray(t, jnp.float32), k, temperature).sum())(
            jnp.asarray(s, jnp.float32))
        np.testing.assert_allclose(np.asarray(grad), ts.grad.numpy().transpose(1, 0, 2), rtol=1e-4, atol=1e-6)
        assert np.count_nonzero(np.asarray(grad)[0, 0]) == k  # only the teacher's K ids get a gradient


@pytest.mark.parametrize("shards,k", [(4, 5), (4, 16), (8, 20)])
def test_vocabulary_parallel_selection_equals_the_whole_vocabulary(shards, k):
    t = jnp.asarray(_logits(4, (2, 3, 64)), jnp.float32)
    vals, ids = teacher_top_k(t, k, shards)
    want_vals, want_ids = jax.lax.top_k(t, k)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


def test_cached_log_probabilities_give_the_logits_loss():
    """The teacher's top-K log-probabilities (what an offline cache stores) give the same loss
    as its logits: the renormalisation over K removes the per-token log-sum-exp."""
    s, t = jnp.asarray(_logits(5), jnp.float32), jnp.asarray(_logits(6), jnp.float32)
    vals, ids = teacher_top_k(t, 12)
    logp = vals - jax.nn.logsumexp(t, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(top_k_kl_loss(s, logp, ids, 1.5)),
                               np.asarray(top_k_kl_loss(s, vals, ids, 1.5)), rtol=1e-5, atol=1e-6)


def test_bad_top_k_is_refused_by_name():
    with pytest.raises(ValueError, match="logit_kl_topk=65 must be in"):
        teacher_top_k(jnp.zeros((2, 64)), 65)
    with pytest.raises(DistillConfigError, match="logit_kl_topk=0 must be a positive integer"):
        parse_distill_config({"logit_kl_topk": 0})
    assert parse_distill_config({"logit_kl_topk": 32}).logit_kl_topk == 32
