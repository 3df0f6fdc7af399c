"""Expert parallelism (issue 13 item 3) on 8 simulated devices: the MoE model's loss and
gradients with the experts split over the ``expert`` mesh axis, by Megatron's allgather
and alltoall dispatchers, alone and with data parallelism + ZeRO-1, equal the one-device
model's (float32); the router losses are each data rank's own, as Megatron's, so an
expert-parallel run equals the data-parallel run with the same batch split."""

import jax
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build

from test_train_step import random_batches, tiny_cfg

# Router losses off for the one-device comparisons (they are per data rank, see below).
MOE = dict(add_bias_linear=False, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, num_layers=2,
           moe_aux_loss_coeff=0.0)


def grads_of(cfg, num_devices, steps_seed=0):
    run = build(cfg, create_mesh(cfg, jax.devices()[:num_devices]))
    state = run.init_state()
    b = random_batches(1, run.global_batch_size, cfg.seq_length, 500, seed=steps_seed)[0]
    b = run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()})
    g, report, _ = run.compute_grads(state, b)
    return jax.device_get(g), jax.device_get(report), run, state, b


def assert_close(got, want, rtol=1e-5):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        scale = np.max(np.abs(b)) + 1e-12
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, rtol=rtol, atol=rtol,
                                   err_msg=jax.tree_util.keystr(path))


CASES = [  # (expert_model_parallel_size, dispatcher, devices = tensor x data x expert, other fields)
    # (alltoall over every data rank, data axis 1: the ep2 x tp2 case below)
    (4, "allgather", 4, {}),
    (2, "allgather", 4, dict(use_distributed_optimizer=True, family="llama", num_query_groups=2)),  # dp2 + ZeRO-1
    # capacity >= tokens: nothing drops; ep4 x dp2 + ZeRO-1
    (4, "alltoall", 8, dict(use_distributed_optimizer=True, moe_expert_capacity_factor=4.0)),
    # ep2 x tp2 + SP, with Qwen2-MoE's gated shared expert and Qwen3's QK-norm (RMSNorm: a
    # LayerNorm k_layernorm's bias adds q.b to every score of a query, so its gradient is 0
    # analytically and float noise in practice, which no relative tolerance compares)
    (2, "alltoall", 4, dict(tensor_model_parallel_size=2, sequence_parallel=True, moe_shared_expert_intermediate_size=32,
                            moe_shared_expert_gate=True, qk_layernorm=True, family="llama")),
]

@pytest.mark.slow
@pytest.mark.parametrize("ep,dispatcher,devices,extra", CASES,
                         ids=[f"ep{e}-{d}-dev{n}-" + "_".join(sorted(x)) for e, d, n, x in CASES])
def test_expert_parallel_matches_one_device(ep, dispatcher, devices, extra):
    dp = devices // extra.get("tensor_model_parallel_size", 1)  # Megatron's data-parallel size: data x expert
    cfg = tiny_cfg(**MOE, **extra, expert_model_parallel_size=ep, moe_token_dispatcher_type=dispatcher,
                   micro_batch_size=16 // (2 * dp), global_batch_size=16)  # 2 micro-batches
    g, report, run, _, _ = grads_of(cfg, devices)
    assert dict(run.mesh.shape)["expert"] == ep and dict(run.mesh.shape)["data"] == dp // ep
    # the experts' weights are split over the expert axis
    kernel = run.state_shardings.params["decoder_layers_0"]["mlp"]["experts"]["linear_fc2"]["kernel"]
    assert kernel.spec[0] == "expert"
    if extra.get("use_distributed_optimizer"):  # ZeRO-1 over each leaf's data-parallel group
        from jmegatron.parallel.rules import entry_axes

        axes = lambda s: {a for e in s.spec for a in entry_axes(e)}  # noqa: E731
        grad_sh = run.grad_shardings
        assert {"data", "expert"} <= axes(grad_sh["word_embeddings"]["embedding"])  # dense: data x expert
        assert axes(grad_sh["decoder_layers_0"]["mlp"]["experts"]["linear_fc2"]["kernel"]) >= {"data", "expert"}
    one_device = ("use_distributed_optimizer", "tensor_model_parallel_size", "sequence_parallel")
    ref_cfg = tiny_cfg(**MOE, **{k: v for k, v in extra.items() if k not in one_device},
                       moe_token_dispatcher_type=dispatcher, micro_batch_size=16 // run.num_microbatches,
                       global_batch_size=16)
    g1, report1, _, _, _ = grads_of(ref_cfg, 1)
    np.testing.assert_allclose(report["lm_loss"], report1["lm_loss"], rtol=1e-5)
    np.testing.assert_array_equal(report["moe_tokens_per_expert"], report1["moe_tokens_per_expert"])
    assert_close(g, g1)


def test_router_losses_are_per_data_rank_as_megatron():
    """With the aux and z-losses on, ep=2 equals plain data parallelism over the same two
    ranks (each rank's router losses over its own tokens), not the one-device model."""
    kw = dict(MOE, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, micro_batch_size=4, global_batch_size=16)
    g_ep, r_ep, _, _, _ = grads_of(tiny_cfg(**kw, expert_model_parallel_size=2), 2)
    g_dp, r_dp, run_dp, _, _ = grads_of(tiny_cfg(**kw), 2)
    assert dict(run_dp.mesh.shape)["data"] == 2 and dict(run_dp.mesh.shape)["expert"] == 1
    for name in ("loss", "lm_loss", "load_balancing_loss", "z_loss"):
        np.testing.assert_allclose(r_ep[name], r_dp[name], rtol=1e-5, err_msg=name)
    assert_close(g_ep, g_dp)
    _, r_1, _, _, _ = grads_of(tiny_cfg(**dict(kw, micro_batch_size=8)), 1)
    assert abs(float(r_1["load_balancing_loss"]) - float(r_ep["load_balancing_loss"])) > 1e-6


def test_alltoall_capacity_drops_and_evaluation_runs_unsplit():
    cfg = tiny_cfg(**MOE, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                   moe_expert_capacity_factor=0.5, micro_batch_size=4, global_batch_size=16)
    _, report, run, state, batch = grads_of(cfg, 4)
    assert 0.0 < float(report["moe_dropped_token_fraction"]) < 1.0
    # evaluation runs the model under GSPMD (no manual expert axis): the one-device path
    total, count = run.eval_step(state.params, batch)
    one = cfg.replace(expert_model_parallel_size=1)
    ref = build(one, create_mesh(one, jax.devices()[:1]))
    total1, count1 = ref.eval_step(jax.device_get(state.params), jax.device_get(batch))
    assert float(count) == float(count1)
    np.testing.assert_allclose(float(total), float(total1), rtol=1e-5)


def test_bad_expert_parallel_configs_name_the_field():
    with pytest.raises(ConfigError, match="num_moe_experts=4 is not divisible by config.expert_model_parallel_size=8"):
        tiny_cfg(**MOE, expert_model_parallel_size=8)
    with pytest.raises(ConfigError, match="expert_model_parallel_size=2 splits the experts"):
        tiny_cfg(expert_model_parallel_size=2)
    with pytest.raises(ConfigError, match="moe_token_dispatcher_type='alltoall'"):
        tiny_cfg(**MOE, expert_model_parallel_size=2, moe_expert_capacity_factor=1.0)
    with pytest.raises(ConfigError, match="use_megatron_fsdp=True with expert_model_parallel_size"):
        tiny_cfg(**MOE, expert_model_parallel_size=2, use_megatron_fsdp=True)
