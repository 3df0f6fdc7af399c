"""Context parallelism's building blocks (issue 14 items 1-2): Megatron's load-balanced
sequence split against megatron-core's own ``get_batch_on_this_cp_rank``, and ring
attention (``cp_comm_type="p2p"``) over the ``context`` axis of 8 simulated devices equal
to one-device causal attention in values and gradients (float32, GQA)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jmegatron.kernels.xla.attention import xla_attention
from jmegatron.parallel import context_parallel as cpl


def _megatron_split(seq, cp, rank, monkeypatch):
    import torch  # (make test-next's Python 3.13 has no CPU torch: .ci/test-next deselects this test)
    from megatron.core import parallel_state, utils

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: rank)
    batch = {"tokens": torch.arange(seq).reshape(1, seq), "attention_mask": None}
    return utils.get_batch_on_this_cp_rank(batch)["tokens"][0].numpy()


@pytest.mark.parametrize("seq,cp", [(16, 2), (32, 4), (24, 3), (8, 1)])
def test_load_balance_index_is_megatrons_split(seq, cp, monkeypatch):
    index = cpl.load_balance_index(seq, cp)
    assert sorted(index) == list(range(seq))
    shard = seq // cp
    for r in range(cp):
        np.testing.assert_array_equal(index[r * shard:(r + 1) * shard], _megatron_split(seq, cp, r, monkeypatch))


def test_load_balance_index_refuses_uneven_chunks():
    with pytest.raises(ValueError, match="seq_length=30 must be divisible by 2 x context_parallel_size=8"):
        cpl.load_balance_index(30, 4)


def test_block_merge_equals_whole_attention():
    """Two key halves, merged by log-sum-exp, equal attention over all keys; a query that
    sees no key of a block gets lse -inf there and is unaffected."""
    rs = np.random.RandomState(0)
    b, s, nq, nkv, d = 2, 12, 4, 2, 8
    q, k, v = (jnp.asarray(rs.randn(b, s, n, d).astype(np.float32)) for n in (nq, nkv, nkv))
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    whole = xla_attention(q, k, v)
    o1, l1 = cpl.attention_block(q, k[:, :5], v[:, :5], pos, pos[:, :5])
    o2, l2 = cpl.attention_block(q, k[:, 5:], v[:, 5:], pos, pos[:, 5:])
    assert np.all(np.isneginf(np.asarray(l2[:, :5])))
    out, _ = cpl.merge_blocks(o1, l1, o2, l2)
    np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-6)


def _ring(cp, q, k, v, kind="p2p", block="xla"):
    """Context-parallel attention (``kind``: a cp_comm_type) over a cp-device context mesh of
    the load-balanced layout, returned in the original order."""
    b, s = q.shape[:2]
    index = cpl.load_balance_index(s, cp)
    inverse = np.argsort(index)
    mesh = Mesh(np.array(jax.devices()[:cp]), ("context",))
    pos = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b, s))
    spec = P(None, "context")
    fn = jax.shard_map(functools.partial(cpl.CP_ATTENTIONS[kind], axis_name="context", axis_size=cp, block=block),
                       mesh=mesh,
                       in_specs=(spec, spec, spec, spec), out_specs=spec)
    # jitted: jaxlib 0.11.2 XLA:CPU crashes on a CPU FFI kernel inside an eager shard_map (docs/GPU.md)
    return jax.jit(fn)(q[:, index], k[:, index], v[:, index], pos)[:, inverse]


@pytest.mark.parametrize("block", ["xla", "cpu"])
@pytest.mark.parametrize("cp,kind", [(2, "p2p"), (4, "p2p"), (4, "all_gather"), (2, "a2a")])
def test_context_parallel_attention_equals_one_device(cp, kind, block):
    """Values and q/k/v gradients of every cp attention with each block kernel (XLA's, the
    CPU kernel's block forms) equal xla_attention on the whole sequence."""
    rs = np.random.RandomState(cp)
    b, s, nq, nkv, d = 2, 32, 4, 2, 8
    q, k, v = (jnp.asarray(rs.randn(b, s, n, d).astype(np.float32)) for n in (nq, nkv, nkv))
    w = jnp.asarray(rs.randn(b, s, nq, d).astype(np.float32))

    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v) * w)

    ring = jax.jit(jax.value_and_grad(functools.partial(loss, functools.partial(_ring, cp, kind=kind, block=block)),
                                      argnums=(0, 1, 2)))
    ref = jax.value_and_grad(functools.partial(loss, xla_attention), argnums=(0, 1, 2))
    (got, got_g), (want, want_g) = ring(q, k, v), ref(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(_ring(cp, q, k, v, kind, block), xla_attention(q, k, v), rtol=1e-5, atol=1e-6)
    for a, e in zip(got_g, want_g):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    hlo = jax.jit(functools.partial(_ring, cp, kind=kind, block=block)).lower(q, k, v).as_text()
    op = {"p2p": "collective_permute", "all_gather": "all_gather", "a2a": "all_to_all"}[kind]
    assert op in hlo


def test_custom_backward_keeps_one_block_not_the_whole_sequence():
    """The custom VJP saves q, k, v, out and lse only; autodiff through the unrolled ring
    would keep every received K/V block (and each block's probabilities) as residuals."""
    cp, b, s, h, d = 4, 1, 512, 4, 32
    mesh = Mesh(np.array(jax.devices()[:cp]), ("context",))
    spec = P(None, "context")

    def temp_bytes(f):
        fn = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
        grad = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(fn(q, k, v, p) ** 2), argnums=(0, 1, 2)))
        x = jnp.ones((b, s, h, d))
        pos = jnp.broadcast_to(jnp.asarray(cpl.load_balance_index(s, cp), jnp.int32), (b, s))
        return grad.lower(x, x, x, pos).compile().memory_analysis().temp_size_in_bytes

    custom = temp_bytes(functools.partial(cpl.ring_attention, axis_name="context", axis_size=cp))
    autodiff = temp_bytes(lambda q, k, v, p: cpl._ring_forward(q, k, v, p, "context", cp)[0])
    assert custom < 0.7 * autodiff, (custom, autodiff)


