"""ByteMLPerf's Mixtral-style MoE training workload ("moe8x2-7B"): 32 layers x hidden 6144,
every MLP an MoE layer of 8 SwiGLU experts of FFN 1024, top-2 routing with the Switch
load-balancing loss at 1e-2, grouped GEMM and the alltoall dispatcher; seq 1024, micro-batch
1, global batch 256, on 8 GPUs.

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/mixtral/train_moe.sh``
(commit cb805174393f, 2025-05-17, unchanged at a30b4f97b174 of 2025-08-18; the version ``run_moe.sh`` calls with ``MAX_TRAIN_STEPS=500000`` and
compares with ``loss_chart.py -s 50 -t 0.002``; its reference log prints
``load_balancing_loss`` beside ``lm loss``).

The script passes ``--expert-model-parallel-size`` twice: ``8`` in ``MOE_ARGS`` and ``1`` in
``MODEL_PARALLEL_ARGS``, which ``torchrun ... ${MOE_ARGS[@]} ... ${MODEL_PARALLEL_ARGS[@]}``
puts later, and argparse keeps the last value: the run is expert parallel 1, i.e. data
parallel 8 with all 8 experts on every GPU (``LAYOUT``). ``ffn_hidden_size`` 1024 is the
experts' FFN (no ``--moe-ffn-hidden-size``: Megatron's default is ``ffn_hidden_size``).

``python -m jmegatron.tools.model_report --config configs/bytemlperf/moe.py``: 8,246,925,312
parameters, 4,623,046,656 active per token (top-2 of 8 experts; tests/test_flops.py counts both
by hand).

Script arguments with no jmegatron field, and what stands for them:

* ``--tokenizer-type Llama2Tokenizer --tokenizer-model ...``: Llama-2's SentencePiece
  vocabulary of 32000 (a multiple of 128: no padding); ``--data-path``: the user's corpus, so
  ``mock_data`` is on here (pass ``--config.data_path=... --config.tokenizer_model=...
  --config.mock_data=False``). ``--load``: the benchmark starts from a checkpoint.
* ``--sequence-parallel`` with tensor parallel 1: Megatron's validate_args turns it off
  (``sequence_parallel = False`` when tp is 1); jmegatron refuses it, so it is off here.
* ``--use-mcore-models``, ``--no-masked-softmax-fusion``, ``--no-position-embedding`` (RoPE
  replaces it), ``NCCL_ALGO=Ring`` / ``CUBLAS_WORKSPACE_CONFIG`` (determinism: jmegatron's
  step is deterministic), ``--data-cache-path``, wandb / tensorboard: no effect here.
* Megatron defaults the script relies on: Adam betas (0.9, 0.999), eps 1e-8, RMSNorm eps
  1e-5, seed 1234, ``moe_layer_freq`` 1 (every layer MoE), no z-loss, softmax routing without
  pre-softmax (Mixtral's: softmax over the top-2 logits).
"""

import os

from jmegatron.config import base_config

HERE = os.path.dirname(os.path.abspath(__file__))

# 8 GPUs (GPUS_PER_NODE=8, NUM_NODES=1), tp 1, pp 1, the last --expert-model-parallel-size 1:
# data parallel 8. model_report uses it by default.
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=8,
              expert_model_parallel_size=1)


def get_config():
    # MODEL_ARGS and MOE_ARGS: --disable-bias-linear --normalization RMSNorm --swiglu
    # --untie-embeddings-and-output-weights, RoPE, dropout 0, --num-experts 8
    # --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    # are the mixtral family's (jmegatron.presets)
    c = base_config("mixtral")
    c.seq_length = 1024
    c.max_position_embeddings = 32768
    c.num_layers = 32
    c.hidden_size = 6144
    c.ffn_hidden_size = 1024
    c.num_attention_heads = 32
    c.init_method_std = 0.01
    c.num_query_groups = 8  # --group-query-attention --num-query-groups 8
    c.rotary_base = 1000000
    c.vocab_size = 32000  # Llama2Tokenizer
    c.make_vocab_size_divisible_by = 128
    # MOE_ARGS
    c.moe_grouped_gemm = True
    c.use_distributed_optimizer = True
    c.moe_token_dispatcher_type = "alltoall"
    # TRAINING_ARGS
    c.micro_batch_size = 1
    c.global_batch_size = 256
    c.lr = 1e-4
    c.train_iters = 500000  # --train-iters $MAX_TRAIN_STEPS, 500000 in run_moe.sh
    c.lr_decay_iters = 320000
    c.lr_decay_style = "cosine"
    c.min_lr = 1.0e-5
    c.weight_decay = 0.1
    c.lr_warmup_iters = 500
    c.clip_grad = 1.0
    c.bf16 = True
    # MODEL_PARALLEL_ARGS: tp 1, pp 1, ep 1 (LAYOUT above); --sequence-parallel is off at tp 1
    c.tensor_model_parallel_size = 1
    c.pipeline_model_parallel_size = 1
    c.expert_model_parallel_size = 1
    # DATA_ARGS
    c.split = "99990,8,2"
    c.mock_data = True
    # EVAL_AND_LOGGING_ARGS
    c.log_interval = 1
    c.save_interval = 10000
    c.eval_interval = 1000
    c.eval_iters = 10
    return c
