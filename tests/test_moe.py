"""The MoE layer on one device (jmegatron/models/moe, issue 13 items 1, 2 and the router
losses of 4).

The router's functions are compared with megatron-core's own (megatron.core.transformer.moe
.moe_utils, run in torch float32 on the same inputs; skipped where megatron-core is not
installed); the MoE layer with a per-token loop written independently; the two expert
paths (ragged grouped GEMM, capacity buffer) with each other; and a tiny MoE GPT trains
through the real train step with its router losses reported.
"""

import dataclasses
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.config import ConfigError, MoEConfig, base_config, from_configdict, moe_layer_pattern
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.models.moe import moe_utils, token_dispatcher
from jmegatron.models.moe.moe_layer import MoELayer, moe_loss_terms
from jmegatron.models.moe.router import MOE_LOSSES, MOE_STATS, TopKRouter
from jmegatron.presets import FAMILIES

T, E = 48, 8


def _megatron():
    import torch
    from megatron.core.transformer.moe import moe_utils as mu

    return mu, torch


def _logits(seed=0, shape=(T, E)):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _t(a):
    import torch

    return torch.from_numpy(np.array(a))


# ------------------------------------------------------------------ router functions vs Megatron
@pytest.mark.parametrize("kw", [
    dict(topk=2, score_function="softmax"),
    dict(topk=2, score_function="softmax", use_pre_softmax=True, scaling_factor=2.5),
    dict(topk=1, score_function="softmax", use_pre_softmax=True),
    dict(topk=3, score_function="sigmoid"),
    dict(topk=1, score_function="sigmoid"),
    dict(topk=2, score_function="sigmoid", expert_bias=True),
    dict(topk=4, score_function="sigmoid", use_pre_softmax=True, scaling_factor=1.8, expert_bias=True),
    # DeepSeek-V3's group-limited routing: 4 groups of 2, the best 2 kept, groups scored by their top 2
    dict(topk=4, score_function="sigmoid", scaling_factor=2.5, expert_bias=True, num_groups=4, group_topk=2),
    dict(topk=2, score_function="softmax", num_groups=2, group_topk=1),
])
def test_topk_routing_matches_megatron(kw):
    mu, torch = _megatron()
    logits = _logits(1)
    bias = np.random.RandomState(2).randn(E).astype(np.float32) * 0.3 if kw.pop("expert_bias", False) else None
    ref_probs, ref_map = mu.topk_routing_with_score_function(
        _t(logits), expert_bias=None if bias is None else _t(bias), **kw)
    probs, routing_map, top = moe_utils.topk_routing_with_score_function(
        jnp.asarray(logits), expert_bias=None if bias is None else jnp.asarray(bias), **kw)
    np.testing.assert_array_equal(np.asarray(routing_map), ref_map.numpy())
    np.testing.assert_allclose(np.asarray(probs), ref_probs.numpy(), rtol=1e-6, atol=1e-7)
    # the top-k indices are the map's experts
    np.testing.assert_array_equal(np.sort(np.asarray(top), 1), np.nonzero(ref_map.numpy())[1].reshape(T, -1))
    if bias is not None:  # the bias moved some choices, so the test exercises it
        plain = mu.topk_routing_with_score_function(_t(logits), **kw)[1].numpy()
        assert (plain != ref_map.numpy()).any()
    if "num_groups" in kw:  # so did the group limit
        free = {k: v for k, v in kw.items() if k not in ("num_groups", "group_topk")}
        plain = mu.topk_routing_with_score_function(_t(logits), expert_bias=None if bias is None else _t(bias),
                                                    **free)[1].numpy()
        assert (plain != ref_map.numpy()).any()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_and_z_loss_match_megatron(score_function):
    mu, torch = _megatron()
    logits, k = _logits(3), 2
    ref_map, ref_scores = mu.compute_routing_scores_for_aux_loss(_t(logits), k, score_function)
    aux_map, scores = moe_utils.compute_routing_scores_for_aux_loss(jnp.asarray(logits), k, score_function)
    np.testing.assert_array_equal(np.asarray(aux_map), ref_map.numpy())
    np.testing.assert_allclose(np.asarray(scores), ref_scores.numpy(), rtol=1e-6)
    ref = mu.switch_load_balancing_loss_func(ref_scores, ref_map.sum(0), T, k, E, 1e-2)
    ours = moe_utils.switch_load_balancing_loss_func(scores, jnp.sum(aux_map, 0), T, k, E, 1e-2)
    np.testing.assert_allclose(float(ours), float(ref), rtol=1e-6)
    np.testing.assert_allclose(float(moe_utils.z_loss_func(jnp.asarray(logits), 1e-3)),
                               float(mu.z_loss_func(_t(logits), 1e-3)), rtol=1e-6)


