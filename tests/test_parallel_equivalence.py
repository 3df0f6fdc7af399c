"""Megatron's parallelisms on 8 simulated CPU devices give the same losses and gradients
as one device (float32, relative 1e-5, 3 steps), with dropout on (hidden and attention
0.1): masks are drawn from global sample numbers (jmegatron/models/dropout.py), never
from the rank. Layouts without tensor parallelism run the CPU kernels as the one-device
reference does ("auto"); tensor-parallel ones run XLA's attention and matmuls."""

import math

import jax
import numpy as np
import optax
import pytest

from jmegatron.config import ConfigError
from jmegatron.kernels import cpu
from jmegatron.parallel.mesh import create_mesh
from jmegatron.reporting import memory
from jmegatron.training.run import build

from test_train_step import random_batches, tiny_cfg

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
LAYOUTS = {
    "dp8_distopt": dict(use_distributed_optimizer=True),
    "tp4_sp_dp2": dict(tensor_model_parallel_size=4, sequence_parallel=True),
    "tp2_dp4_distopt": dict(tensor_model_parallel_size=2, use_distributed_optimizer=True),
    "fsdp8": dict(use_megatron_fsdp=True),
}
LLAMA = dict(family="llama", num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96)
# the attention blocks of today's families in one model: Qwen2's Q/K/V bias, Qwen3's QK-norm
# with a head dimension (32) decoupled from hidden / heads (16), YaRN (jmegatron.models.rope)
BLOCKS = dict(family="llama", num_attention_heads=4, num_query_groups=2, kv_channels=32, ffn_hidden_size=96,
              add_qkv_bias=True, qk_layernorm=True, position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
              yarn_original_max_position_embeddings=16,
              rotary_percent=0.5, rotary_interleaved=True)  # partial + interleaved RoPE (Phi-3's, GLM's parts)
# OLMo-2/3's blocks: the QK-norm over all query heads and all key heads together (its variance a
# mean across the heads that tensor parallelism splits), post-norms only, a decoupled head dimension
OLMO_BLOCKS = dict(family="llama", num_attention_heads=4, num_query_groups=2, kv_channels=32, ffn_hidden_size=96,
                   qk_layernorm=True, qk_layernorm_across_heads=True, sandwich_norms=True, pre_norms=False)
# SmolLM3's NoPE layer (the second) and Granite's scalars: positions that context parallelism
# reorders reach RoPE on one layer only; the scalars sit on tensor-parallel partial sums
BLOCKS.update(no_rope_freq=2, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0)
ARCHS = {"gpt": {}, "llama": LLAMA}
# DeepSeek-V3's blocks in one model: multi-latent attention (q LoRA, latent norms, YaRN), a dense
# first layer then MoE layers with sigmoid routing, the expert bias, 2-of-4 group-limited
# top-4, scaling and a shared expert, and two multi-token prediction depths (MoE layers)
DEEPSEEK = dict(family="deepseek_v3", num_attention_heads=4, num_query_groups=4, ffn_hidden_size=96,
                q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16, num_layers=2,
                moe_layer_freq=(0, 1), num_moe_experts=8, moe_ffn_hidden_size=32, moe_router_topk=4,
                moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                moe_shared_expert_intermediate_size=32, mtp_num_layers=2)


def trajectory(cfg, num_devices, steps=3):
    """``steps`` train steps of ``cfg`` on the first ``num_devices`` devices: (losses
    ``[steps]``, each step's gradients as numpy trees, the Run) (:func:`trajectory_params`)."""
    return trajectory_params(cfg, num_devices, steps)[:3]


def trajectory_params(cfg, num_devices, steps=3, keys=("lm_loss",)):
    """``steps`` train steps of ``cfg`` on the first ``num_devices`` devices over
    :func:`random_batches`: (losses ``[steps]`` (``[steps, len(keys)]``: the metrics ``keys``
    when more than one), each step's gradients as numpy trees, the Run, (the parameters before
    the first step, after the last) as numpy trees). The gradients are read back from the
    optimizer state (:func:`step_gradients`), so only the train step is compiled."""
    run = build(cfg, create_mesh(cfg, jax.devices()[:num_devices]))
    state = run.init_state()
    first = jax.device_get(state.params)
    losses, grads, mu = [], [], None
    for b in random_batches(steps, run.global_batch_size, cfg.seq_length, 500):
        b = run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()})
        state, m = run.train_step(state, b)
        losses.append([float(m[k]) for k in keys])
        new_mu = jax.device_get(_adam_state(state.opt_state).mu)
        grads.append(step_gradients(cfg, new_mu, mu, float(m["grad_norm"])))
        mu = new_mu
    losses = np.array(losses)
    return losses[:, 0] if len(keys) == 1 else losses, grads, run, (first, jax.device_get(state.params))


