"""ByteMLPerf's DeepSeek-like MoE workload on 2 nodes: 14 layers x hidden 5120 x 40 heads
(8 query groups), every MLP an MoE layer of 128 SwiGLU experts of FFN 1024, top-6 routing
with the router in fp32 and the load-balancing loss at 1e-3, plus a shared expert of FFN
2048; seq 4096, global batch 512 ramped up from 64; expert parallel 16 over 16 GPUs.

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/ds_like/
train_ds_like_2node.sh`` (commit a49963b65f75, unchanged at a30b4f97b174), run by ``examples/ds_like/run2script.sh``
(commit a30b4f97b174), which sets ``MAX_TRAIN_SAMPLES=5120000`` and, when unset,
``ATTN_DROPOUT=0.1 HID_DROPOUT=0.1``; the script derives ``BATCH_WARMUP_SAMPLES =
MAX_TRAIN_SAMPLES / 31``, ``DECAY_SAMPLES = MAX_TRAIN_SAMPLES / 2`` and
``LR_WARMUP_SAMPLES = 2000 * 512`` (shell integer arithmetic, so 165161, 2560000, 1024000).

The script's expert parallel size 16 is set (and in ``LAYOUT`` for model_report).

Script arguments with no jmegatron field, and what stands for them:

* ``--tokenizer-type Llama2Tokenizer``: vocabulary 32000 (no padding at tp 1);
  ``--data-path``: the user's corpus, so ``mock_data`` is on here. ``--load``: the run starts
  from a pretrained checkpoint.
* ``--sequence-parallel`` at tensor parallel 1: off (Megatron's validate_args turns it off;
  jmegatron refuses it).
* ``--attention-softmax-in-fp32``: jmegatron's attention softmax is always float32.
  ``--use-cpu-initialization``: initialisation placement only.
* ``--ffn-hidden-size`` is not given: Megatron derives int(4h x 2/3 / 64) x 64 = 13632 for
  ``--swiglu``, this file keeps jmegatron's default 4h (20480); neither sizes a layer, as
  there are no dense MLPs (``moe_layer_freq`` 1).
* ``--use-mcore-models``, ``--no-masked-softmax-fusion``, ``--no-position-embedding``,
  ``NCCL_ALGO`` / ``CUBLAS_WORKSPACE_CONFIG`` / ``PYTORCH_CUDA_ALLOC_CONF``,
  ``--data-cache-path``: no effect here.
"""

import os

from jmegatron.config import base_config

HERE = os.path.dirname(os.path.abspath(__file__))

MAX_TRAIN_SAMPLES = 5120000  # run2script.sh
# 16 GPUs (GPUS_PER_NODE=8 x 2 nodes), tp 1, pp 1, expert parallel 16: Megatron's data
# parallel is 16 (the expert ranks are data ranks for the dense weights) and its expert-data
# parallel 16 / 16 = 1, which is jmegatron's `data` mesh axis (data_parallel_size here).
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
              expert_model_parallel_size=16)


def get_config():
    # MODEL_ARGS: --disable-bias-linear --normalization RMSNorm --swiglu
    # --untie-embeddings-and-output-weights and RoPE are the llama family's (jmegatron.presets)
    c = base_config("llama")
    c.seq_length = 4096
    c.max_position_embeddings = 4096
    c.num_layers = 14
    c.hidden_size = 5120
    c.num_attention_heads = 40
    c.init_method_std = 0.01
    c.attention_dropout = 0.1  # $ATTN_DROPOUT, run2script.sh's default
    c.hidden_dropout = 0.1  # $HID_DROPOUT
    c.num_query_groups = 8  # --group-query-attention --num-query-groups 8
    c.rotary_base = 1000000
    c.norm_epsilon = 1e-6
    c.vocab_size = 32000  # Llama2Tokenizer
    c.make_vocab_size_divisible_by = 128
    # MOE_ARGS
    c.num_moe_experts = 128
    c.moe_grouped_gemm = True
    c.moe_router_load_balancing_type = "aux_loss"
    c.moe_router_topk = 6
    c.moe_router_dtype = "fp32"
    c.moe_aux_loss_coeff = 1e-3
    c.use_distributed_optimizer = True
    c.moe_token_dispatcher_type = "alltoall"
    c.moe_ffn_hidden_size = 1024
    c.moe_shared_expert_intermediate_size = 2048  # "shared-experts 2": two 1024-wide experts as one
    # (--moe-expert-capacity-factor 1.2 is commented out in this script: dropless)
    # TRAINING_ARGS
    c.seed = 1234
    c.micro_batch_size = 1
    c.global_batch_size = 512
    c.lr = 5.7e-5
    c.train_samples = MAX_TRAIN_SAMPLES
    c.rampup_batch_size = (64, 16, MAX_TRAIN_SAMPLES // 31)
    c.lr_decay_samples = MAX_TRAIN_SAMPLES // 2
    c.lr_warmup_samples = 2000 * 512
    c.lr_decay_style = "multi-step"
    c.lr_decay_multi_step = (0.6, 0.3, 0.1)
    c.min_lr = 5.7e-6
    c.lr_warmup_init = 1.0e-8
    c.weight_decay = 0.1
    c.adam_beta1 = 0.9
    c.adam_beta2 = 0.95
    c.adam_eps = 1e-8
    c.clip_grad = 1.0
    c.bf16 = True
    # MODEL_PARALLEL_ARGS: tp 1, expert parallel 16
    c.tensor_model_parallel_size = 1
    c.expert_model_parallel_size = 16
    # DATA_ARGS
    c.split = "99990,8,2"
    c.mock_data = True
    # EVAL_AND_LOGGING_ARGS
    c.log_interval = 1
    c.save_interval = 10000
    c.eval_interval = 10000
    c.eval_iters = 10
    return c
