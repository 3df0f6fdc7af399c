"""The MoE configs (configs/mixtral_8x7b.py, configs/bytemlperf/moe.py, ds_like_2node.py,
ds_like_4node.py): they load and validate with their scripts' values, what this build
refuses is refused naming the field, and their parameters, FLOPs and theoretical memory
equal the counts worked out by hand below (issue 13 item 5)."""

import json
import pathlib

from jmegatron.config import load_config_file
from jmegatron.reporting import flops, memory
from jmegatron.reporting.memory import ParallelLayout
from jmegatron.tools import model_report

REPO = pathlib.Path(__file__).resolve().parents[1]
MIXTRAL = str(REPO / "configs" / "mixtral_8x7b.py")
MOE = str(REPO / "configs" / "bytemlperf" / "moe.py")
DS2 = str(REPO / "configs" / "bytemlperf" / "ds_like_2node.py")
DS4 = str(REPO / "configs" / "bytemlperf" / "ds_like_4node.py")
V = 32000  # Llama-2's vocabulary, a multiple of 128: no padding at tp 1


def test_bytemlperf_moe_transcription():
    c = load_config_file(MOE)
    # MODEL_ARGS of train_moe.sh
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads, c.num_query_groups,
            c.seq_length, c.max_position_embeddings, c.rotary_base, c.init_method_std) == \
        (32, 6144, 1024, 32, 8, 1024, 32768, 1000000, 0.01)
    assert (c.normalization, c.position_embedding_type, c.swiglu, c.untie_embeddings_and_output_weights,
            c.add_bias_linear, c.hidden_dropout, c.attention_dropout) == \
        ("RMSNorm", "rope", True, True, False, 0.0, 0.0)
    # MOE_ARGS: no --moe-ffn-hidden-size, so the experts take ffn_hidden_size
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_aux_loss_coeff, c.moe_router_load_balancing_type,
            c.moe_grouped_gemm, c.moe_token_dispatcher_type, c.moe_ffn_hidden_size, c.moe_layer_freq) == \
        (8, 2, 1e-2, "aux_loss", True, "alltoall", 1024, 1)
    # TRAINING_ARGS
    assert (c.micro_batch_size, c.global_batch_size, c.lr, c.min_lr, c.train_iters, c.lr_decay_iters,
            c.lr_warmup_iters, c.lr_decay_style, c.weight_decay, c.clip_grad, c.bf16) == \
        (1, 256, 1e-4, 1e-5, 500000, 320000, 500, "cosine", 0.1, 1.0, True)
    # --expert-model-parallel-size 8 then 1: argparse keeps the last, so 8 GPUs of data parallel
    assert c.expert_model_parallel_size == 1 and c.use_distributed_optimizer
    assert model_report.config_layout(MOE) == dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                   data_parallel_size=8, expert_model_parallel_size=1)


def test_ds_like_transcriptions():
    c2, c4 = load_config_file(DS2), load_config_file(DS4)
    for c in (c2, c4):
        assert (c.hidden_size, c.num_attention_heads, c.num_query_groups, c.seq_length, c.norm_epsilon,
                c.rotary_base, c.hidden_dropout, c.attention_dropout) == (5120, 40, 8, 4096, 1e-6, 1000000, 0.1, 0.1)
        assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size,
                c.moe_router_dtype, c.moe_aux_loss_coeff, c.moe_token_dispatcher_type) == \
            (128, 6, 1024, 2048, "fp32", 1e-3, "alltoall")
        assert (c.lr_decay_style, c.lr_decay_multi_step, c.adam_beta2, c.seed) == \
            ("multi-step", (0.6, 0.3, 0.1), 0.95, 1234)
    # 2 nodes: 14 layers, dropless (the script comments the capacity factor out), 5,120,000 samples
    assert (c2.num_layers, c2.moe_expert_capacity_factor, c2.global_batch_size, c2.lr, c2.min_lr,
            c2.lr_warmup_init) == (14, None, 512, 5.7e-5, 5.7e-6, 1e-8)
    # shell arithmetic: ramp-up 5120000 / 31, decay 5120000 / 2, warm-up 2000 x 512 samples
    assert (c2.train_samples, c2.rampup_batch_size, c2.lr_decay_samples, c2.lr_warmup_samples) == \
        (5120000, (64, 16, 165161), 2560000, 1024000)
    # 4 nodes: 16 layers, capacity factor 1.2, 15,360,000 samples
    assert (c4.num_layers, c4.moe_expert_capacity_factor, c4.global_batch_size, c4.lr, c4.min_lr,
            c4.lr_warmup_init) == (16, 1.2, 1536, 1e-4, 1e-5, 1e-7)
    assert (c4.train_samples, c4.rampup_batch_size, c4.lr_decay_samples, c4.lr_warmup_samples) == \
        (15360000, (128, 32, 495483), 7680000, 3072000)
    assert model_report.config_layout(DS2)["expert_model_parallel_size"] == 16
    assert model_report.config_layout(DS4) == dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                                   data_parallel_size=1, expert_model_parallel_size=16)