def _adam_state(opt_state):
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(x, optax.ScaleByAdamState)]
    assert len(found) == 1, opt_state
    return found[0]


def step_gradients(cfg, mu, prev_mu, grad_norm):
    """One step's reduced gradients (float64 numpy tree) from Adam's first moment before
    (``prev_mu``; None: the first step) and after the step: ``mu = b1 prev_mu + (1 - b1)
    clip(g)`` (optax.scale_by_adam), ``clip(g) = g min(1, clip_grad / grad_norm)``
    (optax.clip_by_global_norm; ``grad_norm``: the step's metric, before clipping)."""
    b1 = cfg.adam_beta1
    unclip = max(1.0, grad_norm / cfg.clip_grad) if cfg.clip_grad > 0 else 1.0
    prev_mu = prev_mu if prev_mu is not None else jax.tree.map(np.zeros_like, mu)
    return jax.tree.map(lambda m, p: (np.float64(m) - b1 * np.float64(p)) / (1 - b1) * unclip, mu, prev_mu)


_REFERENCES = {}


def reference(name):
    """(the arch's fields, its one-device trajectory), built once per module (a module-scoped
    fixture parametrized per test case is rebuilt for each case)."""
    if name not in _REFERENCES:
        arch = ARCHS[name]
        # One device, the same 2 micro-batches of 8 sequences as every layout below.
        ref = trajectory(tiny_cfg(micro_batch_size=8, **DROPOUT, **arch), 1)
        assert ref[2].model.cfg.attention_impl == "cpu" or not cpu.available()
        _REFERENCES[name] = arch, ref
    return _REFERENCES[name]


# pure data parallelism does not depend on the architecture: llama runs the layouts that split
# its weights (tp4 + SP, ZeRO-1's tp2_dp4_distopt, FSDP), gpt every layout but plain dp8
# (dp8_distopt keeps the 8-way data axis, with ZeRO-1's reduce-scatter). No layout is plain
# tp2_dp4: it splits the weights as tp2_dp4_distopt does, and its gradient all-reduce over the
# data axis beside a tensor axis is tp4_sp_dp2's at another size.
@pytest.mark.parametrize("name,layout", [(arch, layout) for arch in ("gpt", "llama") for layout in LAYOUTS
                                         if not (arch == "llama" and layout == "dp8_distopt")])
def test_layout_matches_one_device(layout, name):
    arch, (ref_losses, ref_grads, _) = reference(name)
    kw = dict(LAYOUTS[layout], **arch)
    tp = kw.get("tensor_model_parallel_size", 1)
    # dp = 8 / tp ranks of micro_batch_size tp: 2 micro-batches of 8 sequences, as the reference.
    cfg = tiny_cfg(micro_batch_size=tp, **DROPOUT, **kw)
    losses, grads, run = trajectory(cfg, 8)
    assert run.model.cfg.attention_impl == ("xla" if tp > 1 or not cpu.available() else "cpu")
    assert run.num_microbatches == 2 and run.mesh.shape["tensor"] == tp
    assert_same_trajectory(losses, grads, ref_losses, ref_grads)


