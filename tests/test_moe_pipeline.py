"""MoE under pipeline parallelism (issue 13 / docs/MOE.md): each pipeline chunk adds its
MoE layers' router losses (aux and z-loss) to the stage's loss and its statistics to the
report, so a pipelined MoE model equals the unpipelined one in loss, reported
load_balancing_loss / z_loss / tokens per expert / dropped fraction, and every gradient
(float32, relative 1e-5) on simulated devices: 1F1B, interleaved, uneven stages with
padding slots and token dropping, and pp x ep (alltoall, allgather) x dp + ZeRO-1.

The router losses are each data-parallel rank's own (Megatron's, and
tests/test_expert_parallel.py), so with more than one data-parallel rank the reference is
the unpipelined model on the same data split; with one it is the one-device model."""

import jax
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.parallel.pipeline_layout import PAD, PipelineLayout

from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build

from test_expert_parallel import assert_close, grads_of
from test_train_step import tiny_cfg

# A tiny Mixtral-like model: 4 layers, every MLP 4 SwiGLU experts top-2, RMSNorm + RoPE,
# both router losses on.
MOE = dict(add_bias_linear=False, num_layers=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, swiglu=True, normalization="RMSNorm",
           position_embedding_type="rope", num_query_groups=2, global_batch_size=16, seq_length=16)


def compare(got, want, layout: PipelineLayout):
    """The pipelined (grads, report) against the unpipelined scan_layers model's: report
    entries and every gradient (the reference's stacked layers taken in the stage order;
    padding slots must get no gradient)."""
    (g, report), (g1, report1) = got, want
    assert set(report) == set(report1)
    for name in report1:
        if name != "moe_tokens_per_expert":
            np.testing.assert_allclose(report[name], report1[name], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(report["moe_tokens_per_expert"], report1["moe_tokens_per_expert"], rtol=1e-6)
    order = layout.order()
    pads = jax.tree.map(lambda a: a[order == PAD], g["decoder_layers"])
    assert not any(np.any(a) for a in jax.tree.leaves(pads))
    g = dict(g, decoder_layers=jax.tree.map(lambda a: a[order != PAD], g["decoder_layers"]))
    real = order[order != PAD]
    g1 = dict(g1, decoder_layers=jax.tree.map(lambda a: a[real], g1["decoder_layers"]))
    assert_close(g, g1)


CASES = [  # (schedule, v, micro-batches, first/last stage layers, devices, other fields)
    # 1F1B, uneven stages (3 + 1 layers: the last stage's chunk has 2 padding slots), tokens dropped
    ("1f1b", 1, 4, (3, None), 2, dict(moe_expert_capacity_factor=0.5)),
    # interleaved (v = 2) x ep2 with the allgather dispatcher and the per-sequence aux loss, 4 devices
    ("interleaved_1f1b", 2, 2, None, 4, dict(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather",
                                             moe_router_load_balancing_type="seq_aux_loss")),
    # 1F1B x ep2 (alltoall) x dp2 + ZeRO-1, 8 devices
    ("1f1b", 1, 2, None, 8, dict(expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                                 use_distributed_optimizer=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v,m,uneven,devices,extra", CASES,
                         ids=[f"{s}-v{v}-m{m}-dev{n}" + ("-uneven" if u else "") + "-" + "_".join(sorted(x))
                              for s, v, m, u, n, x in CASES])
def test_moe_pipeline_matches_unpipelined(schedule, v, m, uneven, devices, extra):
    pp = 2
    first, last = uneven or (None, None)
    ranks = devices // pp  # data x expert: Megatron's data-parallel size
    cfg = tiny_cfg(**MOE, **extra, micro_batch_size=16 // (m * ranks), pipeline_model_parallel_size=pp,
                   virtual_pipeline_model_parallel_size=v if v > 1 else None, pipeline_schedule=schedule,
                   decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last)
    g, report, run, state, batch = grads_of(cfg, devices)
    assert (run.mesh.shape["pipeline"], run.num_microbatches) == (pp, m)
    assert run.mesh.shape["expert"] == extra.get("expert_model_parallel_size", 1)
    # The reference: no pipeline, stacked layers, the same micro-batches and data split, on
    # the same parameters (the stage slots put back in model order; no second init).
    layout = PipelineLayout(MOE["num_layers"], pp, v, first, last)
    assert (layout.order() == PAD).any() == bool(uneven)  # the uneven case has padding slots
    ref = {k: val for k, val in extra.items() if k != "use_distributed_optimizer"}
    ref_cfg = tiny_cfg(**MOE, **ref, micro_batch_size=16 // (m * ranks), scan_layers=True)
    ref_run = build(ref_cfg, create_mesh(ref_cfg, jax.devices()[:ranks]))
    assert ref_run.num_microbatches == m
    params = jax.device_get(state.params)
    slot_of = np.argsort(np.where(layout.order() == PAD, MOE["num_layers"], layout.order()))[:MOE["num_layers"]]
    params["decoder_layers"] = jax.tree.map(lambda a: a[slot_of], params["decoder_layers"])
    ref_state = state.replace(params=params, opt_state=None, step=jax.device_get(state.step),
                              rng=jax.device_get(state.rng))
    g1, report1, _ = jax.device_get(ref_run.compute_grads(ref_state, ref_run.put_batch(jax.device_get(batch))))
    if "moe_expert_capacity_factor" in extra:
        assert 0.0 < float(report["moe_dropped_token_fraction"]) < 1.0
    assert report["moe_tokens_per_expert"].shape == (MOE["num_layers"], MOE["num_moe_experts"])
    aux = "seq_load_balancing_loss" if extra.get("moe_router_load_balancing_type") == "seq_aux_loss" \
        else "load_balancing_loss"
    assert {"loss", "lm_loss", aux, "z_loss", "moe_dropped_token_fraction"} <= set(report1)
    compare((g, report), (g1, report1), layout)


def test_moe_pipeline_refusals_name_the_field():
    with pytest.raises(ConfigError, match="moe_layer_freq=2 mixes dense and MoE layers"):
        tiny_cfg(**MOE, moe_layer_freq=2, pipeline_model_parallel_size=2)


@pytest.mark.slow
def test_pipeline_report_runs_moe_with_expert_parallelism():
    # m micro-batches over Megatron's data-parallel size (data x expert), and the compiled
    # step's ppermutes over the pipeline are the schedule's 2 per tick (the all-to-alls over
    # expert are not among them)
    from jmegatron.tools import pipeline_report

    cfg = tiny_cfg(**MOE, micro_batch_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                   moe_token_dispatcher_type="alltoall")
    row = pipeline_report.analyze(cfg, create_mesh(cfg, jax.devices()[:4]), "1f1b", 4, 1)
    assert (row["m"], row["data_parallel_size"]) == (4, 2)
    assert row["ppermutes_hlo"] == row["ppermutes_analytic"] == 2 * row["ticks"]