def test_scripts_expert_parallel_sizes_load():
    assert load_config_file(DS2).expert_model_parallel_size == 16
    assert load_config_file(DS4).expert_model_parallel_size == 16
    assert load_config_file(MIXTRAL, {"expert_model_parallel_size": 8}).expert_model_parallel_size == 8


def test_scripts_moe_pipeline_loads():
    # the 4-node script's pp 2 (one layer per virtual stage) x ep 16 (MoE under pipeline parallelism)
    c = load_config_file(DS4)
    assert (c.pipeline_model_parallel_size, c.virtual_pipeline_size(), c.expert_model_parallel_size) == (2, 8, 16)
    assert c.moe_expert_capacity_factor == 1.2 and c.moe_token_dispatcher_type == "alltoall"


def test_mixtral_8x7b_parameters_and_flops_by_hand():
    c = load_config_file(MIXTRAL)
    h, L, F, E, k, s = 4096, 32, 14336, 8, 2, 4096
    q, kv = 32 * 128, 8 * 128  # 32 heads, 8 key/value groups of 128
    expert = 3 * h * F  # SwiGLU: [h, 2F] + [F, h]
    assert expert == 176_160_768
    layer = 2 * h + h * (q + 2 * kv) + q * h + h * E + E * expert  # norms, qkv, proj, router, experts
    assert layer == 1_451_270_144
    total = L * layer + 2 * V * h + h  # + embedding, untied output layer, final norm
    assert flops.num_parameters(c, V) == total == 46_702_792_704
    # a token passes through 2 of the 8 experts
    assert flops.num_active_parameters(c, V) == total - L * (E - k) * expert == 12_879_925_248
    # Megatron: 6 FLOPs per MAC (fwd + bwd); per token MLP 3 h F k, attention projections,
    # logits, and the causal core attention q * s per layer
    macs = L * (3 * h * F * k + h * (q + 2 * kv) + q * h) + h * V
    assert macs == 12_747_538_432
    per_token = 6 * macs + 6 * L * q * s
    assert per_token == 79_706_456_064
    assert flops.num_floating_point_operations(c, 128, V) == 128 * s * per_token == 41_789_138_436_882_432


