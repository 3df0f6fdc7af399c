"""Context parallelism composed with distillation, MoE and ZeRO-1 (issue 14 item 4), on
simulated devices, float32, against the unsplit sequence:

* distillation (dense teacher and student, the logits KL, an intermediate cosine loss and the
  LM loss through the balancer) at cp2 (p2p) gives the one-device loss, KD report and
  gradients, and cp2 x dp2 + ZeRO-1 those of dp2 (the balancer runs on each data rank's
  micro-batch), with a loss mask that leaves the context ranks different token counts
  (per-context-rank ratios would differ); three steps give the same parameters; so does
  cp2 x dp2 + FSDP, student and teacher sharded over data x context;
* ZeRO-1 shards the optimizer state over data x context (Megatron's data-parallel group with
  context parallelism), as reporting/memory.py's theory counts it;
* an MoE model (configs/mixtral_tiny.py shrunk, dropless) at cp2 gives the one-device loss,
  load-balancing / seq-aux / z losses, tokens per expert and gradients (Megatron reduces the
  router's token statistics over tensor x context); at cp2 x ep2 the aux loss is per data
  rank by Megatron's definition (the expert ranks split the batch), so it equals ep2 alone;
  pp2 x cp2 (all_gather) equals one device; the ring (p2p) under the pipeline and pipelined
  distillation under cp are refused naming the fields.
"""

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

from jmegatron.config import load_config_file
from jmegatron.parallel.mesh import create_mesh
from jmegatron.parallel.rules import entry_axes
from jmegatron.pretrain_gpt import build

from test_distill_moe import cfg_for as kd_cfg_for, save_teacher, yaml_file
from test_expert_parallel import assert_close

SEQ = 32
GBS = 8


def skewed_batch(run, steps=1, seed=0):
    """``steps`` host batches ``[num_micro, rows, SEQ]``; the loss mask drops positions 20-31
    of every other row, so at cp 2 (rank 0 holds positions 0-7 and 24-31, rank 1 8-23) the
    ranks count different tokens."""
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        toks = rs.randint(0, 500, size=(GBS, SEQ + 1)).astype(np.int32)
        mask = (rs.rand(GBS, SEQ) > 0.1).astype(np.float32)
        mask[::2, 20:] = 0.0
        b = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": mask,
             "position_ids": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (GBS, SEQ)).copy()}
        out.append({k: v.reshape(run.num_microbatches, -1, SEQ) for k, v in b.items()})
    return out


def build_on(cfg, devices):
    return build(cfg, create_mesh(cfg, jax.devices()[:devices]))


def grads_of(cfg, devices):
    run = build_on(cfg, devices)
    g, report, tokens = run.compute_grads(run.init_state(), run.put_batch(skewed_batch(run)[0]), *run.extra_args)
    return jax.device_get(g), jax.device_get(report), float(tokens), run


def axes_of(sharding):
    return {a for e in sharding.spec for a in entry_axes(e)}


# ------------------------------------------------------------------------ distillation
@pytest.fixture(scope="module")
def kd_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp_kd")
    teacher = save_teacher(tmp / "teacher", num_layers=3)
    kd = yaml_file(tmp, "intermediate_layer_pairs:\n  - [decoder.layers.1.input_layernorm, "
                        "decoder.layers.2.input_layernorm]\nskip_lm_loss: false\n")
    return functools.partial(kd_cfg_for, tmp / "student", hidden_dropout=0.0, attention_dropout=0.0,
                             global_batch_size=GBS, kd_teacher_load=teacher, kd_cfg=kd)


