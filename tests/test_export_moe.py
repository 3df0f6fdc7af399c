"""Hugging Face interop of MoE models (issue 13 item 6): jmegatron's MoE layers <->
transformers' MixtralForCausalLM (no shared expert) and Qwen2MoeForCausalLM (shared expert),
golden logits in float32 (<= 1e-4) on tiny random models built here (no downloads; the
import of transformers' own models, Qwen3-MoE's too, is tests/test_hf_families.py's), exact
round trips, `import-hf` / `export hf` of MoE folders and checkpoints,
and TensorRT-LLM's export refusing a shared expert by name (its Mixtral checkpoint and
ModelOpt PTQ of MoE models: tests/test_trtllm_moe.py)."""

import json

import numpy as np
import pytest

import torch  # noqa: E402
import transformers  # noqa: E402

import jax  # noqa: E402

from jmegatron.conversion import hf  # noqa: E402
from jmegatron.export import hf_model  # noqa: E402
from jmegatron.export.common import ExportError  # noqa: E402

from test_golden_logits import VOCAB, hf_logits, jm_logits, make_cfg, max_diff, random_params, tokens_of  # noqa: E402

TOL = 1e-4
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
SHARED = dict(MOE, moe_shared_expert_intermediate_size=40)


@pytest.mark.parametrize("changes,arch", [
    (MOE, "MixtralForCausalLM"),
    (dict(MOE, scan_layers=True), "MixtralForCausalLM"),
    # a dense first layer (mlp_only_layers), Qwen's QKV bias
    (dict(SHARED, moe_layer_freq=(0, 1), add_qkv_bias=True), "Qwen2MoeForCausalLM"),
    # top-k of a softmax over all experts, not renormalised (norm_topk_prob=False)
    (dict(SHARED, moe_router_pre_softmax=True), "Qwen2MoeForCausalLM"),
    # head_dim != hidden / heads, tied embeddings, top-3
    (dict(SHARED, kv_channels=16, untie_embeddings_and_output_weights=False, moe_router_topk=3),
     "Qwen2MoeForCausalLM"),
    # a capacity factor large enough that nothing drops: HF's dropless logits
    (dict(MOE, moe_expert_capacity_factor=4.0), "MixtralForCausalLM"),
], ids=["mixtral", "mixtral-scan", "qwen2moe-dense0-qkvbias", "qwen2moe-presoftmax", "qwen2moe-tied-kv16-top3",
        "mixtral-capacity-nodrop"])
def test_moe_golden_logits(changes, arch):
    cfg = make_cfg("llama", **changes)
    assert hf.hf_architecture(cfg) == arch
    params = random_params(cfg)
    diff, scale = max_diff(cfg, params)
    print(f"{arch} {changes}: max |logit diff| = {diff:.3g} (max |logit| {scale:.3g})")
    assert scale > 1.0 and diff <= TOL


def test_routing_matters():
    # Control: the same weights with the router's expert order rotated in the HF model
    # (experts left in place) give other logits, so the golden test checks the routing.
    cfg = make_cfg("llama", **MOE)
    params = random_params(cfg)
    model = hf_model.to_hf_model(params, cfg)
    tokens = tokens_of()
    ref = jm_logits(cfg, params, tokens)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            gate.weight.copy_(torch.roll(gate.weight, 1, dims=0))
    assert np.max(np.abs(hf_logits(model, tokens) - ref)) > 1e-2


