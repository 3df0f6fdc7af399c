"""Distillation under pipeline parallelism (issue 12 item 4): the teacher split into the
student's stages equals distillation without pipelining (loss and gradients, float32,
relative 1e-5), intermediate pairs on the last stage work, and pairs a pipeline cannot
place (Megatron's rule: last stage only) fail with an error naming the layers."""

import jax
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.distill.config import DistillConfigError
from jmegatron.parallel.mesh import create_mesh
from jmegatron.parallel.pipeline_layout import stage_layer_order
from jmegatron.pretrain_gpt import build, pretrain

from test_checkpoint_resume import cfg_for as _cfg_for

LAYERS = 4


def cfg_for(save, **kw):
    return _cfg_for(save, **{"vocab_size": 512, "num_layers": LAYERS, "scan_layers": True, **kw})


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher4")
    pretrain(cfg_for(d, hidden_size=48, num_attention_heads=4, ffn_hidden_size=96, train_iters=6, eval_interval=0))
    return str(d)


def yaml_file(tmp_path, text):
    p = tmp_path / "kd.yaml"
    p.write_text(text)
    return str(p)


def grads(cfg, n):
    run = build(cfg, create_mesh(cfg, jax.devices()[:n]))
    state = run.init_state()
    rs = np.random.RandomState(0)
    gbs = run.global_batch_size
    toks = rs.randint(0, 512, size=(gbs, 33)).astype(np.int32)
    b = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": (rs.rand(gbs, 32) > 0.1).astype(np.float32),
         "position_ids": np.broadcast_to(np.arange(32, dtype=np.int32), (gbs, 32)).copy()}
    b = run.put_batch({k: v.reshape(run.num_microbatches, -1, 32) for k, v in b.items()})
    g, report, _ = run.compute_grads(state, b, *run.extra_args)
    return jax.device_get(g), jax.device_get(report)


PAIRS = ("intermediate_layer_pairs:\n"
         "  - [decoder.layers.3.pre_mlp_layernorm, decoder.layers.2.input_layernorm, mse]\n"
         "  - [decoder.final_layernorm, decoder.final_layernorm]\n"
         "skip_lm_loss: false\n")


_UNPIPELINED = {}  # the one-device reference per distillation YAML, shared by the layouts


@pytest.mark.slow
@pytest.mark.parametrize("yaml,pp,v,tp,dp,cp", [(None, 2, 2, 1, 1, 1), (PAIRS, 2, 1, 2, 1, 1),
                                                (PAIRS, 2, 1, 1, 2, 1), (PAIRS, 2, 1, 1, 1, 2)],
                         ids=["logits-pp2-v2", "pairs-pp2-tp2", "pairs-pp2-dp2", "pairs-pp2-cp2"])
def test_pipelined_distillation_matches_unpipelined(teacher_dir, tmp_path, yaml, pp, v, tp, dp, cp):
    """dp2 and cp2: the last stage sums each KD loss over the data / context ranks before the
    balancer (its ratios need the micro-batch's global losses); the ranks' token counts differ
    (the loss mask is random)."""
    kw = dict(kd_teacher_load=teacher_dir, micro_batch_size=4 // dp, global_batch_size=16,
              hidden_dropout=0.0, attention_dropout=0.0)
    if yaml:
        kw["kd_cfg"] = yaml_file(tmp_path, yaml)
    if yaml not in _UNPIPELINED:
        _UNPIPELINED[yaml] = grads(cfg_for(tmp_path / "a", **kw), 1)
    g1, r1 = _UNPIPELINED[yaml]
    g2, r2 = grads(cfg_for(tmp_path / "b", pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                           context_parallel_size=cp, cp_comm_type="all_gather" if cp > 1 else "p2p",
                           virtual_pipeline_model_parallel_size=v if v > 1 else None,
                           **kw), pp * tp * dp * cp)
    assert set(r2) == set(r1)
    for k in r1:
        np.testing.assert_allclose(r2[k], r1[k], rtol=1e-5, err_msg=k)
    order = stage_layer_order(LAYERS, pp, v)
    g1 = dict(g1, decoder_layers=jax.tree.map(lambda a: a[order], g1["decoder_layers"]))
    assert jax.tree.structure(g2) == jax.tree.structure(g1)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        scale = np.max(np.abs(b)) + 1e-12
        np.testing.assert_allclose(a / scale, b / scale, rtol=1e-5, atol=1e-5)


def test_pairs_off_the_last_stage_and_uneven_stages_are_refused(teacher_dir, tmp_path):
    bad = yaml_file(tmp_path, "intermediate_layer_pairs:\n  - [decoder.layers.1.input_layernorm, "
                              "decoder.layers.3.input_layernorm]\n")
    cfg = cfg_for(tmp_path / "c", kd_teacher_load=teacher_dir, kd_cfg=bad, pipeline_model_parallel_size=2,
                  micro_batch_size=4, global_batch_size=16)
    with pytest.raises(DistillConfigError, match="last pipeline stage only.*student layers 2..3"):
        grads(cfg, 2)
    cfg = cfg_for(tmp_path / "d", kd_teacher_load=teacher_dir, pipeline_model_parallel_size=2,
                  decoder_first_pipeline_num_layers=1, micro_batch_size=2, global_batch_size=16)
    with pytest.raises(ConfigError, match="uneven pipeline stages"):
        build(cfg, create_mesh(cfg, jax.devices()[:4]))