def test_sinkhorn_and_capacity_match_megatron():
    mu, torch = _megatron()
    logits = _logits(4)
    np.testing.assert_allclose(np.asarray(moe_utils.sinkhorn(jnp.asarray(logits))),
                               mu.sinkhorn(_t(logits)).numpy(), rtol=1e-5, atol=1e-7)
    for args in [(96, 8, 1.0), (100, 7, 1.2), (10, 16, 0.5), (4096 * 6, 128, 1.2)]:
        assert moe_utils.get_capacity(*args) == mu.get_capacity(*args)
    assert moe_utils.get_capacity(10, 16, 0.5, min_capacity=4) == mu.get_capacity(10, 16, 0.5, min_capacity=4)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_token_dropping_matches_megatron(policy, pad):
    mu, torch = _megatron()
    logits, k, factor = _logits(5), 2, 1.0
    ref_probs, ref_map = mu.topk_routing_with_score_function(_t(logits), k)
    probs, routing_map, _ = moe_utils.topk_routing_with_score_function(jnp.asarray(logits), k)
    ref_p, ref_m = mu.apply_router_token_dropping(ref_probs, ref_map, k, factor, policy, pad)
    p, m = moe_utils.apply_router_token_dropping(probs, routing_map, k, factor, policy, pad)
    p, m, ref_p, ref_m = np.asarray(p), np.asarray(m), ref_p.numpy(), ref_m.numpy()
    capacity = mu.get_capacity(T * k, E, factor)
    routed = ref_map.numpy()
    assert (routed.sum(0) > capacity).any()  # this input drops tokens
    # Megatron keeps min(capacity, T) slots per expert; so do we, always routed ones first
    np.testing.assert_array_equal(m.sum(0), ref_m.sum(0))
    if policy == "probs":  # the same tokens survive (ties are only among unrouted zero-prob tokens)
        np.testing.assert_allclose(p, ref_p, rtol=1e-6)
        np.testing.assert_array_equal(m & routed, ref_m & routed)
    else:
        # Megatron's torch.topk over the 0/1 map keeps an arbitrary set among the routed
        # tokens (tied ones; sorted=False): the same count of routed tokens per expert. Ours
        # keeps the earliest positions.
        np.testing.assert_array_equal((m & routed).sum(0), (ref_m & routed).sum(0))
        for e in range(E):
            rows = np.nonzero(routed[:, e])[0]
            np.testing.assert_array_equal(np.nonzero(m[:, e] & routed[:, e])[0], rows[:capacity])
        np.testing.assert_allclose(p, np.asarray(probs) * (m & routed), rtol=0)


def test_expert_bias_update_matches_megatron(monkeypatch):
    mu, torch = _megatron()
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    monkeypatch.setattr(mu.parallel_state, "get_tensor_and_data_parallel_group", lambda **kw: None)
    tokens = np.array([[5, 9, 7, 7, 0, 12, 7, 9], [7, 7, 7, 7, 7, 7, 7, 7]], np.float32)
    bias = np.random.RandomState(6).randn(2, E).astype(np.float32) * 0.01
    ref = mu.get_updated_expert_bias(_t(tokens), _t(bias), 1e-3).numpy()
    ours = np.asarray(moe_utils.get_updated_expert_bias(jnp.asarray(tokens), jnp.asarray(bias), 1e-3))
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    assert (ours[1] == bias[1]).all() and (ours[0] != bias[0]).any()


def _init_params(module, key, *inputs):
    """``{"params": ...}`` of ``module.init`` (unboxed), without what init sowed (a later
    mutable apply would append to it)."""
    return {"params": nn.unbox(jax.jit(module.init)(key, *inputs)["params"])}


