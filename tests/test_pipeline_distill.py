"""Distillation under pipeline parallelism: the teacher split into the student's stages
equals distillation without pipelining at the same data-parallel size (loss and gradients,
float32, relative 1e-5) with
intermediate pairs in any model chunk (interleaved, uneven stages), data, tensor and
context parallelism and document masks; a pair whose layers sit in different chunks fails
with an error naming the chunks."""

import jax
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.distill.config import DistillConfigError
from jmegatron.parallel.mesh import create_mesh
from jmegatron.distill.teacher import teacher_stage_layers
from jmegatron.parallel.pipeline_layout import PipelineLayout, gather_index, take_slots
from jmegatron.pretrain_gpt import build

from test_checkpoint_resume import cfg_for as _cfg_for
from test_distill_moe import save_teacher

LAYERS = 4


def cfg_for(save, **kw):
    return _cfg_for(save, **{"vocab_size": 512, "num_layers": LAYERS, "scan_layers": True, **kw})


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    # 4 scanned layers, 48 wide, saved at initialisation (tests/test_distill_moe.py's save_teacher):
    # the tests compare layouts of one step, which do not need a trained teacher
    return save_teacher(tmp_path_factory.mktemp("teacher4"), num_layers=LAYERS, scan_layers=True)


def yaml_file(tmp_path, text):
    p = tmp_path / "kd.yaml"
    p.write_text(text)
    return str(p)


def make_batch(run, cfg, doc1_seed=0):
    """A random batch; under ``reset_attention_mask`` two documents per row (the first
    ``cut`` tokens, then the rest), the first's tokens drawn from ``doc1_seed`` and its loss
    masked, so only the second document's tokens count."""
    rs = np.random.RandomState(0)
    gbs = run.global_batch_size
    toks = rs.randint(0, 512, size=(gbs, 33)).astype(np.int32)
    b = {"loss_mask": (rs.rand(gbs, 32) > 0.1).astype(np.float32),
         "position_ids": np.broadcast_to(np.arange(32, dtype=np.int32), (gbs, 32)).copy()}
    if cfg.reset_attention_mask:
        cut = rs.randint(4, 28, size=(gbs, 1))
        doc1 = np.arange(33)[None, :] < cut
        toks = np.where(doc1, np.random.RandomState(doc1_seed + 1).randint(0, 512, size=toks.shape), toks)
        b["segment_ids"] = (~doc1[:, :-1]).astype(np.int32)
        b["loss_mask"] = b["loss_mask"] * b["segment_ids"] * (~doc1[:, 1:])
    b.update(tokens=toks[:, :-1], labels=toks[:, 1:])
    return run.put_batch({k: v.reshape(run.num_microbatches, -1, 32) for k, v in b.items()})


def grads(cfg, n, doc1_seeds=(0,)):
    """(gradients, report) of one step on the first ``n`` devices, once per ``doc1_seeds``."""
    run = build(cfg, create_mesh(cfg, jax.devices()[:n]))
    state = run.init_state()
    out = []
    for seed in doc1_seeds:
        g, report, _ = run.compute_grads(state, make_batch(run, cfg, seed), *run.extra_args)
        out.append((jax.device_get(g), jax.device_get(report)))
    return out if len(doc1_seeds) > 1 else out[0]


PAIRS = ("intermediate_layer_pairs:\n"
         "  - [decoder.layers.3.pre_mlp_layernorm, decoder.layers.2.input_layernorm, mse]\n"
         "  - [decoder.final_layernorm, decoder.final_layernorm]\n"
         "skip_lm_loss: false\n")
# a pair in every model chunk of pp2 x v2 (chunks of one layer: s0c0 0, s1c0 1, s0c1 2, s1c1 3) and
# on both stages of the uneven pp2 split 1 + 3, through the student -> teacher projection (32 -> 48)
PAIRS_ANYWHERE = ("intermediate_layer_pairs:\n"
                  "  - [decoder.layers.0.input_layernorm, decoder.layers.0.pre_mlp_layernorm, cosine]\n"
                  "  - [decoder.layers.1.pre_mlp_layernorm, decoder.layers.1.input_layernorm, mse]\n"
                  "  - [decoder.layers.2.input_layernorm, decoder.layers.2.input_layernorm, mse]\n"
                  "  - [decoder.layers.3.pre_mlp_layernorm, decoder.layers.3.pre_mlp_layernorm, mse]\n"
                  "  - [decoder.final_layernorm, decoder.final_layernorm]\n"
                  "skip_lm_loss: false\n")


