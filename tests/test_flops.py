"""FLOPs, parameter counts and MFU against hand-computed values (Megatron-LM's
transformer_flops formula; see jmegatron/reporting/flops.py)."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

from jmegatron.config import load_config_file
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.reporting import flops

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _load(name, **overrides):
    return load_config_file(str(CONFIGS / name), overrides)


# ----------------------------------------------------------------- configs
def test_reference_configs_validate():
    gpt = _load("gpt3_345m.py")
    assert (gpt.num_layers, gpt.hidden_size, gpt.num_attention_heads, gpt.seq_length) == (24, 1024, 16, 1024)
    assert gpt.ffn_hidden_size == 4096 and gpt.kv_channels == 64 and gpt.num_query_groups == 16
    assert gpt.padded_vocab_size() == 50304  # 50257 -> next multiple of 128: 393 * 128
    llama = _load("llama2_7b.py")
    assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size, llama.seq_length) == (32, 4096, 11008, 4096)
    assert llama.kv_channels == 128 and llama.num_query_groups == 32
    assert llama.padded_vocab_size() == 32000  # 250 * 128: no padding at tp=1
    assert _load("llama2_7b.py", tensor_model_parallel_size=8).padded_vocab_size() == 32768  # multiple of 1024


# ------------------------------------------------------------ parameter counts
def test_num_parameters_gpt3_345m():
    cfg = _load("gpt3_345m.py")
    h, V, P, L = 1024, 50304, 1024, 24
    per_layer = (
        2 * (2 * h)               # input_layernorm + pre_mlp_layernorm, scale + bias
        + 3 * (h * h + h)         # linear_q/k/v kernels + biases
        + (h * h + h)             # linear_proj
        + (h * 4 * h + 4 * h)     # linear_fc1
        + (4 * h * h + h)         # linear_fc2
    )
    expected = V * h + P * h + L * per_layer + 2 * h
    assert expected == 354_871_296  # = HF GPT-2 medium 354,823,168 + 47 padding rows * 1024
    assert flops.num_parameters(cfg, cfg.padded_vocab_size()) == expected
    # Unpadded GPT-2 vocabulary gives Hugging Face's gpt2-medium count.
    assert flops.num_parameters(cfg, 50257) == 354_823_168


def test_num_parameters_llama2_7b():
    cfg = _load("llama2_7b.py")
    h, f, L = 4096, 11008, 32
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; two RMSNorm scales
    assert flops.num_parameters(cfg, 32000) == 32000 * h + L * per_layer + h + h * 32000 == 6_738_415_616
    assert flops.num_parameters(cfg, cfg.padded_vocab_size()) == 6_738_415_616
    # tp=8 pads the vocabulary to 32768: 768 extra rows in each of the two untied tables.
    tp8 = _load("llama2_7b.py", tensor_model_parallel_size=8)
    assert flops.num_parameters(tp8, tp8.padded_vocab_size()) == 6_738_415_616 + 2 * 768 * 4096 == 6_744_707_072


def _model_param_count(cfg, padded_vocab):
    model = GPTModel(ModelConfig.from_config(cfg, padded_vocab))
    tokens = jnp.zeros((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens))["params"]
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(shapes))


TINY = {"mock_data": True, "vocab_size": 1000}


@pytest.mark.parametrize("name,overrides", [
    ("gpt_tiny.py", {}),
    ("llama_tiny.py", {}),
    ("gpt_tiny.py", {"scan_layers": True}),
    ("gpt_tiny.py", {"untie_embeddings_and_output_weights": True, "swiglu": True}),
    ("gpt_tiny.py", {"add_bias_linear": False, "position_embedding_type": "none"}),
    ("llama_tiny.py", {"add_qkv_bias": True, "kv_channels": 48}),
    ("llama_tiny.py", {"num_query_groups": 8, "normalization": "LayerNorm"}),
    ("llama_tiny.py", {"qk_layernorm": True, "kv_channels": 48}),
    ("llama_tiny.py", {"qk_layernorm": True, "normalization": "LayerNorm"}),
    ("mixtral_tiny.py", {}),
    ("mixtral_tiny.py", {"moe_layer_freq": 2, "moe_shared_expert_intermediate_size": 96, "swiglu": False}),
    ("mixtral_tiny.py", {"moe_shared_expert_intermediate_size": 96, "moe_shared_expert_gate": True,
                         "qk_layernorm": True}),
])
def test_num_parameters_matches_model(name, overrides):
    cfg = _load(name, **TINY, **overrides)
    v = cfg.padded_vocab_size()
    assert v == 1024
    assert flops.num_parameters(cfg, v) == _model_param_count(cfg, v)


def test_num_parameters_tiny_by_hand():
    gpt = _load("gpt_tiny.py", **TINY)  # h 256, ffn 1024, 4 layers, 256 positions, tied
    h = 256
    gpt_layer = 2 * 2 * h + 4 * (h * h + h) + (h * 1024 + 1024) + (1024 * h + h)
    assert flops.num_parameters(gpt, 1024) == 1024 * h + 256 * h + 4 * gpt_layer + 2 * h == 3_487_232
    llama = _load("llama_tiny.py", **TINY)  # h 256, ffn 688, 8 heads, 2 groups, d 32, untied
    llama_layer = 2 * h + h * 8 * 32 + 2 * h * 2 * 32 + 8 * 32 * h + h * 2 * 688 + 688 * h
    assert flops.num_parameters(llama, 1024) == 2 * 1024 * h + 4 * llama_layer + h == 3_295_488


# ------------------------------------------------------------------- FLOPs
def test_flops_gpt3_345m():
    cfg = _load("gpt3_345m.py")
    B, s, h, L, ffn, V = 8, 1024, 1024, 24, 4096, 50304
    # per token: 3 (fwd+bwd) * 2 (FMA) * [L * (MLP h*ffn*2 + QKV h*3h + proj h*h) + logits h*V]
    per_token_linear = 3 * 2 * (L * (h * ffn * 2 + h * 3 * h + h * h) + h * V)
    assert per_token_linear == 2_121_007_104
    # causal core attention: 3 * 2 * L * (q * s / 2 * 2) with q = h
    per_token_attention = 3 * 2 * L * h * s
    assert per_token_attention == 150_994_944
    expected = B * s * (per_token_linear + per_token_attention)
    assert expected == 18_612_240_777_216
    got = flops.num_floating_point_operations(cfg, B, cfg.padded_vocab_size())
    assert isinstance(got, float) and got == expected
    # The closed form 72 B s L h^2 (1 + s/(12h) + V/(12 L h)) for MHA with ffn = 4h.
    assert got == pytest.approx(72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h)), rel=1e-12)
    # Megatron <= core_v0.11.0 counted the full s x s attention square.
    assert flops.num_floating_point_operations(cfg, B, V, causal=False) == B * s * (per_token_linear + 2 * per_token_attention) == 19_849_191_358_464
    assert flops.flops_per_token(cfg, V) == 2_272_002_048


def test_flops_llama2_7b():
    cfg = _load("llama2_7b.py")
    s, h, L, ffn, V = 4096, 4096, 32, 11008, 32000
    # SwiGLU: h -> 2*ffn and ffn -> h, ffn_expansion_factor 3; MHA: k and v are h wide.
    per_token_linear = 3 * 2 * (L * (h * ffn * 3 + h * (h + h + h) + h * h) + h * V)
    assert per_token_linear == 39_642_464_256
    per_token_attention = 3 * 2 * L * (h * s // 2 * 2)
    assert per_token_attention == 3_221_225_472
    assert flops.flops_per_token(cfg, V) == 42_863_689_728
    one_step = 1024 * s * (per_token_linear + per_token_attention)  # 4M-token global batch
    assert flops.num_floating_point_operations(cfg, 1024, cfg.padded_vocab_size()) == one_step == 179_783_345_280_909_312
    # The 6N approximation is within 6% here (attention adds 3.2e9 per token at s = 4096).
    assert flops.flops_per_token(cfg, V) / (6 * 6_738_415_616) == pytest.approx(1.0602, abs=1e-4)
    # tp=8 pads the logit GEMM to 32768 columns.
    assert flops.num_floating_point_operations(cfg, 1, 32768) == s * (per_token_linear + 3 * 2 * h * 768 + per_token_attention)


def test_flops_gqa_tiny():
    cfg = _load("llama_tiny.py", **TINY)  # h 256, ffn 688, L 4, 8 heads, 2 groups, d 32, s 256
    s, h, L, ffn, V = 256, 256, 4, 688, 1024
    q, kv = 8 * 32, 2 * 32
    per_token = 3 * 2 * (L * (h * ffn * 3 + h * (q + 2 * kv) + q * h) + h * V) + 3 * 2 * L * q * s
    assert per_token == 3 * 2 * (4 * (528_384 + 98_304 + 65_536) + 262_144) + 1_572_864 == 19_759_104
    assert flops.num_floating_point_operations(cfg, 3, V) == 3 * s * per_token
    # kv_channels != h / heads changes q, kv and the attention term.
    wide = _load("llama_tiny.py", **TINY, kv_channels=48)
    q, kv = 8 * 48, 2 * 48
    per_token = 3 * 2 * (L * (h * ffn * 3 + h * (q + 2 * kv) + q * h) + h * V) + 3 * 2 * L * q * s
    assert flops.num_floating_point_operations(wide, 1, V) == s * per_token


def test_flops_packed_sequences():
    cfg = _load("gpt_tiny.py", **TINY)  # h 256, ffn 1024, L 4, s 256
    h, L, V = 256, 4, 1024
    linear = 3 * 2 * (L * (h * 1024 * 2 + h * 3 * h + h * h) + h * V)
    core = 3 * 2 * L * h  # per unit of sum(L_i^2), causal
    # two documents of 100 and 156 tokens in one 256-token row with reset attention masks
    got = flops.num_floating_point_operations(cfg, 1, V, total_tokens=256, seqlen_squared_sum=100**2 + 156**2)
    assert got == 256 * linear + (100**2 + 156**2) * core
    assert got < flops.num_floating_point_operations(cfg, 1, V)


def test_mfu_and_throughput():
    assert flops.tflops_per_device(2.0e15, 2.0, 4) == 250.0
    assert flops.mfu(250.0, 1000.0) == 0.25
    with pytest.raises(ValueError):
        flops.mfu(1.0, 0.0)
    with pytest.raises(ValueError):
        flops.tflops_per_device(1.0, 0.0, 1)


# ------------------------------------------------------- theoretical memory
from jmegatron.reporting import memory  # noqa: E402
from jmegatron.reporting.memory import ParallelLayout  # noqa: E402

TP1 = ParallelLayout()


def test_parallel_layout_parse_and_name():
    lay = ParallelLayout.parse("tp2-dp4-zero1")
    assert (lay.tensor_model_parallel_size, lay.data_parallel_size, lay.use_distributed_optimizer) == (2, 4, True)
    assert lay.name == "tp2-dp4-zero1" and lay.num_devices == 8
    assert ParallelLayout.parse("dp8-fsdp").name == "tp1-dp8-fsdp"
    assert ParallelLayout.parse("tp4-sp-dp2").sequence_parallel
    with pytest.raises(ValueError, match="unknown part 'pp2'"):
        ParallelLayout.parse("tp2-pp2")
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelLayout.parse("sp-dp8")


def test_parameter_classes_gpt3_345m():
    cfg = _load("gpt3_345m.py")
    c = memory.parameter_classes(cfg, 50304)
    h, L = 1024, 24
    assert c["tensor_replicated_fsdp_sharded"] == L * 2 * h + 1024 * h == 1_097_728  # proj/fc2 biases, positions
    assert c["replicated"] == L * 2 * (2 * h) + 2 * h == 100_352  # LayerNorm scale + bias
    assert c["tensor_sharded_fsdp_replicated"] == L * (3 * h + 4 * h) == 172_032  # qkv and fc1 biases
    kernels = 50304 * h + L * (3 * h * h + h * h + 2 * 4 * h * h)
    assert c["sharded"] == kernels == 353_501_184
    assert sum(c.values()) == flops.num_parameters(cfg, 50304)


def test_state_memory_gpt3_345m():
    cfg = _load("gpt3_345m.py")
    P = 354_871_296
    s = memory.weight_and_optimizer_memory(cfg, 50304, TP1)
    # bf16: 16-bit params, float32 grads, float32 main params + m + v (Megatron's 2 + 4 + 12)
    assert (s.weights, s.gradients, s.optimizer_state) == (2 * P, 4 * P, 12 * P)
    assert s.total == 18 * P == 6_387_683_328
    f32 = memory.weight_and_optimizer_memory(cfg.replace(bf16=False), 50304, TP1)
    assert (f32.weights, f32.gradients, f32.optimizer_state) == (4 * P, 4 * P, 8 * P)  # float32 params, grads, m, v
    # tp2 x dp4 with ZeRO-1: sharded kernels and qkv/fc1 biases / 2, the rest whole; moments / 4.
    lay = ParallelLayout(2, 4, use_distributed_optimizer=True)
    per_device = 353_501_184 / 2 + 172_032 / 2 + 1_097_728 + 100_352
    assert per_device == 178_034_688
    assert memory.parameters_per_device(cfg, 50304, lay) == per_device
    z = memory.weight_and_optimizer_memory(cfg, 50304, lay)
    assert (z.weights, z.gradients, z.optimizer_state) == (2 * per_device, 4 * per_device, 12 * per_device / 4)
    # FSDP over 8: everything with a hidden axis / 8; norms and qkv/fc1 biases stay whole.
    fsdp = ParallelLayout(1, 8, use_megatron_fsdp=True)
    f = memory.parameters_per_device(cfg, 50304, fsdp)
    assert f == (353_501_184 + 1_097_728) / 8 + 172_032 + 100_352
    est = memory.theoretical_memory(cfg, 50304, fsdp)
    assert est.weights == 2 * f and est.optimizer_state == 12 * f
    assert est.fsdp_gathered == 6 * P  # the gathered bf16 weights and their whole float32 gradients
    assert memory.theoretical_memory(cfg, 50304, lay).fsdp_gathered == 0.0
    # Megatron's own figure: 18 B per parameter of its count (no biases, no position embeddings).
    megatron_params = 24 * (2 * 1024 * (4096 + 2) + 2 * 1024 ** 2 * 2) + 2 * 1024 + 1024 * 50304
    assert megatron_params == 353_601_536
    assert memory.megatron_weight_and_optimizer_memory(cfg, 50304, TP1) == 18 * megatron_params == 6_364_827_648
    assert memory.megatron_weight_and_optimizer_memory(cfg, 50304, lay) == megatron_params / 2 * (6 + 12 / 4)


def test_activation_memory_gpt3_345m_matches_korthikanti_table2():
    """bf16 (2 bytes), dropout on: exactly the paper's per-layer counts (arXiv:2205.05198 Table 2)."""
    cfg = _load("gpt3_345m.py")  # s 1024, micro-batch 4, h 1024, 16 heads
    s, b, h, a = 1024, 4, 1024, 16
    sbh, as2b = s * b * h, a * s * s * b
    per_layer = memory.activation_memory_per_layer
    assert per_layer(cfg, b, TP1) == sbh * 34 + 5 * as2b == 478_150_656
    tp2 = ParallelLayout(2, 1)
    assert per_layer(cfg, b, tp2) == sbh * (10 + 24 / 2) + 5 * as2b / 2 == 260_046_848
    sp2 = ParallelLayout(2, 1, sequence_parallel=True)
    assert per_layer(cfg, b, sp2) == sbh * 34 / 2 + 5 * as2b / 2 == 239_075_328
    assert per_layer(cfg, b, sp2, "selective") == sbh * 34 / 2 == 71_303_168
    # Megatron's compute_activation_memory (SP + selective): sbh (18 + 4 ffn / h) / t.
    assert per_layer(cfg, b, sp2, "selective") == sbh * (18 + 4 * 4096 / 1024) / 2
    assert per_layer(cfg, b, sp2, "full") == 2 * sbh / 2
    assert per_layer(cfg, b, tp2, "full") == 2 * sbh  # no SP: the layer input is replicated
    act = memory.activation_memory(cfg, 50304, TP1)
    assert act.embedding == 4 * s * b + sbh  # int32 token ids + embedding dropout mask
    assert act.output == 2 * 2 * sbh + 4 * s * b * 50304 == 840_957_952  # norm in/out + fp32 logits
    assert act.total == 24 * 478_150_656 + 4 * s * b + sbh + 840_957_952 == 12_320_784_384
    full = memory.activation_memory(cfg, 50304, TP1, recompute="full")
    assert full.layers == 24 * 2 * sbh and full.recompute_working_set == 478_150_656
    # float32 doubles every activation, not the dropout masks (1 byte).
    f32 = _load("gpt3_345m.py", bf16=False, attention_impl="xla")
    assert per_layer(f32, b, TP1) == sbh * (2 * 32 + 2) + (4 + 1 + 4) * as2b == 880_803_840
    # The CPU attention kernel keeps a float32 log-sum-exp [b, a, s] instead of the s^2 terms.
    kernel = _load("gpt3_345m.py", bf16=False, attention_impl="cpu")
    assert per_layer(kernel, b, TP1) == sbh * (2 * 32 + 2) + 4 * a * s * b
    with pytest.raises(ValueError, match="recompute"):
        per_layer(cfg, b, TP1, "everything")