# ------------------------------------------------------------------ the router module
def _moe(**kw) -> MoEConfig:
    base = dict(num_moe_experts=E, moe_ffn_hidden_size=24, moe_router_topk=2)
    return MoEConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [
    dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3),
    dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs", moe_aux_loss_coeff=1e-2),
    dict(moe_router_load_balancing_type="sinkhorn"),
])
def test_router_module_matches_megatron_in_its_token_order(kw):
    """TopKRouter on [b, s, h] vs Megatron's functions on the same logits in Megatron's
    [s, b] token order (seq_aux_loss: Megatron's _apply_seq_aux_loss reshape; sinkhorn:
    its sinkhorn_load_balancing in training, top-k of the balanced logits, softmax weights)."""
    mu, torch = _megatron()
    b, s, h, k = 3, 16, 12, 2
    cfg = _moe(**kw)
    x = jnp.asarray(np.random.RandomState(7).randn(b, s, h).astype(np.float32))
    router = TopKRouter(cfg)
    params = {"params": nn.unbox(router.init(jax.random.key(0), x))["params"]}  # not init's sown values
    routing, sown = router.apply(params, x, training=True, mutable=[MOE_LOSSES, MOE_STATS])
    assert len(sown[MOE_STATS]["tokens_per_expert"]) == 1
    w = np.asarray(params["params"]["kernel"])
    logits = torch.einsum("sbh,he->sbe", _t(np.asarray(x).transpose(1, 0, 2)), _t(w)).reshape(s * b, E)
    if cfg.moe_router_load_balancing_type == "sinkhorn":
        indices = torch.topk(mu.sinkhorn(logits), k=k, dim=1)[1]
        ref_map = torch.zeros_like(logits).int().scatter(1, indices, 1).bool()
        ref_probs = torch.softmax(logits, dim=-1) * ref_map
    else:
        ref_probs, ref_map = mu.topk_routing_with_score_function(logits, k)
    if cfg.moe_expert_capacity_factor:
        ref_probs, ref_map = mu.apply_router_token_dropping(ref_probs, ref_map, k, 1.0, "probs", False)
    to_bs = lambda a: a.numpy().reshape(s, b, E).transpose(1, 0, 2).reshape(b * s, E)  # noqa: E731
    np.testing.assert_allclose(np.asarray(routing.probs), to_bs(ref_probs), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(routing.routing_map), to_bs(ref_map))
    aux_map, scores = mu.compute_routing_scores_for_aux_loss(logits, k, "softmax")
    losses = sown.get(MOE_LOSSES, {})
    if cfg.moe_router_load_balancing_type == "sinkhorn":
        assert not losses
    elif cfg.moe_router_load_balancing_type == "seq_aux_loss":
        ref = mu.switch_load_balancing_loss_func(scores.reshape(s, -1), aux_map.reshape(s, -1).sum(0), s, k, E,
                                                 1e-3) / b
        np.testing.assert_allclose(float(losses["seq_load_balancing_loss"][0]), float(ref), rtol=1e-5)
        assert "load_balancing_loss" not in losses
    else:
        ref = mu.switch_load_balancing_loss_func(scores, aux_map.sum(0), s * b, k, E, 1e-2)
        np.testing.assert_allclose(float(losses["load_balancing_loss"][0]), float(ref), rtol=1e-5)
    if cfg.moe_z_loss_coeff:
        np.testing.assert_allclose(float(losses["z_loss"][0]), float(mu.z_loss_func(logits, 1e-3)), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(sown[MOE_STATS]["tokens_per_expert"][0]), ref_map.numpy().sum(0))
    # evaluation computes no losses
    _, sown_eval = router.apply(params, x, training=False, mutable=[MOE_LOSSES])
    assert not sown_eval