_UNPIPELINED = {}  # the unpipelined reference per (distillation YAML, document masks, dp), shared by the layouts


def assert_same_step(got, want):
    (g2, r2), (g1, r1) = got, want
    assert set(r2) == set(r1)
    for k in r1:
        np.testing.assert_allclose(r2[k], r1[k], rtol=1e-5, err_msg=k)
    assert jax.tree.structure(g2) == jax.tree.structure(g1)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        scale = np.max(np.abs(b)) + 1e-12
        np.testing.assert_allclose(a / scale, b / scale, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("yaml,pp,v,tp,dp,cp,first,docs", [
    (PAIRS_ANYWHERE, 2, 2, 1, 1, 1, None, False), (PAIRS, 2, 1, 2, 1, 1, None, False),
    (PAIRS_ANYWHERE, 2, 1, 1, 2, 1, 1, True), (PAIRS, 2, 1, 1, 1, 2, None, False)],
    ids=["anywhere-pp2-v2", "pairs-pp2-tp2", "anywhere-uneven-docmask-pp2-dp2", "pairs-pp2-cp2"])
def test_pipelined_distillation_matches_unpipelined(teacher_dir, tmp_path, yaml, pp, v, tp, dp, cp, first, docs):
    """Intermediate pairs in every chunk (interleaved, uneven stages), dp2 and cp2 (the last
    stage's balancer reads each data rank's losses, summed over its context ranks; the ranks'
    token counts differ: the loss mask is random), document masks (both models). The
    reference runs unpipelined on ``dp`` devices (one device for dp 1): the balancer's
    ratios are each data rank's."""
    kw = dict(kd_teacher_load=teacher_dir, micro_batch_size=4 // dp, global_batch_size=16,
              hidden_dropout=0.0, attention_dropout=0.0, kd_cfg=yaml_file(tmp_path, yaml),
              reset_attention_mask=docs)
    if (yaml, docs, dp) not in _UNPIPELINED:
        # unpipelined, the same micro-batches (4 rows) on the same data ranks
        ref = grads(cfg_for(tmp_path / "a", **kw), dp, doc1_seeds=(0, 1) if docs else (0,))
        if docs:  # the teacher and the student mask the first document: its tokens change nothing
            assert_same_step(ref[1], ref[0])
            ref = ref[0]
        _UNPIPELINED[(yaml, docs, dp)] = ref
    g1, r1 = _UNPIPELINED[(yaml, docs, dp)]
    cfg = cfg_for(tmp_path / "b", pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                  context_parallel_size=cp, cp_comm_type="all_gather" if cp > 1 else "p2p",
                  virtual_pipeline_model_parallel_size=v if v > 1 else None,
                  decoder_first_pipeline_num_layers=first, **kw)
    g2, r2 = grads(cfg, pp * tp * dp * cp)
    index = gather_index(PipelineLayout(LAYERS), cfg.pipeline_layout())
    g1 = dict(g1, decoder_layers=jax.tree.map(lambda a: take_slots(a, index), g1["decoder_layers"]))
    assert_same_step((g2, r2), (g1, r1))


def test_teacher_stages_scale_with_its_depth():
    student = cfg_for("/tmp/unused", pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)
    assert teacher_stage_layers(student, 8) == (2, None)
    assert teacher_stage_layers(cfg_for("/tmp/unused"), 6) == (None, None)
    with pytest.raises(ConfigError, match="decoder_first_pipeline_num_layers=1 .* 1.5 on that stage"):
        teacher_stage_layers(student, 6)


def test_a_pair_across_model_chunks_is_refused(teacher_dir, tmp_path):
    bad = yaml_file(tmp_path, "intermediate_layer_pairs:\n  - [decoder.layers.1.input_layernorm, "
                              "decoder.layers.3.input_layernorm]\n")
    cfg = cfg_for(tmp_path / "c", kd_teacher_load=teacher_dir, kd_cfg=bad, pipeline_model_parallel_size=2,
                  micro_batch_size=4, global_batch_size=16)
    with pytest.raises(DistillConfigError, match="student's is in stage 0 chunk 0 and the teacher's in stage 1 "
                                                 "chunk 0 .*s0c0: 0-1, s1c0: 2-3"):
        grads(cfg, 2)
