"""ByteMLPerf's "gpt3 345M" variable-length memory workload: ``gpt3_345m_memory.py`` with
``--variable-data --seq-length-min 1024 --seq-length-step 1024`` (samples of ``32768 -
k * 1024`` tokens, ByteMLPerf's GPTVariableDataset).

Source: bytedance/ByteMLPerf ``byte_train_perf/Megatron-LM/examples/gpt3/
train_gpt3_345M_distributed_variable_memory.sh`` (commit a30b4f97b174), run by
``examples/gpt3/run_345M_variable_memory.sh`` (``MAX_TRAIN_STEPS=2000``, then
``memory_chart.py`` three ways). Every other argument is that of the memory workload.

The variable-length fields are not in jmegatron's config yet (issue 11, item 4, on
another branch); once merged, switch them on here:

    # sched fields: c.variable_data = True; c.seq_length_step = 1024
    # ByteMLPerf also passes --seq-length-min 1024 (its default is 128); it has no field
    # in the item-4 list, so it is recorded here: seq_length_min = 1024

Until then this config equals gpt3_345m_memory.py (the memory of its longest samples).
"""

import os

from jmegatron.config import get_config_of

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=8)  # 8 GPUs

# ByteMLPerf's variable-length arguments (see the module docstring), for the lead to map
# onto the sched fields after merging.
VARIABLE_DATA_ARGS = dict(variable_data=True, seq_length_min=1024, seq_length_step=1024)


def get_config():
    c = get_config_of(os.path.join(HERE, "gpt3_345m_memory.py"))
    # sched fields: c.variable_data = True; c.seq_length_step = 1024
    return c
