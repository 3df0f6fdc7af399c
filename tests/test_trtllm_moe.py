"""TensorRT-LLM MoE checkpoints (issue 13 item 6): ``MixtralForCausalLM`` written by
``python -m jmegatron.export trtllm`` and validated by ``check-trtllm``; ModelOpt FP8 PTQ of
an MoE checkpoint with the router left unquantized.

The writer's output passes the checker at (moe_tp, moe_ep) in {(1,1), (2,1), (1,2), (2,2)}
(tp = moe_tp x moe_ep, TensorRT-LLM's Mapping), the rank shards put back together by
TensorRT-LLM's rules (``Mapping.ep_experts`` / ``moe_tp_rank``, ``concat([w3, w1])``) give
the Hugging Face Mixtral export's tensors exactly (the router in float32), TensorRT-LLM's
MoE computation (``MoeOOTB``: RENORMALIZE routing, ``mlp.fc``'s first half the up projection,
second half the silu input, summed over ranks) on the rank files equals the Hugging Face
``MixtralSparseMoeBlock`` (7.7e-6 at a max output of 22.8), a shard with its
experts swapped or a config with bad MoE fields fails naming the tensor or field, and bad
``--moe-ep`` / ``--moe-tp`` / architectures stop before anything is written.

``python -m jmegatron.export quantize`` (FP8) on a Mixtral checkpoint quantizes the experts
and the attention and leaves the routers unquantized (also Qwen2-MoE's router and
shared-expert gate; ModelOpt's default rules
``*block_sparse_moe.gate*`` / ``*mlp.gate.*``, also checked on Linear routers against a
control without them), writes the unified Hugging Face checkpoint with FP8 experts and the
routers excluded, and reports perplexity; configs whose weight blocks do not fit the
experts' FFN and the quantized TensorRT-LLM export of an MoE model are refused before work.
"""

import json
import os

import jax
import numpy as np
import pytest
import modelopt.torch.quantization as mtq
import safetensors.torch as safetensors_torch
import torch
from modelopt.torch.quantization.nn import TensorQuantizer

from jmegatron.conversion import hf
from jmegatron.export import hf_model
from jmegatron.export.__main__ import main
from jmegatron.export.common import ExportError
from jmegatron.export.quantize import build_quant_config, enabled_quantizers, moe_router_modules, quantize
from jmegatron.export.quantized import load_quantized
from jmegatron.export.trtllm import check_exportable, moe_parallel_sizes, write_trtllm_checkpoint
from jmegatron.export.trtllm_check import check_trtllm_checkpoint

from test_trtllm import TRUE_VOCAB, config_of, errors_of, make_cfg, random_params

load_file, save_file = safetensors_torch.load_file, safetensors_torch.save_file
E, F = 4, 48
MOE = dict(num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=F)
GRID = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (moe_tp, moe_ep); tp = moe_tp * moe_ep
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def moe_cfg(**changes):
    return make_cfg("llama", **dict(MOE, **changes))


@pytest.fixture(scope="module")
def moe_model():
    cfg = moe_cfg()
    return cfg, random_params(cfg, seed=3)


