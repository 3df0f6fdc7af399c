"""TensorRT-LLM checkpoints: ``python -m jmegatron.export trtllm`` and ``check-trtllm``.

The writer's output passes the checker at tp 1/2/4 (GPT and Llama-GQA with duplicated KV
heads) and with pipeline stages (pp 2, tp 2 x pp 2, even and uneven layer splits),
whose layers put back together give the tp-only export's tensors (also from a checkpoint
saved in a pipeline layout); pipeline mapping faults (global layer indices, a layer on no
stage or on two, embeddings on the wrong stage) are named; the rank shards re-assembled by
TensorRT-LLM's rules give back the Hugging Face weights exactly (in float16); the tensors
equal ModelOpt's own exporter's; corrupted checkpoints fail with the tensor or field named;
bad input stops before anything is written; quantized exports (int8_sq, int4_awq) pass the
checker.
"""

import functools
import importlib.util
import json
import os
import re
import shutil

import numpy as np
import pytest

# torch, safetensors and ModelOpt are test dependencies (pyproject.toml [test]): imported,
# not skipped, so a broken install fails here. Only TensorRT-LLM itself (an NVIDIA GPU
# package, not installable on this CPU machine) gates a test: the engine build below.
import flax.linen as nn
import jax
import jax.numpy as jnp
import safetensors.torch as safetensors_torch
import torch

from jmegatron.config import base_config, from_configdict
from jmegatron.conversion import hf
from jmegatron.conversion.trtllm import GPT, pp_layers, rank_tensors
from jmegatron.export import hf_model, quantize
from jmegatron.export.__main__ import main
from jmegatron.export.common import ExportError
from jmegatron.export.trtllm import check_exportable, export_quantized_model, fix_modelopt_config, write_trtllm_checkpoint
from jmegatron.export.trtllm_check import check_trtllm_checkpoint
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

VOCAB = 500  # config vocab (Megatron pads it to 512 rows)
TRUE_VOCAB = 497  # exported vocabulary: not a multiple of 2 or 4, so lm_head is padded per tp
load_file, save_file = safetensors_torch.load_file, safetensors_torch.save_file
HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def make_cfg(kind: str, **changes):
    c = base_config("gpt2" if kind == "gpt" else "llama")
    c.mock_data, c.vocab_size = True, VOCAB
    c.num_layers, c.hidden_size, c.seq_length, c.max_position_embeddings = 2, 64, 32, 32
    c.hidden_dropout = c.attention_dropout = 0.0
    if kind == "gpt":
        c.num_attention_heads, c.ffn_hidden_size = 4, 256
    else:  # Llama with grouped-query attention: 8 heads, 2 KV heads (duplicated at tp 4)
        c.num_attention_heads, c.num_query_groups, c.ffn_hidden_size = 8, 2, 160
    for k, v in changes.items():
        setattr(c, k, v)
    return from_configdict(c)


