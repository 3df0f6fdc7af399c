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


def learnable_batches(n, gbs, seq, vocab, period=16, seed=0):
    """``n`` batches shaped as :func:`random_batches`' (tokens / labels / position_ids int32
    ``[gbs, seq]``, loss_mask float32 ``[gbs, seq]`` with ~10% zeros) whose tokens walk one
    cycle of ``period`` distinct token ids from a random phase per sequence: the next token is
    a function of the current one, so a tiny model's loss falls from ln(vocab) within a few
    steps and its updates follow the data rather than noise."""
    rs = np.random.RandomState(seed)
    cycle = rs.choice(vocab, size=period, replace=False).astype(np.int32)
    out = []
    for _ in range(n):
        phase = rs.randint(0, period, size=(gbs, 1))
        toks = cycle[(phase + np.arange(seq + 1)) % period]
        mask = (rs.rand(gbs, seq) > 0.1).astype(np.float32)
        out.append({"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": mask,
                    "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int32), (gbs, seq)).copy()})
    return out


def main_params(state):
    """The float32 parameters the optimizer updates (host numpy): the main copy under bf16 /
    fp16 (training/float16_optimizer.py), else the parameters."""
    return jax.device_get(getattr(state.opt_state, "main_params", state.params))


def train_main_params(cfg, num_devices, batches, check_state=None):
    """Train ``cfg`` on the first ``num_devices`` devices over ``batches`` (each ``[gbs, seq]``,
    reshaped into the run's micro-batches): (losses ``[steps]``, grad norms ``[steps]``, the
    float32 main parameters before the first step and after the last, the Run). One compiled
    step runs every batch; ``check_state(state, metrics)``, if given, sees every step's result."""
    run = build(cfg, create_mesh(cfg, jax.devices()[:num_devices]))
    state = run.init_state()
    first = main_params(state)
    losses, norms = [], []
    for b in batches:
        b = {k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()}
        state, m = run.train_step(state, run.put_batch(b))
        if check_state is not None:
            check_state(state, m)
        losses.append(float(m["lm_loss"]))
        norms.append(float(m["grad_norm"]))
    return np.array(losses), np.array(norms), first, main_params(state), run


# unit roundoffs u (half the spacing of 1.0): float32 2^-24, bfloat16 2^-8, float16 2^-11
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def update_rtol(dtype, tokens, layers, steps):
    """Relative tolerance for :func:`assert_same_update` of two runs of ``steps`` steps whose
    arithmetic differs by rounding in ``dtype`` (the lower precision of the two), ``tokens``
    the tokens of a global batch, ``layers`` the model's decoder layers:
    ``2 steps sqrt(tokens layers) u``, ``u`` the dtype's unit roundoff (UNIT_ROUNDOFF).

    Derivation: a weight's gradient entry sums ``tokens`` contributions, each passing through
    the ``layers`` layers' rounded matmuls (relative ``u`` each), so its rounding errors add up
    like a random walk to ``~sqrt(tokens layers) u`` of the entries' scale. Adam
    (``m / sqrt(v)`` of the same gradients) carries that relative error into the update, and
    the entries whose gradient sits within it of zero flip sign: they set a leaf's error, up to
    twice the walk's size; each step's update adds its own. Measured worst leaves over 3 steps
    of 512 tokens, as a share of this bound: bf16 against float32 0.06 and fp16 0.26 (2
    layers), fp16 ZeRO-1 against one device 0.11, fp16 pp 2 0.003 (4 layers), float32
    pipelines up to 0.45 (8 layers)."""
    return 2 * steps * np.sqrt(tokens * layers) * UNIT_ROUNDOFF[np.dtype(dtype).name]


def assert_same_update(got, want, init, rtol):
    """Two runs from the same initial parameters ``init`` applied the same update: for each
    leaf, ``||(got - init) - (want - init)||_2 <= rtol ||want - init||_2`` (float64), so a run
    that skips or zeroes its update is off by 1 (``rtol``: :func:`update_rtol`). ``want`` must
    have moved. Trees are host numpy with equal structure."""
    assert jax.tree.structure(got) == jax.tree.structure(want) == jax.tree.structure(init)
    moved = 0
    for (path, g), w, i in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), jax.tree.leaves(init)):
        dw = np.asarray(w, np.float64) - np.asarray(i, np.float64)
        dg = np.asarray(g, np.float64) - np.asarray(i, np.float64)
        ref, err = np.linalg.norm(dw), np.linalg.norm(dg - dw)
        assert err <= rtol * ref, (f"{jax.tree_util.keystr(path)}: the update differs by {err / max(ref, 1e-30):.3g} "
                                   f"of its norm (rtol {rtol:.3g})")
        moved += ref > 0
    assert moved > 0, "the reference run never updated its parameters"


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
    # (3 steps at the full rate from the first (tiny_cfg's one warm-up step runs at lr 0): the
    # recomputed backward's updates reach steps 2 and 3 and the parameters)
    batches = random_batches(3, 16, 32, 500)
    for scan in (False, True):
        kw = dict(scan_layers=scan, micro_batch_size=16, lr_warmup_iters=0)
        base = train_main_params(tiny_cfg(**kw), 1, batches)
        for granularity in ("full", "selective") if not scan else ("full",):
            losses, norms, _, params, _ = train_main_params(tiny_cfg(recompute_granularity=granularity, **kw), 1,
                                                            batches)
            np.testing.assert_allclose(losses, base[0], rtol=1e-5, err_msg=f"{scan} {granularity}")
            np.testing.assert_allclose(norms, base[1], rtol=1e-4, err_msg=f"{scan} {granularity}")
            assert_same_update(params, base[3], base[2], update_rtol(np.float32, 16 * 32, 2, 3))


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