def test_memory_llama2_7b():
    cfg = _load("llama2_7b.py")  # bf16, no dropout, SwiGLU, s 4096, micro-batch 1
    s, h, F, a, V = 4096, 4096, 11008, 32, 32000
    # LN inputs 4, QKV/fc1 inputs 2+2, Q K 4, V 2, proj input 2 (x sbh); gate/up 4F + product 2F (x sb);
    # softmax output 2 a s^2 b; no dropout masks.
    per_layer = 16 * s * h + 6 * s * F + 2 * a * s * s
    assert per_layer == 1_612_709_888
    assert memory.activation_memory_per_layer(cfg, 1, TP1) == per_layer
    assert memory.activation_memory_per_layer(cfg, 1, TP1, "selective") == 16 * s * h + 6 * s * F == 538_968_064
    act = memory.activation_memory(cfg, V, TP1)
    assert act.output == 2 * 2 * s * h + 4 * s * V == 591_396_864
    assert act.embedding == 4 * s  # no embedding dropout mask
    assert act.total == 32 * per_layer + 4 * s + 591_396_864
    P = 6_738_415_616
    st = memory.weight_and_optimizer_memory(cfg, V, TP1)
    assert st.total == 18 * P  # bf16 params, float32 grads, float32 main params + moments
    # Megatron counts the same 6.74e9 parameters for Llama-2-7B (no biases, rope): 18 B each.
    assert memory.megatron_weight_and_optimizer_memory(cfg, V, TP1) == 18 * P == 121_291_481_088
    # tp8 + SP (vocab padded to 32768): everything but the norms / 8.
    tp8 = _load("llama2_7b.py", tensor_model_parallel_size=8, sequence_parallel=True)
    lay = ParallelLayout.from_config(tp8, 1)
    norms = 32 * 2 * h + h
    assert memory.parameters_per_device(tp8, 32768, lay) == (6_744_707_072 - norms) / 8 + norms == 843_321_344
    est = memory.theoretical_memory(tp8, 32768, lay)
    assert est.activations == memory.activation_memory(tp8, 32768, lay).total
    assert est.total == 18 * 843_321_344 + est.activations
    assert est.to_dict()["total"] == est.total


