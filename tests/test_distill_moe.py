"""Distillation with an MoE student or teacher (issue 13 item 7), on simulated devices:
an MoE student's distillation loss and gradients equal a reference assembled by hand from
the distill losses, the balancer and the student's sown router losses (added after the
balancer, as Megatron's MoEAuxLossAutoScaler); an MoE teacher trains a dense student; MoE
student + MoE teacher under ep2 x dp2 equal dp4 (the experts unsplit); the console line
carries load_balancing_loss beside the KD losses; MoE student and teacher under pp2 x dp2
equal dp2 unpipelined."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmegatron.config import ConfigError
from jmegatron.distill.balancer import balance_losses
from jmegatron.distill.losses import hidden_state_cosine_loss, logits_kl_loss
from jmegatron.distill.teacher import load_teacher
from jmegatron.parallel.mesh import create_mesh
from jmegatron.pretrain_gpt import build, pretrain

from test_checkpoint_resume import cfg_for as _cfg_for
from test_expert_parallel import assert_close

HIDDEN = dict(hidden_size=48, num_attention_heads=4, ffn_hidden_size=96)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, add_bias_linear=False,
           moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
SEQ = 32


def cfg_for(save, **kw):
    return _cfg_for(save, **{"vocab_size": 512, **HIDDEN, **kw})


def yaml_file(tmp_path, text):
    p = tmp_path / "kd.yaml"
    p.write_text(text)
    return str(p)


def save_teacher(directory, **kw):
    """A teacher checkpoint of freshly initialised weights (no training: no train step to
    compile); ``init_method_std`` 0.3 makes its logits far from uniform, so the KL to it is
    large and the student's progress towards it measurable."""
    from jmegatron.checkpoint import checkpointing
    from jmegatron.training.run import checkpoint_meta

    cfg = cfg_for(directory, init_method_std=0.3, **kw)
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    ckpt = checkpointing.Checkpointer(str(directory))
    ckpt.save(1, run.init_state(), checkpoint_meta(cfg, run, 1, 0))
    ckpt.wait()
    ckpt.close()
    return str(directory)


@pytest.fixture(scope="module")
def moe_teacher_dir(tmp_path_factory):
    return save_teacher(tmp_path_factory.mktemp("moe_teacher"), **MOE)


@pytest.fixture(scope="module")
def dense_teacher_dir(tmp_path_factory):
    return save_teacher(tmp_path_factory.mktemp("dense_teacher"), num_layers=3)


def batch_for(run, seed=0):
    rs = np.random.RandomState(seed)
    n = run.global_batch_size
    toks = rs.randint(0, 512, size=(n, SEQ + 1)).astype(np.int32)
    b = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": (rs.rand(n, SEQ) > 0.1).astype(np.float32),
         "position_ids": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (n, SEQ)).copy()}
    return {k: v.reshape(run.num_microbatches, -1, SEQ) for k, v in b.items()}


def grads_of(cfg, n, seed=0):
    run = build(cfg, create_mesh(cfg, jax.devices()[:n]))
    state = run.init_state()
    host = batch_for(run, seed)
    g, report, _ = run.compute_grads(state, run.put_batch(host), *run.extra_args)
    return jax.device_get(g), jax.device_get(report), run, state, host


