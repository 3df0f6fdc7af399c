"""Pipeline parallelism (issue 12): the schedules' tables against Megatron's formulas, and
pipelined training on 8 simulated devices against the unpipelined model over 3 steps that
update from the first (float32: losses to relative 1e-5, gradients to 1e-5 at the first step
and 1e-4 after an update, the parameters after the last step to rounding): GPipe, 1F1B and
interleaved 1F1B, pp 2 and 4, m 4 and 8, alone and with tp2 + SP or dp2 + ZeRO-1, GPT and
Llama. Dropout is off: the pipelined stages draw their layers' dropout keys by layer number,
not through Flax's module paths."""

import jax
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.parallel.mesh import create_mesh
from jmegatron.parallel.pipeline_layout import stage_layer_order
from jmegatron.parallel.schedules import build_schedule
from jmegatron.training.run import build

from test_parallel_equivalence import LLAMA, trajectory_params
from test_train_step import assert_same_update, tiny_cfg, update_rtol

NUM_LAYERS = 8
# 3 steps, the first at the full rate (tiny_cfg warms up over one step, which runs at lr 0):
# steps 2 and 3 take their gradients at the weights the pipelined optimizer step wrote; no
# linear-layer biases (the key bias's exact gradient is 0: Adam would turn its rounding noise
# into steps that no rounding bound covers)
STEPS = 3
TRAINS = dict(lr_warmup_iters=0, add_bias_linear=False)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_bubble_and_live_activations_follow_the_formulas(p, m):
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        s = build_schedule(name, p, m, v)
        # busy stage-slots are exactly one forward and one backward per (micro-batch, chunk)
        assert s.busy_slots() == 2 * m * v * p
        assert s.bubble_fraction() == pytest.approx((p - 1) / (v * m + p - 1))
        live = s.peak_live_activations()
        if name == "gpipe":
            assert live == [m] * p
        elif name == "1f1b":
            # flat in m; later stages hold fewer (see docs/PIPELINE.md on Megatron's p - s)
            assert live == [min(2 * (p - st) - 1, m) for st in range(p)]
        else:  # Megatron's interleaved warm-up (p - s - 1) * 2 + (v - 1) * p, plus the one in flight
            assert live == [min((p - st - 1) * 2 + (v - 1) * p + 1, m * v) for st in range(p)]
        assert s.num_slots == max(live)


def test_schedule_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of pipeline_model_parallel_size"):
        build_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="must be one of"):
        build_schedule("zero_bubble", 2, 4, 1)
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size"):
        tiny_cfg(num_layers=NUM_LAYERS, pipeline_model_parallel_size=2, pipeline_schedule="1f1b",
                 virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="not divisible by pipeline_model_parallel_size=4 x"):
        tiny_cfg(num_layers=6, pipeline_model_parallel_size=4)
    with pytest.raises(ConfigError, match="use_distributed_optimizer"):
        cfg = tiny_cfg(num_layers=NUM_LAYERS, pipeline_model_parallel_size=2, use_megatron_fsdp=True)
        build(cfg, create_mesh(cfg, jax.devices()[:8]))


_REFERENCES = {}


