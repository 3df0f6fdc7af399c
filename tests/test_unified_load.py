"""ModelOpt's unified checkpoint read back (export.unified) and loaded where users look
(``--load`` of evaluate / generate / serve through export.imports.checkpoint_of;
``export check-unified``): against ModelOpt's own fake-quantized model of the same weights."""

import copy
import json
import pathlib

import modelopt.torch.quantization as mtq
import numpy as np
import pytest
import torch
import transformers
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers
from safetensors.torch import load_file, save_file

from jmegatron.export.__main__ import main
from jmegatron.export.common import ExportError
from jmegatron.export.imports import checkpoint_of
from jmegatron.export.quantize import quantize_model
from jmegatron.export.unified import read_unified, unified_model

VOCAB, SEQ = 256, 32
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (4, SEQ)).astype(np.int64)
# one family per format: FP8 and INT8 SmoothQuant on GPT-2's layout (fused c_attn, Conv1D),
# INT4 AWQ on Llama's (separate q/k/v, gate/up: AWQ's shared pre_quant_scale); NVFP4 and
# W4A8 AWQ for the refusals
CASES = [("gpt2", "fp8"), ("gpt2", "int8_sq"), ("gpt2", "nvfp4"), ("llama", "int4_awq"), ("llama", "w4a8_awq")]