def test_router_expert_bias_steers_the_choice_and_gets_no_gradient():
    cfg = _moe(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    x = jnp.asarray(np.random.RandomState(8).randn(2, 8, 12).astype(np.float32))
    router = TopKRouter(cfg)
    variables = nn.unbox(router.init(jax.random.key(0), x))
    assert variables["params"]["expert_bias"].shape == (E,)
    np.testing.assert_array_equal(np.asarray(variables["params"]["expert_bias"]), np.zeros(E))
    plain = router.apply(variables, x)
    biased = {"params": dict(variables["params"], expert_bias=jnp.full((E,), -1.0).at[3].set(1.0))}
    routed = router.apply(biased, x)
    assert bool(jnp.all(routed.routing_map[:, 3])) and not bool(jnp.all(plain.routing_map[:, 3]))
    # the bias picks experts but does not weight them, and takes no gradient
    grads = jax.grad(lambda p: jnp.sum(router.apply({"params": p}, x).probs ** 2))(biased["params"])
    np.testing.assert_array_equal(np.asarray(grads["expert_bias"]), np.zeros(E))
    assert float(jnp.abs(grads["kernel"]).sum()) > 0


# ------------------------------------------------------------------ the MoE layer
def _model_cfg(moe: MoEConfig, **kw) -> ModelConfig:
    base = dict(FAMILIES["llama"], num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                num_query_groups=2, kv_channels=8, vocab_size=64, max_position_embeddings=16, init_method_std=0.2,
                **dataclasses.asdict(moe))
    return ModelConfig(**{**base, **kw})


def _chosen_experts(params, x, k):
    """Each token's k experts by the router logits, in numpy (the choice is piecewise
    constant: no gradient flows through it)."""
    logits = np.asarray(x).reshape(-1, x.shape[-1]) @ np.asarray(params["params"]["router"]["kernel"])
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def _naive_moe(params, x, mc: ModelConfig, chosen=None, routing_map=None, probs=None):
    """Token by token (vmapped): softmax over the router logits of its ``chosen`` experts
    (or the given dense ``probs`` / ``routing_map``), each chosen expert's MLP weighted by
    its own weights, plus the shared expert."""
    moe = mc.moe
    p = params["params"]
    fc1, fc2 = p["experts"]["linear_fc1"]["kernel"], p["experts"]["linear_fc2"]["kernel"]

    def act(hid):
        if mc.swiglu:
            return jax.nn.silu(hid[0]) * hid[1]
        return jax.nn.gelu(hid, approximate=False)

    def mlp(w1, w2, v):
        return act(jnp.einsum("h,h...->...", v, w1)) @ w2

    def token(v, chosen_t, map_t, probs_t):
        if chosen is not None:
            weights = jax.nn.softmax((v @ p["router"]["kernel"])[chosen_t])
            out = sum(weights[j] * mlp(fc1[chosen_t[j]], fc2[chosen_t[j]], v) for j in range(chosen_t.shape[0]))
        else:
            out = sum(jnp.where(map_t[e], probs_t[e], 0.0) * mlp(fc1[e], fc2[e], v)
                      for e in range(moe.num_moe_experts))
        if moe.moe_shared_expert_intermediate_size:
            sh = p["shared_experts"]
            out = out + mlp(sh["linear_fc1"]["kernel"], sh["linear_fc2"]["kernel"], v)
        return out

    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    dummy = jnp.zeros((n, 1))
    out = jax.vmap(token)(flat, jnp.asarray(chosen) if chosen is not None else dummy,
                          jnp.asarray(routing_map) if routing_map is not None else dummy,
                          probs if probs is not None else dummy)
    return out.reshape(x.shape)


def test_dropless_moe_layer_equals_per_token_loop():
    """Outputs and gradients equal the per-token loop's; the router losses the layer sows
    (in training) have gradients for the router and the input only, not the experts."""
    mc = _model_cfg(_moe(moe_shared_expert_intermediate_size=20, moe_aux_loss_coeff=1e-1, moe_z_loss_coeff=1e-2))
    layer = MoELayer(mc, training=True)
    x = jnp.asarray(np.random.RandomState(9).randn(2, 6, 16).astype(np.float32))
    params = _init_params(layer, jax.random.key(1), x)
    chosen = _chosen_experts(params, x, 2)

    def outputs_and_grads(f):  # the outputs, and the gradients of a nonlinear function of them
        return jax.jit(lambda prm, v: (f(prm, v), jax.grad(lambda q, w: jnp.sum(jnp.sin(f(q, w))),
                                                            argnums=(0, 1))(prm, v)))(params, x)

    def layer_out(prm, v):
        out, sown = layer.apply(prm, v, mutable=[MOE_LOSSES, MOE_STATS])
        return out, moe_loss_terms(sown, mc.moe, 1)

    def router_losses_and_grads(prm, v):
        (total, report), g = jax.value_and_grad(lambda q, w: layer_out(q, w)[1], argnums=(0, 1),
                                                has_aux=True)(prm, v)
        return total, report, g

    grads = outputs_and_grads(lambda prm, v: layer_out(prm, v)[0])
    ref = outputs_and_grads(lambda prm, v: _naive_moe(prm, v, mc, chosen))
    for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(grads[1][0]["params"]["router"]["kernel"]).max()) > 0  # the router learns

    total, report, (g, gx) = jax.jit(router_losses_and_grads)(params, x)
    np.testing.assert_allclose(float(total), 1e-1 * float(report["load_balancing_loss"])
                               + 1e-2 * float(report["z_loss"]), rtol=1e-6)
    g = g["params"]
    assert float(jnp.abs(g["router"]["kernel"]).max()) > 0 and float(jnp.abs(gx).max()) > 0
    for name in ("experts", "shared_experts"):
        assert all(float(jnp.abs(a).max()) == 0 for a in jax.tree.leaves(g[name]))


