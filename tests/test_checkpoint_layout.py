"""Checkpoints across decoder-layer layouts (issue 12 item 5): per-layer <-> stacked <->
stacked in a pipeline's stage order, on TrainStates, on real checkpoints (resume and
back, bit-exact) and through ``export hf``."""

import os

import jax
import numpy as np
import optax
import pytest

from jmegatron.parallel.pipeline_layout import stage_layer_order
from jmegatron.checkpoint import checkpointing
from jmegatron.checkpoint.layout import LayerLayout, convert_layers
from jmegatron.training.loop import pretrain
from jmegatron.training.run import build, restore_state

from test_checkpoint_resume import cfg_for

L = 4
PER_LAYER, STACKED = LayerLayout(False), LayerLayout(True)


def tiny(save, **kw):
    # no dropout: a scanned and a per-layer model then compute the same function
    # vocab 512: no padding rows at tp 1 or 2, so every run has the same embedding shape
    defaults = dict(num_layers=L, vocab_size=512, train_iters=3, lr_warmup_iters=1, eval_interval=0, hidden_dropout=0.0,
                    attention_dropout=0.0)
    return cfg_for(save, **{**defaults, **kw})


def leaves(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def adam_mu(state):
    return next(x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                if isinstance(x, optax.ScaleByAdamState)).mu


def assert_bit_equal(a, b):
    la, lb = leaves(a), leaves(b)
    assert sorted(la) == sorted(lb)
    for k, x in la.items():
        x, y = np.asarray(x), np.asarray(lb[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert x.tobytes() == y.tobytes(), k  # bit-equal (NaN-safe)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    per_layer, scanned = build(tiny(d / "a")), build(tiny(d / "b", scan_layers=True))
    return per_layer, scanned


def test_state_round_trips_through_every_layout(runs):
    per_layer, scanned = runs
    state = per_layer.init_state()
    # make the optimizer moments distinct from the params (init gives zeros)
    state = state.replace(opt_state=jax.tree.map(lambda x: x + 1.5 if x.ndim else x, state.opt_state))
    host = jax.device_get(state)
    stacked = convert_layers(host, PER_LAYER, STACKED, L)
    # the stacked tree is exactly the scan_layers run's TrainState (params, mu, nu, masks)
    assert jax.tree.structure(stacked) == jax.tree.structure(scanned.abstract_state)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(stacked), jax.tree.leaves(scanned.abstract_state)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), jax.tree_util.keystr(p)
    s22 = convert_layers(stacked, STACKED, LayerLayout(True, 2, 2), L)
    order = stage_layer_order(L, 2, 2)  # [0, 2, 1, 3]: stage 0 holds chunks 0 and 2
    assert list(order) == [0, 2, 1, 3]
    for pos, layer in enumerate(order):
        got = s22.params["decoder_layers"]["mlp"]["linear_fc1"]["kernel"][pos]
        assert np.array_equal(got, host.params[f"decoder_layers_{layer}"]["mlp"]["linear_fc1"]["kernel"]), pos
        got = adam_mu(s22)["decoder_layers"]["self_attention"]["linear_qkv"]["kernel"][pos]
        assert np.array_equal(got, adam_mu(host)[f"decoder_layers_{layer}"]["self_attention"]["linear_qkv"]["kernel"])
    s41 = convert_layers(s22, LayerLayout(True, 2, 2), LayerLayout(True, 4, 1), L)
    assert_bit_equal(s41, stacked)  # v = 1: model order whatever p is
    back = convert_layers(s41, LayerLayout(True, 4, 1), PER_LAYER, L)
    assert_bit_equal(back, host)
    # (2, 2) straight to per-layer, on jax arrays inside jit: same arrays
    back_jit = jax.jit(lambda s: convert_layers(s, LayerLayout(True, 2, 2), PER_LAYER, L))(s22)
    assert_bit_equal(jax.device_get(back_jit), host)
    # restore targets (ShapeDtypeStructs with shardings) convert to the scanned run's shapes
    target = convert_layers(per_layer.abstract_with_shardings(), PER_LAYER, LayerLayout(True, 2, 2), L)
    for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(scanned.abstract_state)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


def test_trees_in_neither_layout_are_refused(runs):
    host = jax.device_get(runs[0].init_state())
    with pytest.raises(ValueError, match="no decoder layers"):
        convert_layers({"word_embeddings": np.zeros(3)}, PER_LAYER, STACKED, L)
    broken = dict(host.params)
    del broken["decoder_layers_2"]
    with pytest.raises(ValueError, match=r"<root> holds layers .*decoder_layers_3.*num_layers=4"):
        convert_layers(broken, PER_LAYER, STACKED, L)
    with pytest.raises(ValueError, match=r"\.params holds per-layer .* source layout is stacked"):
        convert_layers(host, STACKED, PER_LAYER, L)
    stacked = convert_layers(host.params, PER_LAYER, STACKED, L)
    with pytest.raises(ValueError, match=r"<root>\['decoder_layers'\]\[.* expected a leading axis of 8 slots \(num_layers=8\)"):
        convert_layers(stacked, STACKED, PER_LAYER, 8)


def saved_state(run, directory):
    ckpt = checkpointing.Checkpointer(str(directory), create=False)
    state, meta = restore_state(run, ckpt)
    ckpt.close()
    return jax.device_get(state), meta


@pytest.fixture(scope="module")
def per_layer_ckpt(tmp_path_factory):
    """A per-layer run's losses over 3 iterations uninterrupted, and the directory of the same
    run's checkpoint at iteration 2 (read only by the tests)."""
    d = tmp_path_factory.mktemp("per_layer")
    full = pretrain(tiny(d / "full"))
    pretrain(tiny(d / "a", exit_interval=2))
    return full["losses"], d / "a"


@pytest.mark.slow
def test_resume_across_scan_layers_is_bit_exact(runs, per_layer_ckpt, tmp_path):
    per_layer, scanned = runs
    full_losses, a_dir = per_layer_ckpt  # per-layer: 3 iterations uninterrupted; a checkpoint at 2
    # scan_layers run resumes from it (no step: train_iters=2) and saves stacked at 2
    pretrain(tiny(tmp_path / "b", scan_layers=True, load=str(a_dir), train_iters=2, override_opt_param_scheduler=True))
    a, _ = saved_state(per_layer, a_dir)
    b, meta_b = saved_state(scanned, tmp_path / "b")
    assert meta_b["config"]["scan_layers"] and "decoder_layers" in b.params
    assert_bit_equal(b, convert_layers(a, PER_LAYER, STACKED, L))  # params, moments, step, rng
    # ... and back into a per-layer run
    assert_bit_equal(saved_state(per_layer, tmp_path / "b")[0], a)
    # the next step from the stacked checkpoint: the per-layer run's loss, bit for bit
    e = pretrain(tiny(tmp_path / "e", load=str(tmp_path / "b"), override_opt_param_scheduler=True))
    assert sorted(e["losses"]) == [3] and e["losses"][3] == full_losses[3]
    # (that a scanned run's step equals the per-layer run's is tests/test_layout_equivalence.py's)


def test_layout_of_config_and_of_saved_config_agree():
    from jmegatron.config import base_config, from_configdict

    c = base_config()
    c.num_layers, c.vocab_size, c.mock_data = 8, 300, True
    cfg = from_configdict(c)
    pp2 = dict(pipeline_model_parallel_size=2)
    cases = [({}, LayerLayout(False)), (dict(scan_layers=True), LayerLayout(True)), (pp2, LayerLayout(True, 2, 1)),
             (dict(pp2, virtual_pipeline_model_parallel_size=2), LayerLayout(True, 2, 2)),
             (dict(pp2, num_layers_per_virtual_pipeline_stage=1), LayerLayout(True, 2, 4))]
    for changes, want in cases:
        x = cfg.replace(**changes)
        assert LayerLayout.of_config(x) == LayerLayout.of_config(x.to_dict()) == want, changes
    old = {k: v for k, v in cfg.to_dict().items() if "pipeline" not in k}  # saved before the pipeline fields
    assert LayerLayout.of_config(old) == LayerLayout(False)
    assert LayerLayout(True, 2, 1).same_storage(LayerLayout(True), 8)
    assert not LayerLayout(True, 2, 2).same_storage(LayerLayout(True), 8)
    assert not LayerLayout(False).same_storage(LayerLayout(True), 8)


def test_pipeline_stage_order_checkpoint_restores_and_exports(runs, per_layer_ckpt, tmp_path):
    """A checkpoint as a pp=2, v=2 run writes it (stacked in stage order, (p, v) in its
    config) restores into per-layer and scanned runs and exports like the per-layer one."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from safetensors.numpy import load_file

    from jmegatron.export.convert import export_hf

    per_layer, scanned = runs
    a_dir = per_layer_ckpt[1]
    a, meta = saved_state(per_layer, a_dir)
    pp_cfg = per_layer.cfg.replace(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                   save=str(tmp_path / "pp"))
    ckpt = checkpointing.Checkpointer(str(tmp_path / "pp"))
    ckpt.save(2, convert_layers(a, PER_LAYER, LayerLayout(True, 2, 2), L), dict(meta, config=pp_cfg.to_dict()))
    ckpt.close()
    assert_bit_equal(saved_state(per_layer, tmp_path / "pp")[0], a)
    assert_bit_equal(saved_state(scanned, tmp_path / "pp")[0], convert_layers(a, PER_LAYER, STACKED, L))
    # into tp2 + sequence parallel + ZeRO-1 (stacked): resharded, in the run's shardings
    tp2 = build(tiny(tmp_path / "tp2", scan_layers=True, tensor_model_parallel_size=2, sequence_parallel=True,
                     use_distributed_optimizer=True))
    ckpt = checkpointing.Checkpointer(str(tmp_path / "pp"), create=False)
    state, _ = restore_state(tp2, ckpt)
    ckpt.close()
    for x, want in zip(jax.tree.leaves(state), jax.tree.leaves(tp2.state_shardings)):
        assert x.sharding.is_equivalent_to(want, x.ndim)
    assert_bit_equal(jax.device_get(state), convert_layers(a, PER_LAYER, STACKED, L))
    # the same state as a scan_layers run saves it
    ckpt = checkpointing.Checkpointer(str(tmp_path / "scan"))
    ckpt.save(2, convert_layers(a, PER_LAYER, STACKED, L),
              dict(meta, config=per_layer.cfg.replace(scan_layers=True, save=str(tmp_path / "scan")).to_dict()))
    ckpt.close()
    for d, src in (("a", a_dir), ("pp", tmp_path / "pp"), ("scan", tmp_path / "scan")):
        export_hf(str(src), str(tmp_path / f"hf_{d}"))
    ref = load_file(os.path.join(tmp_path / "hf_a", "model.safetensors"))
    for d in ("pp", "scan"):
        got = load_file(os.path.join(tmp_path / f"hf_{d}", "model.safetensors"))
        assert sorted(ref) == sorted(got)
        for k in ref:
            assert np.array_equal(ref[k], got[k]), (d, k)


def test_uneven_stages_convert_with_zero_padding_and_back(runs):
    per_layer, _ = runs
    host = jax.device_get(per_layer.init_state())
    # L = 4 on 2 stages: 1 layer first, 3 last -> 3 slots per stage, 2 of stage 0's padding
    uneven = LayerLayout(True, 2, 1, 1, None)
    assert list(uneven.order(L)) == [0, -1, -1, 1, 2, 3]
    stacked = convert_layers(host, PER_LAYER, uneven, L)
    kernel = stacked.params["decoder_layers"]["mlp"]["linear_fc1"]["kernel"]
    assert kernel.shape[0] == 6 and not kernel[1:3].any()  # padding slots hold zeros
    assert np.array_equal(kernel[3], host.params["decoder_layers_1"]["mlp"]["linear_fc1"]["kernel"])
    assert not adam_mu(stacked)["decoder_layers"]["mlp"]["linear_fc1"]["kernel"][1:3].any()
    # uneven -> even stage order -> uneven -> per-layer: the same arrays
    even = convert_layers(stacked, uneven, LayerLayout(True, 2, 2), L)
    again = convert_layers(even, LayerLayout(True, 2, 2), uneven, L)
    assert_bit_equal(again, stacked)
    assert_bit_equal(convert_layers(again, uneven, PER_LAYER, L), host)
    with pytest.raises(ValueError, match="expected a leading axis of 6 slots"):
        convert_layers(convert_layers(host, PER_LAYER, STACKED, L), uneven, STACKED, L)


@pytest.mark.slow
def test_uneven_pipeline_run_resumes_in_other_layouts(runs, tmp_path):
    per_layer, _ = runs
    uneven = dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)  # stages of 1 and 3 layers
    full = pretrain(tiny(tmp_path / "full", **uneven))  # 3 iterations uninterrupted
    pretrain(tiny(tmp_path / "u", exit_interval=2, **uneven))
    own, _ = saved_state(build(tiny(tmp_path / "u", **uneven)), tmp_path / "u")
    stack = own.params["decoder_layers"]["mlp"]["linear_fc1"]["kernel"]  # 2 stages x 3 slots
    assert stack.shape[0] == 6 and not np.asarray(stack[1:3]).any() and np.asarray(stack[0]).any()
    # a per-layer run continues from it: the uneven run's next loss
    e = pretrain(tiny(tmp_path / "e", load=str(tmp_path / "u")))
    assert sorted(e["losses"]) == [3] and e["losses"][3] == pytest.approx(full["losses"][3], rel=1e-5)
    # and an even interleaved pp=2 run too
    v2 = pretrain(tiny(tmp_path / "v2", load=str(tmp_path / "u"), pipeline_model_parallel_size=2,
                       virtual_pipeline_model_parallel_size=2))
    assert v2["losses"][3] == pytest.approx(full["losses"][3], rel=1e-5)