def reference(arch: str, m: int):
    """One device, scan_layers, the same global batch of 16 in m micro-batches."""
    if (arch, m) not in _REFERENCES:
        kw = LLAMA if arch == "llama" else {}
        _REFERENCES[arch, m] = trajectory_params(tiny_cfg(num_layers=NUM_LAYERS, scan_layers=True,
                                                          micro_batch_size=16 // m, **kw, **TRAINS), 1, steps=STEPS)
    return _REFERENCES[arch, m]


# float32 layouts: their summation orders differ; a global batch of 16 x 32 tokens
PARAMS_RTOL = update_rtol(np.float32, 16 * 32, NUM_LAYERS, STEPS)


def stage_order(params, index):
    """``params`` with its stacked decoder layers taken at ``index`` (a layer order or mask)."""
    return dict(params, decoder_layers=jax.tree.map(lambda a: a[index], params["decoder_layers"]))


def assert_gradient_close(a, b, step):
    """A gradient leaf against the reference's, relative to the reference's largest entry:
    1e-5 at step 0 (the same weights), 1e-4 after an update (Adam moves the entries whose
    gradient is rounding noise by +-lr, and the later gradients see those weights)."""
    scale = np.max(np.abs(b)) + 1e-12
    tol = 1e-5 if step == 0 else 1e-4
    np.testing.assert_allclose(a / scale, b / scale, rtol=tol, atol=tol)


# (arch, schedule, pp, v, m, other layout): gpt runs the 1F1B schedules' bare form at pp4; llama
# (RoPE, GQA, SwiGLU) each schedule beside tp2 + SP, data2 + ZeRO-1 or data2 (the pp2 1F1B and
# pp2 x v2 interleaved forms are those cases with the other axis at 1)
CASES = [
    ("gpt", "1f1b", 4, 1, 8, {}),
    # (gpt gpipe pp4 m4: llama-gpipe-pp4-v1-m4-data2 runs the same GPipe table, pp4 x m4; GPT's tied
    # embedding across stages: the gpt 1F1B and interleaved cases)
    ("gpt", "interleaved_1f1b", 4, 2, 8, {}),
    ("llama", "1f1b", 2, 1, 4, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ("llama", "interleaved_1f1b", 2, 2, 8, dict(data=2, use_distributed_optimizer=True)),
    ("llama", "gpipe", 4, 1, 4, dict(data=2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,schedule,pp,v,m,layout", CASES,
                         ids=[f"{a}-{s}-pp{p}-v{v}-m{m}-" + "_".join(f"{k}{val}" for k, val in lay.items())
                              for a, s, p, v, m, lay in CASES])
def test_pipelined_training_matches_one_device(arch, schedule, pp, v, m, layout):
    ref_losses, ref_grads, _, ref_params = reference(arch, m)
    layout = dict(layout)
    dp = layout.pop("data", 1)
    tp = layout.get("tensor_model_parallel_size", 1)
    kw = dict(LLAMA if arch == "llama" else {}, **layout)
    cfg = tiny_cfg(num_layers=NUM_LAYERS, micro_batch_size=16 // (m * dp), pipeline_model_parallel_size=pp,
                   virtual_pipeline_model_parallel_size=v if v > 1 else None, pipeline_schedule=schedule, **kw,
                   **TRAINS)
    losses, grads, run, params = trajectory_params(cfg, pp * dp * tp, steps=STEPS)
    assert (run.mesh.shape["pipeline"], run.mesh.shape["data"], run.num_microbatches) == (pp, dp, m)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    order = stage_layer_order(NUM_LAYERS, pp, v)
    ref_first, ref_last = (stage_order(p, order) for p in ref_params)
    assert_same_update(params[1], ref_last, ref_first, PARAMS_RTOL)
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        flat_g, flat_r = jax.tree.leaves(g), jax.tree.leaves(stage_order(r, order))
        assert len(flat_g) == len(flat_r)
        for a, b in zip(flat_g, flat_r):
            assert_gradient_close(a, b, step)


UNEVEN = [  # (arch, schedule, pp, v, m, first, last, other layout)
    # (gpt 1F1B pp2 with a 3-layer first stage: the llama 1F1B case below pads its stages the same
    # way, and gpt's uneven stages are the interleaved case's)
    ("gpt", "interleaved_1f1b", 2, 2, 4, 2, 6, {}),
    ("llama", "1f1b", 4, 1, 4, 1, 1, dict(data=2, use_distributed_optimizer=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,schedule,pp,v,m,first,last,layout", UNEVEN,
                         ids=[f"{a}-{s}-pp{p}-v{v}-first{f}-last{l}" for a, s, p, v, m, f, l, _ in UNEVEN])
def test_uneven_stages_match_one_device(arch, schedule, pp, v, m, first, last, layout):
    from jmegatron.parallel.pipeline_layout import PAD, PipelineLayout

    ref_losses, ref_grads, _, ref_params = reference(arch, m)
    layout = dict(layout)
    dp = layout.pop("data", 1)
    cfg = tiny_cfg(num_layers=NUM_LAYERS, micro_batch_size=16 // (m * dp), pipeline_model_parallel_size=pp,
                   virtual_pipeline_model_parallel_size=v if v > 1 else None, pipeline_schedule=schedule,
                   decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                   **dict(LLAMA if arch == "llama" else {}, **layout), **TRAINS)
    losses, grads, run, params = trajectory_params(cfg, pp * dp, steps=STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    order = PipelineLayout(NUM_LAYERS, pp, v, first, last).order()
    assert (order == PAD).any()  # these cases have padding slots
    ref_first, ref_last = (stage_order(p, order[order != PAD]) for p in ref_params)
    assert_same_update(stage_order(params[1], order != PAD), ref_last, ref_first, PARAMS_RTOL)
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        pad = jax.tree.map(lambda a: a[order == PAD], g["decoder_layers"])
        assert not any(np.any(a) for a in jax.tree.leaves(pad))  # padding gets no gradient
        for a, b in zip(jax.tree.leaves(stage_order(g, order != PAD)),
                        jax.tree.leaves(stage_order(r, order[order != PAD]))):
            assert_gradient_close(a, b, step)


@pytest.mark.slow
def test_multi_token_prediction_pp2_matches_one_device():
    # GPT (tied embedding: the depths' embeddings and output layer on the last stage share the
    # first stage's word embeddings), two MTP depths, pp2 x dp2 1F1B m4 (each data rank holds its
    # own share of every depth's masked tokens: the loss mask is random) against one device:
    # every reported loss of 2 steps and the first step's gradients (the same weights)
    layers, depths, steps, keys = 4, 2, 2, ("lm_loss", "mtp_1_loss", "mtp_2_loss", "loss")
    kw = dict(num_layers=layers, mtp_num_layers=depths, mtp_loss_scaling_factor=0.3, **TRAINS)
    ref_losses, ref_grads, _, _ = trajectory_params(tiny_cfg(scan_layers=True, micro_batch_size=4, **kw), 1,
                                                    steps, keys)
    losses, grads, run, _ = trajectory_params(
        tiny_cfg(pipeline_model_parallel_size=2, pipeline_schedule="1f1b", micro_batch_size=2, **kw), 4, steps, keys)
    assert (run.mesh.shape["pipeline"], run.mesh.shape["data"], run.num_microbatches) == (2, 2, 4)
    assert set(grads[0]) >= {"mtp_layers_0", "mtp_layers_1"}
    # each token enters 1 + depths losses, through up to layers + depths layers
    tokens, depth = 16 * 32 * (1 + depths), layers + depths
    np.testing.assert_allclose(losses, ref_losses, rtol=update_rtol(np.float32, tokens, depth, 1))
    order = stage_layer_order(layers, 2, 1)
    got, want = jax.tree.leaves_with_path(grads[0]), jax.tree.leaves(stage_order(ref_grads[0], order))
    assert len(got) == len(want)
    tol = update_rtol(np.float32, tokens, depth, 1)
    for (path, a), b in zip(got, want):
        scale = np.max(np.abs(b)) + 1e-30
        assert np.any(b != 0) or "mtp" not in jax.tree_util.keystr(path)
        np.testing.assert_allclose(a / scale, b / scale, rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))
    # (the update itself is not compared: Adam's first steps turn the rounding noise of entries
    # whose gradient is near zero into +-lr steps; the second step's losses read the updated weights)