def test_moe_student_loss_and_gradients_equal_a_hand_assembled_reference(tmp_path, dense_teacher_dir):
    """MoE student (2 MoE layers, aux + z-loss) + dense 3-layer teacher, the LM loss kept and an
    intermediate pair on the residual stream after MoE layer 0, one device, 2 micro-batches:
    loss, report and every gradient equal KL + cosine + CE through balance_losses, plus the sum
    of the router losses the student sowed, averaged over micro-batches."""
    kd = yaml_file(tmp_path, "intermediate_layer_pairs:\n  - [decoder.layers.1.input_layernorm, "
                             "decoder.layers.2.input_layernorm]\nskip_lm_loss: false\n")
    cfg = cfg_for(tmp_path / "s", **MOE, hidden_dropout=0.0, attention_dropout=0.0, micro_batch_size=8,
                  kd_teacher_load=dense_teacher_dir, kd_cfg=kd)
    g, report, run, state, host = grads_of(cfg, 1)
    assert run.num_microbatches == 2
    student, teacher = run.model, run.forward_step.owner
    assert teacher.cfg.num_moe_experts is None and teacher.cfg.expert_model_parallel_size == 1
    params, t_params = jax.device_get(state.params), jax.device_get(teacher.params)

    def micro_loss(p, micro, with_router):
        args = (micro["tokens"], micro["position_ids"])
        logits_s, sown = student.apply({"params": p}, *args, deterministic=False,
                                       mutable=["intermediates", "moe_losses"])
        logits_t, inter_t = teacher.model.apply({"params": t_params}, *args, mutable=["intermediates"])
        mask = micro["loss_mask"]
        n = jnp.sum(mask)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits_s, micro["labels"])
        hs = sown["intermediates"]["decoder_layers_1"]["input_layernorm_output"][0]
        ht = inter_t["intermediates"]["decoder_layers_2"]["input_layernorm_output"][0]
        total, rep = balance_losses({"student_loss": jnp.sum(ce * mask) / n,
                                     "logits_loss": jnp.sum(logits_kl_loss(logits_s, logits_t) * mask) / n,
                                     "intermediate_0": jnp.sum(hidden_state_cosine_loss(hs, ht) * mask) / n})
        sown_losses = jax.tree_util.tree_flatten_with_path(sown["moe_losses"])[0]
        router = {k: sum(jnp.sum(v) for path, v in sown_losses if k in jax.tree_util.keystr(path))
                  for k in ("load_balancing_loss", "z_loss")}
        if with_router:
            total = total + router["load_balancing_loss"] + router["z_loss"]
        return total, (rep["kd_loss"], router)

    # one compiled function for both: with the router losses (the reference) and without (the control)
    grad_fn = jax.jit(lambda p, m: tuple(jax.value_and_grad(micro_loss, has_aux=True)(p, m, with_router)
                                         for with_router in (True, False)))
    parts = [grad_fn(params, {k: v[i] for k, v in host.items()}) for i in range(run.num_microbatches)]
    want = jax.tree.map(lambda *xs: sum(xs) / len(xs), *parts)
    ((loss, (kd, router)), g_ref), (_, g_no_router) = want
    assert float(router["load_balancing_loss"]) > 0 and float(router["z_loss"]) > 0
    np.testing.assert_allclose(report["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(report["kd_loss"], kd, rtol=1e-5)  # the balancer's total, without the router
    np.testing.assert_allclose(report["loss"] - report["kd_loss"],
                               router["load_balancing_loss"] + router["z_loss"], rtol=1e-4)
    layers = sum(student.cfg.moe_layers())
    assert layers == 2
    np.testing.assert_allclose(report["load_balancing_loss"], router["load_balancing_loss"] / 1e-2 / layers, rtol=1e-5)
    np.testing.assert_allclose(report["z_loss"], router["z_loss"] / 1e-3 / layers, rtol=1e-5)
    assert report["moe_tokens_per_expert"].shape == (2, 4)
    assert float(report["intermediate_distillation_loss"]) > 0 and float(report["lm_loss"]) > 0
    assert_close(g, g_ref)
    # control: the router losses move the router's gradient beyond the tolerance above
    router_kernel = lambda t: np.asarray(t["decoder_layers_0"]["mlp"]["router"]["kernel"])  # noqa: E731
    diff = np.max(np.abs(router_kernel(g_no_router) - router_kernel(g)))
    assert diff > 1e-3 * np.max(np.abs(router_kernel(g)))


def test_moe_teacher_trains_a_dense_student(tmp_path, moe_teacher_dir):
    kd = yaml_file(tmp_path, "intermediate_layer_pairs:\n  - [decoder.final_layernorm, decoder.final_layernorm]\n")
    save = tmp_path / "student"
    cfg = cfg_for(save, train_iters=5, lr_warmup_iters=1, log_interval=1, eval_interval=0, micro_batch_size=8,
                  kd_teacher_load=moe_teacher_dir, kd_cfg=kd)
    out = pretrain(cfg, create_mesh(cfg, jax.devices()[:1]))
    teacher = out["run"].forward_step.owner
    assert teacher.cfg.num_moe_experts == 4 and out["run"].cfg.num_moe_experts is None
    rows = [json.loads(l) for l in open(save / "metrics.jsonl") if "kd_loss" in l]
    kd_losses = [r["kd_loss"] for r in rows]
    assert len(kd_losses) == 5 and np.all(np.isfinite(kd_losses))
    assert kd_losses[-1] < kd_losses[0]
    assert not any("load_balancing_loss" in r for r in rows)  # the teacher's router sows no losses


@pytest.mark.slow
def test_moe_student_and_teacher_under_ep2_dp2_equal_dp4(tmp_path, moe_teacher_dir):
    """The student's z-loss on, its aux loss off: a per-rank token mean of a per-token loss
    is the global mean, the Switch aux loss is not (it is per data rank, as Megatron's)."""
    kd = yaml_file(tmp_path, "intermediate_layer_pairs:\n  - [decoder.layers.1.pre_mlp_layernorm, "
                             "decoder.layers.1.input_layernorm, mse]\nskip_lm_loss: false\n")
    kw = dict(MOE, moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall", num_layers=2,
              hidden_dropout=0.0, attention_dropout=0.0, kd_teacher_load=moe_teacher_dir, kd_cfg=kd)
    g, r, run, _, _ = grads_of(cfg_for(tmp_path / "ep", expert_model_parallel_size=2, micro_batch_size=2,
                                       use_distributed_optimizer=True, **kw), 4)
    assert dict(run.mesh.shape)["expert"] == 2 and dict(run.mesh.shape)["data"] == 2
    teacher = run.forward_step.owner
    assert teacher.cfg.expert_model_parallel_size == 2  # the teacher's experts split like the student's
    assert teacher.shardings["decoder_layers_0"]["mlp"]["experts"]["linear_fc2"]["kernel"].spec[0] == "expert"
    # dp4 (the experts whole on every rank), the same 4 ranks' micro-batches of 2 rows, each
    # balanced on its own (the ranks' token counts differ: no one-device run has these weights)
    g1, r1, _, _, _ = grads_of(cfg_for(tmp_path / "one", micro_batch_size=2, **kw), 4)
    for name in ("loss", "kd_loss", "lm_loss", "logits_distillation_loss", "intermediate_distillation_loss",
                 "z_loss"):
        np.testing.assert_allclose(r[name], r1[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(r["moe_tokens_per_expert"], r1["moe_tokens_per_expert"])
    assert_close(g, g1)


def test_moe_student_console_line_and_a_dense_teacher_under_ep2(tmp_path, capsys, dense_teacher_dir):
    save = tmp_path / "s"
    cfg = cfg_for(save, **MOE, train_iters=2, lr_warmup_iters=1, eval_interval=0, log_interval=1, micro_batch_size=8,
                  kd_teacher_load=dense_teacher_dir)
    out = pretrain(cfg, create_mesh(cfg, jax.devices()[:1]))
    line = [l for l in capsys.readouterr().out.splitlines() if "kd loss:" in l][-1]
    for name in ("kd loss:", "logits distillation loss:", "load_balancing_loss:", "z_loss:"):
        assert name in line, (name, line)
    rows = [json.loads(l) for l in open(save / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["load_balancing_loss"] > 0 and r["z_loss"] > 0 for r in rows)
    # skip_lm_loss (the default YAML): the optimised loss is still the KD total + the router losses
    layers = sum(out["run"].model.cfg.moe_layers())
    for r in rows:
        router = layers * (MOE["moe_aux_loss_coeff"] * r["load_balancing_loss"] + MOE["moe_z_loss_coeff"] * r["z_loss"])
        np.testing.assert_allclose(out["losses"][r["iteration"]] - r["kd_loss"], router, rtol=1e-3)
    # a dense teacher beside an expert-parallel student: replicated over the expert axis
    cfg = cfg_for(tmp_path / "ep", **MOE, expert_model_parallel_size=2, kd_teacher_load=dense_teacher_dir)
    mesh = create_mesh(cfg)
    teacher = load_teacher(dense_teacher_dir, cfg, 512, mesh)
    assert teacher.cfg.expert_model_parallel_size == 1 and teacher.cfg.num_moe_experts is None
    specs = [s.spec for s in jax.tree.leaves(teacher.shardings)]
    assert specs and not any("expert" in str(s) for s in specs)


def test_moe_student_and_teacher_under_pp2_dp2_equal_dp2(tmp_path, moe_teacher_dir):
    """The pipelined stages with an MoE student (its router losses chunk losses on each
    stage, outside the balancer) and an MoE teacher, pp2 x dp2 with an intermediate pair on
    the last stage: loss, KD and router losses, tokens per expert and every gradient equal
    the unpipelined step at dp2."""
    from jmegatron.parallel.pipeline_layout import stage_layer_order

    kd = yaml_file(tmp_path, "intermediate_layer_pairs:\n  - [decoder.layers.1.pre_mlp_layernorm, "
                             "decoder.layers.1.input_layernorm, mse]\nskip_lm_loss: false\n")
    kw = dict(MOE, moe_aux_loss_coeff=0.0, num_layers=2, scan_layers=True, hidden_dropout=0.0, attention_dropout=0.0,
              kd_teacher_load=moe_teacher_dir, kd_cfg=kd)
    g, r, run, _, _ = grads_of(cfg_for(tmp_path / "pp", pipeline_model_parallel_size=2, micro_batch_size=2,
                                       global_batch_size=8, **kw), 4)
    assert dict(run.mesh.shape)["pipeline"] == 2 and dict(run.mesh.shape)["data"] == 2
    # unpipelined dp2: the balancer runs on each data rank's micro-batch
    g1, r1, _, _, _ = grads_of(cfg_for(tmp_path / "one", micro_batch_size=2, global_batch_size=8, **kw), 2)
    for name in ("loss", "kd_loss", "lm_loss", "logits_distillation_loss", "intermediate_distillation_loss",
                 "z_loss"):
        np.testing.assert_allclose(r[name], r1[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(r["moe_tokens_per_expert"], r1["moe_tokens_per_expert"])
    order = stage_layer_order(2, 2, 1)
    g1 = dict(g1, decoder_layers=jax.tree.map(lambda a: a[order], g1["decoder_layers"]))
    assert_close(g, g1)


def test_bad_teacher_layouts_are_refused(tmp_path, moe_teacher_dir):
    ep8 = cfg_for(tmp_path / "d", **dict(MOE, num_moe_experts=8), expert_model_parallel_size=8,
                  kd_teacher_load=moe_teacher_dir)
    with pytest.raises(ConfigError, match="num_moe_experts=4, not divisible by the student's "
                                          "expert_model_parallel_size=8"):
        load_teacher(moe_teacher_dir, ep8, 512, create_mesh(ep8))