def test_mixtral_8x7b_memory_by_hand():
    c = load_config_file(MIXTRAL)
    h, L, F, E, k, n, a = 4096, 32, 14336, 8, 2, 4096, 32
    q, kv = 4096, 1024
    experts = L * E * 3 * h * F  # 45,097,156,608, split over ep 8
    dense = 46_702_792_704 - experts
    lay = ParallelLayout(1, 1, use_distributed_optimizer=True, expert_model_parallel_size=8)
    assert lay.num_devices == 8 and lay.megatron_data_parallel_size == 8 and lay.name == "tp1-ep8-dp1-zero1"
    assert memory.expert_parameters_per_device(c, V, lay) == experts / 8 == 5_637_144_576
    assert memory.parameters_per_device(c, V, lay) == dense + experts / 8 == 7_242_780_672
    st = memory.weight_and_optimizer_memory(c, V, lay)
    # bf16: 2 B weights, 4 B float32 gradients, 12 B float32 main params + moments (Megatron's 18)
    assert (st.weights, st.gradients) == (2 * 7_242_780_672, 4 * 7_242_780_672)
    # ZeRO-1: dense optimizer state over Megatron's dp = 8, expert state over the data axis (1)
    assert st.optimizer_state == 12 * (dense / 8 + experts / 8) == 12 * 5_837_849_088
    # Activations of one micro-batch (1 x 4096 tokens), bf16 (e = 2), no dropout; XLA attention
    # under bf16 keeps the 2-byte s x s softmax output.
    e = 2
    replicated = n * h * (2 * e + e + e)  # two norm inputs, qkv input, router/dispatch input
    attention = n * e * ((q + kv) + kv + q)  # Q,K; V; linear_proj input
    scores = a * n * n * e
    r = n * k  # dropless: each token's 2 copies
    routed = r * (e * h + e * 2 * F + 2 * e * F + 8)  # dispatched, fc1 out, act out + weighted, weights+perm
    router = 2 * e * n * E  # logits and scores in the activations' dtype
    per_moe_layer = replicated + attention + scores + routed + router
    assert (replicated, attention, scores, routed, router) == \
        (134_217_728, 83_886_080, 1_073_741_824, 1_006_698_496, 131_072)
    act = memory.activation_memory(c, V, lay)
    assert act.per_moe_layer == per_moe_layer == 2_298_675_200
    output = 2 * e * n * h + 4 * n * V  # final norm + output-layer inputs, float32 logits
    assert act.total == L * per_moe_layer + 4 * n + output == 74_149_019_648
    # Megatron's theoretical_memory_usage.py: all 8 experts on the shard (no ep term), no router
    T = L * (2 * h * (E * F * 1.5 + 1) + 2 * h * h * 1.25) + h
    assert memory.megatron_num_parameters_on_most_loaded_shard(c, V) == T + 2 * V * h == 46_701_744_128
    assert memory.megatron_weight_and_optimizer_memory(c, V, lay) == (6 + 12 / 8) * 46_701_744_128


def test_ds_like_parameters_flops_and_memory_by_hand():
    c = load_config_file(DS2)
    h, L, E, k, F, Fs, s = 5120, 14, 128, 6, 1024, 2048, 4096
    q, kv = 40 * 128, 8 * 128
    expert = 3 * h * F
    layer = 2 * h + h * (q + 2 * kv) + q * h + h * E + E * expert + 3 * h * Fs  # ... + shared expert
    assert (expert, layer) == (15_728_640, 2_108_303_360)
    total = L * layer + 2 * V * h + h
    assert flops.num_parameters(c, V) == total == 29_843_932_160
    assert flops.num_active_parameters(c, V) == total - L * (E - k) * expert == 2_979_415_040
    macs = L * (3 * h * (F * k + Fs) + h * (q + 2 * kv) + q * h) + h * V  # top-6 routed + shared
    per_token = 6 * macs + 6 * L * q * s
    assert per_token == 18_599_116_800
    assert flops.num_floating_point_operations(c, 512, V) == 512 * s * per_token
    # The script's ep 16 on 16 GPUs: Megatron's dp 16, jmegatron's data axis 1
    lay = ParallelLayout(1, 1, use_distributed_optimizer=True, expert_model_parallel_size=16)
    experts = L * E * expert
    dense = total - experts
    assert memory.parameters_per_device(c, V, lay) == dense + experts / 16 == 3_419_816_960
    # ZeRO-1 main params + moments (bf16: 12 B): dense over Megatron's dp 16; this device's 1/16
    # of the experts over data 1
    assert memory.weight_and_optimizer_memory(c, V, lay).optimizer_state == 12 * (dense / 16 + experts / 16 / 1) \
        == 22_382_949_120

    # ds_like_4node: capacity factor 1.2, dropout 0.1 (1-byte masks), router in fp32
    c4 = load_config_file(DS4)
    n, e, a = s, 2, 40
    replicated = n * h * (4 * e + 2 * 1)  # + the two residual dropout masks
    attention = n * e * ((q + kv) + kv + q)
    scores = a * n * n * (e + 1 + e)  # softmax output, dropout mask, dropout output
    capacity = 231  # ceil(4096 * 6 / 128 * 1.2) = ceil(230.4)
    r = E * capacity  # every slot of the [E, C, h] buffer computes
    assert memory.moe_routed_tokens(c4, n) == r == 29_568
    routed = r * (e * h + e * 2 * F + 2 * e * F + 8)
    router = 2 * 4 * n * E  # fp32 logits and scores
    shared = n * e * (2 * Fs + Fs)
    per_moe_layer = replicated + attention + scores + routed + router + shared
    assert per_moe_layer == 4_265_581_568
    assert memory.activation_memory_per_layer(c4, 1, ParallelLayout(), moe=True) == per_moe_layer
    # dropless (ds_like_2node): r = n * k
    assert memory.moe_routed_tokens(c, n) == n * k


