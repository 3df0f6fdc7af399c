"""python -m jmegatron.tools.model_report: parameters, FLOPs per iteration and theoretical
memory per device against values computed by hand here, pipeline stages as Megatron's
theoretical_memory_usage.py counts them, and the CLI on every ByteMLPerf config."""

import json
import pathlib

import pytest

from jmegatron.config import load_config_file
from jmegatron.reporting import flops, memory
from jmegatron.reporting.memory import ParallelLayout
from jmegatron.tools import model_report

REPO = pathlib.Path(__file__).resolve().parents[1]
BYTEMLPERF = sorted((REPO / "configs" / "bytemlperf").glob("*.py"))

# L 2, h 32, 2 heads (kv_channels 16), ffn 64, seq 16 = positions, vocab 100 -> padded 128,
# micro-batch 2, global batch 8, float32, dropout 0.1, XLA attention (so the s^2 scores are
# kept whatever the machine), learned positions, LayerNorm, biases, tied output layer.
SMALL = ["--config", "configs/gpt_tiny.py", "--config.mock_data=True", "--config.vocab_size=100",
         "--config.num_layers=2", "--config.hidden_size=32", "--config.ffn_hidden_size=64",
         "--config.num_attention_heads=2", "--config.seq_length=16", "--config.max_position_embeddings=16",
         "--config.micro_batch_size=2", "--config.global_batch_size=8",
         "--config.attention_impl=xla", "--config.matmul_impl=xla"]
L, h, ffn, a, s, V, b = 2, 32, 64, 2, 16, 128, 2
PER_LAYER_PARAMS = (2 * (2 * h)                # two LayerNorms, scale + bias
                    + (h * 3 * h + 3 * h)       # linear_qkv
                    + (h * h + h)               # linear_proj
                    + (h * ffn + ffn)           # linear_fc1
                    + (ffn * h + h))            # linear_fc2
PARAMS = V * h + s * h + L * PER_LAYER_PARAMS + 2 * h  # embeddings, positions, layers, final norm


def _small_cfg():
    from jmegatron.command_line import parse_args

    path, overrides = parse_args(SMALL)
    return load_config_file(str(REPO / path), overrides)