@pytest.fixture(scope="module")
def kd_one_device(kd_setup):
    return grads_of(kd_setup(micro_batch_size=GBS // 2), 1)


@pytest.fixture(scope="module")
def kd_dp2(kd_setup):
    """dp2 without context parallelism: each data rank's micro-batches of 2 rows balanced on
    their own (the ranks' token counts differ, so no one-device run weights them alike)."""
    return grads_of(kd_setup(micro_batch_size=GBS // 4), 2)


KD_NAMES = ("loss", "kd_loss", "lm_loss", "logits_distillation_loss", "intermediate_distillation_loss")


@pytest.mark.parametrize("devices,extra", [(2, {}), (4, dict(use_megatron_fsdp=True))],
                         ids=["cp2", "cp2-dp2-fsdp"])
def test_distillation_under_cp_equals_one_device(kd_setup, request, devices, extra):
    """The teacher runs inside the step with the student's ring attention (its layer-2 input
    feeds the intermediate loss), and every KD loss is a token sum over the context ranks
    divided by the data rank's token count, so the balancer's O / kd ratio sees the whole
    sequences of that rank's micro-batch: cp2 equals one device, cp2 x dp2 equals dp2. A
    per-context-rank ratio would differ: the context ranks' token counts do. (cp2 x dp2 with
    ZeRO-1: test_distillation_steps_under_cp2_dp2_zero1_equal_dp2's three steps.)"""
    g1, r1, tokens1, _ = request.getfixturevalue("kd_one_device" if devices == 2 else "kd_dp2")
    g, r, tokens, run = grads_of(kd_setup(micro_batch_size=GBS // devices, context_parallel_size=2, **extra),
                                 devices)
    assert dict(run.mesh.shape)["context"] == 2 and run.num_microbatches == 2
    assert run.forward_step.owner.cfg.context_parallel_size == 2  # the teacher's attention is the ring's
    if extra.get("use_megatron_fsdp"):  # FSDP over data x context (Megatron-FSDP's dp-cp group)
        # the teacher's weights are sharded (and gathered per micro-batch) like the student's
        teacher_qkv = run.forward_step.owner.shardings["decoder_layers_0"]["self_attention"]["linear_qkv"]["kernel"]
        assert {"data", "context"} <= axes_of(teacher_qkv)
        from jmegatron.reporting import memory as memory_lib

        weights = sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in
                      zip(jax.tree.leaves(run.abstract_state.params), jax.tree.leaves(run.state_shardings.params)))
        layout = memory_lib.ParallelLayout.from_config(run.cfg, run.mesh.shape["data"])
        assert weights == memory_lib.weight_and_optimizer_memory(run.cfg, run.padded_vocab_size, layout).weights
    assert tokens == tokens1
    for name in KD_NAMES:
        np.testing.assert_allclose(r[name], r1[name], rtol=1e-5, err_msg=name)
    assert r["intermediate_distillation_loss"] > 0
    assert_close(g, g1)


@pytest.mark.slow
def test_distillation_steps_under_cp2_dp2_zero1_equal_dp2(kd_setup):
    """Three optimizer steps at cp2 x dp2 with ZeRO-1 over data x context: the same losses and
    parameters as dp2 without context parallelism (the balancer runs on each data rank's
    micro-batch); the moments are sharded over data and context. (The student
    has no linear biases: the key bias's gradient is zero up to rounding, which Adam's
    normalisation turns into updates of either sign, whatever the layout.)"""
    def train(cfg, devices):
        run = build_on(cfg, devices)
        state, losses = run.init_state(), []
        for b in skewed_batch(run, steps=3, seed=1):
            state, m = run.train_step(state, run.put_batch(b), *run.extra_args)
            losses.append(float(m["kd_loss"]))
        return np.array(losses), jax.device_get(state.params), run

    losses, params, run = train(kd_setup(micro_batch_size=2, context_parallel_size=2, add_bias_linear=False,
                                         use_distributed_optimizer=True), 4)
    moments = {jax.tree_util.keystr(path): s for path, s in
               jax.tree_util.tree_leaves_with_path(run.state_shardings.opt_state) if ".mu" in jax.tree_util.keystr(path)}
    for name in ("['word_embeddings']['embedding']", "['decoder_layers_0']['mlp']['linear_fc1']['kernel']"):
        (sharding,) = [s for path, s in moments.items() if path.endswith(name)]
        assert {"data", "context"} <= axes_of(sharding), (name, sharding)
    losses1, params1, _ = train(kd_setup(micro_batch_size=2, add_bias_linear=False), 2)
    np.testing.assert_allclose(losses, losses1, rtol=1e-5)
    assert_close(params, params1, rtol=2e-5)


# ------------------------------------------------------------------------ mixture of experts
def moe_cfg(**kw):
    """configs/mixtral_tiny.py shrunk: 2 layers of 4 SwiGLU experts, top 2, GQA, RoPE, dropless;
    the z-loss on beside the aux loss."""
    shrink = dict(mock_data=True, vocab_size=500, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  num_attention_heads=4, num_query_groups=2, seq_length=SEQ, max_position_embeddings=SEQ,
                  num_moe_experts=4, moe_ffn_hidden_size=32, moe_z_loss_coeff=1e-3, global_batch_size=GBS,
                  lr_warmup_iters=1)
    return load_config_file("configs/mixtral_tiny.py", dict(shrink, **kw))


MOE_NAMES = ("loss", "lm_loss", "z_loss", "moe_dropped_token_fraction")


@pytest.fixture(scope="module")
def moe_one_device():
    """The one-device reference: scanned layers (the pipeline's stacked layout), 4 micro-batches."""
    return grads_of(moe_cfg(micro_batch_size=2, scan_layers=True), 1)


def test_moe_under_cp2_equals_one_device(moe_one_device):
    """Megatron's definition makes cp invisible to the router losses: the tokens per expert
    are reduced over context before the Switch loss (aux_loss), and the z-loss is a token
    mean over equal shares."""
    g1, r1, _, _ = moe_one_device
    g, r, _, run = grads_of(moe_cfg(micro_batch_size=2, scan_layers=True, context_parallel_size=2), 2)
    assert dict(run.mesh.shape)["context"] == 2
    for name in MOE_NAMES + ("load_balancing_loss",):
        np.testing.assert_allclose(r[name], r1[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(r["moe_tokens_per_expert"], r1["moe_tokens_per_expert"])
    assert r1["load_balancing_loss"] > 0 and r1["z_loss"] > 0
    assert_close(g, g1)


@pytest.mark.slow
def test_moe_seq_aux_loss_under_cp2_ep2_equals_ep2():
    """seq_aux_loss (per-sequence Switch losses: the sequence's token counts summed over its
    context ranks) with the expert ranks splitting the batch: Megatron's aux losses are per
    data rank (an expert rank is one), so cp2 x ep2 equals ep2 alone on the same batch split."""
    kw = dict(moe_router_load_balancing_type="seq_aux_loss", moe_token_dispatcher_type="allgather",
              expert_model_parallel_size=2, micro_batch_size=GBS // 4)
    g2, r2, _, _ = grads_of(moe_cfg(**kw), 2)
    g, r, _, run = grads_of(moe_cfg(context_parallel_size=2, **kw), 4)
    assert dict(run.mesh.shape)["context"] == 2 and dict(run.mesh.shape)["expert"] == 2
    for name in MOE_NAMES + ("seq_load_balancing_loss",):
        np.testing.assert_allclose(r[name], r2[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(r["moe_tokens_per_expert"], r2["moe_tokens_per_expert"])
    assert r2["seq_load_balancing_loss"] > 0
    assert_close(g, g2)


@pytest.mark.parametrize("devices,extra", [(4, {}), (4, dict(expert_model_parallel_size=2))],
                         ids=["moe-cp2-dp2-zero1", "moe-cp2-ep2-zero1"])
def test_zero1_state_over_data_and_context_is_the_theory(devices, extra):
    """The optimizer state's per-device bytes from the run's shardings (experts over data x
    context, the dense leaves over data x expert x context) equal
    reporting/memory.py's ZeRO-1 theory, which divides by the context ranks too."""
    from jmegatron.reporting import memory as memory_lib

    cfg = moe_cfg(context_parallel_size=2, use_distributed_optimizer=True, micro_batch_size=2,
                  moe_token_dispatcher_type="allgather", **extra)
    run = build_on(cfg, devices)
    sh = run.state_shardings.opt_state
    leaves = jax.tree_util.tree_leaves_with_path(sh)
    expert_fc2 = [s for path, s in leaves if "experts" in jax.tree_util.keystr(path)][0]
    assert {"data", "context"} <= axes_of(expert_fc2)
    state_bytes = sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                      for a, s in zip(jax.tree.leaves(run.abstract_state.opt_state), jax.tree.leaves(sh)))
    layout = memory_lib.ParallelLayout.from_config(cfg, run.mesh.shape["data"])
    theory = memory_lib.weight_and_optimizer_memory(cfg, run.padded_vocab_size, layout).optimizer_state
    assert state_bytes == pytest.approx(theory, abs=16)  # Adam's two step counts (int32) beside the moments
    if not extra:  # every leaf over the data x context group of 4
        unsharded = memory_lib.weight_and_optimizer_memory(cfg, run.padded_vocab_size, dataclasses.replace(
            layout, use_distributed_optimizer=False)).optimizer_state
        assert theory == pytest.approx(unsharded / 4)


# ------------------------------------------------------------------------ pipeline
@pytest.mark.slow
def test_moe_pipeline_under_cp_all_gather_equals_one_device(moe_one_device):
    """pp2 x cp2 (all_gather) of the MoE model: the stages' router losses are each rank's share
    over data x context, so loss, router losses, tokens per expert and gradients equal the
    one-device (scanned) model's."""
    g1, r1, _, _ = moe_one_device
    g, r, _, run = grads_of(moe_cfg(micro_batch_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
                                    cp_comm_type="all_gather"), 4)
    assert dict(run.mesh.shape)["pipeline"] == 2 and dict(run.mesh.shape)["context"] == 2
    for name in MOE_NAMES + ("load_balancing_loss",):
        np.testing.assert_allclose(r[name], r1[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(r["moe_tokens_per_expert"], r1["moe_tokens_per_expert"])
    assert_close(g, g1)


def test_pipeline_refusals_under_cp_name_the_fields(kd_setup):
    from jmegatron.config import ConfigError

    with pytest.raises(ConfigError, match="cp_comm_type='p2p' is not built .* set cp_comm_type='all_gather' or 'a2a'"):
        moe_cfg(micro_batch_size=2, context_parallel_size=2, pipeline_model_parallel_size=2)
    # pp x cp distillation is built (tests/test_pipeline_distill.py); a teacher the stages cannot split is refused
    with pytest.raises(ConfigError, match="teacher .* config.num_layers=3 is not divisible by pipeline_model_parallel_size=2"):
        build_on(kd_setup(micro_batch_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
                          cp_comm_type="all_gather", num_layers=2), 4)

