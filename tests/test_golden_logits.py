"""Golden-logit tests: jmegatron vs the Hugging Face model built by jmegatron.export.hf_model.

Random (non-trivial) float32 weights, dropout 0: the transformers GPT2LMHeadModel /
LlamaForCausalLM holding the exported weights must give the same logits (max abs
difference <= 1e-4) for per-layer and scanned params, and the state-dict mapping must
round-trip exactly.
"""

import subprocess
import sys

import numpy as np
import pytest

import torch  # noqa: E402
import transformers  # noqa: E402,F401

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jmegatron.config import base_config, from_configdict  # noqa: E402
from jmegatron.conversion import hf, tree  # noqa: E402
from jmegatron.export import hf_model  # noqa: E402
from jmegatron.models.gpt import GPTModel  # noqa: E402
from jmegatron.models.transformer_config import ModelConfig  # noqa: E402

SEQ, BATCH, VOCAB = 32, 2, 500
TOL = 1e-4


def make_cfg(kind: str, scan: bool = False, **changes):
    c = base_config("gpt2" if kind == "gpt" else "llama")
    c.mock_data = True
    c.vocab_size = VOCAB
    c.num_layers = 2
    c.hidden_size = 64
    c.seq_length = SEQ
    c.max_position_embeddings = SEQ
    c.hidden_dropout = 0.0
    c.attention_dropout = 0.0
    c.scan_layers = scan
    if kind == "gpt":
        c.num_attention_heads = 4
        c.ffn_hidden_size = 256
    else:
        c.num_attention_heads = 8
        c.num_query_groups = 2
        c.ffn_hidden_size = 160
    for k, v in changes.items():
        setattr(c, k, v)
    return from_configdict(c)


def model_of(cfg):
    return GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))


