"""Multi-token prediction (DeepSeek-V3's MTP) held to megatron-core's own
``MultiTokenPredictionBlock``: a megatron-core ``GPTModel`` with two MTP depths whose layers
are MoE layers (the last decoder layer's kind), built on the CPU with random weights, is
imported through ``export.megatron``; jmegatron's ``lm_loss``, each ``mtp_{k}_loss`` (the
values megatron-core's ``MTPLossLoggingHelper`` tracks) and the gradient of every weight of
the optimised loss equal megatron-core's backward (whose ``MTPLossAutoScaler`` injects the
MTP losses' gradient, scaled by ``mtp_loss_scaling_factor / mtp_num_layers``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import megatron.core  # noqa: E402,F401
import torch  # noqa: E402

from jmegatron.config import ConfigError, base_config, from_configdict  # noqa: E402
from jmegatron.conversion import megatron as MC  # noqa: E402
from jmegatron.export import megatron as M  # noqa: E402
from jmegatron.models.gpt import GPTModel, ModelConfig  # noqa: E402
from jmegatron.models.multi_token_prediction import roll_left  # noqa: E402
from jmegatron.training.losses import lm_loss_fn  # noqa: E402

from test_megatron_checkpoint import randomize  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, SEQ, D = 300, 16, 2
MOE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
           num_query_groups=2, ffn_hidden_size=96, num_moe_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2,
           moe_shared_expert_intermediate_size=32, moe_layer_freq=(0, 1), moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.0, moe_aux_loss_coeff=0.0,
           untie_embeddings_and_output_weights=True)


def cfg_of(**kw):
    c = base_config()
    c.mock_data, c.vocab_size, c.num_layers, c.hidden_size, c.num_attention_heads = True, VOCAB, 2, 64, 4
    c.seq_length, c.hidden_dropout, c.attention_dropout = SEQ, 0.0, 0.0
    c.mtp_num_layers, c.mtp_loss_scaling_factor = D, 0.3
    for k, v in {**MOE, **kw}.items():
        setattr(c, k, v)
    return from_configdict(c)


@pytest.fixture(scope="module")
def reference(mcore):
    """megatron-core's model (random weights), one training forward and backward of its
    language-model loss on a batch with a masked position, its tracked MTP losses and its
    gradients."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    cfg = cfg_of()
    torch.manual_seed(0)
    model = M.megatron_core_model(cfg, cfg.padded_vocab_size())
    randomize(model)
    with torch.no_grad():
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # the vocabulary padding rows
            model.get_parameter(name)[VOCAB:] = 0.0                             # zero, as import pads them
    state = {k: v.clone() for k, v in model.state_dict().items() if v is not None and not k.endswith("_extra_state")}
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (2, SEQ))
    labels = rng.integers(0, VOCAB, (2, SEQ))
    loss_mask = np.ones((2, SEQ), np.float32)
    loss_mask[0, 5] = loss_mask[1, 11] = 0.0
    model.train()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    MTPLossLoggingHelper.tracker.clear()
    per_token = model(torch.from_numpy(tokens), torch.arange(SEQ)[None].expand(2, SEQ),
                      attention_mask=torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool(),
                      labels=torch.from_numpy(labels), loss_mask=torch.from_numpy(loss_mask))
    mask = torch.from_numpy(loss_mask)
    lm = (per_token * mask).sum() / mask.sum()
    lm.backward()
    mtp = MTPLossLoggingHelper.tracker["values"].detach().numpy().copy()
    MTPLossLoggingHelper.tracker.clear()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return dict(cfg=cfg, state=state, tokens=tokens, labels=labels, loss_mask=loss_mask, lm=float(lm), mtp=mtp,
                grads=grads)


def test_losses_and_every_gradient_equal_megatron_cores(reference):
    r = reference
    cfg = r["cfg"]
    params = MC.from_megatron_state_dict(r["state"], cfg, vocab_size=VOCAB)
    assert set(params["mtp_layers_1"]) == {"enorm", "hnorm", "eh_proj", "transformer_layer", "final_layernorm"}
    model = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
    micro = dict(tokens=jnp.asarray(r["tokens"], jnp.int32), labels=jnp.asarray(r["labels"], jnp.int32),
                 loss_mask=jnp.asarray(r["loss_mask"]),
                 position_ids=jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (2, SEQ)), sample_offset=0)
    loss_fn = lm_loss_fn(model)
    num_tokens = jnp.float32(r["loss_mask"].sum())
    (loss, report), grads = jax.jit(jax.value_and_grad(
        lambda p: loss_fn(p, micro, jax.random.key(0), num_tokens, None, lambda x: x), has_aux=True))(params)
    np.testing.assert_allclose(float(report["lm_loss"]), r["lm"], rtol=1e-5)
    mtp = [float(report[f"mtp_{k}_loss"]) for k in range(1, D + 1)]
    print(f"lm {float(report['lm_loss']):.6f} vs {r['lm']:.6f}; mtp {mtp} vs {r['mtp'].tolist()}")
    np.testing.assert_allclose(mtp, r["mtp"], rtol=1e-5)
    assert mtp[0] != mtp[1]  # each depth scores its own shift
    np.testing.assert_allclose(float(loss), r["lm"] + 0.3 / D * sum(mtp), rtol=1e-5)
    got = MC.to_megatron_state_dict(jax.device_get(grads), cfg)
    assert {k for k in r["grads"] if k.startswith("mtp.")} <= set(got)
    worst = 0.0
    for name, want in r["grads"].items():
        g = got[name]
        scale = np.abs(want).max() + 1e-12
        worst = max(worst, np.abs(g - want).max() / scale)
        np.testing.assert_allclose(g / scale, want / scale, atol=1e-5, err_msg=name)
    print(f"max gradient difference relative to each weight's largest: {worst:.3g}")