def _run(capsys, *argv, json_path=None):
    extra = ["--json", str(json_path)] if json_path else []
    code = model_report.main([*argv, *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_hand_counts_small_config(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert PER_LAYER_PARAMS == 8544 and PARAMS == 21_760
    code, out, err = _run(capsys, *SMALL, "--dp", "2", json_path=tmp_path / "r.json")
    assert code == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["layout"] == "tp1-dp2" and r["num_devices"] == 2 and r["padded_vocab_size"] == V
    assert r["num_microbatches"] == 2 and r["global_batch_size"] == 8  # 8 / (2 x dp 2)
    assert r["num_parameters"] == PARAMS and r["parameters_per_device"] == PARAMS
    # FLOPs: 6 per multiply-accumulate (2 x fwd+bwd 3); per token QKV 3h^2, proj h^2, MLP 2 h ffn
    # per layer and the logits h V; causal attention: QK^T and PV over half the s x s square.
    macs_per_token = L * (3 * h * h + h * h + 2 * h * ffn) + h * V
    assert macs_per_token == 20_480
    hand_flops = 6 * (8 * s * macs_per_token + 8 * L * s * s * h)
    assert hand_flops == 16_515_072 and r["flops_per_iteration"] == hand_flops
    assert r["flops_per_token"] == hand_flops / (8 * s)
    # Memory (bytes per device): float32 weights and gradient accumulator, two AdamW moments.
    m = r["memory"]
    assert (m["weights"], m["gradients"], m["optimizer_state"]) == (4 * PARAMS, 4 * PARAMS, 8 * PARAMS)
    # Activations of one micro-batch, e = 4 bytes, dropout masks 1 byte, n = s b = 32 tokens.
    e, n = 4, s * b
    replicated = n * h * (2 * e + e + e + 2 * 1)  # two norm inputs, qkv and fc1 inputs, two masks
    split = n * (e * 2 * h + e * h + e * h + e * ffn + e * ffn)  # Q,K; V; proj input; fc1 out; fc2 in
    scores = a * s * s * b * (e + 1 + e)  # softmax output, dropout mask, dropout output
    per_layer = replicated + split + scores
    assert (replicated, split, scores, per_layer) == (18_432, 32_768, 9_216, 60_416)
    embedding = 4 * n + 1 * n * h  # int32 token ids, embedding dropout mask
    output = 2 * e * n * h + 4 * n * V  # final norm and output-layer inputs, float32 logits
    assert m["activations"] == L * per_layer + embedding + output == 146_560
    assert m["total"] == 16 * PARAMS + 146_560 == 494_720
    # Megatron's formulas: 18 bytes per parameter of its count (no biases, no positions) and
    # s b h (18 + 4 ffn / h) per layer + 8 s b + s b h + 4 s b h (1 + V / h).
    megatron_params = L * (2 * h * (ffn + 2) + 2 * h * h * 2) + 2 * h + V * h
    assert r["megatron_parameters_on_most_loaded_shard"] == megatron_params == 20_800
    assert r["megatron_memory"]["weight_and_optimizer"] == 18 * megatron_params
    assert r["megatron_memory"]["activations"] == s * b * h * (18 + 4 * 2) * L + 8 * s * b + s * b * h \
        + 4 * s * b * h * (1 + V / h) == 75_008
    for text in ("parameters:            21,760", "FLOPs per iteration:   1.65151e+07", "total", "GiB"):
        assert text in out


def test_pipeline_stages_as_megatron():
    cfg = _small_cfg()
    lay = ParallelLayout(1, 1, pipeline_model_parallel_size=2)
    # Stage 0: word and position embeddings and layer 0; stage 1: layer 1, the final norm and
    # the output layer (the tied model's copy of the word embeddings).
    first = V * h + s * h + PER_LAYER_PARAMS
    last = PER_LAYER_PARAMS + 2 * h + V * h
    assert sum(memory.parameter_classes(cfg, V, 2, 0).values()) == first == 13_152
    assert sum(memory.parameter_classes(cfg, V, 2, 1).values()) == last == 12_704
    assert memory.parameters_per_device(cfg, V, lay) == max(first, last)
    est = memory.theoretical_memory(cfg, V, lay, num_microbatches=4)
    assert est.weights == 4 * first and est.optimizer_state == 8 * first
    # First stage under 1F1B: min(4 micro-batches, 2 stages) = 2 in flight of its 1 layer, the
    # embedding terms twice, no output layer.
    e, n = 4, s * b
    per_layer = 60_416
    assert est.activations == per_layer * 1 * 2 + 2 * (4 * n + n * h) == 123_136
    assert memory.theoretical_memory(cfg, V, lay, num_microbatches=1).activations == per_layer + 4 * n + n * h
    # Megatron: (T / p + V h) / tp parameters, T = transformer layers + final norm.
    T = L * (2 * h * (ffn + 2) + 2 * h * h * 2) + 2 * h
    assert memory.megatron_num_parameters_on_most_loaded_shard(cfg, V, 1, 2) == T / 2 + V * h == 12_448
    assert memory.megatron_weight_and_optimizer_memory(cfg, V, lay) == 18 * 12_448
    act = s * b * h * (18 + 4 * 2) * L + 8 * s * b * 2 + s * b * h * 2  # no output layer at p > 1
    assert memory.megatron_activation_memory(cfg, V, lay, num_microbatches=4) == act == 55_808
    assert memory.megatron_activation_memory(cfg, V, lay, num_microbatches=1) == act / 2
    with pytest.raises(ValueError, match="divide num_layers=2"):
        memory.parameter_classes(cfg, V, 3, 0)


def test_bytemlperf_345m_transcription_and_count():
    cfg = load_config_file(str(REPO / "configs" / "bytemlperf" / "gpt3_345m.py"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length,
            cfg.max_position_embeddings) == (12, 512, 8, 1024, 2048)
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.lr, cfg.min_lr, cfg.lr_warmup_fraction,
            cfg.lr_decay_iters, cfg.init_method_std, cfg.adam_beta2, cfg.weight_decay) == \
        (32, 512, 6e-5, 6e-6, 0.001, 430000, 0.006, 0.95, 0.1)
    from jmegatron.training.optimizer import lr_schedule

    lr = lr_schedule(cfg, cfg.global_batch_size)  # --lr-warmup-fraction .001 x 430000: 430 iterations
    assert float(lr(429)) < 6e-5 and float(lr(430)) == pytest.approx(6e-5)
    hh, P, VV = 512, 2048, 50304
    layer = 2 * 2 * hh + (3 * hh * hh + 3 * hh) + (hh * hh + hh) + (hh * 4 * hh + 4 * hh) + (4 * hh * hh + hh)
    assert flops.num_parameters(cfg, cfg.padded_vocab_size()) == VV * hh + P * hh + 12 * layer + 2 * hh \
        == 64_633_856
    mem = load_config_file(str(REPO / "configs" / "bytemlperf" / "gpt3_345m_memory.py"))
    assert (mem.seq_length, mem.max_position_embeddings, mem.micro_batch_size, mem.global_batch_size,
            mem.train_iters) == (32768, 32768, 4, 32, 2000)
    big = load_config_file(str(REPO / "configs" / "bytemlperf" / "gpt3_175b.py"))
    assert (big.num_layers, big.hidden_size, big.num_attention_heads, big.seq_length,
            big.micro_batch_size, big.global_batch_size) == (96, 12288, 96, 2048, 1, 1536)
    assert model_report.config_layout(str(REPO / "configs" / "bytemlperf" / "gpt3_175b.py")) == dict(
        tensor_model_parallel_size=8, pipeline_model_parallel_size=16, data_parallel_size=1)


@pytest.mark.parametrize("path", BYTEMLPERF, ids=[p.stem for p in BYTEMLPERF])
def test_cli_on_every_bytemlperf_config(path, tmp_path, capsys):
    code, out, err = _run(capsys, "--config", str(path), json_path=tmp_path / "r.json")
    assert code == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    cfg = load_config_file(str(path))
    layout = model_report.config_layout(str(path))
    assert r["num_devices"] == layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"] \
        * layout["data_parallel_size"] * layout.get("expert_model_parallel_size", 1)
    assert r["global_batch_size"] == cfg.global_batch_size
    assert f"parameters:            {r['num_parameters']:,}" in out
    assert f"FLOPs per iteration:   {r['flops_per_iteration']:.6g}" in out
    assert "theoretical memory per device" in out and f"{r['memory']['total'] / 2 ** 30:10.3f} GiB" in out
    assert r["num_parameters"] > 0 and r["flops_per_iteration"] > 0 and r["memory"]["total"] > 0


def test_175b_layout_from_config_and_flags(capsys):
    path = str(REPO / "configs" / "bytemlperf" / "gpt3_175b.py")
    code, out, err = _run(capsys, "--config", path)
    assert code == 0, err
    assert "layout tp8-pp16-dp1 (128 devices)" in out
    assert "1536 micro-batches" in out and "padded vocab 51200" in out  # 50257 -> multiple of 128 x 8
    code, out, err = _run(capsys, "--config", path, "--tp", "4", "--pp", "8", "--dp", "4", "--zero1")
    assert code == 0, err
    assert "layout tp4-pp8-dp4-zero1 (128 devices)" in out


def test_moe_config_in_a_tensor_parallel_layout(capsys):
    # a MoE config resolved at tp 1 reported at tp 4 x ep 2: the expert tensor size follows the tensor size
    # (Qwen3-30B-A3B fits 8 x 80 GB so, with selective recomputation)
    code, out, err = _run(capsys, "--config", str(REPO / "configs" / "qwen3_30b_a3b.py"), "--tp", "4", "--sp",
                          "--ep", "2", "--config.recompute_granularity=selective")
    assert code == 0, err
    assert "layout tp4-sp-ep2-dp1 (8 devices)" in out


@pytest.mark.parametrize("argv,message", [
    (["--pp", "3"], "pipeline_model_parallel_size=3 must be >= 1 and divide num_layers=2"),
    (["--cp", "0"], "--cp 0: parallel sizes must be >= 1"),
    (["--tp", "3"], "is not divisible by tensor_model_parallel_size=3"),
    (["--config.hidden_sise=4"], "hidden_sise"),
    (["--dp", "3"], "global_batch_size=8 is not divisible"),
], ids=["pp-3", "cp-0", "tp-3", "typo", "dp-3"])
def test_bad_input_exits_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out, err = _run(capsys, *SMALL, *argv)
    assert code == 2 and message in err, err


def test_context_parallel_memory_theory_by_hand(capsys):
    """ByteMLPerf's 32k memory workload at cp 1, 2, 4, 8: each device holds s b / cp tokens;
    the ring (p2p) keeps q, k, v, out and a float32 log-sum-exp per head and token instead of
    the [a, s, s] scores; the per-layer bytes equal the hand count, and model_report prints
    them per cp."""
    from jmegatron.config import load_config_file
    from jmegatron.reporting import memory

    cfg = load_config_file(str(REPO / "configs" / "bytemlperf" / "gpt3_345m_memory.py"),
                           {"mock_data": True, "vocab_size": 50257})
    s, b, h, a, F = cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads, \
        cfg.ffn_hidden_size
    e = memory.activation_bytes_per_element(cfg)
    m = 1 if cfg.hidden_dropout else 0
    per_layer = {}
    for cp in (1, 2, 4, 8):
        lay = ParallelLayout(1, 8 // cp, context_parallel_size=cp)
        n = s * b / cp
        tokens_terms = n * h * (4 * e + 2 * m) + n * (e * 2 * h + e * h + e * h + e * F + e * F)
        if cp == 1:
            m_a = 1 if cfg.attention_dropout else 0
            want = tokens_terms + a * s * s * b * (e + (m_a + e if m_a else 0))  # XLA attention's scores
        else:
            want = tokens_terms + 4 * a * n  # the ring: a float32 log-sum-exp per head and token
        per_layer[cp] = memory.activation_memory_per_layer(cfg.replace(attention_impl="xla"), b, lay)
        assert per_layer[cp] == pytest.approx(want)
        assert lay.num_devices == 8 and (f"cp{cp}" in lay.name) == (cp > 1)
    assert per_layer[2] < per_layer[1] / 20  # the s^2 scores are gone
    assert per_layer[8] == pytest.approx(per_layer[2] / 4)  # then linear in the tokens held
    assert ParallelLayout.parse("cp4-dp2") == ParallelLayout(1, 2, context_parallel_size=4)
    code, out, err = _run(capsys, "--config", str(REPO / "configs" / "bytemlperf" / "gpt3_345m_memory.py"),
                          "--config.mock_data=True", "--config.vocab_size=50257", "--cp", "4", "--dp", "2")
    assert code == 0, err
    assert "layout tp1-cp4-dp2 (8 devices)" in out and "no context-parallel term" in out
