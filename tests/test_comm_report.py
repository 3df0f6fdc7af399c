"""The communication audit: the compiled train step's collectives against Megatron's
analytic counts (Korthikanti et al. 2022; Megatron-Core's distributed optimizer)."""

import jax
import pytest

from jmegatron.parallel.mesh import create_mesh
from jmegatron.reporting.collectives import replica_groups
from jmegatron.tools.comm_report import analyze, summarize
from jmegatron.training.run import build

from test_train_step import tiny_cfg

L, H, S, B = 2, 64, 32, 2  # layers, hidden, sequence, micro-batch per data-parallel rank


def report(**kw):
    cfg = tiny_cfg(num_layers=L, hidden_size=H, seq_length=S, micro_batch_size=B, global_batch_size=16, **kw)
    return analyze(build(cfg, create_mesh(cfg, jax.devices()[:8])))


def by(report, kind, axes, elements=None):
    rows = [r for r in summarize(report["collectives"]) if r["kind"] == kind and tuple(r["axes"]) == axes
            and (elements is None or r["elements"] == elements)]
    return sum(r["count_per_step"] for r in rows), sum(r["elements"] * r["count_per_step"] for r in rows)


def small(r):
    return r["elements"] <= max(B * S, H) * 2


@pytest.fixture(scope="module")
def tp2():
    return report(tensor_model_parallel_size=2)


def test_tensor_parallel_all_reduces_match_megatron(tp2):
    nm = tp2["num_microbatches"]
    assert nm == 2
    # 2 forward + 2 backward per layer and micro-batch, + embedding forward + output-layer backward
    assert by(tp2, "all-reduce", ("tensor",), B * S * H)[0] == (4 * L + 2) * nm
    assert tp2["analytic"]["all-reduce over tensor of b*s*h, per step"] == (4 * L + 2) * nm
    # data parallel: exactly one reduction of every gradient element per step
    assert by(tp2, "all-reduce", ("data",))[1] - by(tp2, "all-reduce", ("data",), 1)[1] == \
        tp2["analytic"]["all-reduce over data of gradients, elements per step"]
    # nothing else moves weights or activations: every other collective is per-token scalars
    for r in summarize(tp2["collectives"]):
        if r["kind"] == "all-reduce" and r["axes"] in (["tensor"], ["data"]):
            continue
        if r["kind"] == "all-reduce" and r["elements"] == 1 and r["count_per_step"] == 1:
            continue  # the processes' stop flag, max over every device (step.TrainStep)
        raise AssertionError(f"unexpected collective {r}")
    others = [r for r in summarize(tp2["collectives"]) if r["axes"] == ["tensor"] and r["elements"] != B * S * H]
    assert all(small(r) for r in others), others


def test_per_device_bytes_follow_the_layout():
    # gpt_tiny's shape (4 x 256, seq 256, vocab 8192) under tp2 x dp4 with ZeRO-1: the
    # replicated norms, row-parallel biases and position embeddings stay under 2%.
    from jmegatron.config import load_config_file
    from conftest import REPO

    cfg = load_config_file(str(REPO / "configs" / "gpt_tiny.py"), {
        "mock_data": True, "vocab_size": 8192, "tensor_model_parallel_size": 2, "micro_batch_size": 2,
        "global_batch_size": 8, "use_distributed_optimizer": True})
    pd = analyze(build(cfg, create_mesh(cfg, jax.devices()[:8])))["per_device_bytes"]
    assert pd["parameters"] == pytest.approx(pd["total_parameters"] / 2, rel=0.02)
    assert pd["optimizer_state"] == pytest.approx(pd["total_optimizer_state"] / 8, rel=0.02)


