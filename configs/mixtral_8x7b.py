"""Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088), a reference
config for FLOPs and memory reports and for the Hugging Face mapping; not trained here
(mock_data=True so it validates without data).

Architecture as Mistral AI's Hugging Face ``config.json`` for ``Mixtral-8x7B-v0.1``
(``MixtralForCausalLM``) and the "Mixtral 8x7B" example of Megatron-LM's
``megatron/core/transformer/moe/README.md`` (``--num-experts 8 --moe-router-topk 2 --swiglu
--normalization RMSNorm --group-query-attention --num-query-groups 8
--untie-embeddings-and-output-weights --disable-bias-linear``): 32 layers, hidden 4096,
32 heads of 128 with 8 key/value groups, every MLP an MoE layer of 8 SwiGLU experts of
FFN 14336 with top-2 softmax routing (softmax over the two chosen logits: Megatron's
default, not pre-softmax), RMSNorm eps 1e-5, RoPE base 1e6 (HF's ``rope_theta``; the
README's script leaves Megatron's default 10000), 32768 positions, vocabulary
32000 (a multiple of 128: no padding at tp 1). 46,702,792,704 parameters,
12,879,925,248 active per token (tests/test_flops.py counts both by hand).

Training settings are that README example's (seq 4096, micro-batch 1, global batch 128,
lr 1e-4 cosine to 1e-5 over 320000 iterations, 500 warm-up iterations, weight decay 0.1,
clip 1.0, init std 0.01, aux loss 1e-2, grouped GEMM, the distributed optimizer, bf16, split
99990,8,2; Megatron's default dispatcher).

``LAYOUT`` (model_report's default): expert parallel 8 on 8 devices, one expert each
(jmegatron's data axis 1; Megatron's data parallel 8). The README runs tensor parallel 2 with
sequence parallelism x expert parallel 8 (16 GPUs); MoE with tensor parallelism and expert
parallelism are both refused on this build, so the config keeps tp 1 / ep 1 to validate and
the report's layout is ep 8 alone (``--tp 2`` is refused for MoE until that lands).
"""

from jmegatron.config import base_config

LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
              expert_model_parallel_size=8)


def get_config():
    c = base_config("mixtral")  # 8 experts, top-2, aux loss 1e-2 (jmegatron.presets)
    c.num_layers = 32
    c.hidden_size = 4096
    c.ffn_hidden_size = 14336
    c.num_attention_heads = 32
    c.num_query_groups = 8
    c.kv_channels = 128
    c.seq_length = 4096
    c.max_position_embeddings = 32768
    c.vocab_size = 32000
    c.make_vocab_size_divisible_by = 128
    c.rotary_base = 1000000
    c.init_method_std = 0.01
    c.moe_ffn_hidden_size = 14336
    c.moe_grouped_gemm = True
    c.use_distributed_optimizer = True
    c.bf16 = True
    c.micro_batch_size = 1
    c.global_batch_size = 128
    c.train_iters = 500000
    c.lr = 1e-4
    c.min_lr = 1e-5
    c.lr_decay_style = "cosine"
    c.lr_decay_iters = 320000
    c.lr_warmup_iters = 500
    c.weight_decay = 0.1
    c.clip_grad = 1.0
    c.split = "99990,8,2"
    c.mock_data = True
    return c
