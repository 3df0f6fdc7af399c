"""FP8 training with delayed scaling in pure JAX (issue 15 item 2, jmegatron/models/fp8.py,
docs/PRECISION.md "FP8 meta"): the quantized dot against float32 and against an independent
numpy (ml_dtypes) emulation, the amax / scale update against a float32 reference of the same
steps, max-combination of the observed amaxes through gradient accumulation, scan_layers,
data parallelism, ZeRO-1 and the pipeline, exact resume and the CLI."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from jmegatron.config import ConfigError
from jmegatron.models import fp8
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.optimizer import make_optimizer
from jmegatron.training.run import build

from conftest import REPO, subprocess_env
from test_train_step import assert_same_update, random_batches, tiny_cfg

E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # the formats' largest finite values (OCP FP8 spec)


def np_quantize(x, scale, dtype, fmax):
    """Independent emulation: scale, saturate, round to the FP8 grid, dequantize (float64)."""
    q = np.clip(np.asarray(x, np.float32) * np.float32(scale), -fmax, fmax).astype(dtype)
    return q.astype(np.float64) / float(scale)


def meta_for(x, k, g, history=1):
    m = fp8.init_fp8_meta(history)
    m["input_scale"] = jnp.float32(E4M3_MAX / np.abs(x).max())
    m["kernel_scale"] = jnp.float32(E4M3_MAX / np.abs(k).max())
    m["output_grad_scale"] = jnp.float32(E5M2_MAX / np.abs(g).max())
    return m


@pytest.mark.parametrize("contract", [1, 2])
def test_quantized_dot_values_and_gradients(contract):
    rs = np.random.RandomState(0)
    # [b, s, h] x [h, f] (fc1) or [b, s, heads, kv] x [heads, kv, h] (linear_proj's layout)
    xs, ks = ((2, 8, 32), (32, 16)) if contract == 1 else ((2, 8, 4, 8), (4, 8, 16))
    x = rs.randn(*xs).astype(np.float32) * 3
    k = rs.randn(*ks).astype(np.float32) * 0.02
    g = rs.randn(2, 8, 16).astype(np.float32) * 1e-3
    nd = x.ndim
    dims = ((tuple(range(nd - contract, nd)), tuple(range(contract))), ((), ()))
    meta = meta_for(x, k, g, history=3)
    y, vjp = jax.vjp(lambda a, b, m: fp8.fp8_dot_general(a, b, m, dims, "hybrid"), x, k, meta)
    dx, dk, dmeta = vjp(jnp.asarray(g))
    ax = tuple(range(nd - contract, nd))
    ref = lambda a, b: np.tensordot(a, b, axes=(ax, tuple(range(contract))))  # noqa: E731

    # exactly the emulated FP8 product (float32 accumulation), ...
    qx = np_quantize(x, meta["input_scale"], ml_dtypes.float8_e4m3fn, E4M3_MAX)
    qk = np_quantize(k, meta["kernel_scale"], ml_dtypes.float8_e4m3fn, E4M3_MAX)
    qg = np_quantize(g, meta["output_grad_scale"], ml_dtypes.float8_e5m2, E5M2_MAX)
    np.testing.assert_allclose(y, ref(qx, qk), rtol=1e-5, atol=1e-6)
    # ... within FP8's error of float32: e4m3 rounds to 2^-4 relative, e5m2 to 2^-3
    bound = ((1 + 2 ** -4) ** 2 - 1) * ref(np.abs(x), np.abs(k))
    assert np.all(np.abs(y - ref(x, k)) <= bound + 1e-6)
    assert np.abs(y - ref(x, k)).max() > 0  # really quantized
    assert np.abs(y - ref(x, k)).mean() < 0.25 * bound.mean()  # rounding errors mostly cancel

    # gradients: dgrad / wgrad as FP8 dots of the e5m2 output gradient
    dx_ref = np.tensordot(qg, qk, axes=((2,), (contract,)))
    wgrad = lambda a, b: np.tensordot(a, b, axes=((0, 1), (0, 1)))  # noqa: E731
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(dk, wgrad(qx, qg), rtol=1e-5, atol=1e-9)
    dx32 = np.tensordot(g, k, axes=((2,), (contract,)))
    bound = ((1 + 2 ** -4) * (1 + 2 ** -3) - 1) * np.tensordot(np.abs(g), np.abs(k), axes=((2,), (contract,)))
    assert np.all(np.abs(dx - dx32) <= bound + 1e-9)
    bound = ((1 + 2 ** -4) * (1 + 2 ** -3) - 1) * wgrad(np.abs(x), np.abs(g))
    assert np.all(np.abs(dk - wgrad(x, g)) <= bound + 1e-9)

    # the meta's cotangents: this step's amaxes at index 0, zeros elsewhere and for the scales
    for name, tensor in (("input", x), ("kernel", k), ("output_grad", g)):
        np.testing.assert_array_equal(dmeta[f"{name}_amax_history"], [np.abs(tensor).max(), 0, 0])
        assert float(dmeta[f"{name}_scale"]) == 0.0


def test_saturates_and_e4m3_format():
    x = jnp.asarray([1.0, -1000.0, 3.0])
    q = fp8.quantize(x, jnp.float32(1.0), fp8.E4M3)
    assert q.dtype == jnp.float8_e4m3fn and np.asarray(q.astype(jnp.float32)).tolist() == [1.0, -448.0, 3.0]
    # "e4m3": the output gradient in e4m3 too (3 mantissa bits: 1 + 2^-4 rounds away)
    meta = fp8.init_fp8_meta(1)
    _, vjp = jax.vjp(lambda a: fp8.fp8_dot_general(a, jnp.eye(2), meta, (((1,), (0,)), ((), ())), "e4m3"),
                     jnp.ones((1, 2)))
    dx = vjp(jnp.asarray([[1.0 + 2 ** -4, 100000.0]]))[0]
    assert np.asarray(dx).tolist() == [[1.0, 448.0]]


def update_reference(hist, scale, observed, fmax, margin, algo):
    """TE's delayed scaling, float32 numpy: roll in the observation, amax, scale (old scale
    where the amax is 0 or not finite)."""
    hist = np.concatenate([[observed], hist[:-1]]).astype(np.float32)
    amax = hist.max() if algo == "max" else hist[0]
    if amax > 0 and np.isfinite(amax):
        scale = np.float32(fmax) / amax / np.float32(2.0 ** margin)
    return hist, np.float32(scale)


def fp8_leaves(params):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)
            if fp8.is_fp8_meta(p)}


def reshaped(b, run, cfg):
    return run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in b.items()})


@pytest.mark.parametrize("fmt,algo,margin", [("e4m3", "most_recent", 0), ("hybrid", "max", 2)])
def test_update_against_reference_edge_cases(fmt, algo, margin):
    """update_layer_meta on stacked [2 layers, 3] histories: zero and non-finite amaxes keep
    the old scale (TE), others follow the reference."""
    meta = {f"{t}_amax_history": jnp.asarray([[0.5, 2.0, 0.0], [0.0, 0.0, 0.0]]) for t in fp8.TENSORS}
    meta.update({f"{t}_scale": jnp.asarray([3.0, 5.0]) for t in fp8.TENSORS})
    obs = {f"{t}_amax_history": jnp.asarray([[v, 0.0, 0.0], [0.0, 0.0, 0.0]])
           for t, v in zip(fp8.TENSORS, (0.25, np.inf, 4.0))}
    obs.update({f"{t}_scale": jnp.zeros(2) for t in fp8.TENSORS})
    new = fp8.update_layer_meta(meta, obs, fp8=fmt, margin=margin, amax_compute_algo=algo)
    for t in fp8.TENSORS:
        fmax = E5M2_MAX if t == "output_grad" and fmt == "hybrid" else E4M3_MAX
        for layer in range(2):
            h, sc = update_reference(np.asarray(meta[f"{t}_amax_history"][layer]), np.float32(meta[f"{t}_scale"][layer]),
                                     np.float32(obs[f"{t}_amax_history"][layer, 0]), fmax, margin, algo)
            np.testing.assert_array_equal(new[f"{t}_amax_history"][layer], h)
            np.testing.assert_allclose(new[f"{t}_scale"][layer], sc, rtol=1e-7)
    assert float(new["input_scale"][1]) == 5.0  # all-zero history: the old scale
    with pytest.raises(ValueError, match="fp8_amax_compute_algo"):
        fp8.update_layer_meta(meta, obs, fp8=fmt, amax_compute_algo="mean")


# The one-device runs the tests share (each program compiled once for the module): hybrid FP8,
# history length 4 (>= STEPS), max over the history, margin 1, 2 micro-batches of 4 rows a step,
# every step at the full rate (TRAINS); per-layer with tiny_cfg's 2 layers (``unscanned``) and
# ``scan_layers`` with 4 layers (``scanned``: 2 a stage at pp 2).
ONE_DEVICE = dict(fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max", fp8_margin=1,
                  micro_batch_size=4, global_batch_size=8)
SCANNED = dict(ONE_DEVICE, scan_layers=True, num_layers=4)


@pytest.fixture(scope="module")
def unscanned():
    cfg = tiny_cfg(**ONE_DEVICE, **TRAINS)
    return cfg, build(cfg, create_mesh(cfg, jax.devices()[:1]))


@pytest.fixture(scope="module")
def scanned():
    cfg = tiny_cfg(**SCANNED, **TRAINS)
    return cfg, build(cfg, create_mesh(cfg, jax.devices()[:1]))


def test_delayed_scaling_against_float32_reference(unscanned):
    fmt, algo, margin = "hybrid", "max", 1
    cfg, run = unscanned
    assert (cfg.fp8, cfg.fp8_amax_compute_algo, cfg.fp8_margin) == (fmt, algo, margin)
    state = run.init_state()
    ref = fp8_leaves(jax.device_get(state.params))
    assert all(v.dtype == np.float32 for v in ref.values())
    assert all((v == 0).all() for k, v in ref.items() if "history" in k)
    assert all((v == 1).all() for k, v in ref.items() if "scale" in k)
    changed = False
    sown = jax.jit(lambda p, t: run.model.apply({"params": p}, t, mutable=["intermediates"])[1])
    for b in random_batches(3, run.global_batch_size, cfg.seq_length, 500, seed=1):
        batch = reshaped(b, run, cfg)
        observed = fp8_leaves(jax.device_get(run.compute_grads(state, batch)[0]))
        # the observed input amax of layer 0's QKV is its input's (the input layernorm's output)
        ln = sown(state.params, jnp.asarray(b["tokens"]))["intermediates"]["decoder_layers_0"]["input_layernorm_output"][0]
        key = "['decoder_layers_0']['self_attention']['linear_qkv']['fp8_meta']['input_amax_history']"
        np.testing.assert_allclose(observed[key][0], np.abs(np.asarray(ln)).max(), rtol=1e-6)
        state, _ = run.train_step(state, batch)
        for k in ref:
            if not k.endswith("_amax_history']"):
                continue
            t = k.rsplit("['", 1)[1][: -len("_amax_history']")]
            sk = k.replace("_amax_history", "_scale")
            fmax = E5M2_MAX if t == "output_grad" and fmt == "hybrid" else E4M3_MAX
            assert (observed[k][1:] == 0).all()
            new_hist, new_scale = update_reference(ref[k], ref[sk], observed[k][0], fmax, margin, algo)
            changed |= bool(new_scale != ref[sk])
            ref[k], ref[sk] = new_hist, new_scale
        got = fp8_leaves(jax.device_get(state.params))
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=2e-6, err_msg=k)
    assert changed


def test_max_accumulation_over_micro_batches(unscanned):
    """2 micro-batches in one step: each meta "gradient" is the max of what the micro-batches
    observe alone (not their sum or mean); the other gradients are the mean."""
    cfg, run = unscanned
    assert run.num_microbatches == 2
    state = run.init_state()
    b = random_batches(1, 8, cfg.seq_length, 500, seed=2)[0]
    b["loss_mask"][:] = 1.0  # equal token counts: the step's gradient is the mean of the micro-batches'
    batch = reshaped(b, run, cfg)
    whole = jax.device_get(run.compute_grads(state, batch)[0])
    parts = [jax.device_get(run.compute_grads(state, jax.tree.map(lambda a: a[i:i + 1], batch))[0])
             for i in range(2)]
    flat = lambda t: dict((jax.tree_util.keystr(p), np.asarray(v)) for p, v in jax.tree_util.tree_leaves_with_path(t))  # noqa
    whole, parts = flat(whole), [flat(p) for p in parts]
    distinct = 0
    for k, v in whole.items():
        each = np.stack([p[k] for p in parts])
        if fp8.is_fp8_meta([jax.tree_util.DictKey(s.strip("[]'")) for s in k.split("][")]):
            np.testing.assert_allclose(v, each.max(0), rtol=1e-6, err_msg=k)
            distinct += int("history" in k and len(set(each[:, 0].tolist())) > 1)
        else:
            np.testing.assert_allclose(v, each.mean(0), rtol=2e-4, atol=1e-7, err_msg=k)
    assert distinct > 0  # the micro-batches observed different amaxes: max != sum, != mean


def stack_layers(params, n):
    layers = [params[f"decoder_layers_{i}"] for i in range(n)]
    out = {k: v for k, v in params.items() if not k.startswith("decoder_layers_")}
    out["decoder_layers"] = jax.tree.map(lambda *a: np.stack(a), *layers)
    return out


def test_scan_layers_histories_equal_unscanned(unscanned):
    cfg_a, run_a = unscanned
    cfg_b = tiny_cfg(**ONE_DEVICE, **TRAINS, scan_layers=True)
    run_b = build(cfg_b, create_mesh(cfg_b, jax.devices()[:1]))
    state_a = run_a.init_state()
    stacked = stack_layers(jax.device_get(state_a.params), cfg_a.num_layers)
    state_b = run_b.init_state()
    state_b = state_b.replace(params=jax.device_put(stacked, run_b.state_shardings.params))
    for b in random_batches(3, 8, cfg_a.seq_length, 500, seed=4):
        state_a, ma = run_a.train_step(state_a, reshaped(b, run_a, cfg_a))
        state_b, mb = run_b.train_step(state_b, reshaped(b, run_b, cfg_b))
        np.testing.assert_allclose(ma["lm_loss"], mb["lm_loss"], rtol=1e-5)
    a = stack_layers(jax.device_get(state_a.params), cfg_a.num_layers)
    got, want = fp8_leaves(jax.device_get(state_b.params)), fp8_leaves(a)
    assert got.keys() == want.keys() and len(got) == 4 * 6
    for k in want:
        assert got[k].shape[0] == cfg_a.num_layers
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
    assert (got["['decoder_layers']['mlp']['linear_fc1']['fp8_meta']['input_amax_history']"][:, :3] > 0).all()


def test_data_parallel_zero1_equals_one_device(scanned):
    """dp 2 + ZeRO-1 (history length 4: divisible by dp, yet unsharded) gives one device's
    losses and meta; the meta stays replicated, has no Adam moments and is not in grad_norm."""
    out = {}
    for n, zero1 in ((1, False), (2, True)):  # the same micro-batches: 2 of 4 rows
        if n == 1:
            cfg, run = scanned
        else:
            cfg = tiny_cfg(**dict(SCANNED, micro_batch_size=2), **TRAINS, use_distributed_optimizer=True)
            run = build(cfg, create_mesh(cfg, jax.devices()[:n]))
        state = run.init_state()
        first = trainable(state.params)
        losses = []
        for b in random_batches(STEPS, 8, cfg.seq_length, 500, seed=5):
            batch = reshaped(b, run, cfg)
            grads = None if zero1 else jax.device_get(run.compute_grads(state, batch)[0])
            state, m = run.train_step(state, batch)
            losses.append(float(m["lm_loss"]))
            if grads is not None:
                trained = [np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(grads)
                           if not fp8.is_fp8_meta(p)]
                norm = np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in trained))
                np.testing.assert_allclose(m["grad_norm"], norm, rtol=1e-5)
        out[n] = (losses, fp8_leaves(jax.device_get(state.params)), first, trainable(state.params))
        if zero1:
            for path, sh in jax.tree_util.tree_leaves_with_path(state.params):
                if fp8.is_fp8_meta(path):
                    assert sh.sharding.is_fully_replicated, jax.tree_util.keystr(path)
            for path, sh in jax.tree_util.tree_leaves_with_path(run.grad_shardings):
                if fp8.is_fp8_meta(path):
                    assert "data" not in str(sh.spec)
                elif "kernel" in jax.tree_util.keystr(path):
                    assert "data" in str(sh.spec)  # the kernels' state is sharded
            moments = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)]
            assert not any("fp8_meta" in k for k in moments)
    assert_same_run(out[1], out[2])


def test_tensor_and_context_parallel_equal_one_device(scanned):
    """tp 2 x cp 2: the amax of tensor-sharded kernels and activations (GSPMD) and the pmax over
    the context ranks give one device's observations and scales after a step."""
    out = {}
    for n in (1, 4):
        if n == 1:
            cfg, run = scanned
        else:
            cfg = tiny_cfg(**SCANNED, **TRAINS, tensor_model_parallel_size=2, context_parallel_size=2)
            run = build(cfg, create_mesh(cfg, jax.devices()[:n]))
        state, m = run.train_step(run.init_state(), reshaped(random_batches(1, 8, cfg.seq_length, 500, seed=7)[0],
                                                             run, cfg))
        out[n] = (float(m["lm_loss"]), fp8_leaves(jax.device_get(state.params)))
    np.testing.assert_allclose(out[4][0], out[1][0], rtol=1e-6)
    for k, v in out[1][1].items():
        np.testing.assert_allclose(out[4][1][k], v, rtol=1e-5, err_msg=k)


