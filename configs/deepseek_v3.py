"""DeepSeek-V3 671B (DeepSeek-AI 2024, arXiv:2412.19437), a reference config for FLOPs and
memory reports (``python -m jmegatron.tools.model_report``); it is not trained here
(mock_data=True so it validates without data).

Architecture (family preset "deepseek_v3") from transformers' DeepseekV3Config defaults and
Megatron-LM's DeepSeek-V3 recipe (the Hub's config.json is not read here): 61 layers, the first
3 dense (SwiGLU ffn 18432), then MoE layers of 256 routed experts (ffn 2048, top-8, groups 8 /
4, scaling 2.5) plus one shared expert of 2048; hidden 7168, 128 heads of multi-latent
attention (q_lora_rank 1536, kv_lora_rank 512, qk_head_dim 128 + qk_pos_emb_head_dim 64,
v_head_dim 128), YaRN factor 40 over a 4096-token original context (mscale 1, mscale_all_dim
1), vocabulary 129280, untied output, sequences of 4096, and one multi-token prediction depth
(an MoE layer, 11.6B more parameters; its loss weighted 0.1, Megatron-LM's recipe). The
optimizer and schedule stand in from configs/llama2_7b.py.
"""

import os

from jmegatron.config import get_config_of, set_family


def get_config():
    c = set_family(get_config_of(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama2_7b.py")),
                   "deepseek_v3")
    c.num_layers = 61
    c.hidden_size = 7168
    c.ffn_hidden_size = 18432
    c.num_attention_heads = 128
    c.num_query_groups = 128
    c.moe_layer_freq = "([0]*3+[1]*58)"
    c.num_moe_experts = 256
    c.moe_ffn_hidden_size = 2048
    c.moe_shared_expert_intermediate_size = 2048
    c.q_lora_rank = 1536
    c.kv_lora_rank = 512
    c.qk_head_dim = 128
    c.qk_pos_emb_head_dim = 64
    c.v_head_dim = 128
    c.yarn_rotary_scaling_factor = 40.0
    c.yarn_original_max_position_embeddings = 4096
    c.yarn_mscale = 1.0
    c.yarn_mscale_all_dim = 1.0
    c.seq_length = 4096
    c.max_position_embeddings = 163840
    c.vocab_size = 129280
    c.mtp_num_layers = 1
    c.mtp_loss_scaling_factor = 0.1
    return c
