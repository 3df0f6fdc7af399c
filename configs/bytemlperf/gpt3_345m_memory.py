"""ByteMLPerf's "gpt3 345M" memory workload: the model of ``gpt3_345m.py`` at sequence
length 32768, micro-batch 4, global batch 32, 2000 iterations, a memory line every
iteration.

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/gpt3/
train_gpt3_345M_distributed_memory.sh`` (commit a30b4f97b174), run by
``examples/gpt3/run_345M_memory.sh`` with ``MAX_TRAIN_STEPS=2000`` and compared by
``memory_chart.py`` (allocated, ``--reserved``, ``--fragment``; ``-s 50 -t 0.002``).
Every other argument is the same as ``train_gpt3_345M_distributed.sh`` (gpt3_345m.py).

``--test-memory`` (ByteMLPerf's flag: print the ``[Rank r] (after N iterations) memory
(MB) | allocated ...`` line at every logged iteration, not only the first) is
``test_memory``.

At 32768 tokens jmegatron's XLA attention keeps the ``[b, heads, s, s]`` scores, which
Megatron's flash attention does not: see the recompute columns of model_report.
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=8)  # 8 GPUs


def get_config():
    c = get_config_of(os.path.join(HERE, "gpt3_345m.py"))
    c.seq_length = 32768
    c.max_position_embeddings = 32768
    c.micro_batch_size = 4
    c.global_batch_size = 32
    c.train_iters = 2000  # --train-iters $MAX_TRAIN_STEPS, 2000 in run_345M_memory.sh
    c.log_interval = 1
    c.save_interval = 10000
    c.eval_interval = 2000
    c.eval_iters = 2000
    c.test_memory = True  # --test-memory
    return c