def hf_config(family):
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    if family == "gpt2":
        c = transformers.GPT2Config(n_positions=SEQ, n_embd=128, n_layer=2, n_head=4, **common)
    else:
        c = transformers.LlamaConfig(max_position_embeddings=SEQ, hidden_size=128, intermediate_size=256,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **common)
    c.architectures = ["GPT2LMHeadModel" if family == "gpt2" else "LlamaForCausalLM"]
    return c


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per case: the unified folder ModelOpt writes (float32); ModelOpt's fake-quantized model
    as exported (after its export-time fusion of q/k/v and gate/up input scales) with its
    logits [4, SEQ, VOCAB], and each quantized linear's input in it; the unquantized logits.
    Eager attention on both sides."""
    out = {}
    calib = [{"tokens": TOKENS, "position_ids": np.broadcast_to(np.arange(SEQ), TOKENS.shape).astype(np.int64)}]
    ids = torch.from_numpy(TOKENS)
    for family in ("gpt2", "llama"):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager").eval()
        with torch.no_grad():
            plain = base(ids).logits.numpy()
        ref_dir = tmp_path_factory.mktemp(f"{family}_ref")
        base.save_pretrained(ref_dir)
        for fam, name in CASES:
            if fam != family:
                continue
            if name == "nvfp4":  # not a --quant-cfg of quantize; ModelOpt's config as is
                q = mtq.quantize(copy.deepcopy(base), copy.deepcopy(mtq.NVFP4_DEFAULT_CFG), forward_loop=lambda m: m(ids))
            else:
                q = quantize_model(copy.deepcopy(base), name, "none", calib)
            folder = tmp_path_factory.mktemp(f"{family}_{name}")
            if name in ("nvfp4", "w4a8_awq"):  # refused; ModelOpt's NVFP4 fake quantization runs on CUDA only
                with torch.inference_mode():
                    export_hf_checkpoint(q, dtype=torch.float32, export_dir=str(folder))
                out[family, name] = {"folder": str(folder)}
                continue
            fused = copy.deepcopy(q)
            requantize_resmooth_fused_llm_layers(fused)
            inputs, fm = {}, dict(fused.named_modules())
            hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: inputs.__setitem__(n, args[0].detach().clone()))
                     for n, m in fm.items() if hasattr(m, "weight_quantizer") and m.weight_quantizer.is_enabled]
            with torch.no_grad():
                fake = fused(ids).logits.numpy()
            for h in hooks:
                h.remove()
            with torch.inference_mode():
                export_hf_checkpoint(q, dtype=torch.float32, export_dir=str(folder))
            out[family, name] = {"folder": str(folder), "fake": fake, "plain": plain, "reference": str(ref_dir),
                                 "fused": fused, "inputs": inputs}
    return out


def test_no_input_quantizer_outside_linears(folders):
    """build_quant_config leaves ModelOpt's LayerNorm input quantizers (GPT-2's ln_*) disabled,
    also with megatron-core imported (jmegatron.export.__main__): no export writes their scale."""
    import megatron.core  # noqa: F401

    for key in (("gpt2", "fp8"), ("gpt2", "int8_sq")):
        on = [n for n, m in folders[key]["fused"].named_modules()
              if n.endswith("input_quantizer") and m.is_enabled
              and not hasattr(folders[key]["fused"].get_submodule(n.rsplit(".", 1)[0]), "weight_quantizer")]
        assert on == [], (key, on)


@pytest.mark.parametrize("family, name", [("gpt2", "fp8"), ("gpt2", "int8_sq"), ("llama", "int4_awq")])
def test_reader_computes_the_fake_quantized_linears(folders, family, name):
    """Each quantized linear of unified_model (dequantized weight; input times pre_quant_scale,
    cast to the format's grid at input_scale), fed the input ModelOpt's fake-quantized linear saw,
    gives that linear's output: at least 98% of the outputs agree to 1e-5 of the output's range.
    The rest sit on an E4M3 rounding boundary, where a 1-ulp float32 difference (x / input_scale
    against ModelOpt's x * (448 / amax)) picks the neighbouring code; an input left uncast moves
    almost every output by the quantization error."""
    f = folders[family, name]
    model, ckpt = unified_model(f["folder"])
    reader = dict(model.named_modules())
    fake = dict(f["fused"].named_modules())
    assert sorted(f["inputs"]) == sorted(ckpt.input_quant)
    for module, x in f["inputs"].items():
        with torch.no_grad():
            want, got = fake[module](x), reader[module](x)
        off = ((got - want).abs() > 1e-5 * want.abs().max()).float().mean().item()
        assert off < 0.02, (family, name, module, off)
    with torch.no_grad():
        logits = model(torch.from_numpy(TOKENS)).logits.numpy()
    assert (logits.argmax(-1) == f["fake"].argmax(-1)).mean() > 0.97


@pytest.mark.parametrize("family, name", [("gpt2", "fp8"), ("llama", "int4_awq")])
def test_load_through_checkpoint_of(folders, family, name):
    """The folder as ``--load`` (checkpoint_of: the import evaluate / generate / serve run):
    jmegatron's model (FP8 linears at the folder's scales; W4A16 dequantized with its
    pre_quant_scale folded) gives the fake-quantized logits: the median difference is a
    twentieth of the quantization's own (unquantized against fake-quantized), the greedy
    tokens agree."""
    import jax

    from jmegatron.training.run import restore_run_params

    f = folders[family, name]
    with checkpoint_of(f["folder"]) as load:
        run, params, _ = restore_run_params(load)
        assert (run.cfg.fp8 == "e4m3") == (name == "fp8")
        logits = np.asarray(jax.jit(lambda p, t: run.model.apply({"params": p}, t))(params, TOKENS))[..., :VOCAB]
    effect = np.median(np.abs(f["plain"] - f["fake"]))
    diff = np.median(np.abs(logits - f["fake"]))
    assert diff < effect / 20, (family, name, diff, effect)
    assert (logits.argmax(-1) == f["fake"].argmax(-1)).mean() > 0.97


def test_refused_by_name(folders):
    """Activation formats jmegatron's model does not compute are refused at --load naming the
    format and check-unified; formats the reader does not decode are refused by it."""
    for name, algo in (("int8_sq", "W8A8_SQ_PER_CHANNEL"), ("nvfp4", "NVFP4")):
        with pytest.raises(ExportError, match=f"{algo}.*check-unified"):
            with checkpoint_of(folders["gpt2", name]["folder"]):
                pass
    with pytest.raises(ExportError, match="quant_algo 'W4A8_AWQ' is not read back"):
        read_unified(folders["llama", "w4a8_awq"]["folder"])


def test_check_unified_cli(folders, tmp_path, capsys):
    """check-unified: no problems and near-full agreement for a good folder, its largest logit
    difference that of the quantization; a missing input_scale is refused by name (exit 2)."""
    f = folders["gpt2", "fp8"]
    assert main(["check-unified", "--load", f["folder"], "--reference", f["reference"], "--samples", "4",
                 "--seq-length", str(SEQ), "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["problems"] == [] and r["quant_algo"] == "FP8" and r["agreement"] > 0.9
    np.testing.assert_allclose(r["max_logit_diff"], np.abs(f["plain"] - f["fake"]).max(), rtol=0.5)

    bad = tmp_path / "bad"
    bad.mkdir()
    for p in pathlib.Path(f["folder"]).iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    t = load_file(str(bad / "model.safetensors"))
    t.pop("transformer.h.1.attn.c_proj.input_scale")
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert main(["check-unified", "--load", str(bad)]) == 2
    assert "c_proj.input_scale is missing" in capsys.readouterr().err