def test_theoretical_memory_matches_state_shardings():
    """The per-device parameter count equals the bytes the real shardings put on a device."""
    import numpy as np

    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.run import build

    for name, layout in [("gpt_tiny.py", "tp2-dp4-zero1"), ("llama_tiny.py", "tp2-dp4"),
                         ("gpt_tiny.py", "tp4-dp2"), ("llama_tiny.py", "dp8-fsdp")]:
        lay = ParallelLayout.parse(layout)
        cfg = _load(name, **TINY, tensor_model_parallel_size=lay.tensor_model_parallel_size,
                    use_distributed_optimizer=lay.use_distributed_optimizer,
                    use_megatron_fsdp=lay.use_megatron_fsdp, global_batch_size=64,
                    lr_warmup_iters=0)
        run = build(cfg, create_mesh(cfg, jax.devices()[:lay.num_devices]))

        def device_bytes(tree, shardings):
            return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
                       for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))

        st = memory.weight_and_optimizer_memory(cfg, run.padded_vocab_size, lay)
        assert device_bytes(run.abstract_state.params, run.state_shardings.params) == st.weights, layout
        assert device_bytes(run.abstract_state.opt_state, run.state_shardings.opt_state) == \
            pytest.approx(st.optimizer_state, rel=1e-3), layout