# 3 steps, the first at the full rate (tiny_cfg warms up over one step, which runs at lr 0)
STEPS = 3
TRAINS = dict(lr_warmup_iters=0)
# FP8's noise between layouts (the meta's tolerance below; measured over 3 steps: dp 2 + ZeRO-1
# 2e-4, pp 2 7e-3 of a leaf's update)
FP8_UPDATE_RTOL = 2e-2


def trainable(params):
    """The parameters the optimizer updates (host numpy, keyed by path): all but the meta."""
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
            jax.tree_util.tree_leaves_with_path(jax.device_get(params)) if not fp8.is_fp8_meta(p)}


def assert_same_run(a, b):
    """Two layouts' (losses, meta, trained parameters before the first step and after the
    last) over STEPS steps from the same weights (history length >= STEPS). Step 1 runs on the
    same weights: its loss and observed amaxes (history index STEPS - 1) agree to float32
    rounding; after the first update float32 differences in the gradient sums can flip FP8
    roundings, so later steps and the parameters' summed update agree to FP8's noise."""
    np.testing.assert_allclose(a[0][0], b[0][0], rtol=1e-6)
    np.testing.assert_allclose(a[0][1:], b[0][1:], rtol=1e-3)
    for k, v in a[1].items():
        if "history" in k:
            np.testing.assert_allclose(b[1][k][..., STEPS - 1], v[..., STEPS - 1], rtol=1e-5, err_msg=k)
            np.testing.assert_allclose(b[1][k][..., :STEPS - 1], v[..., :STEPS - 1], rtol=2e-2, err_msg=k)
        else:
            np.testing.assert_allclose(b[1][k], v, rtol=2e-2, err_msg=k)
    assert_same_update(b[3], a[3], a[2], FP8_UPDATE_RTOL)