def random_params(cfg, seed: int = 0) -> dict:
    """The model's param tree (float32 numpy) with every leaf redrawn so each tensor
    matters: kernels and embeddings large enough for peaked attention, norm scales
    ~1 +- 0.2, biases ~0 +- 0.2."""
    tokens = jnp.zeros((1, SEQ), jnp.int32)
    # Only the tree structure and shapes are needed (every leaf is redrawn below).
    params = nn.unbox(jax.eval_shape(model_of(cfg).init, jax.random.PRNGKey(seed), tokens))["params"]
    rng = np.random.default_rng(seed)

    def redraw(path, leaf):
        name = path[-1].key
        shape = leaf.shape
        if name == "scale":
            return (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        if name == "bias":
            return (0.2 * rng.standard_normal(shape)).astype(np.float32)
        std = 0.5 if name == "embedding" else 0.125
        return (std * rng.standard_normal(shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(redraw, params)


def tokens_of(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32)


def jm_logits(cfg, params, tokens) -> np.ndarray:
    return np.asarray(jax.jit(model_of(cfg).apply)({"params": params}, tokens))


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def max_diff(cfg, params, vocab_size=None):
    tokens = tokens_of()
    ref = jm_logits(cfg, params, tokens)
    model = hf_model.to_hf_model(params, cfg, vocab_size)
    got = hf_logits(model, tokens)
    v = got.shape[-1]
    assert ref.shape[:2] == got.shape[:2] == (BATCH, SEQ)
    return float(np.max(np.abs(ref[..., :v] - got))), float(np.max(np.abs(ref)))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scan"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_golden_logits(kind, scan):
    cfg = make_cfg(kind, scan)
    params = random_params(cfg)
    if scan:
        assert "decoder_layers" in params
    diff, scale = max_diff(cfg, params)
    print(f"{kind} scan={scan}: max |logit diff| = {diff:.3g} (max |logit| {scale:.3g})")
    assert scale > 1.0  # non-trivial logits
    assert diff <= TOL


@pytest.mark.parametrize("kind,changes", [
    ("gpt", dict(untie_embeddings_and_output_weights=True)),
    ("llama", dict(untie_embeddings_and_output_weights=False, add_bias_linear=True)),
], ids=["gpt-untied", "llama-tied-biases"])
def test_golden_logits_variants(kind, changes):
    cfg = make_cfg(kind, **changes)
    params = random_params(cfg, seed=3)
    diff, _ = max_diff(cfg, params)
    print(f"{kind} {changes}: max |logit diff| = {diff:.3g}")
    assert diff <= TOL


def test_export_true_vocab_drops_padding():
    cfg = make_cfg("gpt")
    params = random_params(cfg)
    assert params["word_embeddings"]["embedding"].shape[0] == 512
    diff, _ = max_diff(cfg, params, vocab_size=VOCAB)
    assert diff <= TOL
    sd = hf.to_hf_state_dict(params, cfg, vocab_size=VOCAB)
    assert sd["transformer.wte.weight"].shape == (VOCAB, 64)
    back = hf.from_hf_state_dict(sd, cfg)  # padded back to 512 rows with zeros
    emb = back["word_embeddings"]["embedding"]
    assert emb.shape == (512, 64)
    np.testing.assert_array_equal(emb[:VOCAB], params["word_embeddings"]["embedding"][:VOCAB])
    assert not emb[VOCAB:].any()


def _assert_trees_equal(a, b, path=""):
    assert isinstance(a, dict) == isinstance(b, dict), path
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_trees_equal(a[k], b[k], f"{path}/{k}")
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype == np.float32, path
        assert a.shape == b.shape, path
        np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scan"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_state_dict_round_trip(kind, scan):
    cfg = make_cfg(kind, scan)
    params = random_params(cfg)
    sd = hf.to_hf_state_dict(params, cfg)
    assert all(isinstance(v, np.ndarray) for v in sd.values())
    if kind == "gpt":
        assert sd["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)
        assert "lm_head.weight" not in sd  # tied
    else:
        assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
        assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)
        assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (160, 64)
        assert sd["lm_head.weight"].shape == (512, 64)
    back = hf.from_hf_state_dict(sd, cfg)
    _assert_trees_equal(jax.tree_util.tree_map(np.asarray, params), back)
    # torch tensors are accepted too
    back_t = hf.from_hf_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, cfg)
    _assert_trees_equal(back, back_t)


def test_stack_unstack_layers():
    cfg = make_cfg("llama", scan=True)
    stacked = jax.tree_util.tree_map(np.asarray, random_params(cfg))
    per_layer = tree.unstack_layers(stacked, cfg.num_layers)
    assert "decoder_layers" not in per_layer and "decoder_layers_1" in per_layer
    assert per_layer["decoder_layers_1"]["mlp"]["linear_fc1"]["kernel"].shape == (64, 2, 160)
    _assert_trees_equal(tree.stack_layers(per_layer, cfg.num_layers), stacked)
    # the per-layer model gives the scanned model's logits
    tokens = tokens_of()
    np.testing.assert_allclose(jm_logits(make_cfg("llama"), per_layer, tokens),
                               jm_logits(cfg, stacked, tokens), atol=1e-5)
    # a scanned config gets stacked params back from from_hf_state_dict
    sd = hf.to_hf_state_dict(per_layer, cfg)
    _assert_trees_equal(hf.from_hf_state_dict(sd, cfg), stacked)
    with pytest.raises(ValueError, match="decoder_layers"):
        tree.stack_layers(stacked, cfg.num_layers)


def test_hf_config_dict():
    gpt = hf.hf_config_dict(make_cfg("gpt"), 512)
    assert gpt["architectures"] == ["GPT2LMHeadModel"] and gpt["model_type"] == "gpt2"
    assert gpt["activation_function"] == "gelu"
    assert (gpt["n_embd"], gpt["n_layer"], gpt["n_head"], gpt["n_inner"], gpt["n_positions"]) == (64, 2, 4, 256, SEQ)
    assert gpt["tie_word_embeddings"] is True and gpt["vocab_size"] == 512
    llama = hf.hf_config_dict(make_cfg("llama"), 512)
    assert llama["architectures"] == ["LlamaForCausalLM"]
    assert (llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"]) == (8, 2, 8)
    assert llama["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert llama["tie_word_embeddings"] is False and llama["attention_bias"] is False
    assert llama["mlp_bias"] is False and llama["intermediate_size"] == 160


@pytest.mark.parametrize("kind,changes,fields", [
    ("gpt", dict(swiglu=True), ["swiglu"]),
    ("gpt", dict(num_query_groups=2, normalization="RMSNorm"), ["num_query_groups", "normalization"]),
    ("gpt", dict(add_bias_linear=False), ["add_bias_linear"]),
    ("llama", dict(normalization="LayerNorm", swiglu=False), ["normalization", "swiglu"]),
    ("llama", dict(add_qkv_bias=True, qk_layernorm=True), ["add_qkv_bias"]),
    ("llama", dict(position_embedding_type="none"), ["position_embedding_type"]),
])
def test_unrepresentable_config_rejected(kind, changes, fields):
    cfg = make_cfg(kind, **changes)
    with pytest.raises(ValueError) as e:
        hf.hf_architecture(cfg)
    for f in fields:
        assert f"config.{f}=" in str(e.value)
    with pytest.raises(ValueError):
        hf.to_hf_state_dict({}, cfg)


def test_mismatched_params_rejected():
    cfg = make_cfg("gpt")
    params = random_params(cfg)
    with pytest.raises(ValueError, match="hidden_size|shape"):
        hf.to_hf_state_dict(params, make_cfg("gpt", hidden_size=128))
    sd = hf.to_hf_state_dict(params, cfg)
    del sd["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match="c_fc.bias"):
        hf.from_hf_state_dict(sd, cfg)


def test_module_does_not_import_torch():
    code = ("import sys, jmegatron.conversion.hf; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