# ------------------------------------------------- executed core attention
def _compiled_attention_flops(name: str, cp: int, b: int, s: int, nq: int, nkv: int, d: int) -> float:
    """XLA's cost analysis of one attention's forward + backward (a random cotangent, so
    nothing folds), summed over the ``cp`` devices of a ``context`` mesh."""
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from jmegatron.kernels.xla.attention import xla_attention
    from jmegatron.parallel.context_parallel import CP_ATTENTIONS, load_balance_index

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, s, nq, d))
    k, v = (jax.random.normal(kk, (b, s, nkv, d)) for kk in keys[1:3])
    dout = jax.random.normal(keys[3], (b, s, nq, d))
    if cp == 1:
        def attn(q, k, v):
            return xla_attention(q, k, v)
    else:
        mesh = Mesh(np.array(jax.devices()[:cp]), ("context",))
        pos = jnp.broadcast_to(jnp.asarray(load_balance_index(s, cp), jnp.int32), (b, s))
        spec = P(None, "context")

        def attn(q, k, v):
            return jax.shard_map(lambda q, k, v, p: CP_ATTENTIONS[name](q, k, v, p, "context", cp), mesh=mesh,
                                 in_specs=(spec,) * 4, out_specs=spec)(q, k, v, pos)

    def fwd_bwd(q, k, v, dout):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(dout)

    cost = jax.jit(fwd_bwd).lower(q, k, v, dout).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"] * cp  # per device under shard_map