@pytest.mark.parametrize("moe_tp,moe_ep", GRID)
def test_writer_output_passes_checker(moe_tp, moe_ep, moe_model, tmp_path):
    cfg, params = moe_model
    tp = moe_tp * moe_ep
    out = tmp_path / "c"
    write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(out), tp=tp, moe_ep=moe_ep, dtype="bfloat16")
    report = check_trtllm_checkpoint(str(out))
    print(report.format())
    assert report.ok, report.errors
    c = config_of(out)
    assert (c["architecture"], c["hidden_act"], c["intermediate_size"]) == ("MixtralForCausalLM", "swiglu", F)
    assert c["moe"] == {"num_experts": E, "top_k": 2, "normalization_mode": 1}
    assert c["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1, "moe_tp_size": moe_tp,
                            "moe_ep_size": moe_ep}
    for r in range(tp):
        t = load_file(str(out / f"rank{r}.safetensors"))
        assert t["transformer.layers.1.mlp.router.weight"].dtype == torch.float32
        assert t["transformer.layers.1.mlp.router.weight"].shape == (E, 64)
        assert t["transformer.layers.1.mlp.fc.weight"].shape == (E // moe_ep, 2 * F // moe_tp, 64)
        assert t["transformer.layers.1.mlp.fc.weight"].dtype == torch.bfloat16
        assert t["transformer.layers.1.mlp.proj.weight"].shape == (E // moe_ep, 64, F // moe_tp)
        assert not any(".mlp.gate." in k for k in t)  # the experts' gate rows live in mlp.fc


def reassemble_moe(out) -> dict:
    """Full float32 tensors from the rank files of a pp-1 Llama/Mixtral checkpoint, put
    back by TensorRT-LLM's rules: attention and lm_head as the dense Llama (rows / columns
    over tp), experts from ``Mapping.ep_experts`` (rank t: ep rank t % ep) and the FFN
    columns of MoE tp rank t // ep; ``mlp.fc`` split back into its up and gate halves."""
    c = config_of(out)
    m = c["mapping"]
    tp, ep, mtp, V = m["tp_size"], m["moe_ep_size"], m["moe_tp_size"], c["vocab_size"]
    nq, nkv, d, h = c["num_attention_heads"], c["num_key_value_heads"], c["head_size"], c["hidden_size"]
    n_exp, f = c["moe"]["num_experts"], c["intermediate_size"]
    ranks = [{k: v.float() for k, v in load_file(os.path.join(out, f"rank{r}.safetensors")).items()}
             for r in range(tp)]
    full = {}
    for name in ranks[0]:
        cat = lambda dim: torch.cat([R[name] for R in ranks], dim)  # noqa: E731
        if "layernorm" in name or name.startswith("transformer.ln_f") or name.endswith("router.weight"):
            for R in ranks[1:]:
                assert torch.equal(R[name], ranks[0][name]), name
            full[name] = ranks[0][name]
        elif name.endswith("attention.dense.weight"):
            full[name] = cat(1)
        elif name in ("lm_head.weight", "transformer.vocab_embedding.weight"):
            t = cat(0)
            assert not t[V:].any()
            full[name] = t[:V]
        elif name.endswith("attention.qkv.weight"):
            q_rows, kv_rows = nq // tp * d, max(nkv // tp, 1) * d
            parts = [torch.split(R[name], [q_rows, kv_rows, kv_rows]) for R in ranks]
            owners = range(tp) if nkv >= tp else [g * (tp // nkv) for g in range(nkv)]
            full[name] = torch.cat([torch.cat([p[0] for p in parts]), torch.cat([parts[r][1] for r in owners]),
                                    torch.cat([parts[r][2] for r in owners])])
        elif name.endswith(("mlp.fc.weight", "mlp.proj.weight")):
            up, gate, proj = torch.zeros(n_exp, f, h), torch.zeros(n_exp, f, h), torch.zeros(n_exp, h, f)
            for t, R in enumerate(ranks):
                experts = slice(t % ep * (n_exp // ep), (t % ep + 1) * (n_exp // ep))
                cols = slice(t // ep * (f // mtp), (t // ep + 1) * (f // mtp))
                if name.endswith("fc.weight"):
                    local = R[name]
                    up[experts, cols], gate[experts, cols] = local[:, :f // mtp], local[:, f // mtp:]
                else:
                    proj[experts, :, cols] = R[name]
            if name.endswith("fc.weight"):
                full[name.replace("fc.weight", "up")], full[name.replace("fc.weight", "gate")] = up, gate
            else:
                full[name] = proj
        else:
            raise AssertionError(f"unexpected tensor {name}")
    return full


def hf_mixtral_as_trtllm(sd: dict, L: int) -> dict:
    """Hugging Face Mixtral checkpoint keys -> the names of :func:`reassemble_moe`."""
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()}
    out = {"transformer.vocab_embedding.weight": t["model.embed_tokens.weight"],
           "transformer.ln_f.weight": t["model.norm.weight"], "lm_head.weight": t["lm_head.weight"]}
    for i in range(L):
        o, p = f"transformer.layers.{i}", f"model.layers.{i}"
        moe = f"{p}.block_sparse_moe"
        out[f"{o}.input_layernorm.weight"] = t[f"{p}.input_layernorm.weight"]
        out[f"{o}.post_layernorm.weight"] = t[f"{p}.post_attention_layernorm.weight"]
        out[f"{o}.attention.qkv.weight"] = torch.cat([t[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"])
        out[f"{o}.attention.dense.weight"] = t[f"{p}.self_attn.o_proj.weight"]
        out[f"{o}.mlp.router.weight"] = t[f"{moe}.gate.weight"]
        n = t[f"{moe}.gate.weight"].shape[0]
        out[f"{o}.mlp.up"] = torch.stack([t[f"{moe}.experts.{e}.w3.weight"] for e in range(n)])
        out[f"{o}.mlp.gate"] = torch.stack([t[f"{moe}.experts.{e}.w1.weight"] for e in range(n)])
        out[f"{o}.mlp.proj.weight"] = torch.stack([t[f"{moe}.experts.{e}.w2.weight"] for e in range(n)])
    return out


@pytest.mark.parametrize("moe_tp,moe_ep", GRID)
def test_reassembled_shards_equal_hf_weights(moe_tp, moe_ep, moe_model, tmp_path):
    cfg, params = moe_model
    write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(tmp_path / "c"), tp=moe_tp * moe_ep, moe_tp=moe_tp,
                            dtype="float16")
    got = reassemble_moe(tmp_path / "c")
    want = hf_mixtral_as_trtllm(hf.to_hf_state_dict(params, cfg, TRUE_VOCAB), cfg.num_layers)
    assert sorted(got) == sorted(want)
    for name in want:
        if name.endswith("router.weight"):  # kept in float32: bit-exact
            assert torch.equal(got[name], want[name]), name
        else:  # exact up to the cast to the checkpoint dtype
            assert torch.equal(got[name], want[name].to(torch.float16).float()), name
    # the control: up and gate are told apart (swapping them changes the tensors)
    assert not torch.equal(want["transformer.layers.0.mlp.up"], want["transformer.layers.0.mlp.gate"])


def trtllm_moe_layer(ranks: list, layer: int, x: np.ndarray, top_k: int, ep: int, swap: bool = False) -> np.ndarray:
    """TensorRT-LLM's MoE layer on tokens ``x [T, h]`` (float64 numpy), computed from the rank
    files as its ``MoeOOTB`` does (``tensorrt_llm/layers/moe.py``): RENORMALIZE routing (top-k
    of the float32 router logits, softmax over those k), each rank's experts
    (``Mapping.ep_experts``) as ``GatedMLP``s whose ``gate`` (up projection) is the first half
    of ``mlp.fc`` rows and whose ``fc`` (the silu input) is the second half
    (``MoeOOTB.load_weights``), ``proj(silu(fc(x)) * gate(x))`` on the rank's FFN columns,
    then the sum over ranks (the allreduce). ``swap``: read the halves the other way round."""
    o = f"transformer.layers.{layer}.mlp"
    router = ranks[0][f"{o}.router.weight"].double().numpy()
    logits = x @ router.T
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    vals = np.take_along_axis(logits, top, -1)
    w = np.exp(vals - vals.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t, R in enumerate(ranks):
        fc, proj = R[f"{o}.fc.weight"].double().numpy(), R[f"{o}.proj.weight"].double().numpy()
        local = fc.shape[0]
        half = fc.shape[1] // 2
        for j in range(local):
            e = t % ep * local + j
            up, act_in = (fc[j, :half], fc[j, half:]) if not swap else (fc[j, half:], fc[j, :half])
            for tok in range(x.shape[0]):
                hit = np.nonzero(top[tok] == e)[0]
                if hit.size:
                    a = act_in @ x[tok]
                    out[tok] += w[tok, hit[0]] * (proj[j] @ ((a / (1 + np.exp(-a))) * (up @ x[tok])))
    return out


@pytest.mark.parametrize("moe_tp,moe_ep", [(1, 1), (2, 2)])
def test_tensorrt_llm_moe_semantics_equal_hf_mixtral_block(moe_tp, moe_ep, tmp_path):
    # Weights exactly representable in float16, so the checkpoint holds them exactly: the
    # TensorRT-LLM computation over the ranks equals the Hugging Face MixtralSparseMoeBlock
    # (itself golden-tested against jmegatron); reading fc's halves the other way does not.
    cfg = moe_cfg()
    params = jax.tree.map(lambda a: a.astype(np.float16).astype(np.float32) * 0.5, random_params(cfg, seed=7))
    write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(tmp_path / "c"), tp=moe_tp * moe_ep, moe_ep=moe_ep)
    ranks = [load_file(str(tmp_path / "c" / f"rank{r}.safetensors")) for r in range(moe_tp * moe_ep)]
    block = hf_model.to_hf_model(params, cfg, TRUE_VOCAB).model.layers[1].mlp
    x = np.random.default_rng(0).standard_normal((6, 64)) * 0.5
    with torch.no_grad():
        want = block(torch.from_numpy(x).float()[None])[0].double().numpy()
    got = trtllm_moe_layer(ranks, 1, x, cfg.moe_router_topk, moe_ep)
    scale = np.abs(want).max()
    print(f"max |TRT-LLM - HF| = {np.abs(got - want).max():.3g} (max |HF| {scale:.3g})")
    assert scale > 0.1 and np.abs(got - want).max() <= 1e-4 * scale, np.abs(got - want).max()
    swapped = trtllm_moe_layer(ranks, 1, x, cfg.moe_router_topk, moe_ep, swap=True)
    assert np.abs(swapped - want).max() > 1e-2 * scale


def test_pipeline_stages_hold_the_same_moe_tensors(moe_model, tmp_path):
    cfg, params = moe_model
    write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(tmp_path / "pp"), tp=2, pp=2, moe_ep=2)
    write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(tmp_path / "flat"), tp=2, moe_ep=2)
    assert check_trtllm_checkpoint(str(tmp_path / "pp")).ok
    for t in range(2):
        stage1 = load_file(str(tmp_path / "pp" / f"rank{2 + t}.safetensors"))  # layer 1, numbered 0
        flat = load_file(str(tmp_path / "flat" / f"rank{t}.safetensors"))
        for k in ("router.weight", "fc.weight", "proj.weight"):
            assert torch.equal(stage1[f"transformer.layers.0.mlp.{k}"], flat[f"transformer.layers.1.mlp.{k}"])


# ----------------------------------------------------------------------------- checker faults
@pytest.fixture(scope="module")
def moe_tp2_ep2(moe_model, tmp_path_factory):
    cfg, params = moe_model
    out = tmp_path_factory.mktemp("moe") / "c"
    write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(out), tp=2, moe_ep=2)
    return out


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_config(path, fn):
    c = config_of(path)
    fn(c)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


def _edit_rank(path, rank, fn):
    f = os.path.join(path, f"rank{rank}.safetensors")
    t = load_file(f)
    fn(t)
    save_file(t, f)


def _set(d, path, value):
    if isinstance(value, dict) and "_ffn" in value:
        d["intermediate_size"] = value.pop("_ffn")
    *head, last = path.split(".")
    for k in head:
        d = d[k]
    if value is None:
        del d[last]
    else:
        d[last] = value


@pytest.mark.parametrize("field,value,message", [
    ("mapping.moe_ep_size", 4, "moe_tp_size 1 x moe_ep_size 4 != tp_size 2"),
    ("moe.num_experts", 5, "num_experts 5 is not divisible by mapping.moe_ep_size 2"),
    ("moe.top_k", 5, "moe.top_k = 5 > moe.num_experts = 4"),
    ("moe.normalization_mode", 7, "moe.normalization_mode = 7 is not an ExpertScaleNormalizationMode"),
    ("moe.renormalize", True, "moe has unknown field(s) ['renormalize']"),
    ("moe", None, "'MixtralForCausalLM' needs a moe block with num_experts > 1"),
    ("mapping", dict(world_size=2, tp_size=2, pp_size=1, moe_tp_size=2, moe_ep_size=1, _ffn=47),
     "intermediate_size 47 (the experts' FFN) is not divisible by mapping.moe_tp_size 2"),
    ("quantization.quant_algo", "FP8", "quantized MoE layouts"),
], ids=["ep-times-tp", "experts-vs-ep", "topk", "normalization", "unknown-field", "no-moe", "ffn-vs-moe-tp",
        "quantized"])
def test_bad_moe_config_fields_are_named(field, value, message, moe_tp2_ep2, tmp_path):
    out = _copy(moe_tp2_ep2, tmp_path / "c")
    _edit_config(out, lambda c: _set(c, field, value))
    errors = errors_of(out)
    assert any(message in e for e in errors), errors


def test_bad_moe_tensors_are_named(moe_tp2_ep2, tmp_path):
    # the router in float16 (TRT-LLM's router is float32), ranks with different routers, and
    # an MoE rank holding all experts instead of its two
    out = _copy(moe_tp2_ep2, tmp_path / "c")
    _edit_rank(out, 0, lambda t: t.update({"transformer.layers.0.mlp.router.weight":
                                           t["transformer.layers.0.mlp.router.weight"].half()}))
    _edit_rank(out, 1, lambda t: t.update({"transformer.layers.1.mlp.router.weight":
                                           t["transformer.layers.1.mlp.router.weight"] + 1}))
    _edit_rank(out, 1, lambda t: t.update({"transformer.layers.0.mlp.fc.weight":
                                           t["transformer.layers.0.mlp.fc.weight"].repeat(2, 1, 1)}))
    errors = errors_of(out)
    print("\n".join(errors))
    assert "rank0.safetensors: transformer.layers.0.mlp.router.weight has dtype float16, expected float32" in errors
    assert any("rank1.safetensors: transformer.layers.1.mlp.router.weight differs from rank0's" in e for e in errors)
    assert ("rank1.safetensors: transformer.layers.0.mlp.fc.weight has shape (4, 96, 64), expected (2, 96, 64)"
            in errors)


# ----------------------------------------------------------------------------- refused before writing
def test_moe_parallel_sizes_follow_tensorrt_llms_mapping():
    assert moe_parallel_sizes(4) == (4, 1)
    assert moe_parallel_sizes(4, moe_ep=2) == (2, 2)
    assert moe_parallel_sizes(4, moe_tp=1) == (1, 4)
    assert moe_parallel_sizes(4, 2, 2) == (2, 2)


@pytest.mark.parametrize("changes,tp,kw,message", [
    ({}, 8, dict(moe_ep=8), "--moe-ep 8: num_moe_experts=4 is not divisible by it"),
    ({}, 2, dict(moe_ep=4), "--moe-ep 4 does not divide --tp 2"),
    ({}, 4, dict(moe_tp=2, moe_ep=4), "--moe-tp 2 x --moe-ep 4 = 8 != --tp 4"),
    ({}, 2, dict(moe_ep=0), "--moe-ep 0: must be an integer >= 1"),
    (dict(moe_ffn_hidden_size=36), 8, dict(moe_ep=1), "--moe-tp 8: moe_ffn_hidden_size=36 is not divisible by it"),
    (dict(moe_shared_expert_intermediate_size=32), 1, {}, "config.moe_shared_expert_intermediate_size=32"),
    (dict(moe_router_score_function="sigmoid"), 1, {},
     "config.moe_router_score_function='sigmoid'"),
    (dict(moe_layer_freq=(0, 1)), 1, {}, "config.moe_layer_freq=(0, 1) has dense layers"),
], ids=["experts-vs-ep", "ep-vs-tp", "product", "zero", "ffn-vs-moe-tp", "shared-expert", "deepseek-sigmoid",
        "dense-layer"])
def test_bad_moe_export_fails_before_writing(changes, tp, kw, message, tmp_path):
    cfg = moe_cfg(**changes)
    with pytest.raises(ExportError) as e:
        check_exportable(cfg, tp, "float16", **kw)
    assert message in str(e.value)
    with pytest.raises(ExportError):  # the writer checks first: nothing is created
        write_trtllm_checkpoint({}, cfg, TRUE_VOCAB, str(tmp_path / "c"), tp=tp, **kw)
    assert not (tmp_path / "c").exists()


def test_dense_model_refuses_moe_flags():
    with pytest.raises(ExportError, match="--moe-tp / --moe-ep are for mixture-of-experts checkpoints"):
        check_exportable(make_cfg("llama"), 2, "float16", moe_ep=2)


# ----------------------------------------------------------------------------- CLI on a checkpoint
@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A jmegatron MoE checkpoint (Mixtral, 2 x 64, 4 experts of 48, top-2, vocab 256) made by
    ``import-hf`` from a transformers-built model with redrawn weights, and a tokenized
    dataset of 10 random documents (no training: seconds)."""
    import transformers

    from jmegatron.data.indexed_dataset import IndexedDatasetBuilder
    from jmegatron.export.imports import import_hf

    d = tmp_path_factory.mktemp("moe_ckpt")
    conf = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=F, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                      num_local_experts=E, num_experts_per_tok=2, rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(conf).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.5 if "embed" in name else 0.125)
    model.save_pretrained(str(d / "hf"))
    import_hf(str(d / "hf"), str(d / "ckpt"))
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(d / "data.bin"))
    for _ in range(10):
        builder.add_item(rng.integers(0, 256, 300))
        builder.end_document()
    builder.finalize(str(d / "data.idx"))
    return {"ckpt": str(d / "ckpt"), "data": str(d / "data"), "dir": d}


def test_cli_export_and_check(moe_checkpoint, tmp_path, capsys):
    out = tmp_path / "trt"
    assert main(["trtllm", "--load", moe_checkpoint["ckpt"], "--tp", "2", "--moe-ep", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "MixtralForCausalLM" in printed and "moe_tp 1 x moe_ep 2" in printed and "OK: valid" in printed
    assert main(["check-trtllm", str(out)]) == 0
    # the experts of rank 1 are experts 2 and 3 of the source (Mapping.ep_experts)
    from safetensors.numpy import load_file as load_np

    hf_sd = load_np(str(moe_checkpoint["dir"] / "hf" / "model.safetensors"))
    fc = load_file(str(out / "rank1.safetensors"))["transformer.layers.1.mlp.fc.weight"].float().numpy()
    w3 = hf_sd.get("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    if w3 is None:  # transformers 5 saves the fused module layout only when asked; both are accepted
        w3 = hf_sd["model.layers.1.mlp.experts.gate_up_proj"][3, F:]
    np.testing.assert_allclose(fc[1, :F], w3, rtol=1e-3, atol=1e-3)  # float16


@pytest.mark.parametrize("args,message", [
    (["--tp", "2", "--moe-ep", "3"], "--moe-ep 3 does not divide --tp 2"),
    (["--tp", "8", "--moe-ep", "8"], "--moe-ep 8: num_moe_experts=4 is not divisible by it"),
    (["--tp", "2", "--moe-tp", "2", "--moe-ep", "2"], "--moe-tp 2 x --moe-ep 2 = 4 != --tp 2"),
])
def test_cli_bad_moe_split_exits_2_before_writing(args, message, moe_checkpoint, tmp_path, capsys):
    out = tmp_path / "trt"
    assert main(["trtllm", "--load", moe_checkpoint["ckpt"], *args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- ModelOpt PTQ


@pytest.fixture(scope="module")
def fp8(moe_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_q") / "q"
    report = quantize(moe_checkpoint["ckpt"], "fp8", moe_checkpoint["data"], str(out), calib_size=8,
                      calib_batch_size=4, calib_seq_length=64, eval_samples=8, split="6,2,2", max_new_tokens=4)
    return out, report


def test_fp8_quantizes_experts_and_leaves_routers_unquantized(fp8):
    out, report = fp8
    fp32, q = report["rows"]
    assert q["quant_algo"] == "FP8" and np.isfinite(q["ppl"]) and q["ppl"] > 1
    assert q["loss"] != fp32["loss"] and abs(q["relative_change"]) < 0.05
    model, src, info = load_quantized(str(out), "fp8")
    routers = moe_router_modules(model)
    assert routers == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    for r in routers:
        assert enabled_quantizers(model, r) == []
    experts = enabled_quantizers(model, "model.layers.1.mlp.experts")
    for e in range(E):  # one weight quantizer per expert and projection (ModelOpt's _QuantFusedExperts)
        assert f"model.layers.1.mlp.experts.gate_up_proj_weight_quantizers.{e}" in experts
        assert f"model.layers.1.mlp.experts.down_proj_weight_quantizers.{e}" in experts
    assert "model.layers.1.mlp.experts.gate_up_proj_input_quantizer" in experts
    assert enabled_quantizers(model, "model.layers.0.self_attn.q_proj")

    hf_dir = out / "fp8" / "unified_hf"
    hq = json.loads((hf_dir / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8"
    assert {"model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"} <= set(
        hq["exclude_modules"])
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        gate = f.get_tensor("model.layers.0.block_sparse_moe.gate.weight")
        w1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.2.w1.weight")
        assert gate.dtype == torch.float16 and tuple(gate.shape) == (E, 64)
        assert w1.dtype == torch.float8_e4m3fn
        assert "model.layers.0.block_sparse_moe.experts.2.w1.weight_scale" in f.keys()
    quality = (out / "quality.md").read_text()
    assert "| fp8 | FP8_DEFAULT_CFG | FP8 |" in quality


def test_qwen2_moe_router_and_shared_expert_gate_stay_unquantized():
    # Qwen2-MoE (shared expert with its sigmoid gate, a dense first layer): FP8 quantizes the
    # routed and shared experts and leaves the router and the shared-expert gate alone
    from jmegatron.export.quantize import quantize_model

    cfg = moe_cfg(moe_shared_expert_intermediate_size=32, moe_layer_freq=(0, 1))
    model = hf_model.to_hf_model(random_params(cfg, seed=1), cfg, TRUE_VOCAB)
    tokens = np.random.default_rng(0).integers(0, TRUE_VOCAB, (2, 16))
    batch = {"tokens": tokens, "position_ids": np.tile(np.arange(16), (2, 1))}
    model = quantize_model(model, "fp8", "none", [batch])
    assert moe_router_modules(model) == ["model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate"]
    for r in moe_router_modules(model):
        assert enabled_quantizers(model, r) == [], r
    assert enabled_quantizers(model, "model.layers.1.mlp.experts")
    assert enabled_quantizers(model, "model.layers.1.mlp.shared_expert.down_proj")
    assert enabled_quantizers(model, "model.layers.0.mlp.up_proj")  # the dense layer


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(16, 4, bias=False)  # a router that is an nn.Linear (transformers 4.x)
        self.w1 = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.w1(x) + self.gate(x).sum(-1, keepdim=True)


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block_sparse_moe = _Block()
        self.mlp = _Block()

    def forward(self, x):
        return self.block_sparse_moe(x) + self.mlp(x)


@pytest.mark.parametrize("keep_rules", [True, False])
def test_router_rules_disable_linear_routers(keep_rules):
    # With ModelOpt's rules the Linear routers get disabled quantizers while their neighbours'
    # are on; without them (control) the same routers are quantized.
    cfg = build_quant_config("fp8")
    if not keep_rules:
        cfg["quant_cfg"] = [e for e in cfg["quant_cfg"]
                            if e.get("quantizer_name") not in ("*block_sparse_moe.gate*", "*mlp.gate.*")]
    torch.manual_seed(0)
    model = mtq.quantize(_Toy(), cfg, forward_loop=lambda m: m(torch.randn(4, 16)))
    for block in ("block_sparse_moe", "mlp"):
        on = enabled_quantizers(model, f"{block}.gate")
        assert bool(on) != keep_rules, (block, on)
        assert any(isinstance(m, TensorQuantizer) for n, m in model.named_modules() if n.startswith(f"{block}.gate."))
        assert enabled_quantizers(model, f"{block}.w1")


def test_block_configs_refused_for_the_experts_ffn(moe_checkpoint, tmp_path):
    with pytest.raises(ExportError, match=r"moe_ffn_hidden_size \(the experts' linear_fc2 input\) = 48"):
        quantize(moe_checkpoint["ckpt"], "int4_awq", moe_checkpoint["data"], str(tmp_path / "q"))
    assert not (tmp_path / "q").exists()


def test_quantized_trtllm_export_of_moe_is_refused(fp8, tmp_path, capsys):
    out, _ = fp8
    assert main(["trtllm", "--quantized", str(out), "--out", str(tmp_path / "t")]) == 2
    assert "trtllm --quantized: this checkpoint is a mixture-of-experts model" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
