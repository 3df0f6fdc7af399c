"""Mixtral-style tiny MoE model: llama_tiny's attention and shapes with every
MLP an MoE layer of 8 SwiGLU experts, top-2 routing and the Switch load-balancing loss at
1e-2, grouped GEMM and the alltoall dispatcher, as ByteMLPerf's
byte_train_perf/Megatron-LM/examples/mixtral/train_moe.sh (MOE_ARGS) sets them. Each
expert's FFN is half of llama_tiny's, so the two routed experts cost one llama_tiny MLP
per token. Expert parallelism (that script's --expert-model-parallel-size 8) is not
built yet; docs/MOE.md."""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_tiny.py"))
    c = set_family(c, "mixtral")  # 8 experts, top-2, aux loss 1e-2 (jmegatron.presets)
    c.moe_ffn_hidden_size = 344
    c.moe_grouped_gemm = True
    c.moe_token_dispatcher_type = "alltoall"
    return c