@pytest.mark.parametrize("name,cp", [("xla", 1), ("p2p", 2), ("p2p", 4), ("all_gather", 2), ("a2a", 2)])
def test_executed_attention_fraction_matches_compiled_flops(name, cp):
    """The hardware/model ratio of core attention is what XLA compiles: the whole masked
    square for XLA, all_gather and a2a (2x Megatron's causal count), (cp + 1) / cp of it with
    the flash-style recompute for the ring. Matmuls dominate at d = 64; the softmax's and
    merges' elementwise work stays within 6%."""
    b, s, nq, nkv, d = 1, 512, 4, 2, 64
    cfg = _load("gpt_tiny.py", mock_data=True, vocab_size=512, seq_length=s, max_position_embeddings=s, num_attention_heads=nq,
                kv_channels=d, num_query_groups=nkv, bf16=False)
    megatron = flops.core_attention_flops(cfg, b) / cfg.num_layers
    assert megatron == 6 * nq * d * s * s * b  # 3 passes x 2 FLOPs x (QK^T + PV) x causal half
    predicted = flops.core_attention_executed_fraction(cfg, "xla", cp, "p2p" if name == "xla" else name)
    measured = _compiled_attention_flops(name, cp, b, s, nq, nkv, d) / megatron
    assert measured == pytest.approx(predicted, rel=0.06), (name, cp, measured, predicted)


def test_executed_attention_fraction_by_path():
    cfg = _load("gpt_tiny.py", mock_data=True, vocab_size=512, seq_length=1024, max_position_embeddings=1024, bf16=False)
    assert flops.core_attention_executed_fraction(cfg, "cpu") == pytest.approx((1 + 64 / 1024) * 7 / 6)
    assert flops.core_attention_executed_fraction(cfg.replace(bf16=True), "cpu") == 2.0  # the kernel is float32
    assert flops.core_attention_executed_fraction(cfg.replace(recompute_granularity="selective"), "xla") == 2 * 8 / 6
    assert flops.core_attention_executed_fraction(cfg, "xla", 8, "p2p") == pytest.approx(9 / 8 * 7 / 6)
    with pytest.raises(ValueError, match="attention_impl='auto'"):
        flops.core_attention_executed_fraction(cfg, "auto")
    with pytest.raises(ValueError, match="cp_comm_type"):
        flops.core_attention_executed_fraction(cfg, "xla", 2, "ring")