def test_ragged_path_equals_capacity_path_without_drops():
    # capacity factor E / k: capacity = T, so nothing can drop
    x = jnp.asarray(np.random.RandomState(10).randn(2, 8, 16).astype(np.float32))
    dropless = MoELayer(_model_cfg(_moe()))
    padded = MoELayer(_model_cfg(_moe(moe_expert_capacity_factor=E / 2)))
    params = _init_params(dropless, jax.random.key(2), x)
    def outputs_and_grads(layer):
        def f(p):
            out, sown = layer.apply(p, x, mutable=[MOE_STATS])
            return out, sown[MOE_STATS]["router"]["dropped_tokens"][0]
        return jax.jit(lambda p: (f(p), jax.grad(lambda q: jnp.sum(jnp.cos(f(q)[0])))(p)))(params)

    (out_a, dropped), grads_a = outputs_and_grads(padded)
    (out_b, _), grads_b = outputs_and_grads(dropless)
    assert float(dropped) == 0
    for a, b in zip(jax.tree.leaves((out_a, grads_a)), jax.tree.leaves((out_b, grads_b))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_gpt_oss_experts_equal_transformers():
    """The biased router and experts with the clamped quick-GELU GLU (``add_bias_linear``,
    ``quick_geglu``, ``glu_linear_offset=1``, ``activation_func_clamp_value=7``) equal
    transformers' ``GptOssMLP`` holding the same weights, on the dropless (grouped GEMM) and the
    capacity path (nothing dropped), whose gradients agree; some gate / up values pass the clamp."""
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    x = jnp.asarray(np.random.RandomState(11).randn(2, 8, 16).astype(np.float32))
    gpt_oss = dict(add_bias_linear=True, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                   activation_func_clamp_value=7.0, init_method_std=1.0)
    dropless = MoELayer(_model_cfg(_moe(), **gpt_oss))
    padded = MoELayer(_model_cfg(_moe(moe_expert_capacity_factor=E / 2), **gpt_oss))
    params = _init_params(dropless, jax.random.key(3), x)
    noise = iter(jax.random.split(jax.random.key(4), 8))
    params = jax.tree_util.tree_map_with_path(  # biases drawn (zeros at init)
        lambda path, a: a + 0.5 * jax.random.normal(next(noise), a.shape) if path[-1].key == "bias" else a, params)
    p = jax.tree.map(np.asarray, params["params"])
    e, h, f = E, 16, p["experts"]["linear_fc2"]["kernel"].shape[1]
    ref = GptOssMLP(GptOssConfig(hidden_size=h, intermediate_size=f, num_local_experts=e, num_experts_per_tok=2))
    fc1, fc1_bias = p["experts"]["linear_fc1"]["kernel"], p["experts"]["linear_fc1"]["bias"]
    with torch.no_grad():
        ref.router.weight.copy_(torch.from_numpy(p["router"]["kernel"].T.copy()))
        ref.router.bias.copy_(torch.from_numpy(p["router"]["bias"]))
        ref.experts.gate_up_proj.copy_(torch.from_numpy(np.swapaxes(fc1, 2, 3).reshape(e, h, 2 * f).copy()))
        ref.experts.gate_up_proj_bias.copy_(torch.from_numpy(np.swapaxes(fc1_bias, 1, 2).reshape(e, 2 * f).copy()))
        ref.experts.down_proj.copy_(torch.from_numpy(p["experts"]["linear_fc2"]["kernel"]))
        ref.experts.down_proj_bias.copy_(torch.from_numpy(p["experts"]["linear_fc2"]["bias"]))
        theirs = ref(torch.from_numpy(np.asarray(x)))[0].numpy()
    gate_up = np.einsum("th,ehcf->etcf", np.asarray(x).reshape(-1, h), fc1) + fc1_bias[:, None]
    assert (gate_up[:, :, 0] > 7).any() and (np.abs(gate_up[:, :, 1]) > 7).any()

    def outputs_and_grads(layer):
        f_ = lambda q: layer.apply(q, x, mutable=[MOE_STATS])[0]  # noqa: E731
        return jax.jit(lambda q: (f_(q), jax.grad(lambda r: jnp.sum(jnp.cos(f_(r))))(q)))(params)

    (out_a, grads_a), (out_b, grads_b) = outputs_and_grads(dropless), outputs_and_grads(padded)
    for out in (out_a, out_b):
        np.testing.assert_allclose(np.asarray(out), theirs, rtol=1e-5, atol=1e-4)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):  # float32 sums in two orders
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-4 * max(1.0, float(np.max(np.abs(b))))
    assert float(jnp.abs(grads_a["params"]["router"]["bias"]).max()) > 0


