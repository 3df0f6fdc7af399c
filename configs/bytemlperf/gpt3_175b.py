"""ByteMLPerf's GPT-3 175B workload (Megatron-LM's own example, kept in ByteMLPerf's fork):
96 layers x hidden 12288 x 96 heads, seq 2048, micro-batch 1, global batch 1536 ramped
up from 16, tensor parallel 8 x pipeline parallel 16.

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/gpt3/
train_gpt3_175b_distributed.sh`` (commit a30b4f97b174; the same arguments as Megatron-LM's
``examples/gpt3/train_gpt3_175b_distributed.sh``).

For FLOPs and memory reports (``python -m jmegatron.tools.model_report --config
configs/bytemlperf/gpt3_175b.py``): the script's 128-GPU layout is in ``LAYOUT``, which
model_report reads, not in the config's parallel fields, so the file loads on a machine of
any size (``--config.tensor_model_parallel_size=8 --config.pipeline_model_parallel_size=16``
sets it for a run).

Script arguments not set here:

* ``--rampup-batch-size 16 16 5859375`` (start 16, increment 16, over 5,859,375 samples):
  ``RAMPUP_BATCH_SIZE`` below. jmegatron refuses it with ``train_iters``, as Megatron's
  validate_args does with the script as written:
  iteration-based training (``--train-iters``) asserts ``rampup_batch_size is None``
  ("expected no batch-size rampup for iteration-based training",
  ``megatron/training/arguments.py`` in ByteMLPerf's fork and upstream); a run needs
  ``--train-samples`` instead (``--config.train_iters=None --config.train_samples=N
  --config.rampup_batch_size="(16, 16, 5859375)"``).
* No ``--deterministic-mode`` here, unlike the 345M/857M scripts; the rest as gpt3_345m.py.
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))

# --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16: 128 GPUs, i.e. 16 nodes
# of GPUS_PER_NODE=8 (the script's NUM_NODES=1 is a placeholder: "Change for multinode
# config"); data parallel 1 at 128 GPUs.
LAYOUT = dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=16, data_parallel_size=1)
RAMPUP_BATCH_SIZE = (16, 16, 5859375)  # --rampup-batch-size; see the module docstring


def get_config():
    c = get_config_of(os.path.join(HERE, "gpt3_345m.py"))
    # GPT_MODEL_ARGS
    c.num_layers = 96
    c.hidden_size = 12288
    c.ffn_hidden_size = 4 * 12288
    c.num_attention_heads = 96
    c.seq_length = 2048
    c.max_position_embeddings = 2048
    # TRAINING_ARGS (weight decay, betas, init std, clip, bf16, lr schedule as gpt3_345m.py)
    c.micro_batch_size = 1
    c.global_batch_size = 1536
    # --rampup-batch-size: RAMPUP_BATCH_SIZE (needs train_samples; see the module docstring)
    c.train_iters = 500000
    # EVAL_AND_LOGGING_ARGS
    c.log_interval = 100
    c.save_interval = 10000
    c.eval_interval = 1000
    c.eval_iters = 10
    return c
