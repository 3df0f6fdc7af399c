"""ByteMLPerf's "gpt3 857M" training workload, with its script's exact model and training
arguments: 24 layers x hidden 1024 x 16 heads, seq 2048, micro-batch 4, global batch 512;
the optimizer and schedule of ``gpt3_345m.py``.

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/gpt3/
train_gpt3_857M_distributed.sh`` (commit a30b4f97b174), run by ``examples/gpt3/run_857M.sh``
with ``MAX_TRAIN_STEPS=500000`` (its wandb name says "875M").

Despite the name this is Megatron-LM's 345M shape (configs/gpt3_345m.py) at sequence
length 2048 with 2048 learned positions: 355,919,872 parameters with the padded GPT-2
vocabulary (``python -m jmegatron.tools.model_report --config configs/bytemlperf/gpt3_857m.py``).
The arguments without a jmegatron field are described in gpt3_345m.py.
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=8)  # 8 GPUs


def get_config():
    c = get_config_of(os.path.join(HERE, "gpt3_345m.py"))
    c.num_layers = 24
    c.hidden_size = 1024
    c.ffn_hidden_size = 4 * 1024
    c.num_attention_heads = 16
    c.seq_length = 2048
    c.max_position_embeddings = 2048
    c.micro_batch_size = 4
    c.global_batch_size = 512
    c.train_iters = 500000  # --train-iters $MAX_TRAIN_STEPS, 500000 in run_857M.sh
    return c