def test_optimizer_leaves_meta_alone():
    cfg = tiny_cfg(fp8="hybrid", clip_grad=1.0, weight_decay=0.1)
    params = {"w": {"kernel": jnp.ones((4, 4)), fp8.FP8_META: fp8.init_fp8_meta(2)}}
    grads = {"w": {"kernel": jnp.full((4, 4), 0.5),
                   fp8.FP8_META: jax.tree.map(lambda a: jnp.full(a.shape, 1e6), fp8.init_fp8_meta(2))}}
    tx = make_optimizer(cfg, 16)
    state = tx.init(params)
    for _ in range(2):  # step 0 has lr 0 (warm-up)
        updates, state = tx.update(grads, state, params)
    assert all((np.asarray(u) == 0).all() for u in jax.tree.leaves(updates["w"][fp8.FP8_META]))
    plain = make_optimizer(tiny_cfg(clip_grad=1.0, weight_decay=0.1), 16)
    p_state = plain.init({"w": {"kernel": params["w"]["kernel"]}})
    for _ in range(2):
        p_updates, p_state = plain.update({"w": {"kernel": grads["w"]["kernel"]}}, p_state,
                                          {"w": {"kernel": params["w"]["kernel"]}})
    # the meta's huge "gradients" change neither the clipping nor the kernel's update
    np.testing.assert_array_equal(updates["w"]["kernel"], p_updates["w"]["kernel"])
    assert optax.tree.norm(updates["w"]["kernel"]) > 0


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match=r"fp8_recipe='tensorwise' needs transformer_impl='transformer_engine' "
                                          r"\(Transformer Engine\)"):
        ModelConfig.from_config(tiny_cfg(fp8="hybrid", fp8_recipe="tensorwise"), 512)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        ModelConfig.from_config(tiny_cfg(fp8="e4m3", tensor_model_parallel_size=2, sequence_parallel=True), 512)
    with pytest.raises(TypeError, match="Linear"):
        fp8.Fp8DotGeneral()(jnp.ones(2), jnp.ones(2), None)
    # the embedding and the output layer stay unquantized
    model = GPTModel(ModelConfig.from_config(tiny_cfg(fp8="e4m3", untie_embeddings_and_output_weights=True), 512))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    metas = {jax.tree_util.keystr(p).split("['fp8_meta']")[0] for p, _ in jax.tree_util.tree_leaves_with_path(shapes)
             if fp8.is_fp8_meta(p)}
    assert metas == {f"['decoder_layers_{i}']['{m}']['{l}']" for i in range(2) for m, l in
                     (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"), ("mlp", "linear_fc1"),
                      ("mlp", "linear_fc2"))}


