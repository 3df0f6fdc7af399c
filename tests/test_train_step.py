"""The jitted train step: data parallel on 8 devices equals 1 device; micro-batch
accumulation equals one big batch; the step neither recompiles nor syncs with the host."""

import jax
import numpy as np
import pytest

from jmegatron.config import base_config, from_configdict
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build


def tiny_cfg(family=None, **kw):
    """A 2-layer, 64-wide model of model family ``family`` (jmegatron.presets; None: the
    defaults, GPT-style) without dropout; ``kw`` overrides any field."""
    c = base_config(family)
    c.mock_data, c.vocab_size = True, 500
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 2, 64, 4, 32
    c.hidden_dropout = c.attention_dropout = 0.0
    c.micro_batch_size, c.global_batch_size, c.lr_warmup_iters, c.lr = 2, 16, 1, 1e-3
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


def random_batches(n, gbs, seq, vocab, seed=0):
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        toks = rs.randint(0, vocab, size=(gbs, seq + 1)).astype(np.int32)
        mask = (rs.rand(gbs, seq) > 0.1).astype(np.float32)
        out.append({"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": mask,
                    "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int32), (gbs, seq)).copy()})
    return out


def train(cfg, num_devices, steps=3):
    run = build(cfg, create_mesh(cfg, jax.devices()[:num_devices]))
    state = run.init_state()
    losses, norms = [], []
    for b in random_batches(steps, run.global_batch_size, cfg.seq_length, 500):
        b = {k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()}
        state, m = run.train_step(state, run.put_batch(b))
        losses.append(float(m["lm_loss"]))
        norms.append(float(m["grad_norm"]))
    return np.array(losses), np.array(norms), jax.device_get(state.params), run


@pytest.mark.parametrize("kw", [{}, {"family": "llama", "num_query_groups": 2}])
def test_data_parallel_8_equals_1_device(kw):
    # Equal micro-batch counts on both sides: micro_batch_size 2 x dp 8 vs 16 x dp 1.
    l8, n8, p8, run8 = train(tiny_cfg(**kw), 8)
    l1, n1, p1, _ = train(tiny_cfg(micro_batch_size=16, **kw), 1)
    assert run8.mesh.shape["data"] == 8 and run8.num_microbatches == 1
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    np.testing.assert_allclose(n8, n1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_matches_whole_batch_when_masks_full():
    # With every token counted, the mean of micro-batch means equals the whole-batch mean.
    cfg_acc = tiny_cfg(micro_batch_size=4)       # 4 micro-batches of 4 on 1 device
    cfg_one = tiny_cfg(micro_batch_size=16)      # 1 micro-batch of 16
    for cfg in (cfg_acc, cfg_one):
        run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
        state = run.init_state()
        rs = np.random.RandomState(1)
        toks = rs.randint(0, 500, size=(16, 33)).astype(np.int32)
        b = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": np.ones((16, 32), np.float32),
             "position_ids": np.broadcast_to(np.arange(32, dtype=np.int32), (16, 32)).copy()}
        b = {k: v.reshape(run.num_microbatches, -1, 32) for k, v in b.items()}
        _, m = run.train_step(state, run.put_batch(b))
        cfg_result = (float(m["lm_loss"]), float(m["grad_norm"]))
        if cfg is cfg_acc:
            acc = cfg_result
    np.testing.assert_allclose(acc, cfg_result, rtol=1e-5)


def test_step_compiles_once_and_donates_state():
    cfg = tiny_cfg()
    run = build(cfg, create_mesh(cfg, jax.devices()[:8]))
    state = run.init_state()
    batches = random_batches(3, run.global_batch_size, cfg.seq_length, 500)
    old = state
    for b in batches:
        b = {k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()}
        state, _ = run.train_step(state, run.put_batch(b))
    assert run.train_step._cache_size() == 1
    assert jax.tree.leaves(old.params)[0].is_deleted()  # donated


def test_recompute_gives_the_same_step():
    # (scan_layers draws its initial weights per stacked layer, so its trajectory differs;
    # the scanned model's logits equal the per-layer model's: tests/test_golden_logits.py)
    # (selective recompute checkpoints the core attention alike in both layouts: once is enough;
    # recomputation does not depend on the layout: one device, which compiles fastest)
    for scan in (False, True):
        base = train(tiny_cfg(scan_layers=scan, micro_batch_size=16), 1, steps=2)
        for granularity in ("full", "selective") if not scan else ("full",):
            losses, norms, _, _ = train(tiny_cfg(scan_layers=scan, recompute_granularity=granularity,
                                                 micro_batch_size=16), 1, steps=2)
            np.testing.assert_allclose(losses, base[0], rtol=1e-5, err_msg=f"{scan} {granularity}")
            np.testing.assert_allclose(norms, base[1], rtol=1e-4, err_msg=f"{scan} {granularity}")


def test_step_makes_no_host_transfer():
    cfg = tiny_cfg()
    run = build(cfg, create_mesh(cfg, jax.devices()[:8]))
    state = run.init_state()
    b = random_batches(1, run.global_batch_size, cfg.seq_length, 500)[0]
    b = run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()})
    state, _ = run.train_step(state, b)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        state, m = run.train_step(state, b)
    assert np.isfinite(float(m["lm_loss"]))