def _hf_random(model, seed=0):
    """Redraw a transformers model's weights so each matters (its own init is ~0.02)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.5 if "embed" in name else 0.125) * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("changes", [MOE, dict(SHARED, moe_layer_freq=(0, 1))], ids=["mixtral", "qwen2moe"])
def test_state_dict_round_trip(changes):
    cfg = make_cfg("llama", **changes)
    params = random_params(cfg, seed=5)
    sd = hf.to_hf_state_dict(params, cfg)
    arch = hf.hf_architecture(cfg)
    if arch == "MixtralForCausalLM":  # the checkpoint (Hub) names
        assert sd["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (64, 48)
        assert sd["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 64)
    else:
        assert not sd["model.layers.1.mlp.shared_expert_gate.weight"].any()
        assert "model.layers.0.mlp.gate_proj.weight" in sd  # the dense layer
    back = hf.from_hf_state_dict(sd, cfg)
    a, b = jax.tree_util.tree_leaves_with_path(params), dict(jax.tree_util.tree_leaves_with_path(back))
    assert len(a) == len(b)
    for path, x in a:
        assert np.array_equal(x, b[path]), jax.tree_util.keystr(path)


def test_config_round_trip_and_refusals():
    cfg = make_cfg("llama", **dict(SHARED, moe_layer_freq=(0, 1), moe_aux_loss_coeff=1e-2))
    conf = hf.hf_config_dict(cfg, VOCAB)
    assert conf["model_type"] == "qwen2_moe" and conf["mlp_only_layers"] == [0] and conf["norm_topk_prob"] is True
    back = hf.config_fields_from_hf(conf)
    for k in ("num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_topk",
              "moe_layer_freq", "moe_router_pre_softmax", "moe_aux_loss_coeff", "ffn_hidden_size", "kv_channels"):
        assert back[k] == getattr(cfg, k), k
    with pytest.raises(ValueError, match="moe_router_score_function='sigmoid'"):
        hf.hf_architecture(make_cfg("llama", **MOE, moe_router_score_function="sigmoid"))
    with pytest.raises(ValueError, match="moe_layer_freq=2 has dense layers"):
        hf.hf_architecture(make_cfg("llama", **MOE, moe_layer_freq=2))
    with pytest.raises(ValueError, match="moe_router_pre_softmax=True"):
        hf.hf_architecture(make_cfg("llama", **MOE, moe_router_pre_softmax=True))
    with pytest.raises(ValueError, match="sliding_window=4096"):
        hf.config_fields_from_hf(dict(hf.hf_config_dict(make_cfg("llama", **MOE), VOCAB), sliding_window=4096))


def test_dense_only_exporters_refuse_moe():
    # TensorRT-LLM takes Mixtral (tests/test_trtllm_moe.py) but not a shared expert: refused
    # by name before any work
    from jmegatron.export.trtllm import check_exportable

    assert check_exportable(make_cfg("llama", **MOE), 1, "float16") == "MixtralForCausalLM"
    with pytest.raises(ExportError, match="trtllm: config.moe_shared_expert_intermediate_size=40"):
        check_exportable(make_cfg("llama", **SHARED), 1, "float16")


@pytest.mark.slow
def test_import_hf_and_export_hf_folders(tmp_path):
    # A Mixtral folder written by transformers -> `import-hf` -> a jmegatron checkpoint ->
    # `export hf` -> a folder with the same tensors; the checkpoint and both folders give
    # the same logits; quantize refuses a block config that does not fit the experts, before any work.
    from safetensors.numpy import load_file

    from jmegatron.data.indexed_dataset import IndexedDatasetBuilder
    from jmegatron.export.convert import export_hf
    from jmegatron.export.imports import import_hf
    from jmegatron.export.quantize import quantize
    from jmegatron.training.run import restore_run

    conf = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
                                      num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0)
    _hf_random(transformers.MixtralForCausalLM(conf).to(torch.float32)).save_pretrained(str(tmp_path / "hf"))
    cfg = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 48)
    summary = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert summary["architecture"] == "MixtralForCausalLM" and summary["vocab_size"] == VOCAB
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in b and set(a) == set(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_local_experts"] == 4
    tokens = tokens_of()
    run, state, _ = restore_run(str(tmp_path / "ckpt"))
    ref = np.asarray(run.model.apply({"params": state.params}, tokens))[..., :VOCAB]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert np.max(np.abs(ref)) > 1.0 and np.max(np.abs(hf_logits(model, tokens) - ref)) <= TOL

    data = tmp_path / "calib"
    builder = IndexedDatasetBuilder(str(data) + ".bin")
    builder.add_item(np.arange(100) % VOCAB)
    builder.end_document()
    builder.finalize(str(data) + ".idx")
    # quantize takes MoE checkpoints (tests/test_trtllm_moe.py); a block config that does not fit
    # the experts' FFN is refused by name before any work
    with pytest.raises(ExportError, match=r"moe_ffn_hidden_size \(the experts' linear_fc2 input\) = 48"):
        quantize(str(tmp_path / "ckpt"), "int4_awq", str(data), str(tmp_path / "q"))
    assert not (tmp_path / "q").exists()