# ------------------------------------------------------------------ in the train step
from jmegatron.config import ConfigError  # noqa: E402
from jmegatron.parallel.mesh import create_mesh  # noqa: E402
from jmegatron.training.run import build  # noqa: E402

from test_expert_parallel import assert_close  # noqa: E402
from test_train_step import random_batches, tiny_cfg  # noqa: E402

LLAMA = dict(family="llama", num_query_groups=2)


def grads_of(cfg, num_devices):
    run = build(cfg, create_mesh(cfg, jax.devices()[:num_devices]))
    state = run.init_state()
    b = random_batches(1, run.global_batch_size, cfg.seq_length, 500, seed=5)[0]
    b = run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()})
    g, report, tokens = run.compute_grads(state, b)
    return jax.device_get(g), jax.device_get(report), float(tokens), run


CP_CASES = [  # (context_parallel_size, devices, model, other fields)
    # dp 1: the dropout offsets vary over no size-1 axis; selective recomputation
    (2, 2, {}, dict(hidden_dropout=0.1, recompute_granularity="selective")),
    # (all_gather at cp4: test_context_parallel_attention_equals_one_device's cp4 all_gather)
    # (a2a at cp2 x dp2 + ZeRO-1: a2a in the step is the a2a x tp2 case below, ZeRO-1 at cp2 x dp2 the next)
    # cp2 x dp2 + ZeRO-1; attention dropout: each ring block draws the one-device hash mask
    (2, 4, LLAMA, dict(attention_dropout=0.1, hidden_dropout=0.1, use_distributed_optimizer=True)),
    # (cp2 x tp2 + SP with the p2p ring: tests/test_parallel_equivalence.py's test_family_blocks_match_one_device)
    # all_gather x tp2 + SP, its blocks drawing the one-device attention-dropout masks
    (2, 4, LLAMA, dict(attention_dropout=0.1, cp_comm_type="all_gather", tensor_model_parallel_size=2,
                       sequence_parallel=True)),
    (2, 4, dict(LLAMA, num_query_groups=4), dict(cp_comm_type="a2a", tensor_model_parallel_size=2)),
    (4, 8, {}, dict(scan_layers=True, attention_dropout=0.2)),  # cp4 x dp2, scanned layers, attention dropout
    (2, 4, LLAMA, dict(recompute_granularity="full", scan_layers=True)),  # activation recomputation
]


