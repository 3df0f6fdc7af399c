"""DeepSeek-V3's aux-loss-free balancing in training (issue 13 item 1,
``moe_router_enable_expert_bias``): each router's ``expert_bias`` takes no gradient and is
advanced once per global batch after the optimizer step by Megatron-Core's own
``get_updated_expert_bias`` rule on the step's tokens per expert, summed over micro-batches
and data ranks (megatron/core/distributed/finalize_model_grads.py
``_update_router_expert_bias``); expert-parallel runs keep the one-device biases."""

import jax
import numpy as np
import pytest
import torch

from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build

from test_train_step import random_batches, tiny_cfg

MOE = dict(add_bias_linear=False, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, num_layers=2,
           moe_aux_loss_coeff=0.0, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=0.05)
RATE = MOE["moe_router_bias_update_rate"]


def biases(params):
    """{layer name: expert_bias [.., E]} of every router."""
    return {jax.tree_util.keystr(path[:1]): np.asarray(leaf) for path, leaf in
            jax.tree_util.tree_leaves_with_path(params) if getattr(path[-1], "key", None) == "expert_bias"}


def megatron_update(tokens, bias, monkeypatch):
    """Megatron-Core's update on the global counts (its all-reduce over the tensor x data
    group is the identity here: the counts are already summed)."""
    from megatron.core.transformer.moe import moe_utils as mu

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    monkeypatch.setattr(mu.parallel_state, "get_tensor_and_data_parallel_group", lambda **kw: None)
    return mu.get_updated_expert_bias(torch.tensor(np.asarray(tokens, np.float32)),
                                      torch.tensor(np.asarray(bias, np.float32)), RATE).numpy()


def train(cfg, num_devices, steps=3):
    """Per step: (biases before, metrics, biases after, params after)."""
    run = build(cfg, create_mesh(cfg, jax.devices()[:num_devices]))
    state = run.init_state()
    out = []
    for b in random_batches(steps, run.global_batch_size, cfg.seq_length, 500, seed=3):
        before = biases(jax.device_get(state.params))
        state, metrics = run.train_step(state, run.put_batch(
            {k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()}))
        params = jax.device_get(state.params)
        out.append((before, jax.device_get(metrics), biases(params), params))
    return out


@pytest.mark.parametrize("scan", [False, True])
def test_bias_follows_megatrons_update_after_each_step(scan, monkeypatch):
    cfg = tiny_cfg(**MOE, scan_layers=scan, micro_batch_size=4, global_batch_size=8, log_num_zeros_in_grad=True)
    history = train(cfg, 1)
    moved = 0
    for before, metrics, after, _ in history:
        tokens = metrics["moe_tokens_per_expert"]  # [num_moe_layers, E], mean over micro-batches
        assert tokens.shape == (2, 4)
        # top-2 of every token of a micro-batch (nothing drops without a capacity factor)
        np.testing.assert_allclose(tokens.sum(-1), 2 * 4 * cfg.seq_length)
        for name, bias in before.items():
            rows = tokens if scan else tokens[int(name.rsplit("_", 1)[1].rstrip("']"))]
            np.testing.assert_allclose(after[name], megatron_update(rows, bias, monkeypatch), rtol=0, atol=1e-7)
        moved += sum(int(np.any(after[n] != before[n])) for n in before)
    assert moved > 0
    # num_zeros leaves the biases' (always zero) gradients out: fewer zeros than bias entries
    assert history[0][1]["num_zeros"] < 2 * 4


@pytest.mark.slow
def test_expert_parallel_biases_equal_one_device():
    """ep2 (alltoall) x dp2 + ZeRO-1: the same tokens per expert, so the same biases and
    losses as one device after every step."""
    kw = dict(MOE, global_batch_size=8)
    ep = train(tiny_cfg(**kw, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                        use_distributed_optimizer=True, micro_batch_size=1), 4)
    one = train(tiny_cfg(**kw, micro_batch_size=4), 1)
    for (_, m, after, _), (_, m1, after1, _) in zip(ep, one):
        np.testing.assert_array_equal(m["moe_tokens_per_expert"], m1["moe_tokens_per_expert"])
        np.testing.assert_allclose(m["lm_loss"], m1["lm_loss"], rtol=1e-5)
        for name in after1:
            np.testing.assert_array_equal(after[name], after1[name])


@pytest.mark.slow
def test_pipeline_biases_equal_one_device():
    """pp2 (1F1B, uneven stages: 3 + 1 layers, so a padding slot): each bias rides with its
    layer's pipeline slot and the stages' tokens per expert assemble over the pipeline, so
    the biases and losses after each step equal one device's (stacked layers)."""
    kw = dict(MOE, num_layers=4, scan_layers=True, global_batch_size=8, micro_batch_size=2)
    pp = train(tiny_cfg(**kw, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3), 2)
    one = train(tiny_cfg(**kw), 1)
    for (_, m, after, params), (_, m1, after1, params1) in zip(pp, one):
        np.testing.assert_array_equal(m["moe_tokens_per_expert"], m1["moe_tokens_per_expert"])
        np.testing.assert_allclose(m["lm_loss"], m1["lm_loss"], rtol=1e-5)
        (name,) = after1
        stored = after[name]  # [slots, E] in stage order, the padding slot zero
        from jmegatron.training.state import stored_layer_index

        index = stored_layer_index(tiny_cfg(**kw, pipeline_model_parallel_size=2,
                                            decoder_first_pipeline_num_layers=3))
        for slot, layer in enumerate(index):
            want = after1[name][layer] if layer >= 0 else np.zeros(4)
            np.testing.assert_array_equal(stored[slot], want)