def random_params(cfg, seed: int = 0) -> dict:
    """The model's parameter tree (float32 numpy) with every leaf drawn at random."""
    tokens = jnp.zeros((1, cfg.seq_length), jnp.int32)
    model = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(seed), tokens))["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)


def config_of(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def errors_of(path) -> list:
    report = check_trtllm_checkpoint(str(path))
    assert not report.ok
    return report.errors


# ----------------------------------------------------------------------------- writer + checker
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_writer_output_passes_checker(kind, tp, tmp_path):
    cfg = make_cfg(kind)
    out = tmp_path / "ckpt"
    write_trtllm_checkpoint(random_params(cfg), cfg, TRUE_VOCAB, str(out), tp=tp, dtype="float16")
    assert sorted(os.listdir(out)) == ["config.json"] + [f"rank{r}.safetensors" for r in range(tp)]
    report = check_trtllm_checkpoint(str(out))
    print(report.format())
    assert report.ok, report.errors
    c = config_of(out)
    assert c["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
    assert c["vocab_size"] == TRUE_VOCAB and c["dtype"] == "float16"
    if kind == "gpt":
        assert (c["architecture"], c["position_embedding_type"], c["hidden_act"]) == (
            "GPTForCausalLM", "learned_absolute", "gelu")
    else:
        assert (c["architecture"], c["position_embedding_type"], c["hidden_act"]) == (
            "LlamaForCausalLM", "rope_gpt_neox", "silu")
        assert c["num_key_value_heads"] == 2 and c["head_size"] == 8
    lm = load_file(str(out / "rank0.safetensors"))["lm_head.weight"]
    assert lm.shape == (-(-TRUE_VOCAB // tp), 64)
    if kind == "llama" and tp == 4:  # 8 heads / 4 = 2 query heads + 1 duplicated KV head per rank
        assert load_file(str(out / "rank3.safetensors"))["transformer.layers.0.attention.qkv.weight"].shape == (
            (2 + 2) * 8, 64)
        assert any("duplicated KV heads" in c for c in report.checks)


def reassemble(out) -> dict:
    """Full float32 tensors from the rank files, concatenated by TensorRT-LLM's rules."""
    c = config_of(out)
    tp, V = c["mapping"]["tp_size"], c["vocab_size"]
    nq, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_size"]
    ranks = [{k: v.float() for k, v in load_file(os.path.join(out, f"rank{r}.safetensors")).items()}
             for r in range(tp)]

    def cat(name, dim):
        return torch.cat([R[name] for R in ranks], dim)

    full = {}
    for name in ranks[0]:
        if name.endswith(("layernorm.weight", "layernorm.bias")) or name.startswith("transformer.ln_f") or \
                name.endswith(("dense.bias", "proj.bias")):
            full[name] = ranks[0][name]
        elif name.endswith(("dense.weight", "proj.weight")):
            full[name] = cat(name, 1)
        elif name.endswith(("mlp.fc.weight", "mlp.gate.weight", "mlp.fc.bias", "mlp.gate.bias")):
            full[name] = cat(name, 0)
        elif name in ("lm_head.weight", "transformer.vocab_embedding.weight", "transformer.position_embedding.weight"):
            rows = V if name != "transformer.position_embedding.weight" else c["max_position_embeddings"]
            t = cat(name, 0) if c["use_parallel_embedding"] or name == "lm_head.weight" else ranks[0][name]
            assert not t[rows:].any(), f"{name}: padding rows must be zero"
            full[name] = t[:rows]
        elif ".attention.qkv." in name:
            q_rows, kv_rows = nq // tp * d, max(nkv // tp, 1) * d
            parts = [torch.split(R[name], [q_rows, kv_rows, kv_rows]) for R in ranks]
            owners = range(tp) if nkv >= tp else [g * (tp // nkv) for g in range(nkv)]  # one rank per KV head
            full[name] = torch.cat([torch.cat([p[0] for p in parts]), torch.cat([parts[r][1] for r in owners]),
                                    torch.cat([parts[r][2] for r in owners])])
        else:
            raise AssertionError(f"unexpected tensor {name}")
    return full


def hf_as_trtllm(sd: dict, kind: str, L: int) -> dict:
    """Hugging Face state dict -> TensorRT-LLM's full (unsplit) names and [out, in] layout."""
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()}
    out = {}
    if kind == "gpt":
        out["transformer.vocab_embedding.weight"] = t["transformer.wte.weight"]
        out["transformer.position_embedding.weight"] = t["transformer.wpe.weight"]
        for i in range(L):
            o, p = f"transformer.layers.{i}", f"transformer.h.{i}"
            for n, src in (("input_layernorm", "ln_1"), ("post_layernorm", "ln_2")):
                out[f"{o}.{n}.weight"], out[f"{o}.{n}.bias"] = t[f"{p}.{src}.weight"], t[f"{p}.{src}.bias"]
            for n, src in (("attention.qkv", "attn.c_attn"), ("attention.dense", "attn.c_proj"),
                           ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
                out[f"{o}.{n}.weight"] = t[f"{p}.{src}.weight"].T  # Conv1D is [in, out]
                out[f"{o}.{n}.bias"] = t[f"{p}.{src}.bias"]
        out["transformer.ln_f.weight"] = t["transformer.ln_f.weight"]
        out["transformer.ln_f.bias"] = t["transformer.ln_f.bias"]
        out["lm_head.weight"] = t.get("lm_head.weight", t["transformer.wte.weight"])
        return out
    out["transformer.vocab_embedding.weight"] = t["model.embed_tokens.weight"]
    for i in range(L):
        o, p = f"transformer.layers.{i}", f"model.layers.{i}"
        out[f"{o}.input_layernorm.weight"] = t[f"{p}.input_layernorm.weight"]
        out[f"{o}.post_layernorm.weight"] = t[f"{p}.post_attention_layernorm.weight"]
        out[f"{o}.attention.qkv.weight"] = torch.cat([t[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"])
        out[f"{o}.attention.dense.weight"] = t[f"{p}.self_attn.o_proj.weight"]
        out[f"{o}.mlp.fc.weight"] = t[f"{p}.mlp.gate_proj.weight"]  # silu(fc(x)) * gate(x)
        out[f"{o}.mlp.gate.weight"] = t[f"{p}.mlp.up_proj.weight"]
        out[f"{o}.mlp.proj.weight"] = t[f"{p}.mlp.down_proj.weight"]
        if f"{p}.self_attn.q_proj.bias" in t:
            out[f"{o}.attention.qkv.bias"] = torch.cat([t[f"{p}.self_attn.{n}_proj.bias"] for n in "qkv"])
            out[f"{o}.attention.dense.bias"] = t[f"{p}.self_attn.o_proj.bias"]
            for src, dst in (("gate_proj", "fc"), ("up_proj", "gate"), ("down_proj", "proj")):
                out[f"{o}.mlp.{dst}.bias"] = t[f"{p}.mlp.{src}.bias"]
    out["transformer.ln_f.weight"] = t["model.norm.weight"]
    out["lm_head.weight"] = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return out


@pytest.mark.parametrize("kind,tp,changes,dtype", [
    ("gpt", 2, {}, "float16"),
    ("gpt", 4, dict(untie_embeddings_and_output_weights=True), "bfloat16"),
    ("llama", 4, {}, "float16"),  # KV heads duplicated
    ("llama", 2, dict(untie_embeddings_and_output_weights=False, add_bias_linear=True), "float16"),
], ids=["gpt-tp2", "gpt-untied-tp4-bf16", "llama-gqa-tp4", "llama-tied-bias-tp2"])
def test_reassembled_shards_equal_hf_weights(kind, tp, changes, dtype, tmp_path):
    cfg = make_cfg(kind, **changes)
    params = random_params(cfg, seed=tp)
    write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(tmp_path / "c"), tp=tp, dtype=dtype,
                            use_parallel_embedding=(kind == "gpt"))
    got = reassemble(tmp_path / "c")
    want = hf_as_trtllm(hf.to_hf_state_dict(params, cfg, TRUE_VOCAB), kind, cfg.num_layers)
    assert sorted(got) == sorted(want)
    tdt = getattr(torch, dtype)
    for name in want:  # exact: the only change is the cast to the checkpoint dtype
        assert torch.equal(got[name], want[name].to(tdt).float()), name


def test_tensors_equal_modelopt_export(tmp_path):
    """ModelOpt's exporter on the Hugging Face model of the same weights writes the same
    tensors (GPT tp 2, Llama-GQA tp 4); its GPT config needs fix_modelopt_config, and the
    checker finds ModelOpt's rope position type inconsistent with the position table."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    for kind, tp in (("gpt", 2), ("llama", 4)):
        cfg = make_cfg(kind)
        params = random_params(cfg, seed=5)
        mine, theirs = tmp_path / f"{kind}_mine", tmp_path / f"{kind}_modelopt"
        write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(mine), tp=tp)
        export_tensorrt_llm_checkpoint(hf_model.to_hf_model(params, cfg, TRUE_VOCAB), kind, torch.float16, str(theirs),
                                       inference_tensor_parallel=tp)
        for r in range(tp):
            a, b = (load_file(str(p / f"rank{r}.safetensors")) for p in (mine, theirs))
            assert sorted(a) == sorted(b)
            for k in a:
                assert torch.equal(a[k], b[k]), (kind, r, k)
        raw = config_of(theirs)
        if kind == "gpt":
            assert raw["position_embedding_type"] == "rope_gpt_neox"  # ModelOpt's manual config path
            assert any("unexpected tensor transformer.position_embedding.weight" in e for e in errors_of(theirs))
        fixed, fixes = fix_modelopt_config(raw, cfg)
        assert ("position_embedding_type" in " ".join(fixes)) == (kind == "gpt")
        ours = config_of(mine)
        for k in ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_size", "intermediate_size", "hidden_act", "position_embedding_type",
                  "mapping", "use_parallel_embedding", "embedding_sharding_dim", "share_embedding_table"):
            assert fixed[k] == ours[k], k
        with open(theirs / "config.json", "w") as f:
            json.dump(fixed, f)
        assert check_trtllm_checkpoint(str(theirs)).ok


# ----------------------------------------------------------------------------- corrupted checkpoints
@pytest.fixture(scope="module")
def llama_tp4(tmp_path_factory):
    cfg = make_cfg("llama")
    out = tmp_path_factory.mktemp("trt") / "llama_tp4"
    write_trtllm_checkpoint(random_params(cfg), cfg, TRUE_VOCAB, str(out), tp=4)
    return out


def _edit_rank(path, rank, fn):
    f = os.path.join(path, f"rank{rank}.safetensors")
    t = load_file(f)
    fn(t)
    save_file(t, f)


def _edit_config(path, fn):
    c = config_of(path)
    fn(c)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


def _set_k_rows(t):
    w = t["transformer.layers.0.attention.qkv.weight"].clone()
    w[16:24] += 1.0  # rank 1's K rows (2 query heads x 8 = 16 rows, then K)
    t["transformer.layers.0.attention.qkv.weight"] = w


CORRUPTIONS = {
    "missing-tensor": (lambda p: _edit_rank(p, 1, lambda t: t.pop("transformer.layers.1.mlp.gate.weight")),
                       "rank1.safetensors: missing tensor transformer.layers.1.mlp.gate.weight"),
    "wrong-shape": (lambda p: _edit_rank(p, 2, lambda t: t.update({
        "transformer.layers.0.attention.qkv.weight": t["transformer.layers.0.attention.qkv.weight"][:-8].clone()})),
        "rank2.safetensors: transformer.layers.0.attention.qkv.weight has shape (24, 64), expected (32, 64)"),
    "wrong-dtype": (lambda p: _edit_rank(p, 0, lambda t: t.update(
        {"transformer.ln_f.weight": t["transformer.ln_f.weight"].float()})),
        "rank0.safetensors: transformer.ln_f.weight has dtype float32, expected float16"),
    "unexpected-tensor": (lambda p: _edit_rank(p, 3, lambda t: t.update({"transformer.extra.weight": torch.ones(2)})),
                          "rank3.safetensors: unexpected tensor transformer.extra.weight"),
    "kv-not-duplicated": (lambda p: _edit_rank(p, 1, _set_k_rows),
                          "rank1.safetensors: transformer.layers.0.attention.qkv.weight: K/V rows differ from rank0"),
    "replicated-differs": (lambda p: _edit_rank(p, 2, lambda t: t.update(
        {"transformer.ln_f.weight": t["transformer.ln_f.weight"] * 2})),
        "rank2.safetensors: transformer.ln_f.weight differs from rank0's"),
    "non-finite": (lambda p: _edit_rank(p, 0, lambda t: t.update(
        {"transformer.layers.0.mlp.proj.weight": t["transformer.layers.0.mlp.proj.weight"] * float("inf")})),
        "rank0.safetensors: transformer.layers.0.mlp.proj.weight has non-finite values"),
    "missing-rank-file": (lambda p: os.remove(os.path.join(p, "rank3.safetensors")),
                          "rank3.safetensors: missing (mapping.world_size = 4)"),
    "truncated-file": (lambda p: open(os.path.join(p, "rank0.safetensors"), "r+b").truncate(1000),
                       "rank0.safetensors: unreadable"),
    "missing-field": (lambda p: _edit_config(p, lambda c: c.pop("dtype")), "missing mandatory field 'dtype'"),
    "field-type": (lambda p: _edit_config(p, lambda c: c.update(num_key_value_heads="2")),
                   "field 'num_key_value_heads' = '2' is not int"),
    "bad-activation": (lambda p: _edit_config(p, lambda c: c.update(hidden_act="gelu_exact")),
                       "hidden_act 'gelu_exact' is not a TensorRT-LLM activation"),
    "bad-position-type": (lambda p: _edit_config(p, lambda c: c.update(position_embedding_type="learned_absolute")),
                          "LlamaForCausalLM has no position embedding table"),
    "world-size": (lambda p: _edit_config(p, lambda c: c["mapping"].update(world_size=2)),
                   "mapping.world_size = 2 != tp_size 4 x pp_size 1"),
    "tp-does-not-match-files": (lambda p: _edit_config(p, lambda c: c["mapping"].update(world_size=2, tp_size=2)),
                                "rank2.safetensors: unexpected file (mapping.world_size = 2)"),
    "quant-algo-unknown": (lambda p: _edit_config(p, lambda c: c["quantization"].update(quant_algo="INT3")),
                           "quantization.quant_algo 'INT3'"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_checkpoint_fails_naming_the_problem(case, llama_tp4, tmp_path, capsys):
    work = tmp_path / "c"
    shutil.copytree(llama_tp4, work)
    corrupt, expected = CORRUPTIONS[case]
    corrupt(str(work))
    errors = errors_of(work)
    assert any(expected in e for e in errors), errors
    assert main(["check-trtllm", str(work)]) == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and expected in printed and "INVALID" in printed


def test_quantization_fields_are_checked(llama_tp4, tmp_path):
    """A float checkpoint whose config claims FP8 fails on each linear's dtype and missing scales."""
    work = tmp_path / "c"
    shutil.copytree(llama_tp4, work)
    _edit_config(str(work), lambda c: c["quantization"].update(quant_algo="FP8"))
    errors = errors_of(work)
    assert any("rank0.safetensors: missing tensor transformer.layers.0.attention.qkv.weights_scaling_factor" in e
               for e in errors)
    assert any("transformer.layers.0.mlp.fc.weight has dtype float16, expected float8_e4m3fn or int8" in e
               for e in errors)
    assert not any("lm_head" in e for e in errors)  # lm_head may stay unquantized


def test_checker_pipeline_stages(tmp_path):
    """pp_size 2: embeddings on the first stage, ln_f and lm_head on the last, layers renumbered."""
    cfg = make_cfg("llama")
    src = tmp_path / "tp1"
    write_trtllm_checkpoint(random_params(cfg), cfg, TRUE_VOCAB, str(src), tp=1)
    full = load_file(str(src / "rank0.safetensors"))
    out = tmp_path / "pp2"
    out.mkdir()
    first = {k: v for k, v in full.items() if k.startswith(("transformer.vocab_embedding", "transformer.layers.0."))}
    last = {k.replace("layers.1.", "layers.0."): v for k, v in full.items()
            if k.startswith(("transformer.layers.1.", "transformer.ln_f", "lm_head"))}
    save_file(first, str(out / "rank0.safetensors"))
    save_file(last, str(out / "rank1.safetensors"))
    c = config_of(src)
    c["mapping"] = {"world_size": 2, "tp_size": 1, "pp_size": 2}
    with open(out / "config.json", "w") as f:
        json.dump(c, f)
    report = check_trtllm_checkpoint(str(out))
    assert report.ok, report.errors
    _edit_rank(str(out), 0, lambda t: t.update({"lm_head.weight": full["lm_head.weight"]}))
    assert any("rank0.safetensors: unexpected tensor lm_head.weight" in e for e in errors_of(out))


# ----------------------------------------------------------------------------- pipeline parallel (--pp)
def test_pp_layers_is_tensorrt_llms_split():
    """Mapping.pp_layers = torch.tensor_split(arange(L), pp)[pp_rank]: the first L % pp stages
    get one layer more."""
    for L, pp in ((4, 2), (3, 2), (7, 3), (5, 5), (8, 1)):
        want = [t.tolist() for t in torch.tensor_split(torch.arange(L), pp)]
        assert [pp_layers(L, pp, s) for s in range(pp)] == want
    assert pp_layers(7, 3, 0) == [0, 1, 2] and pp_layers(7, 3, 2) == [5, 6]
    with pytest.raises(ValueError, match="pp_size 3 must be in"):
        pp_layers(2, 3, 0)


def merge_pipeline(out) -> dict:
    """tp rank -> the tensors of its pp ranks put together, each stage's local layer
    indices mapped back to global ones by pp_layers. Fails when two stages hold one name."""
    c = config_of(out)
    tp, pp, L = c["mapping"]["tp_size"], c["mapping"]["pp_size"], c["num_hidden_layers"]
    merged = {t: {} for t in range(tp)}
    for stage in range(pp):
        layers = pp_layers(L, pp, stage)
        for t in range(tp):
            for name, v in load_file(os.path.join(out, f"rank{stage * tp + t}.safetensors")).items():
                m = re.match(r"transformer\.layers\.(\d+)\.(.*)$", name)
                if m:
                    name = f"transformer.layers.{layers[int(m[1])]}.{m[2]}"
                assert name not in merged[t], f"{name} is on two pipeline stages"
                merged[t][name] = v
    return merged


@pytest.mark.parametrize("kind,tp,pp,layers", [
    ("gpt", 1, 2, 4), ("gpt", 2, 2, 4), ("llama", 1, 2, 4), ("llama", 2, 2, 3),
], ids=["gpt-pp2", "gpt-tp2xpp2", "llama-pp2", "llama-tp2xpp2-uneven"])
def test_pipeline_export_passes_checker_and_merges_to_tp_export(kind, tp, pp, layers, tmp_path):
    cfg = make_cfg(kind, num_layers=layers)
    params = random_params(cfg, seed=layers + tp)
    out, ref = tmp_path / "pp", tmp_path / "tp_only"
    config = write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(out), tp=tp, pp=pp)
    write_trtllm_checkpoint(params, cfg, TRUE_VOCAB, str(ref), tp=tp)
    assert config["mapping"] == {"world_size": tp * pp, "tp_size": tp, "pp_size": pp} == config_of(out)["mapping"]
    assert sorted(os.listdir(out)) == ["config.json"] + [f"rank{r}.safetensors" for r in range(tp * pp)]
    report = check_trtllm_checkpoint(str(out))
    print(report.format())
    assert report.ok, report.errors
    assert any(c.startswith("pipeline mapping") for c in report.checks)
    for r in range(tp * pp):
        stage = r // tp
        names = set(load_file(str(out / f"rank{r}.safetensors")))
        assert ("transformer.vocab_embedding.weight" in names) == (stage == 0)
        assert ("transformer.position_embedding.weight" in names) == (stage == 0 and kind == "gpt")
        assert ("lm_head.weight" in names) == ("transformer.ln_f.weight" in names) == (stage == pp - 1)
        local = {int(n.split(".")[2]) for n in names if n.startswith("transformer.layers.")}
        assert local == set(range(len(pp_layers(layers, pp, stage))))  # local indices from 0
    if layers % pp:
        assert [len(pp_layers(layers, pp, s)) for s in range(pp)] == [2, 1]
        assert any("uneven pipeline split" in n for n in report.notes)
    merged = merge_pipeline(out)
    for t in range(tp):
        want = load_file(str(ref / f"rank{t}.safetensors"))
        assert sorted(merged[t]) == sorted(want)
        for name in want:
            assert torch.equal(merged[t][name], want[name]), (t, name)


@pytest.fixture(scope="module")
def llama_pp2(tmp_path_factory):
    cfg = make_cfg("llama", num_layers=4)
    out = tmp_path_factory.mktemp("trt_pp") / "llama_pp2"
    write_trtllm_checkpoint(random_params(cfg), cfg, TRUE_VOCAB, str(out), tp=1, pp=2)
    return out


def _renumber(t, mapping):
    for name in [n for n in t if n.startswith("transformer.layers.")]:
        i = int(name.split(".")[2])
        if i in mapping:
            t[name.replace(f"layers.{i}.", f"layers.{mapping[i]}.", 1)] = t.pop(name)


def _drop_layer(t, i):
    for name in [n for n in t if n.startswith(f"transformer.layers.{i}.")]:
        t.pop(name)


def _copy_layer(t, src, dst):
    for name in [n for n in t if n.startswith(f"transformer.layers.{src}.")]:
        t[name.replace(f"layers.{src}.", f"layers.{dst}.", 1)] = t[name].clone()


PP_CORRUPTIONS = {
    "global-indices": (lambda p: _edit_rank(p, 1, lambda t: _renumber(t, {1: 3, 0: 2})),
                       "rank1.safetensors: transformer.layers.{2,3} beyond the 2 layer(s) of pipeline stage 1 (global "
                       "layers 2-3): TensorRT-LLM numbers a stage's layers locally from 0 (they look like global "
                       "indices)"),
    "layer-missing": (lambda p: _edit_rank(p, 1, lambda t: _drop_layer(t, 1)),
                      "layer 3 (tp rank 0) is held by no pipeline stage (Mapping.pp_layers puts it on stage 1)"),
    "layer-twice": (lambda p: _edit_rank(p, 0, lambda t: _copy_layer(t, 1, 2)),
                    "layer 2 (tp rank 0) is held by pipeline stages [0, 1]"),
    "embedding-on-last-stage": (lambda p: _edit_rank(p, 1, lambda t: t.update(
        {"transformer.vocab_embedding.weight": torch.zeros(TRUE_VOCAB, 64, dtype=torch.float16)})),
        "rank1.safetensors: unexpected tensor transformer.vocab_embedding.weight"),
    "embedding-missing": (lambda p: _edit_rank(p, 0, lambda t: t.pop("transformer.vocab_embedding.weight")),
                          "rank0.safetensors: missing tensor transformer.vocab_embedding.weight"),
    "lm-head-missing": (lambda p: _edit_rank(p, 1, lambda t: t.pop("lm_head.weight")),
                        "rank1.safetensors: missing tensor lm_head.weight"),
    "pp-larger-than-layers": (lambda p: _edit_config(p, lambda c: c["mapping"].update(world_size=5, pp_size=5)),
                              "mapping.pp_size 5 > num_hidden_layers 4"),
}


@pytest.mark.parametrize("case", sorted(PP_CORRUPTIONS))
def test_pipeline_mapping_errors_are_named(case, llama_pp2, tmp_path):
    work = tmp_path / "c"
    shutil.copytree(llama_pp2, work)
    assert check_trtllm_checkpoint(str(work)).ok
    corrupt, expected = PP_CORRUPTIONS[case]
    corrupt(str(work))
    errors = errors_of(work)
    assert any(expected in e for e in errors), errors


def test_bad_pp_fails_before_writing(tmp_path):
    out = tmp_path / "never"
    gpt = make_cfg("gpt")  # 2 layers
    params = random_params(gpt)
    for pp, message in ((0, r"--pp 0: the pipeline parallel size must be an integer >= 1"),
                        (3, r"--pp 3: num_layers=2 cannot fill 3 pipeline stages .*use --pp 1\.\.2")):
        with pytest.raises(ExportError, match=message):
            write_trtllm_checkpoint(params, gpt, TRUE_VOCAB, str(out), tp=1, pp=pp)
    with pytest.raises(ValueError, match=r"rank=4 must be in \[0, tp \* pp = 4\)"):
        rank_tensors(params, gpt, GPT, TRUE_VOCAB, 2, 4, pp=2)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- bad input
def test_bad_tp_and_architecture_fail_before_writing(tmp_path):
    out = tmp_path / "never"
    gpt = make_cfg("gpt")
    with pytest.raises(ExportError, match=r"--tp 3: num_attention_heads=4 is not divisible by --tp 3.*\[1, 2, 4\]"):
        write_trtllm_checkpoint(random_params(gpt), gpt, TRUE_VOCAB, str(out), tp=3)
    llama = make_cfg("llama", num_attention_heads=12, num_query_groups=3, hidden_size=96)
    with pytest.raises(ExportError, match="num_query_groups=3: --tp 2 must divide it, or be a multiple of it"):
        check_exportable(llama, 2, "float16")
    bad = make_cfg("gpt", normalization="RMSNorm")
    with pytest.raises(ExportError, match="no TensorRT-LLM target.*normalization='RMSNorm'"):
        write_trtllm_checkpoint(random_params(bad), bad, TRUE_VOCAB, str(out), tp=1)
    with pytest.raises(ExportError, match="--dtype 'float32'"):
        check_exportable(gpt, 1, "float32")
    for changes, named in ((dict(qk_layernorm=True), "qk_layernorm=True"), (dict(rope_scaling=True), "rope_scaling=True"),
                           (dict(add_bias_linear=False, add_qkv_bias=True), "add_qkv_bias=True without")):
        new = make_cfg("llama", **changes)
        with pytest.raises(ExportError, match=f"trtllm: .*{named}.*TensorRT-LLM legacy checkpoint"):
            write_trtllm_checkpoint(random_params(new), new, TRUE_VOCAB, str(out), tp=1)
    assert not out.exists() and os.listdir(tmp_path) == []  # no staging folder left behind either


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A jmegatron checkpoint: GPT 2 x 64, vocab 300 (padded 384), 2 iterations on mock data."""
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.loop import pretrain

    d = tmp_path_factory.mktemp("trt_src") / "ckpt"
    cfg = make_cfg("gpt", vocab_size=300, train_iters=2, micro_batch_size=2, global_batch_size=2, lr_warmup_iters=0,
                   eval_interval=0, log_interval=1, peak_tflops=1.0, save=str(d))
    pretrain(cfg, mesh=create_mesh(cfg, jax.devices()[:1]))
    return str(d)


def test_cli_export_and_check(trained, tmp_path, capsys):
    out = str(tmp_path / "tp2")
    assert main(["trtllm", "--load", trained, "--tp", "2", "--dtype", "bfloat16", "--out", out]) == 0
    assert "OK: valid TensorRT-LLM checkpoint" in capsys.readouterr().out
    c = config_of(out)
    assert c["dtype"] == "bfloat16" and c["vocab_size"] == 300 and c["producer"]["iteration"] == 2
    assert main(["check-trtllm", out]) == 0
    printed = capsys.readouterr().out
    assert "rank1.safetensors" in printed and "bfloat16 x" in printed and "OK: valid" in printed
    # replicated embeddings: full [300, 64] table on every rank
    out2 = str(tmp_path / "replicated")
    assert main(["trtllm", "--load", trained, "--tp", "2", "--no-parallel-embedding", "--out", out2]) == 0
    assert load_file(os.path.join(out2, "rank1.safetensors"))["transformer.vocab_embedding.weight"].shape == (300, 64)


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "error: --tp 3: num_attention_heads=4 is not divisible by --tp 3"),
    (["--tp", "0"], "error: --tp 0: the tensor parallel size must be an integer >= 1"),
    (["--quant-cfg", "int8_sq"], "error: --quant-cfg goes with --quantized"),
    (["--pp", "0"], "error: --pp 0: the pipeline parallel size must be an integer >= 1"),
    (["--pp", "3"], "error: --pp 3: num_layers=2 cannot fill 3 pipeline stages"),
], ids=["tp-3", "tp-0", "quant-cfg-without-quantized", "pp-0", "pp-3"])
def test_cli_bad_input_exits_2_before_writing(args, message, trained, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["trtllm", "--load", trained, "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_pipeline_export_from_any_layout(trained, tmp_path, capsys):
    """`trtllm --tp 2 --pp 2` from a per-layer checkpoint and from the same state saved as a
    pp=2 run saves it (stacked, pipeline config): the same rank files, which pass the checker.
    --pp with --quantized is refused before anything is read."""
    from jmegatron.checkpoint import checkpointing
    from jmegatron.checkpoint.layout import LayerLayout, convert_layers
    from jmegatron.training.run import restore_run

    run, state, meta = restore_run(trained)
    pp_dir = tmp_path / "pp_ckpt"
    pp_cfg = run.cfg.replace(pipeline_model_parallel_size=2, save=str(pp_dir))
    ckpt = checkpointing.Checkpointer(str(pp_dir))
    ckpt.save(int(meta["iteration"]), convert_layers(jax.device_get(state), LayerLayout(False), LayerLayout(True, 2, 1),
                                                     run.cfg.num_layers), dict(meta, config=pp_cfg.to_dict()))
    ckpt.close()
    outs = {}
    for name, load in (("per_layer", trained), ("pp_layout", str(pp_dir))):
        outs[name] = str(tmp_path / name)
        assert main(["trtllm", "--load", load, "--tp", "2", "--pp", "2", "--out", outs[name]]) == 0
        printed = capsys.readouterr().out
        assert "world_size 4 = tp 2 x pp 2" in printed and "OK: valid TensorRT-LLM checkpoint" in printed
    assert config_of(outs["pp_layout"])["mapping"] == {"world_size": 4, "tp_size": 2, "pp_size": 2}
    for r in range(4):
        a, b = (load_file(os.path.join(outs[n], f"rank{r}.safetensors")) for n in ("per_layer", "pp_layout"))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), r
    assert main(["trtllm", "--quantized", str(tmp_path / "absent"), "--pp", "2", "--out", str(tmp_path / "q")]) == 2
    assert "error: --pp 2 is not available with --quantized" in capsys.readouterr().err


def test_cli_refuses_non_empty_out(trained, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert main(["trtllm", "--load", trained, "--out", str(tmp_path)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_build_engine_without_tensorrt_llm_stops(trained, tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec  # tensorrt_llm made unimportable, so this runs everywhere
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "tensorrt_llm" else find_spec(name, *a, **k))
    out = tmp_path / "never"
    assert main(["trtllm", "--load", trained, "--out", str(out), "--build-engine"]) == 2
    err = capsys.readouterr().err
    assert "--build-engine runs `trtllm-build`, which needs TensorRT-LLM" in err and "tensorrt_llm" in err
    assert not out.exists()


@pytest.mark.skipif(not HAS_TRTLLM, reason="tensorrt_llm is not importable here (TensorRT-LLM needs an NVIDIA GPU "
                                           "and its wheels); --build-engine cannot run trtllm-build")
def test_build_engine(trained, tmp_path):
    out = tmp_path / "ckpt"
    assert main(["trtllm", "--load", trained, "--out", str(out), "--build-engine"]) == 0
    assert (out / "engine" / "rank0.engine").is_file()


# ----------------------------------------------------------------------------- quantized (ModelOpt)
@functools.lru_cache(maxsize=None)
def _fake_quantized(kind: str, qformat: str, kv_cache: str = "none", seed: int = 0):
    """(model, cfg): the transformers model of random weights, fake-quantized by ModelOpt with
    ``quantize``'s config (output layer left unquantized) and calibrated on random tokens
    (hidden 128 so AWQ's 128-wide blocks fit)."""
    import modelopt.torch.quantization as mtq
    from jmegatron.export.quantize import build_quant_config

    cfg = make_cfg(kind, hidden_size=128, ffn_hidden_size=256)
    model = hf_model.to_hf_model(random_params(cfg, seed), cfg, TRUE_VOCAB)
    tokens = torch.from_numpy(np.random.default_rng(seed).integers(0, TRUE_VOCAB, (4, 32)))

    def loop(m):
        m(tokens)

    return mtq.quantize(model, build_quant_config(qformat, kv_cache), loop), cfg


@pytest.mark.parametrize("kind,qformat,kv_cache,tp,algo", [
    ("gpt", "int8_sq", "none", 2, "W8A8_SQ_PER_CHANNEL"),
    ("llama", "int4_awq", "none", 1, "W4A16_AWQ"),
    ("llama", "fp8", "fp8", 2, "FP8"),
], ids=["gpt-int8_sq-tp2", "llama-int4_awq-tp1", "llama-fp8-fp8kv-tp2"])
def test_quantized_export_passes_checker(kind, qformat, kv_cache, tp, algo, tmp_path):
    model, cfg = _fake_quantized(kind, qformat, kv_cache)
    out = tmp_path / "q"
    config, fixes = export_quantized_model(model, cfg, str(out), tp=tp, dtype="float16")
    print(fixes)
    assert config["quantization"]["quant_algo"] == algo
    assert config["quantization"]["kv_cache_quant_algo"] == (None if kv_cache == "none" else "FP8")
    assert "rank" not in config and (kind != "gpt" or config["position_embedding_type"] == "learned_absolute")
    report = check_trtllm_checkpoint(str(out))
    print(report.format())
    assert report.ok, report.errors
    r0 = load_file(str(out / "rank0.safetensors"))
    dense = r0["transformer.layers.0.attention.dense.weight"]
    assert dense.dtype == (torch.float8_e4m3fn if qformat == "fp8" else torch.int8)
    assert r0["lm_head.weight"].dtype == torch.float16
    # a missing scaling factor is named
    scale = "transformer.layers.1.mlp.fc.weights_scaling_factor"
    assert scale in r0
    _edit_rank(str(out), 0, lambda t: t.pop(scale))
    assert any(f"rank0.safetensors: missing tensor {scale}" in e for e in errors_of(out))


def test_quantized_layout_modelopt_refuses_is_a_clear_error(tmp_path):
    """AWQ at tp 2: 64 input features per rank of attention.dense cannot hold 128-wide groups."""
    model, cfg = _fake_quantized("llama", "int4_awq", "none")
    out = tmp_path / "never"
    with pytest.raises(ExportError, match="ModelOpt cannot export this quantized model at --tp 2: .*block size 128"):
        export_quantized_model(model, cfg, str(out), tp=2)
    assert os.listdir(tmp_path) == []


def test_cli_quantized_end_to_end(trained, tmp_path, capsys):
    """`quantize` (int8_sq, calibrated on a small MMIDIDX file) then `trtllm --quantized`."""
    from jmegatron.data.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    prefix = str(tmp_path / "tokens")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(24):
        builder.add_item(rng.integers(0, 300, 200))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    qdir = tmp_path / "quantized"
    quantize.quantize(trained, "int8_sq", prefix, str(qdir), calib_size=4, calib_batch_size=4, calib_seq_length=32,
                      eval_samples=4, split="4,1,1", max_new_tokens=0)
    out = tmp_path / "trt"
    assert main(["trtllm", "--quantized", str(qdir), "--tp", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "config.json fix: position_embedding_type 'rope_gpt_neox' -> 'learned_absolute'" in printed
    assert "OK: valid TensorRT-LLM checkpoint" in printed
    c = config_of(out)
    assert c["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL" and c["mapping"]["tp_size"] == 2
    assert c["producer"]["iteration"] == 2