def test_sequence_parallel_gathers_and_scatters():
    rep = report(tensor_model_parallel_size=2, sequence_parallel=True)
    nm = rep["num_microbatches"]
    n = (4 * L + 2) * nm
    assert by(rep, "all-gather", ("tensor",), B * S * H)[0] == n
    # Megatron's explicit reduce-scatters (jmegatron.parallel.tensor_parallel), no all-reduce
    # of activations left
    assert by(rep, "reduce-scatter", ("tensor",), B * S * H)[0] == n
    assert by(rep, "all-reduce", ("tensor",), B * S * H)[0] == 0
    # besides: per-token scalars, and the gradients of parameters replicated over the tensor
    # axis (norms: H, position embeddings: S x H), summed over the sequence shards as Megatron
    # all-reduces its layer-norm gradients under sequence parallelism
    others = [r for r in summarize(rep["collectives"]) if r["axes"] == ["tensor"] and r["elements"] != B * S * H]
    assert all(small(r) or (r["kind"] == "all-reduce" and r["elements"] == S * H) for r in others), others


def test_distributed_optimizer_scatters_gradients_and_gathers_parameters():
    rep = report(tensor_model_parallel_size=2, use_distributed_optimizer=True)
    want = rep["analytic"]["reduce-scatter over data of gradients, elements per step"]
    assert by(rep, "reduce-scatter", ("data",))[1] == want
    assert by(rep, "all-gather", ("data",))[1] == want
    # no all-reduce of weights over data any more (only the loss and token-count scalars)
    assert all(r["elements"] == 1 for r in summarize(rep["collectives"])
               if r["kind"] == "all-reduce" and r["axes"] == ["data"])
    # Adam's two fp32 moments of this rank's parameter shard, plus the step counters
    per_rank = rep["analytic"]["parameter elements per tensor rank"]
    assert rep["per_device_bytes"]["optimizer_state"] == pytest.approx(2 * 4 * per_rank / 4, abs=64)


def test_distributed_optimizer_under_cp_scatters_over_data_and_context():
    """cp2 x dp4 + ZeRO-1: one reduce-scatter of the gradients and one all-gather of the
    parameters over the data x context group (Megatron's DP x CP), no weight all-reduce."""
    rep = report(context_parallel_size=2, use_distributed_optimizer=True)
    want = rep["analytic"]["reduce-scatter over data x context of gradients, elements per step"]
    assert by(rep, "reduce-scatter", ("data", "context"))[1] == want
    assert by(rep, "all-gather", ("data", "context"))[1] == want
    assert all(r["elements"] == 1 for r in summarize(rep["collectives"]) if r["kind"] == "all-reduce")
    per_rank = rep["analytic"]["parameter elements per tensor rank"]
    assert rep["per_device_bytes"]["optimizer_state"] == pytest.approx(2 * 4 * per_rank / 8, abs=64)


def test_replica_group_formats():
    assert replica_groups("x replica_groups={{0,2},{1,3}}, y", 4) == [[0, 2], [1, 3]]
    assert replica_groups("x replica_groups=[2,2]<=[4], y", 4) == [[0, 1], [2, 3]]
    assert replica_groups("x replica_groups=[2,2]<=[2,2]T(1,0), y", 4) == [[0, 2], [1, 3]]
    assert replica_groups("x replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, y", 4) == [[0, 2], [1, 3]]
    assert replica_groups("x replica_groups=mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_1'}, y",
                          4) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_permutes_match_the_analytic_count(cp):
    """cp_comm_type='p2p': the compiled step's collective-permutes over context are the
    ring's messages: forward 2 (cp-1) single K or V blocks (Megatron's count), backward
    (cp-1) [K|V] + [dK|dV] hops and one [dK|dV] hop home; nothing else travels the ring."""
    rep = report(context_parallel_size=cp)
    nm = rep["num_microbatches"]
    messages = rep["analytic"]["collective-permute over context, per step"]
    blocks = rep["analytic"]["K/V blocks sent over context, per step"]
    assert (messages, blocks) == ((4 * (cp - 1) + 1) * L * nm, (6 * (cp - 1) + 2) * L * nm)
    block = rep["analytic"]["collective-permute elements (one K or V block, b*(s/cp)*kv_heads*d)"]
    assert block == B * (S // cp) * H
    assert by(rep, "collective-permute", ("context",), block)[0] == 2 * (cp - 1) * L * nm  # the forward's
    assert by(rep, "collective-permute", ("context",)) == (messages, blocks * block)
