"""FP8 into export (issue 15 item 5): an FP8-trained checkpoint's own scales -> TensorRT-LLM's
FP8 checkpoint, no calibration; checked with check-trtllm and against ModelOpt's FP8 PTQ of
the same weights.

The FP8 checkpoint is made here (the FP8 training path is not imported): a gpt_tiny-sized
Llama (GQA, SwiGLU, scanned layers) trained 2 steps, then ``fp8_meta`` subtrees added to its
four linears per layer as docs/PRECISION.md places them (stacked ``[layers, H]`` / ``[layers]``),
with amax histories of real amaxes: the float32 model run on 4 batches (input amax of each
linear recorded by hooks on the transformers model of the same weights, <= 1e-4 from
jmegatron's), the kernels' own amax, and TE's scales ``448 / amax`` (``fp8_amax_compute_algo
"max"``, margin 0).
"""

import copy
import json
import os

import jax
import numpy as np
import pytest

import modelopt  # noqa: E402,F401
import torch  # noqa: E402

from safetensors.torch import load_file  # noqa: E402

from jmegatron.conversion import hf  # noqa: E402
from jmegatron.conversion.trtllm import rank_tensors  # noqa: E402
from jmegatron.export import fp8_scales  # noqa: E402
from jmegatron.export.__main__ import main  # noqa: E402
from jmegatron.export.common import ExportError, hf_model, load_checkpoint  # noqa: E402
from jmegatron.export.fp8_scales import FP8_E4M3_MAX, checkpoint_fp8_scales  # noqa: E402
from jmegatron.export.hf_model import to_hf_model  # noqa: E402
from jmegatron.export.trtllm import export_quantized_model, trtllm_architecture, write_fp8_trtllm_checkpoint  # noqa: E402
from jmegatron.export.trtllm_check import check_trtllm_checkpoint  # noqa: E402

from test_trtllm import make_cfg  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

H = 4  # fp8_amax_history_len
VOCAB = 300
# HF Llama module -> the jmegatron FP8 linear whose input it sees
HF_INPUTS = {"self_attn.q_proj": "self_attention/linear_qkv", "self_attn.o_proj": "self_attention/linear_proj",
             "mlp.gate_proj": "mlp/linear_fc1", "mlp.down_proj": "mlp/linear_fc2"}


def batches(seed, n=1):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, VOCAB, (2, 32))) for _ in range(n)]