def test_mixed_dense_and_moe_layers_activations():
    # moe_layer_freq 2 on 4 layers: layers 0 and 2 are MoE; per-layer figures add up
    c = load_config_file(str(REPO / "configs" / "mixtral_tiny.py"), {"mock_data": True, "vocab_size": 1000,
                                                                    "moe_layer_freq": 2})
    lay = ParallelLayout()
    act = memory.activation_memory(c, 1024, lay)
    assert act.per_moe_layer != act.per_layer
    assert act.layers == 2 * act.per_layer + 2 * act.per_moe_layer
    assert act.per_layer == memory.activation_memory_per_layer(c, c.micro_batch_size, lay)


def test_model_report_mixtral(tmp_path, capsys):
    code = model_report.main(["--config", MIXTRAL, "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr()
    assert code == 0, out.err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["layout"] == "tp1-ep8-dp1-zero1" and r["num_devices"] == 8
    assert r["global_batch_size"] == 128 and r["num_microbatches"] == 16  # 128 / (1 x dp 1 x ep 8)
    assert r["num_active_parameters"] == 12_879_925_248 and r["num_parameters"] == 46_702_792_704
    assert "active per token:    12,879,925,248" in out.out and "routed experts:    5,637,144,576" in out.out
    # --ep that does not divide the experts, or --ep on a dense model: exit 2, the flag named
    assert model_report.main(["--config", MIXTRAL, "--ep", "3"]) == 2
    assert "--ep 3 does not divide config.num_moe_experts=8" in capsys.readouterr().err
    assert model_report.main(["--config", str(REPO / "configs" / "llama2_7b.py"), "--ep", "2"]) == 2
    assert "config.num_moe_experts is None" in capsys.readouterr().err


def test_parameter_classes_with_experts():
    # The five classes add up to the model's count; the experts are their own class (split
    # over ep); with mixed dense/MoE layers under pipeline stages every stored slot counts
    # as an MoE layer (the documented upper bound), i.e. as an all-MoE model's stage.
    c = load_config_file(str(REPO / "configs" / "mixtral_tiny.py"), {"mock_data": True, "vocab_size": 1000,
                                                                    "moe_layer_freq": 2})
    classes = memory.parameter_classes(c, 1024)
    assert sum(classes.values()) == flops.num_parameters(c, 1024)
    h, E, F = 256, 8, 344
    assert classes["expert"] == 2 * E * 3 * h * F  # layers 0 and 2, SwiGLU experts
    all_moe = c.replace(moe_layer_freq=1)
    assert memory.parameter_classes(c, 1024, 2, 0) == memory.parameter_classes(all_moe, 1024, 2, 0)
    ep2 = ParallelLayout(1, 1, expert_model_parallel_size=2)
    assert memory.parameters_per_device(c, 1024, ep2) == flops.num_parameters(c, 1024) - classes["expert"] / 2


def test_deepseek_v3_megatron_count_uses_the_mla_term():
    # Megatron-LM's theoretical_memory_usage.py with multi_latent_attention: its count is every
    # parameter but the routers and their expert biases (h E + E per MoE layer), MLA included,
    # and of the multi-token prediction depth its layer alone (not eh_proj [2h, h] and 3 norms)
    c = load_config_file(str(REPO / "configs" / "deepseek_v3.py"))
    h, E, V = c.hidden_size, c.num_moe_experts, c.padded_vocab_size()
    moe_layers = flops.moe_layer_count(c, mtp=True)
    assert (c.mtp_num_layers, moe_layers) == (1, 59)  # 58 decoder MoE layers and the MTP layer
    total = flops.num_parameters(c, V)
    assert total == 671_026_419_200 + 11_610_068_224  # the main model + the MTP depth
    assert flops.num_parameters(c.replace(mtp_num_layers=None), V) == 671_026_419_200
    assert memory.megatron_num_parameters_on_most_loaded_shard(c, V) == \
        total - moe_layers * (h * E + E) - (2 * h * h + 3 * h)
