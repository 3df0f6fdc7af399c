"""issue 13 "Must show": configs/mixtral_tiny.py with expert_model_parallel_size=2 on 8
simulated devices (data 4 x expert 2, the alltoall dispatcher), end to end on Shakespeare:
trains with the CLI (the router's load-balancing loss on the console line), resumes
bit-exactly, evaluates and generates (restored onto one device, the experts unsplit), and
exports to Hugging Face (MixtralForCausalLM, logits equal to jmegatron's) and TensorRT-LLM
(tp 2 = moe_tp 1 x moe_ep 2, checked).

Kept short: 2 layers, hidden 64, 4 experts of FFN 64, seq 64, a 512-token vocabulary,
global batch 8 (1 micro-batch x 1 x dp 8), 6 iterations."""

import json
import shutil

import numpy as np
import pytest

from jmegatron.evaluate import main as evaluate_main
from jmegatron.generate import main as generate_main
from jmegatron.train import main as train_main

from conftest import REPO
from test_pipeline_e2e import cli, data, metrics  # noqa: F401  (data: the module's Shakespeare fixture)

pytestmark = pytest.mark.slow

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             seq_length=64, max_position_embeddings=64, num_moe_experts=4, moe_ffn_hidden_size=64,
             micro_batch_size=1, global_batch_size=8, train_iters=6, lr_warmup_iters=2, log_interval=1,
             eval_interval=3, eval_iters=2, save_interval=3, peak_tflops=1.0, expert_model_parallel_size=2)


def train_args(data, save):
    tok, prefix = data
    args = dict(SMALL, data_path=prefix, tokenizer_model=tok, save=str(save))
    return ["--config", str(REPO / "configs" / "mixtral_tiny.py"), *(f"--config.{k}={v}" for k, v in args.items())]


def test_mixtral_tiny_ep2_trains_resumes_evaluates_generates(data, tmp_path, capsys):  # noqa: F811
    full = tmp_path / "full"
    out = cli(["jmegatron.train", *train_args(data, full)])
    assert "mesh {'pipeline': 1, 'data': 4, 'expert': 2," in out and "x dp 8" in out
    assert "load_balancing_loss:" in out
    losses, vals = metrics(full)
    assert sorted(losses) == list(range(1, 7)) and sorted(vals) == [3, 6]
    assert losses[6] < losses[1]
    rows = [json.loads(l) for l in open(full / "metrics.jsonl") if "moe_tokens_per_expert" in l]
    tokens = np.asarray(rows[-1]["moe_tokens_per_expert"])  # [MoE layers, experts]: top-2 of 8 x 64 tokens
    assert tokens.shape == (2, 4) and np.allclose(tokens.sum(axis=1), 8 * 64 * 2)

    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "6")
    assert train_main(train_args(data, resumed)) == 0
    assert "at iteration 3" in capsys.readouterr().out
    got, got_vals = metrics(resumed)
    for it in range(4, 7):
        assert got[it] == losses[it], it  # bit-identical
    assert got_vals[6] == vals[6]

    assert evaluate_main(["--load", str(full), "--split", "valid"]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["iteration"] == 6 and np.isfinite(ev["loss"])
    assert generate_main(["--load", str(full), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--seed", "1"]) == 0
    assert "ROMEO:" in capsys.readouterr().out

    # exports: Hugging Face, with the same logits as the checkpoint's model
    import torch
    import transformers

    from jmegatron.export.__main__ import main as export_main
    from jmegatron.export.common import load_checkpoint
    from jmegatron.models.gpt import GPTModel
    from jmegatron.models.transformer_config import ModelConfig

    hf = tmp_path / "hf"
    assert export_main(["hf", "--load", str(full), "--out", str(hf)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    src = load_checkpoint(str(full))
    tokens = np.random.RandomState(0).randint(0, src.vocab_size, size=(2, 24)).astype(np.int32)
    ours = np.asarray(GPTModel(ModelConfig.from_config(src.cfg, src.padded_vocab_size)).apply(
        {"params": src.params}, tokens, deterministic=True))[..., :src.vocab_size]
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
    # TensorRT-LLM: tensor parallel 2 as two expert ranks, checked after writing
    capsys.readouterr()
    trt = tmp_path / "trtllm"
    assert export_main(["trtllm", "--load", str(full), "--tp", "2", "--moe-ep", "2", "--dtype", "bfloat16",
                        "--out", str(trt)]) == 0
    out = capsys.readouterr().out
    assert "MixtralForCausalLM" in out and "OK: valid TensorRT-LLM checkpoint" in out
    config = json.loads((trt / "config.json").read_text())
    assert config["mapping"]["moe_ep_size"] == 2 and config["moe"]["num_experts"] == 4