@pytest.mark.parametrize("cp,devices,model,extra", CP_CASES,
                         ids=[f"cp{c}-dev{n}-{'llama' if m else 'gpt'}-" + "_".join(sorted(x))
                              for c, n, m, x in CP_CASES])
def test_context_parallel_matches_one_device(cp, devices, model, extra):
    cfg = tiny_cfg(**model, **extra, context_parallel_size=cp, micro_batch_size=2, global_batch_size=8)
    g, report, tokens, run = grads_of(cfg, devices)
    assert dict(run.mesh.shape)["context"] == cp
    one_device = ("use_distributed_optimizer", "tensor_model_parallel_size", "sequence_parallel")
    ref = tiny_cfg(**model, **{k: v for k, v in extra.items() if k not in one_device},
                   micro_batch_size=8 // run.num_microbatches, global_batch_size=8)
    g1, report1, tokens1, _ = grads_of(ref, 1)
    assert tokens == tokens1
    np.testing.assert_allclose(report["lm_loss"], report1["lm_loss"], rtol=1e-5)
    assert_close(g, g1)


@pytest.mark.parametrize("fields,message", [
    (dict(seq_length=36), "seq_length=36 must be divisible by 2 x context_parallel_size=8"),
    (dict(attention_dropout=0.1, cp_comm_type="a2a"), "attention_dropout=0.1 with context_parallel_size=4 "
                                                       "and cp_comm_type='a2a'"),
    (dict(hidden_dropout=0.1, dropout_impl="threefry"), "dropout_impl='threefry' with dropout"),
    (dict(attention_dropout=0.1, dropout_impl="threefry"), "dropout_impl='threefry' with dropout"),
    (dict(cp_comm_type="a2a", num_query_groups=2), "num_query_groups=2 is not divisible by "
                                                    "tensor_model_parallel_size x context_parallel_size = 4"),
    (dict(cp_comm_type="ring"), "cp_comm_type='ring': choose"),
    (dict(pipeline_model_parallel_size=2), "pipeline_model_parallel_size=2 with context_parallel_size=4"),
])
def test_bad_context_parallel_configs_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny_cfg(context_parallel_size=4, **fields)


def test_context_parallel_training_steps_match_one_device():
    """Three optimizer steps (cp2 x dp2 + ZeRO-1, Llama/GQA) give the one-device losses, and the
    step's program passes K/V around the ring (collective permutes in its lowered HLO)."""
    from test_train_step import train

    kw = dict(LLAMA, micro_batch_size=2, global_batch_size=8)
    losses, norms, _, run = train(tiny_cfg(**kw, context_parallel_size=2, use_distributed_optimizer=True), 4)
    losses1, norms1, _, _ = train(tiny_cfg(**dict(kw, micro_batch_size=4)), 1)
    np.testing.assert_allclose(losses, losses1, rtol=1e-5)
    np.testing.assert_allclose(norms, norms1, rtol=1e-4)
    b = random_batches(1, 8, 32, 500)[0]
    host = {k: v.reshape(run.num_microbatches, -1, 32) for k, v in b.items()}
    batch = run.put_batch(host)
    hlo = run.compute_grads.lower(run.abstract_state, batch).as_text()  # (lowered: no second compile)
    assert "collective_permute" in hlo
    # the slot order is data: each slot's original position, permuted with the batch (the eval
    # batch keeps its order)
    shape = host["tokens"].shape
    np.testing.assert_array_equal(np.asarray(batch["positions"]), np.broadcast_to(cpl.load_balance_index(32, 2), shape))
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), host["tokens"][..., cpl.load_balance_index(32, 2)])
    np.testing.assert_array_equal(np.asarray(run.put_batch(host, train=False)["positions"]),
                                  np.broadcast_to(np.arange(32), shape))