def assert_same_trajectory(losses, grads, ref_losses, ref_grads):
    """Losses to relative 1e-5 and every gradient leaf to 1e-5 of its largest entry."""
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        flat_g, flat_r = jax.tree.leaves(g), jax.tree.leaves(r)
        assert len(flat_g) == len(flat_r)
        for a, b in zip(flat_g, flat_r):
            scale = np.max(np.abs(b)) + 1e-12
            np.testing.assert_allclose(a / scale, b / scale, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks", [BLOCKS, OLMO_BLOCKS], ids=["qwen", "olmo"])
def test_family_blocks_match_one_device(blocks):
    """QK-norm (its scales shared by the heads that tensor parallelism splits), the Q/K/V
    biases and YaRN (positions that context parallelism reorders); OLMo's QK-norm over all
    heads (a reduction across the tensor ranks) and post-norms only; under tp2 + SP x cp2 x dp2:
    one step's loss and every gradient equal one device's (the layouts' training
    trajectories are test_layout_matches_one_device's and tests/test_context_parallel.py's).
    The ring's branches differ between context ranks, so no collective may sit inside one
    (XLA's CPU runtime deadlocks on it, checked before the step runs)."""
    from test_context_parallel import grads_of

    kw = dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2)
    cfg = tiny_cfg(**DROPOUT, **blocks, **kw, micro_batch_size=2, global_batch_size=8)
    run = build(cfg, create_mesh(cfg, jax.devices()))
    assert dict(run.mesh.shape) == {"pipeline": 1, "data": 2, "expert": 1, "context": 2, "tensor": 2}
    host = random_batches(1, run.global_batch_size, cfg.seq_length, 500, seed=5)[0]
    batch = run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in host.items()})
    state = run.init_state()
    hlo = run.compute_grads.lower(state, batch).compile().as_text()
    branch_collectives = [line for line in hlo.splitlines() if "collective" in line and "/cond/branch" in line]
    assert not branch_collectives, branch_collectives[:2]
    g, report, tokens = jax.device_get(run.compute_grads(state, batch))
    g1, report1, tokens1, _ = grads_of(tiny_cfg(**DROPOUT, **blocks, micro_batch_size=4, global_batch_size=8), 1)
    assert float(tokens) == tokens1
    assert_same_trajectory([report["lm_loss"]], [g], [report1["lm_loss"]], [g1])


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_model_parallel_size=3), "8 devices are not divisible by tensor\\(3\\)"),
    (dict(tensor_model_parallel_size=8), "num_attention_heads=4 is not divisible by tensor_model_parallel_size=8"),
    (dict(tensor_model_parallel_size=4, num_query_groups=2), "num_query_groups=2 is not divisible"),
    (dict(tensor_model_parallel_size=2, ffn_hidden_size=99), "ffn_hidden_size=99 is not divisible"),
    (dict(use_megatron_fsdp=True, hidden_size=60, num_attention_heads=4), "hidden_size=60 is not divisible by the data-parallel size 8"),
    (dict(sequence_parallel=True), "sequence_parallel=True needs"),
])
def test_bad_parallel_sizes_fail_at_start_up(kw, match):
    with pytest.raises(ConfigError, match=match):
        cfg = tiny_cfg(**kw)
        build(cfg, create_mesh(cfg, jax.devices()[:8]))


@pytest.mark.parametrize("name,kw", [
    ("llama", dict(tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True)),
])
def test_tensor_parallel_alone_matches_one_device(kw, name):
    # tp 2 on 2 devices: one data-parallel rank, so the data collectives are skipped (XLA's
    # partitioner rejects an all-reduce over a size-1 manual axis beside an automatic one);
    # with SP and ZeRO-1, whose data-axis collectives are the ones skipped (gpt's plain tp2
    # weights are test_layout_matches_one_device's)
    arch, (ref_losses, ref_grads, _) = reference(name)
    losses, grads, run = trajectory(tiny_cfg(micro_batch_size=8, **DROPOUT, **kw, **arch), 2)
    assert run.mesh.shape["data"] == 1 and run.num_microbatches == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads[-1]), jax.tree.leaves(ref_grads[-1])):
        scale = np.max(np.abs(b)) + 1e-12
        np.testing.assert_allclose(a / scale, b / scale, rtol=1e-5, atol=1e-5)


def test_deepseek_v3_blocks_match_one_device():
    """Multi-latent attention (its down projections replicated over tensor ranks, the up
    projections column-parallel), DeepSeek-V3's routing with expert parallelism and the
    multi-token prediction losses under tp2 + SP x ep2 x dp4: one step's loss, each MTP loss
    and every gradient equal one device's."""
    from test_context_parallel import grads_of

    kw = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2)
    g, report, tokens, run = grads_of(tiny_cfg(**DROPOUT, **DEEPSEEK, **kw, micro_batch_size=2, global_batch_size=8), 8)
    assert dict(run.mesh.shape) == {"pipeline": 1, "data": 2, "expert": 2, "context": 1, "tensor": 2}
    assert run.model.cfg.attention_impl == "xla"
    # model_report's per-device parameters (MLA's replicated down projections, the MTP layers) are the layout's
    shards = [math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(run.abstract_with_shardings().params)]
    assert sum(shards) == memory.parameters_per_device(run.cfg, run.cfg.padded_vocab_size(),
                                                        memory.ParallelLayout.from_config(run.cfg, 4))
    g1, report1, tokens1, _ = grads_of(tiny_cfg(**DROPOUT, **DEEPSEEK, micro_batch_size=8, global_batch_size=8), 1)
    assert tokens == tokens1
    for k in ("mtp_1_loss", "mtp_2_loss"):
        np.testing.assert_allclose(report[k], report1[k], rtol=1e-5)
    assert_same_trajectory([report["lm_loss"]], [g], [report1["lm_loss"]], [g1])