def test_evaluation_and_generation_skip_the_depths(reference):
    # without the "mtp" collection mutable (evaluation, generation) the model is the plain GPT:
    # the same logits as the model without MTP on the shared weights, no MTP compute
    r = reference
    cfg = r["cfg"]
    params = MC.from_megatron_state_dict(r["state"], cfg, vocab_size=VOCAB)
    plain_cfg = cfg_of(mtp_num_layers=None)
    plain = {k: v for k, v in params.items() if not k.startswith("mtp_layers_")}
    tokens = jnp.asarray(r["tokens"], jnp.int32)
    a = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size())).apply({"params": params}, tokens)
    b = GPTModel(ModelConfig.from_config(plain_cfg, cfg.padded_vocab_size())).apply({"params": plain}, tokens)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_roll_left_zero_fills_the_end():
    x = jnp.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(roll_left(x, 2), [[2, 3, 4, 5, 0, 0], [8, 9, 10, 11, 0, 0]])


@pytest.mark.parametrize("kw, match", [
    (dict(mtp_num_layers=0), "mtp_num_layers=0 must be >= 1"),
    (dict(mtp_loss_scaling_factor=-1.0), "mtp_loss_scaling_factor=-1.0 must be >= 0"),
    (dict(pipeline_model_parallel_size=2), "with pipeline_model_parallel_size=2 and num_moe_experts=4 is not built"),
    (dict(context_parallel_size=2), "with context_parallel_size=2 is not built"),
])
def test_refusals_name_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        cfg_of(**kw)


def test_parameter_count_is_megatron_cores(reference):
    from jmegatron.reporting import flops

    cfg = reference["cfg"]
    mcore = sum(v.numel() for v in reference["state"].values())  # parameters and the routers' expert biases
    assert flops.num_parameters(cfg, cfg.padded_vocab_size()) == mcore
    assert flops.num_parameters(cfg, cfg.padded_vocab_size()) > flops.num_parameters(
        cfg.replace(mtp_num_layers=None), cfg.padded_vocab_size())


def test_training_reports_each_depth_and_moves_the_mtp_routers_bias(capsys):
    from jmegatron.training.loop import pretrain

    rate = 1e-3
    cfg = cfg_of(train_iters=3, log_interval=1, eval_interval=0, micro_batch_size=2, global_batch_size=16,
                 lr_warmup_iters=0, moe_router_bias_update_rate=rate, peak_tflops=1.0)
    out = pretrain(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert len(lines) == 3 and all("mtp_1 loss:" in line and "mtp_2 loss:" in line for line in lines)
    bias = np.asarray(jax.device_get(out["state"].params["mtp_layers_1"]["transformer_layer"]["mlp"]["router"]
                                     ["expert_bias"]))
    steps = bias / rate  # three sign(mean - t_e) updates of +-rate (or 0) each, from zero
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    assert np.any(bias != 0) and np.all(np.abs(steps) <= 3 + 1e-3)


def test_megatron_checkpoint_holds_the_depths_in_every_layout(reference):
    # megatron-core's key set back exactly; the MTP layers' experts split over expert ranks and
    # eh_proj over tensor ranks (column-parallel), all of them on the last pipeline stage
    r = reference
    cfg = r["cfg"]
    sd = MC.to_megatron_state_dict(MC.from_megatron_state_dict(r["state"], cfg, vocab_size=VOCAB), cfg)
    assert set(sd) == set(r["state"])
    for k, v in r["state"].items():
        np.testing.assert_array_equal(sd[k], v.numpy(), err_msg=k)
    for tp, pp, ep in ((2, 1, 2), (1, 2, 1)):
        shards = MC.shard_state_dict(sd, cfg, tp, pp, ep)
        if pp > 1:
            assert not any(k.startswith("mtp.") for k in shards[MC.rank_dir(0, 0, 0, pp, ep)])
        if tp > 1:
            assert shards[MC.rank_dir(1, 0, 1, pp, ep)]["mtp.layers.0.eh_proj.weight"].shape == (32, 128)
            assert "mtp.layers.1.transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight" in \
                shards[MC.rank_dir(0, 0, 1, pp, ep)]
        merged = MC.merge_shards({(t, s, x): shards[MC.rank_dir(t, s, x, pp, ep)] for t in range(tp)
                                 for s in range(pp) for x in range(ep)}, cfg, tp, pp, ep)
        assert set(merged) == set(sd)
        for k, v in sd.items():
            np.testing.assert_array_equal(merged[k], v, err_msg=f"{(tp, pp, ep)} {k}")
    fields = MC.config_fields_from_megatron_args(M.megatron_args(cfg, cfg.padded_vocab_size(), VOCAB))
    assert (fields["mtp_num_layers"], fields["mtp_loss_scaling_factor"]) == (D, 0.3)