@pytest.mark.slow
def test_cli_trains_resumes_and_evaluates_at_cp2(tmp_path):
    """python -m jmegatron.train at cp 2 x dp 2 (4 simulated devices, gpt_tiny shrunk, hidden
    dropout 0.1, mock data): trains, evaluates in the sequence's own order, and a run resumed
    from iteration 3 repeats iterations 4-6 bit for bit."""
    import shutil

    from test_pipeline_e2e import cli, metrics

    def args(save):
        fields = dict(mock_data=True, vocab_size=512, num_layers=2, hidden_size=64, num_attention_heads=4,
                      seq_length=128, max_position_embeddings=128, micro_batch_size=2, global_batch_size=8,
                      train_iters=6, lr_warmup_iters=1, eval_interval=3, eval_iters=1, log_interval=1,
                      attention_dropout=0.0, context_parallel_size=2, save=str(save), save_interval=3)
        return ["jmegatron.train", "--config", "configs/gpt_tiny.py", *(f"--config.{k}={v}" for k, v in fields.items())]

    full = tmp_path / "full"
    out = cli(args(full), devices=4)
    assert "'data': 2, 'expert': 1, 'context': 2" in out
    losses, vals = metrics(full)
    assert sorted(losses) == list(range(1, 7)) and sorted(vals) == [3, 6] and losses[6] < losses[1]
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "6")
    (resumed / "metrics.jsonl").write_text("")  # only what the resumed run writes
    out = cli(args(resumed), devices=4)
    assert "at iteration 3" in out
    got, got_vals = metrics(resumed)
    assert sorted(got) == [4, 5, 6]
    for it in (4, 5, 6):
        assert got[it] == losses[it], it
    assert got_vals[6] == vals[6]


def test_backward_recompute_is_not_hoisted_into_the_forward():
    """Each further ring-attention layer adds about its residuals (q, k, v, out, lse) to the
    gradient's compiled temporaries, not the [a, 2c, 2c] score blocks XLA's scheduler kept
    alive when the backward's recompute did not depend on the output gradient."""
    cp, b, s, h, d = 2, 1, 1024, 4, 32
    mesh = Mesh(np.array(jax.devices()[:cp]), ("context",))
    spec = P(None, "context")

    def temp_bytes(layers):
        def f(q, k, v, p):
            x = q
            for i in range(layers):
                x = cpl.ring_attention(x * 1.01, k * (1 + i), v, p, "context", cp)
            return jax.lax.psum(jnp.sum(x ** 2), "context")

        fn = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 4, out_specs=P())
        x = jax.ShapeDtypeStruct((b, s, h, d), jnp.float32)
        pos = jax.ShapeDtypeStruct((b, s), jnp.int32)
        grad = jax.jit(jax.grad(fn, argnums=(0, 1, 2)))
        return grad.lower(x, x, x, pos).compile().memory_analysis().temp_size_in_bytes

    per_layer = (temp_bytes(4) - temp_bytes(2)) / 2
    block = h * (s // cp) ** 2 * 4  # one [a, 2c, 2c] float32 score block
    residuals = 4 * b * (s // cp) * h * d * 4  # q, k, v, out
    assert per_layer < residuals + block / 2, (per_layer, residuals, block)