def input_amaxes(model, token_batches, num_layers):
    """{layer: {linear: [amax per batch]}} of the float32 transformers model's linear inputs."""
    seen = {i: {v: [] for v in HF_INPUTS.values()} for i in range(num_layers)}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name, linear in HF_INPUTS.items():
            mod = layer.get_submodule(name)
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, i=i, linear=linear: seen[i][linear].append(float(args[0].abs().max()))))
    with torch.no_grad():
        for t in token_batches:
            model(t)
    for h in hooks:
        h.remove()
    return seen


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(base, fp8): the trained checkpoint and the same state with fp8_meta added (config fp8 e4m3)."""
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.checkpoint import checkpointing
    from jmegatron.training.loop import pretrain
    from jmegatron.training.run import restore_run

    root = tmp_path_factory.mktemp("fp8x")
    base = str(root / "base")
    cfg = make_cfg("llama", vocab_size=VOCAB, train_iters=2, micro_batch_size=2, global_batch_size=2,
                   lr_warmup_iters=0, eval_interval=0, log_interval=1, peak_tflops=1.0, save=base, scan_layers=True)
    pretrain(cfg, mesh=create_mesh(cfg, jax.devices()[:1]))
    run, state, meta = restore_run(base)
    params = jax.tree.map(np.asarray, state.params)
    L = cfg.num_layers
    model = to_hf_model(params, cfg, VOCAB)
    seen = input_amaxes(model, batches(1, H), L)  # batch 0 oldest
    layers = params["decoder_layers"]
    new_layers = jax.tree.map(lambda a: a, layers)
    for path in fp8_scales.FP8_LINEARS:
        node = new_layers
        for part in path.split("/"):
            node = node[part]
        kernel_amax = np.abs(node["kernel"].reshape(L, -1)).max(axis=1).astype(np.float32)  # [L]
        in_hist = np.array([seen[i][path][::-1] for i in range(L)], np.float32)  # newest first, [L, H]
        k_hist = np.repeat(kernel_amax[:, None], H, axis=1)
        node["fp8_meta"] = {
            "input_amax_history": in_hist, "kernel_amax_history": k_hist,
            "output_grad_amax_history": np.full((L, H), 1e-3, np.float32),
            "input_scale": (FP8_E4M3_MAX / in_hist.max(axis=1)).astype(np.float32),
            "kernel_scale": (FP8_E4M3_MAX / kernel_amax).astype(np.float32),
            "output_grad_scale": np.full((L,), FP8_E4M3_MAX / 1e-3, np.float32)}
    fp8 = str(root / "fp8")
    fp8_cfg = run.cfg.replace(fp8="e4m3", fp8_amax_history_len=H, fp8_amax_compute_algo="max", fp8_margin=0,
                              save=fp8)
    ckpt = checkpointing.Checkpointer(fp8)
    ckpt.save(int(meta["iteration"]), state.replace(params=dict(params, decoder_layers=new_layers)),
              dict(meta, config=fp8_cfg.to_dict()))
    ckpt.close()
    return base, fp8


def fake_quant_logits(out, cfg, tokens):
    """Logits of the TensorRT-LLM FP8 checkpoint ``out`` (tp 1) as its engine computes them,
    in float32: weights dequantized (fp8 * weights_scaling_factor), each quantized linear's
    input cast to e4m3 with its activation_scaling_factor (x -> cast(clip(x / s)) * s)."""
    t = load_file(os.path.join(out, "rank0.safetensors"))
    nq, nkv, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels

    def deq(key):
        w = t[f"{key}.weight"]
        return w.float() * t[f"{key}.weights_scaling_factor"] if w.dtype == torch.float8_e4m3fn else w.float()

    sd = {"model.embed_tokens.weight": t["transformer.vocab_embedding.weight"].float(),
          "model.norm.weight": t["transformer.ln_f.weight"].float(), "lm_head.weight": t["lm_head.weight"].float()}
    act = {}
    for i in range(cfg.num_layers):
        o, p = f"transformer.layers.{i}", f"model.layers.{i}"
        q, k, v = torch.split(deq(f"{o}.attention.qkv"), [nq * d, nkv * d, nkv * d])
        sd.update({f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
                   f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.o_proj.weight": deq(f"{o}.attention.dense"),
                   f"{p}.mlp.gate_proj.weight": deq(f"{o}.mlp.fc"), f"{p}.mlp.up_proj.weight": deq(f"{o}.mlp.gate"),
                   f"{p}.mlp.down_proj.weight": deq(f"{o}.mlp.proj"),
                   f"{p}.input_layernorm.weight": t[f"{o}.input_layernorm.weight"].float(),
                   f"{p}.post_attention_layernorm.weight": t[f"{o}.post_layernorm.weight"].float()})
        for hf_name, trt in (("q_proj", "attention.qkv"), ("k_proj", "attention.qkv"), ("v_proj", "attention.qkv"),
                             ("o_proj", "attention.dense"), ("gate_proj", "mlp.fc"), ("up_proj", "mlp.gate"),
                             ("down_proj", "mlp.proj")):
            act[f"{p}.{'self_attn' if hf_name[0] in 'qkvo' else 'mlp'}.{hf_name}"] = \
                float(t[f"{o}.{trt}.activation_scaling_factor"])
    model = to_hf_model(hf.from_hf_state_dict(sd, cfg), cfg, VOCAB)
    for name, s in act.items():
        def quant_input(m, args, s=s):
            x = (args[0] / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * s
            return (x,) + args[1:]
        model.get_submodule(name).register_forward_pre_hook(quant_input)
    with torch.no_grad():
        return model(tokens).logits.numpy()


def held_out_loss(logits, tokens):
    lp = torch.log_softmax(torch.from_numpy(logits[:, :-1]), -1)
    return float(-lp.gather(-1, tokens[:, 1:, None]).mean())


def test_fp8_export_matches_modelopt_ptq(ckpts, tmp_path):
    """Same names, shapes and dtypes as ModelOpt's FP8 PTQ export of the same weights (tp 2);
    weight factors equal (both encode the weights' amax); activation factors within 2x
    (different data: our 4 training-like batches vs ModelOpt's one calibration batch);
    the two FP8 models' held-out losses within 1% and logits as close to each other as
    either is to float32."""
    import modelopt.torch.quantization as mtq

    from jmegatron.export.quantize import build_quant_config

    base, fp8 = ckpts
    src = load_checkpoint(fp8)
    cfg = src.cfg
    assert fp8_scales.has_fp8_meta(src.params)
    plain = fp8_scales.strip_fp8_meta(src.params)
    model = to_hf_model(plain, cfg, src.vocab_size)
    calib = batches(7)[0]
    modelopt_model = mtq.quantize(copy.deepcopy(model), build_quant_config("fp8"), lambda m: m(calib))
    ours, theirs = {}, {}
    for tp in (1, 2):
        ours[tp], theirs[tp] = str(tmp_path / f"ours{tp}"), str(tmp_path / f"modelopt{tp}")
        config = write_fp8_trtllm_checkpoint(src.params, cfg, src.vocab_size, ours[tp], tp=tp)
        their_config, _ = export_quantized_model(modelopt_model, cfg, theirs[tp], tp=tp, dtype="float16")
        assert config["quantization"] == their_config["quantization"] == {
            "quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
        for key in ("architecture", "dtype", "num_hidden_layers", "num_key_value_heads", "head_size",
                    "intermediate_size", "hidden_act", "position_embedding_type", "mapping", "vocab_size"):
            assert config[key] == their_config[key], key
        report = check_trtllm_checkpoint(ours[tp])
        assert report.ok, report.errors
    act_ratios = []
    for r in range(2):
        a, b = (load_file(os.path.join(d[2], f"rank{r}.safetensors")) for d in (ours, theirs))
        assert sorted(a) == sorted(b)
        for k in a:
            assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
            if k.endswith("weights_scaling_factor"):
                assert a[k].dtype == torch.float32
                np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-6, err_msg=k)
            elif k.endswith("activation_scaling_factor"):
                act_ratios.append(float(a[k] / b[k]))
            elif a[k].dtype == torch.float8_e4m3fn:
                # same scale (to 1e-6), so the codes agree but for round-half cases of the scale's last bit
                assert (a[k].view(torch.uint8) == b[k].view(torch.uint8)).float().mean() > 0.999, k
    print("activation factor ours / ModelOpt:", np.round(act_ratios, 3))
    assert len(act_ratios) == 2 * 2 * 5 and all(0.5 <= x <= 2.0 for x in act_ratios)

    held = batches(99)[0]
    with torch.no_grad():
        ref = model(held).logits.numpy()
    got, want = fake_quant_logits(ours[1], cfg, held), fake_quant_logits(theirs[1], cfg, held)
    err_ours, err_theirs = np.abs(got - ref).max(), np.abs(want - ref).max()
    losses = [held_out_loss(x, held) for x in (ref, got, want)]
    print(f"max |logit - fp32|: ours {err_ours:.4f}, ModelOpt {err_theirs:.4f}; ours vs ModelOpt "
          f"{np.abs(got - want).max():.4f}; held-out loss fp32 / ours / ModelOpt {np.round(losses, 5)}")
    assert 0 < err_ours <= 2 * err_theirs + 1e-6
    assert np.abs(got - want).max() <= 2 * max(err_ours, err_theirs)
    assert abs(losses[1] / losses[2] - 1) < 0.01 and abs(losses[1] / losses[0] - 1) < 0.01


def test_weights_are_the_training_forwards_fp8_codes(ckpts, tmp_path):
    """--weight-scales checkpoint writes cast(w * kernel_scale) (JAX's float8_e4m3fn cast, the
    FP8 forward's dtype) and 1/kernel_scale; --weight-scales amax writes amax(w)/448."""
    import jax.numpy as jnp

    _, fp8 = ckpts
    src = load_checkpoint(fp8)
    cfg = src.cfg
    out = str(tmp_path / "c")
    write_fp8_trtllm_checkpoint(src.params, cfg, src.vocab_size, out, tp=1)
    got = load_file(os.path.join(out, "rank0.safetensors"))
    plain = rank_tensors(fp8_scales.strip_fp8_meta(src.params), cfg, trtllm_architecture(cfg), src.vocab_size, 1, 0)
    layer = src.params["decoder_layers_1"]
    for path, names in (("self_attention/linear_qkv", ["attention.qkv"]), ("mlp/linear_fc1", ["mlp.fc", "mlp.gate"]),
                        ("mlp/linear_fc2", ["mlp.proj"])):
        node = layer
        for part in path.split("/"):
            node = node[part]
        ks = node["fp8_meta"]["kernel_scale"]
        for n in names:
            key = f"transformer.layers.1.{n}"
            w = jnp.asarray(plain[f"{key}.weight"]) * ks
            want = np.asarray(jnp.clip(w, -448, 448).astype(jnp.float8_e4m3fn)).view(np.uint8)
            assert np.array_equal(got[f"{key}.weight"].view(torch.uint8).numpy(), want), key
            assert float(got[f"{key}.weights_scaling_factor"]) == np.float32(1) / np.float32(ks)
    amax = checkpoint_fp8_scales(src.params, cfg, "amax")
    kernel = src.params["decoder_layers_0"]["self_attention"]["linear_qkv"]["kernel"]
    assert amax[0]["self_attention/linear_qkv"].weights_scaling_factor == np.float32(np.abs(kernel).max()) / 448


def test_scale_rules_from_history():
    """max / most_recent over the history, the margin, TE's fallback to the stored scale."""
    cfg = make_cfg("gpt", num_layers=1)

    def params(hist, input_scale=1.0):
        meta = {"input_amax_history": np.array(hist, np.float32), "kernel_amax_history": np.full(3, 2.0, np.float32),
                "output_grad_amax_history": np.zeros(3, np.float32), "input_scale": np.float32(input_scale),
                "kernel_scale": np.float32(224.0), "output_grad_scale": np.float32(1.0)}
        linears = {"self_attention": {"linear_qkv": {"kernel": np.ones(1), "fp8_meta": meta},
                                      "linear_proj": {"kernel": np.ones(1), "fp8_meta": meta}},
                   "mlp": {"linear_fc1": {"kernel": np.ones(1), "fp8_meta": meta},
                           "linear_fc2": {"kernel": np.ones(1), "fp8_meta": meta}}}
        return {"decoder_layers_0": linears}

    def act(p, **changes):
        return checkpoint_fp8_scales(p, cfg.replace(**changes))[0]["mlp/linear_fc2"]

    p = params([3.0, 5.0, 0.0])
    assert act(p, fp8_amax_compute_algo="max").activation_scaling_factor == np.float32(5.0 / 448)
    assert act(p, fp8_amax_compute_algo="most_recent").activation_scaling_factor == np.float32(3.0 / 448)
    assert act(p, fp8_amax_compute_algo="max", fp8_margin=1).activation_scaling_factor == np.float32(10.0 / 448)
    s = act(params([0.0, 0.0, 0.0], input_scale=448 / 7.0))
    assert s.activation_source == "stored input_scale" and np.isclose(s.activation_scaling_factor, 7 / 448)
    assert act(p).weights_scaling_factor == np.float32(1 / 224)
    # a stale kernel scale (the kernel grew after the last update) saturates, as TE's cast does
    q, saturated = fp8_scales.quantize_weight(np.array([1.0, 2.0, -3.0, 0.01], np.float32), np.float32(1 / 224),
                                              kernel_scale=np.float32(224.0))
    assert q.float().tolist() == [224.0, 448.0, -448.0, 2.25] and saturated == 1
    with pytest.raises(ExportError, match="ran no FP8 step"):
        act(params([0.0, 0.0, 0.0]))
    bad = params([1.0, 1.0, 1.0])
    del bad["decoder_layers_0"]["mlp"]["linear_fc1"]["fp8_meta"]
    with pytest.raises(ExportError, match="no decoder_layers_0/mlp/linear_fc1/fp8_meta"):
        checkpoint_fp8_scales(bad, cfg)


def test_cli_fp8_export_and_refusals(ckpts, tmp_path, capsys):
    """`trtllm --load FP8 --scales from-checkpoint` (tp 2 x pp 2) passes check-trtllm and says
    which scales it used; a checkpoint without fp8_meta is refused naming the flag and the
    fix; the plain exports of the FP8 checkpoint (trtllm unquantized, hf) keep working."""
    from jmegatron.export.convert import export_hf
    from jmegatron.training.run import restore_run

    base, fp8 = ckpts
    out = str(tmp_path / "fp8_tp2pp2")
    assert main(["trtllm", "--load", fp8, "--scales", "from-checkpoint", "--tp", "2", "--pp", "2", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "with the checkpoint's own scales" in printed and "fp8_amax_compute_algo='max', H=4" in printed
    assert "weights_scaling_factor = 1 / kernel_scale" in printed and "OK: valid TensorRT-LLM checkpoint" in printed
    c = json.load(open(os.path.join(out, "config.json")))
    assert c["quantization"]["quant_algo"] == "FP8" and c["producer"]["fp8"]["activation_scales_from"] == ["history"]
    assert load_file(os.path.join(out, "rank3.safetensors"))["transformer.layers.0.mlp.proj.weight"].dtype == \
        torch.float8_e4m3fn
    assert main(["check-trtllm", out]) == 0
    capsys.readouterr()

    never = tmp_path / "never"
    assert main(["trtllm", "--load", base, "--scales", "from-checkpoint", "--out", str(never)]) == 2
    err = capsys.readouterr().err
    assert "--scales from-checkpoint" in err and "holds no FP8 scales" in err and "--quant-cfg fp8" in err
    assert not never.exists()
    assert main(["trtllm", "--quantized", str(tmp_path), "--scales", "from-checkpoint", "--out", str(never)]) == 2
    assert "--scales from-checkpoint goes with --load" in capsys.readouterr().err

    plain = str(tmp_path / "plain")
    assert main(["trtllm", "--load", fp8, "--out", plain]) == 0
    printed = capsys.readouterr().out
    assert "note: this checkpoint was trained in FP8" in printed and "OK: valid" in printed
    a = load_file(os.path.join(plain, "rank0.safetensors"))
    assert a["transformer.layers.0.attention.qkv.weight"].dtype == torch.float16

    summary = export_hf(fp8, str(tmp_path / "hf"))
    run, state, _ = restore_run(base)  # the same weights without fp8_meta
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 32)).astype(np.int32)
    ref = np.asarray(run.model.apply({"params": state.params}, tokens))[..., :summary["vocab_size"]]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.abs(got - ref).max() <= 1e-4


def test_gpt_layout_matches_modelopt(tmp_path):
    """GPT-2 variant (LayerNorm, biases, learned positions), per-layer params with fp8_meta
    written directly: at tp 2 the same tensor names, shapes and dtypes as ModelOpt's FP8
    export of the same weights, equal weight factors, and check-trtllm passes."""
    import modelopt.torch.quantization as mtq

    from jmegatron.export.quantize import build_quant_config
    from test_trtllm import TRUE_VOCAB, random_params

    cfg = make_cfg("gpt")
    params = random_params(cfg, seed=3)
    rng = np.random.default_rng(3)
    for i in range(cfg.num_layers):
        for path in fp8_scales.FP8_LINEARS:
            node = params[f"decoder_layers_{i}"]
            for part in path.split("/"):
                node = node[part]
            amax_k = np.float32(np.abs(node["kernel"]).max())
            hist = rng.uniform(1.0, 8.0, H).astype(np.float32)
            node["fp8_meta"] = {"input_amax_history": hist, "kernel_amax_history": np.full(H, amax_k),
                                "output_grad_amax_history": np.zeros(H, np.float32),
                                "input_scale": np.float32(FP8_E4M3_MAX / hist.max()),
                                "kernel_scale": np.float32(FP8_E4M3_MAX / amax_k), "output_grad_scale": np.float32(1)}
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "modelopt")
    write_fp8_trtllm_checkpoint(params, cfg, TRUE_VOCAB, ours, tp=2)
    assert check_trtllm_checkpoint(ours).ok
    model = to_hf_model(fp8_scales.strip_fp8_meta(params), cfg, TRUE_VOCAB)
    calib = torch.from_numpy(rng.integers(0, TRUE_VOCAB, (2, 32)))
    export_quantized_model(mtq.quantize(model, build_quant_config("fp8"), lambda m: m(calib)), cfg, theirs, tp=2)
    for r in range(2):
        a, b = (load_file(os.path.join(d, f"rank{r}.safetensors")) for d in (ours, theirs))
        assert sorted(a) == sorted(b)
        for k in a:
            assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
            if k.endswith("weights_scaling_factor"):
                np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-6, err_msg=k)


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    """A tokenized prefix of random documents (ids < VOCAB) for `quantize`'s data flags."""
    from jmegatron.data.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("fp8_data") / "random")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    rng = np.random.default_rng(7)
    for _ in range(30):
        builder.add_item(rng.integers(0, VOCAB, 80))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def quantize_fp8(load, prefix, out, **kw):
    from jmegatron.export.quantize import quantize

    return quantize(load, "fp8", prefix, str(out), calib_size=4, calib_batch_size=2, calib_seq_length=32,
                    eval_samples=8, split="4,1,1", max_new_tokens=0, export_dtype="float16", **kw)