@pytest.mark.parametrize("pad", [False, True])
def test_capacity_layer_computes_the_kept_assignments(pad):
    """With drops (factor 1.0; GELU experts): the layer equals the loop over the (token,
    expert) pairs that the routing keeps; padded slots (zero weight) change nothing."""
    mc = _model_cfg(_moe(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=pad), swiglu=False)
    layer = MoELayer(mc)
    x = jnp.asarray(np.random.RandomState(11).randn(2, 12, 16).astype(np.float32))
    params = _init_params(layer, jax.random.key(3), x)
    out, sown = layer.apply(params, x, mutable=[MOE_STATS])
    routing = TopKRouter(mc.moe).apply({"params": params["params"]["router"]}, x)
    assert float(sown[MOE_STATS]["router"]["dropped_tokens"][0]) > 0
    naive = jax.jit(lambda prm, v: _naive_moe(prm, v, mc, routing_map=np.asarray(routing.routing_map),
                                              probs=routing.probs))
    np.testing.assert_allclose(np.asarray(out), np.asarray(naive(params, x)), rtol=1e-5, atol=1e-6)


def test_dispatch_dropless_sorts_by_expert_then_token():
    top = jnp.asarray([[2, 0], [0, 1], [2, 1]])
    probs = jnp.arange(9, dtype=jnp.float32).reshape(3, 3)
    d = token_dispatcher.dispatch_dropless(jnp.arange(3, dtype=jnp.float32)[:, None], top, probs)
    np.testing.assert_array_equal(np.asarray(d.group_sizes), [2, 2, 2])
    np.testing.assert_array_equal(np.asarray(d.tokens[:, 0]), [0, 1, 1, 2, 0, 2])
    np.testing.assert_array_equal(np.asarray(d.probs), [0, 3, 4, 7, 2, 8])


