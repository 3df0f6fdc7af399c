"""ByteMLPerf's DeepSeek-like MoE workload on 4 nodes: ds_like_2node.py's model with 16
layers, a capacity factor of 1.2 (token dropping), global batch 1536 ramped up from 128,
lr 1e-4, and pipeline parallel 2 (interleaved, one layer per virtual stage) x expert
parallel 16 over 32 GPUs.

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/ds_like/
train_ds_like_4node.sh`` (commit a49963b65f75, unchanged at a30b4f97b174), run by ``examples/ds_like/run4script.sh``
(commit 65eb4cd95983: ``MAX_TRAIN_SAMPLES=15360000``, dropout 0.1 when unset); derived in
the script: ramp-up samples ``15360000 / 31`` = 495483, decay samples 7680000, warm-up
samples ``2000 * 1536`` = 3072000.

The script's layout is set: pipeline 2 (interleaved, one layer per virtual stage: 8
chunks per stage) x expert 16; ``LAYOUT`` repeats it for model_report, with
``VIRTUAL_PIPELINE`` for ``--num-layers-per-virtual-pipeline-stage 1``.

Other script arguments as ds_like_2node.py (``--use-cpu-initialization`` is commented out
here).
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))

MAX_TRAIN_SAMPLES = 15360000  # run4script.sh
# 32 GPUs (8 x 4 nodes): pipeline 2 x expert 16, tensor 1; Megatron's data parallel 16,
# expert-data parallel 16 / 16 = 1 = jmegatron's `data` axis.
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, data_parallel_size=1,
              expert_model_parallel_size=16)
VIRTUAL_PIPELINE = dict(num_layers_per_virtual_pipeline_stage=1)  # 16 / (2 x 1) = 8 chunks per stage


def get_config():
    c = get_config_of(os.path.join(HERE, "ds_like_2node.py"))
    # MODEL_ARGS (the rest as ds_like_2node.py)
    c.num_layers = 16
    # MOE_ARGS
    c.moe_expert_capacity_factor = 1.2
    # TRAINING_ARGS
    c.global_batch_size = 1536
    c.lr = 1e-4
    c.train_samples = MAX_TRAIN_SAMPLES
    c.rampup_batch_size = (128, 32, MAX_TRAIN_SAMPLES // 31)
    c.lr_decay_samples = MAX_TRAIN_SAMPLES // 2
    c.lr_warmup_samples = 2000 * 1536
    c.min_lr = 1e-5
    c.lr_warmup_init = 1.0e-7
    # MODEL_PARALLEL_ARGS: tp 1, pp 2 (vpp: 1 layer per chunk), ep 16 (LAYOUT)
    c.pipeline_model_parallel_size = 2
    c.num_layers_per_virtual_pipeline_stage = 1
    c.expert_model_parallel_size = 16
    return c