def test_unified_checkpoint_from_training_scales_matches_modelopt_and_loads_back(ckpts, token_data, tmp_path):
    """`quantize --quant-cfg fp8 --scales from-checkpoint`: ModelOpt's unified checkpoint with
    the training's own scales and no calibration. Against ModelOpt's PTQ export of the same
    weights: the same tensor names, dtypes and shapes, the same hf_quant_config.json; its
    weight_scale is 1 / kernel_scale (q/k/v and gate/up sharing one), its input_scale the
    history amax / 448 (to an ulp: ModelOpt divides the amax we set by 448), its float8 weights the training forward's codes. Read back as a
    server computes it (dequantized weights, inputs cast at input_scale), its perplexity is the
    fake-quantized model's, and check_unified finds a removed input_scale."""
    from safetensors.torch import save_file

    from jmegatron.export.unified import check_unified

    base, fp8 = ckpts
    ours = quantize_fp8(fp8, token_data, tmp_path / "ours", scales="from-checkpoint")
    ptq = quantize_fp8(fp8, token_data, tmp_path / "ptq")
    row, ptq_row = ours["rows"][1], ptq["rows"][1]
    assert row["scales"] == "from-checkpoint" and ptq_row["scales"] == "calibrate"
    for r in (row, ptq_row):  # the folder read back computes what the fake-quantized model computed
        assert abs(r["reloaded_ppl"] / r["ppl"] - 1) < 2e-3, r
    assert abs(row["ppl"] / ours["rows"][0]["ppl"] - 1) < 0.05  # FP8 costs little over fp32

    folder, ptq_folder = (str(tmp_path / d / "fp8" / "unified_hf") for d in ("ours", "ptq"))
    a, b = load_file(os.path.join(folder, "model.safetensors")), load_file(os.path.join(ptq_folder, "model.safetensors"))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in a.items()} == {k: (v.dtype, tuple(v.shape)) for k, v in b.items()}
    assert json.load(open(os.path.join(folder, "hf_quant_config.json")))["quantization"] == \
        json.load(open(os.path.join(ptq_folder, "hf_quant_config.json")))["quantization"]
    assert json.load(open(os.path.join(folder, "config.json")))["quantization_config"]["quant_method"] == "modelopt"

    src = load_checkpoint(fp8)
    scales = checkpoint_fp8_scales(src.params, src.cfg)
    weights = hf.to_hf_state_dict(fp8_scales.strip_fp8_meta(src.params), src.cfg, src.vocab_size)
    for i, linears in scales.items():
        for path, sc in linears.items():
            for name in fp8_scales.unified_modules(src.cfg, i, path):
                # (amax * 448 / 448 in float32: within an ulp)
                np.testing.assert_allclose(float(a[f"{name}.weight_scale"]), np.float32(1.0) / sc.kernel_scale,
                                           rtol=2e-7, err_msg=name)
                np.testing.assert_allclose(float(a[f"{name}.input_scale"]), sc.activation_scaling_factor, rtol=2e-7,
                                           err_msg=name)
                codes, _ = fp8_scales.quantize_weight(weights[f"{name}.weight"], None, sc.kernel_scale)
                assert torch.equal(a[f"{name}.weight"].view(torch.uint8), codes.view(torch.uint8)), name
                ratio = float(a[f"{name}.input_scale"]) / float(b[f"{name}.input_scale"])
                assert 0.5 <= ratio <= 2.0, (name, ratio)  # training amaxes vs calibration amaxes
    info = json.load(open(tmp_path / "ours" / "fp8" / "quantize_info.json"))
    assert info["scales"]["scales"] == "from-checkpoint" and info["scales"]["activation_scales_from"] == ["history"]

    assert check_unified(folder) == []
    a.pop("model.layers.0.mlp.down_proj.input_scale")
    save_file(a, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    assert any("model.layers.0.mlp.down_proj.input_scale" in p for p in check_unified(folder))


@pytest.mark.parametrize("args, match", [
    (["--quant-cfg", "fp8", "--scales", "from-checkpoint"], "holds no FP8 scales"),
    (["--quant-cfg", "int8_sq", "--scales", "from-checkpoint"], "sets the fp8 config's scales, but --quant-cfg is"),
    (["--quant-cfg", "fp8", "--scales", "from-checkpoint", "--kv-cache-quant", "fp8"], "keeps no KV-cache amax"),
])
def test_cli_from_checkpoint_refusals(ckpts, token_data, tmp_path, capsys, args, match):
    base, fp8 = ckpts
    load = base if "holds no" in match else fp8
    assert main(["quantize", "--load", load, "--calib-data", token_data, "--out", str(tmp_path / "q"), *args]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


# ----------------------------------------------------------------------------- the README's FP8 flow
# jmegatron FP8 linear -> the GPT2LMHeadModel module whose input it sees (transformers' modeling_gpt2.py)
GPT2_INPUTS = {"self_attention/linear_qkv": "attn.c_attn", "self_attention/linear_proj": "attn.c_proj",
               "mlp/linear_fc1": "mlp.c_fc", "mlp/linear_fc2": "mlp.c_proj"}


@pytest.fixture(scope="module")
def readme_fp8_run(tmp_path_factory):
    """configs/gpt_tiny.py (the GPT-2 layout: LayerNorm, GELU, biases, learned positions) shrunk
    to 2 x 64 and trained 3 steps as the README's "Precision, FP8 and GPU kernels" section trains
    it: bf16, fp8 hybrid, amax history 1024, amax algo max (mock data, ids < VOCAB)."""
    from jmegatron.config import load_config_file
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.loop import pretrain

    save = str(tmp_path_factory.mktemp("readme_fp8") / "fp8")
    cfg = load_config_file("configs/gpt_tiny.py", dict(
        mock_data=True, vocab_size=VOCAB, save=save, bf16=True, fp8="hybrid", fp8_amax_history_len=1024,
        fp8_amax_compute_algo="max", num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=2,
        seq_length=32, max_position_embeddings=32, micro_batch_size=2, global_batch_size=2, train_iters=3,
        lr_warmup_iters=0, eval_interval=0, log_interval=1, peak_tflops=1.0))
    pretrain(cfg, mesh=create_mesh(cfg, jax.devices()[:1]))
    return save


def test_readme_fp8_flow_gpt2(readme_fp8_run, token_data, tmp_path, capsys):
    """The README's commands on an FP8-trained GPT-2-layout run: `quantize --quant-cfg fp8 --scales
    from-checkpoint` writes the unified checkpoint; read back as a server reads it, its
    input_scale is each linear's training amax (max of input_amax_history) / 448 = 1 /
    input_scale of the last update, its weight_scale 1 / kernel_scale, no other module (no
    LayerNorm) carries an input scale, and its logits are the fake-quantized model's. The
    ModelOpt quantizer table goes to quant_summary.txt, not the console. `trtllm --scales
    from-checkpoint` writes the legacy FP8 checkpoint and says what it wrote."""
    from jmegatron.export.quantized import load_quantized
    from jmegatron.export.unified import unified_model

    out = tmp_path / "fp8_unified"
    assert main(["quantize", "--load", readme_fp8_run, "--quant-cfg", "fp8", "--scales", "from-checkpoint",
                 "--calib-data", token_data, "--calib-size", "4", "--calib-batch-size", "2", "--calib-seq-length",
                 "32", "--eval-samples", "4", "--split", "4,1,1", "--max-new-tokens", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TensorQuantizer(" not in printed and "16 of 51 ModelOpt quantizers enabled (8 input, 8 weight)" in printed
    table = (out / "fp8" / "quant_summary.txt").read_text()
    assert "transformer.h.0.ln_1.input_quantizer" in table and table.endswith("51 TensorQuantizers found in model\n")

    src = load_checkpoint(readme_fp8_run)
    assert src.cfg.position_embedding_type == "learned_absolute" and src.cfg.fp8 == "hybrid"
    metas = fp8_scales.layer_fp8_meta(src.params, src.cfg)
    folder = str(out / "fp8" / "unified_hf")
    model, ckpt = unified_model(folder)
    want_modules = set()
    for i in range(src.cfg.num_layers):
        for path, module in GPT2_INPUTS.items():
            name, meta = f"transformer.h.{i}.{module}", metas[i][path]
            want_modules.add(name)
            amax = np.float32(meta["input_amax_history"].max())
            assert amax > 0, (name, "the training observed no input")
            np.testing.assert_allclose(ckpt.input_scales[name], amax / np.float32(FP8_E4M3_MAX), rtol=2e-7, err_msg=name)
            np.testing.assert_allclose(ckpt.input_scales[name], 1 / meta["input_scale"], rtol=1e-6, err_msg=name)
            np.testing.assert_allclose(float(ckpt.tensors[f"{name}.weight_scale"]), 1 / meta["kernel_scale"],
                                       rtol=2e-7, err_msg=name)
    assert set(ckpt.input_scales) == want_modules

    fake, fake_src, info = load_quantized(str(out))
    assert info["scales"]["scales"] == "from-checkpoint" and info["export_dtype"] == "bfloat16"
    tokens = torch.from_numpy(np.random.default_rng(5).integers(0, VOCAB, (2, 32)))
    with torch.no_grad():
        want, got, fp32 = fake(tokens).logits, model(tokens).logits, hf_model(fake_src)(tokens).logits
    # a bf16 run's parameters survive the bf16 export, and the float8 codes and input casts are the
    # fake quantization's: the same float32 computation, while FP8 itself moves the logits
    err, fp8_effect = float((got - want).abs().max()), float((want - fp32).abs().max())
    assert err <= 1e-5 * max(1.0, float(want.abs().max())) and fp8_effect > 100 * max(err, 1e-6), (err, fp8_effect)

    trt = tmp_path / "trtllm_fp8"
    assert main(["trtllm", "--load", readme_fp8_run, "--scales", "from-checkpoint", "--out", str(trt)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {trt}" in printed and "GPTForCausalLM" in printed and "OK: valid" in printed


# the HF module (Llama's layout: Llama, Mistral, Qwen2/3, Gemma) -> the jmegatron FP8 linear whose input it sees
LLAMA_INPUTS = {"self_attn.q_proj": "self_attention/linear_qkv", "self_attn.k_proj": "self_attention/linear_qkv",
                "self_attn.v_proj": "self_attention/linear_qkv", "self_attn.o_proj": "self_attention/linear_proj",
                "mlp.gate_proj": "mlp/linear_fc1", "mlp.up_proj": "mlp/linear_fc1", "mlp.down_proj": "mlp/linear_fc2"}


def family_cfg(family, **changes):
    """A 2 x 64 config of preset ``family`` trained in FP8 (hybrid, history H, algo max)."""
    from jmegatron.config import base_config, from_configdict

    c = base_config(family)
    c.mock_data, c.vocab_size, c.fp8, c.fp8_amax_history_len, c.fp8_amax_compute_algo = True, VOCAB, "hybrid", H, "max"
    c.num_layers, c.hidden_size, c.seq_length, c.max_position_embeddings = 2, 64, 32, 32
    c.num_attention_heads, c.ffn_hidden_size = 4, 128
    for k, v in changes.items():
        setattr(c, k, v)
    return from_configdict(c)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2"])
def test_every_dense_family_takes_its_training_scales(family):
    """Each dense family's transformers model gets, on every quantized linear, the input amax of
    the jmegatron FP8 linear whose input it sees (q/k/v: linear_qkv's, gate/up: linear_fc1's)
    and the weight amax 448 / kernel_scale; no other module (GPT-2's LayerNorms included) has an
    enabled input quantizer. The training scales are drawn per layer and linear, so a
    misplaced one is caught."""
    from jmegatron.export.quantize import checkpoint_scaled_model
    from test_trtllm import random_params

    cfg = family_cfg(family)
    params = fp8_scales.strip_fp8_meta(random_params(cfg, seed=1))
    rng = np.random.default_rng(1)
    amax = {}
    for i in range(cfg.num_layers):
        for path in fp8_scales.FP8_LINEARS:
            node = params[f"decoder_layers_{i}"]
            for part in path.split("/"):
                node = node[part]
            hist = rng.uniform(1.0, 8.0, H).astype(np.float32)
            k = np.float32(rng.uniform(1.0, 4.0))
            node["fp8_meta"] = {"input_amax_history": hist, "kernel_amax_history": np.full(H, k, np.float32),
                                "output_grad_amax_history": np.ones(H, np.float32),
                                "input_scale": np.float32(FP8_E4M3_MAX / hist.max()),
                                "kernel_scale": np.float32(FP8_E4M3_MAX / k), "output_grad_scale": np.float32(1)}
            amax[i, path] = (hist.max(), k)
    model = to_hf_model(fp8_scales.strip_fp8_meta(params), cfg, VOCAB)
    model, _ = checkpoint_scaled_model(model, params, cfg)
    gpt2 = family == "gpt2"
    inputs = {v: k for k, v in GPT2_INPUTS.items()} if gpt2 else LLAMA_INPUTS
    enabled = {n.removesuffix(".input_quantizer"): m for n, m in model.named_modules()
               if n.endswith(".input_quantizer") and m.is_enabled}
    want = {f"{'transformer.h' if gpt2 else 'model.layers'}.{i}.{name}": (i, path) for i in range(cfg.num_layers)
            for name, path in inputs.items()}
    assert set(enabled) == set(want)
    for name, (i, path) in want.items():
        in_amax, k_amax = amax[i, path]
        module = model.get_submodule(name)
        np.testing.assert_allclose(float(enabled[name].amax), in_amax, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(float(module.weight_quantizer.amax), k_amax, rtol=1e-6, err_msg=name)


MOE_SIZES = {"mixtral": {}, "qwen3_moe": {},
             "deepseek_v3": dict(moe_router_num_groups=2, moe_router_group_topk=1, q_lora_rank=32, kv_lora_rank=16,
                                 qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)}


@pytest.mark.parametrize("family", list(MOE_SIZES))
def test_moe_refused_by_name_before_any_work(family, ckpts, token_data, tmp_path, capsys, monkeypatch):
    """FP8 training leaves the MoE experts unquantized, so an MoE checkpoint has no scales for
    them: `quantize` and `trtllm` refuse `--scales from-checkpoint` naming
    config.num_moe_experts and the fix, from the checkpoint's config alone (the FP8 Llama
    checkpoint's config read as this family's MoE config; reading any array fails the test)."""
    from jmegatron.export import quantize, trtllm

    cfg = family_cfg(family, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, **MOE_SIZES[family])
    with pytest.raises(ExportError, match=r"config.num_moe_experts=4: FP8 training leaves the MoE experts "
                                          r"unquantized.*--quant-cfg fp8 --calib-data PREFIX` without --scales"):
        fp8_scales.check_fp8_exportable(cfg)
    if family != "mixtral":
        return
    _, fp8 = ckpts

    def no_arrays(*args, **kwargs):
        raise AssertionError("an array was read before the refusal")

    for module in (quantize, trtllm):
        monkeypatch.setattr(module, "checkpoint_config", lambda load, iteration=None, saved=None: cfg)
        monkeypatch.setattr(module, "load_checkpoint", no_arrays)
    out = tmp_path / "q"
    assert main(["quantize", "--load", fp8, "--quant-cfg", "fp8", "--scales", "from-checkpoint", "--calib-data",
                 token_data, "--out", str(out)]) == 2
    assert "config.num_moe_experts=4: FP8 training leaves the MoE experts unquantized" in capsys.readouterr().err
    assert main(["trtllm", "--load", fp8, "--scales", "from-checkpoint", "--out", str(out)]) == 2
    assert "config.num_moe_experts=4: FP8 training leaves the MoE experts unquantized" in capsys.readouterr().err
    assert not out.exists()