@pytest.mark.slow
def test_pipeline_equals_one_device(scanned):
    """pp 2 (1F1B, 2 micro-batches, 2 layers a stage): each stage max-combines its layers'
    amaxes over the micro-batches; the meta equals the one-device scanned model's."""
    out = {}
    for pp in (1, 2):
        if pp == 1:
            cfg, run = scanned
        else:
            cfg = tiny_cfg(**SCANNED, **TRAINS, pipeline_model_parallel_size=pp)
            run = build(cfg, create_mesh(cfg, jax.devices()[:pp]))
        state = run.init_state()
        first = trainable(state.params)
        losses = []
        for b in random_batches(STEPS, 8, cfg.seq_length, 500, seed=6):
            state, m = run.train_step(state, reshaped(b, run, cfg))
            losses.append(float(m["lm_loss"]))
        out[pp] = (losses, fp8_leaves(jax.device_get(state.params)), first, trainable(state.params))
    assert_same_run(out[1], out[2])


def resume_cfg(save, **kw):
    from test_checkpoint_resume import cfg_for
    return cfg_for(save, fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max", train_iters=6,
                   global_batch_size=2, eval_interval=0, log_interval=1, **kw)


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path):
    """One device, 2 micro-batches a step: a run stopped at 3 and resumed (histories and scales
    restored from the checkpoint) gives the uninterrupted run's losses bit for bit."""
    from jmegatron.training.loop import pretrain

    def run(save, **kw):
        cfg = resume_cfg(save, **kw)
        return pretrain(cfg, create_mesh(cfg, jax.devices()[:1]))

    full = run(tmp_path / "full")
    run(tmp_path / "resumed", exit_interval=3)
    second = run(tmp_path / "resumed")
    assert sorted(second["losses"]) == list(range(4, 7))
    for it in range(4, 7):
        assert second["losses"][it] == full["losses"][it], it


@pytest.mark.slow
def test_cli_trains_in_fp8(tmp_path):
    cmd = [sys.executable, "-m", "jmegatron.train", "--config", "configs/gpt_tiny.py", "--config.fp8=hybrid",
           "--config.mock_data=True", "--config.vocab_size=300", "--config.num_layers=2",
           "--config.hidden_size=32", "--config.num_attention_heads=2", "--config.seq_length=32",
           "--config.max_position_embeddings=32", "--config.micro_batch_size=2", "--config.global_batch_size=4",
           "--config.train_iters=3", "--config.lr_warmup_iters=1", "--config.log_interval=1", "--config.eval_interval=0",
           "--config.peak_tflops=1.0", f"--config.save={tmp_path}", "--config.fp8_amax_history_len=4"]
    env = subprocess_env(1)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "iteration        3/" in proc.stdout
