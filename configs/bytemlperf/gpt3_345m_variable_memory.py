"""ByteMLPerf's "gpt3 345M" variable-length memory workload: ``gpt3_345m_memory.py`` with
``--variable-data --seq-length-min 1024 --seq-length-step 1024`` (samples of ``32768 -
k * 1024`` tokens, ByteMLPerf's GPTVariableDataset).

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/gpt3/
train_gpt3_345M_distributed_variable_memory.sh`` (commit a30b4f97b174), run by
``examples/gpt3/run_345M_variable_memory.sh`` (``MAX_TRAIN_STEPS=2000``, then
``memory_chart.py`` three ways). Every other argument is that of the memory workload.

``--seq-length-min 1024``: ByteMLPerf's GPTVariableDataset draws without it (lengths are
``seq_length - k * seq_length_step``, k in 1..9, the shortest 23552); here it is the bound the
config checks that shortest length against.
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=8)  # 8 GPUs


def get_config():
    c = get_config_of(os.path.join(HERE, "gpt3_345m_memory.py"))
    c.variable_data = True  # --variable-data
    c.seq_length_step = 1024  # --seq-length-step 1024
    c.seq_length_min = 1024  # --seq-length-min 1024
    return c