def test_moe_layer_freq_selects_layers():
    assert moe_layer_pattern(2, 5) == (1, 0, 1, 0, 1)
    assert moe_layer_pattern("([0]*1+[1]*3)", 4) == (0, 1, 1, 1)
    assert moe_layer_pattern([0, 1], 2) == (0, 1)
    with pytest.raises(ValueError, match="moe_layer_freq"):
        moe_layer_pattern("__import__('os')", 4)
    mc = _model_cfg(_moe(moe_layer_freq=(0, 1)))
    params = jax.eval_shape(GPTModel(mc).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    assert "linear_fc1" in params["decoder_layers_0"]["mlp"] and "router" in params["decoder_layers_1"]["mlp"]


# ------------------------------------------------------------------ config and training
def _cfg(**kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 256
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 2, 32, 4, 16
    c.hidden_dropout = c.attention_dropout = 0.0
    c.add_bias_linear, c.swiglu = False, True
    c.micro_batch_size, c.global_batch_size, c.lr_warmup_iters, c.lr = 2, 4, 0, 3e-3
    c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size = 4, 2, 48
    c.moe_aux_loss_coeff, c.moe_z_loss_coeff = 1e-2, 1e-3
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


@pytest.mark.parametrize("kw,match", [
    (dict(moe_router_topk=5), "moe_router_topk=5 exceeds config.num_moe_experts=4"),
    (dict(moe_router_score_function="relu"), "moe_router_score_function"),
    (dict(moe_router_load_balancing_type="global"), "moe_router_load_balancing_type"),
    (dict(moe_token_drop_policy="random"), "moe_token_drop_policy"),
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type"),
    (dict(moe_router_dtype="bf16"), "moe_router_dtype"),
    (dict(moe_router_dtype="fp64"), "moe_router_dtype='fp64' needs 64-bit JAX"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor=0.0 must be > 0"),
    (dict(moe_expert_capacity_factor=-1.0), "moe_expert_capacity_factor"),
    (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=1.0),
     "moe_expert_capacity_factor works with"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn.*moe_aux_loss_coeff=0"),
    (dict(moe_router_topk=1), "moe_router_pre_softmax"),
    (dict(moe_router_enable_expert_bias=True), "moe_router_score_function='sigmoid'"),
    (dict(moe_layer_freq=(1, 0, 1)), "moe_layer_freq"),
    (dict(moe_layer_freq=0), "moe_layer_freq"),
    (dict(moe_layer_freq=2, scan_layers=True), "scan_layers"),
    (dict(num_moe_experts=None), "moe_ffn_hidden_size=48 needs config.num_moe_experts"),
    (dict(expert_model_parallel_size=3), "is not divisible by config.expert_model_parallel_size=3"),
    (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size"),
    (dict(moe_aux_loss_coeff=-1.0), "moe_aux_loss_coeff"),
    (dict(moe_layer_freq=2, pipeline_model_parallel_size=2), "mixes dense and MoE layers, but "
     "pipeline_model_parallel_size=2"),
])
def test_bad_moe_configs_fail_naming_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**kw)


def test_moe_layer_freq_string_and_cli_form():
    cfg = _cfg(num_layers=4, moe_layer_freq="([0]*1+[1]*3)")
    assert cfg.moe_layer_freq == (0, 1, 1, 1)
    from jmegatron.command_line import _parse_value

    assert _parse_value("moe_layer_freq", "[0,1,1,1]") == [0, 1, 1, 1]
    assert _parse_value("moe_layer_freq", "([0]*1+[1]*3)") == "([0]*1+[1]*3)"
    assert _parse_value("moe_layer_freq", "2") == 2


@pytest.mark.slow
def test_tiny_moe_gpt_trains_and_reports_router_losses():
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.loop import build

    def run_steps(cfg, steps):
        run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
        state = run.init_state()
        rs = np.random.RandomState(0)
        toks = rs.randint(0, 256, size=(run.global_batch_size, cfg.seq_length + 1)).astype(np.int32)
        batch = {"tokens": toks[:, :-1], "labels": toks[:, 1:],
                 "loss_mask": np.ones((run.global_batch_size, cfg.seq_length), np.float32),
                 "position_ids": np.broadcast_to(np.arange(cfg.seq_length, dtype=np.int32),
                                                 (run.global_batch_size, cfg.seq_length)).copy()}
        batch = run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in batch.items()})
        out = []
        for _ in range(steps):
            state, m = run.train_step(state, batch)
            out.append(jax.device_get(m))
        return out

    cfg = _cfg(moe_expert_capacity_factor=1.0, scan_layers=True)  # every layer MoE: one scanned layer body
    metrics = run_steps(cfg, 4)
    lm = [float(m["lm_loss"]) for m in metrics]
    assert lm[-1] < lm[0] - 0.1, lm
    for m in metrics:  # loss = lm loss + coefficient x (mean over MoE layers) x MoE layers, per term
        expected = (float(m["lm_loss"]) + 1e-2 * 2 * float(m["load_balancing_loss"])
                    + 1e-3 * 2 * float(m["z_loss"]))
        np.testing.assert_allclose(float(m["loss"]), expected, rtol=1e-5)
        assert 0.9 < float(m["load_balancing_loss"]) < 2.0 and float(m["z_loss"]) > 0
        assert m["moe_tokens_per_expert"].shape == (2, 4)
        # two micro-batches of 2 x 16 tokens, k = 2: each layer assigns 64 per micro-batch
        assert float(m["moe_tokens_per_expert"].sum()) <= 2 * 64
        assert 0.0 <= float(m["moe_dropped_token_fraction"]) < 0.5


def test_checkpoint_compatibility_knows_the_moe_fields():
    from jmegatron.checkpoint.checkpointing import CheckpointError, check_compatible

    dense = _cfg(num_moe_experts=None, moe_ffn_hidden_size=None)
    old = {k: v for k, v in dense.to_dict().items() if not k.startswith(("moe_", "num_moe"))}  # saved before MoE
    check_compatible(dense, old, 256, 256, "ckpt")
    moe = _cfg(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    saved = __import__("json").loads(moe.to_json())  # tuples come back as lists
    check_compatible(moe, saved, 256, 256, "ckpt")
    with pytest.raises(CheckpointError, match="num_moe_experts: checkpoint None vs config 4"):
        check_compatible(moe, dict(old, num_layers=4), 256, 256, "ckpt")


def test_parameter_count_and_flops_of_moe_models():
    from jmegatron.reporting import flops

    cfg = _cfg(num_layers=4, moe_layer_freq=(0, 1, 1, 1), moe_shared_expert_intermediate_size=40,
               untie_embeddings_and_output_weights=True)
    mc = ModelConfig.from_config(cfg, 256)
    shapes = jax.eval_shape(GPTModel(mc).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    count = sum(int(np.prod(a.value.shape if hasattr(a, "value") else a.shape))
                for a in jax.tree.leaves(shapes, is_leaf=lambda a: hasattr(a, "value")))
    assert flops.num_parameters(cfg, 256) == count
    # by hand: per token and MoE layer, top-2 experts of 48 and the shared expert of 40,
    # SwiGLU (3 GEMM widths), x 3 (fwd + bwd) x 2 (FMA); the dense layer's ffn is 4h = 128
    h, s = 32, 16
    dense = _cfg(num_layers=4, num_moe_experts=None, moe_ffn_hidden_size=None, untie_embeddings_and_output_weights=True)
    mlp_dense, mlp_moe = 6 * h * 128 * 3, 6 * h * (2 * 48 + 40) * 3
    assert (flops.num_floating_point_operations(cfg, 2, 256) - flops.num_floating_point_operations(dense, 2, 256)
            == 2 * s * 3 * (mlp_moe - mlp_dense))



def test_logger_reports_router_losses_tokens_per_expert_and_drops(tmp_path):
    import io
    import json

    from jmegatron.training.logging import MetricsLogger

    stream = io.StringIO()
    logger = MetricsLogger(str(tmp_path), str(tmp_path / "tb"), 1e9, 1, 1.0, 10, stream=stream)
    step = {"lm_loss": 2.0, "loss": 2.1, "lr": 1e-3, "grad_norm": 1.0, "num_tokens": 64.0,
            "load_balancing_loss": 1.25, "z_loss": 3.0, "moe_dropped_token_fraction": 0.25,
            "moe_tokens_per_expert": np.array([[10.0, 20.0, 30.0, 4.0]], np.float32)}
    logger.log_train(2, [step, dict(step, moe_dropped_token_fraction=0.75,
                                    moe_tokens_per_expert=np.array([[20.0, 20.0, 10.0, 14.0]]))], 1.0)
    logger.close()
    line = stream.getvalue()
    assert "| load_balancing_loss: 1.250000E+00 | z_loss: 3.000000E+00 |" in line and "dropped" not in line
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["moe_tokens_per_expert"] == [[15.0, 20.0, 20.0, 9.0]]
    assert record["moe_dropped_token_fraction"] == 0.5 and record["z_loss"] == 3.0
    assert any(p.name.startswith("events") for p in (tmp_path / "tb").iterdir())

