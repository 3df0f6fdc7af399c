"""The parallelism group of a run's config: :class:`ModelParallelConfig`, the sizes of the
tensor, pipeline, context and expert dimensions and how the data ranks hold the state.

Field names, defaults and meanings follow megatron/core/model_parallel_config.py and
megatron/training/arguments.py (``_add_distributed_args``); the mesh they build is
:mod:`jmegatron.parallel.mesh`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jmegatron.config.common import ConfigError, ConfigGroup, check_positive

PIPELINE_SCHEDULES = ("auto", "gpipe", "1f1b", "interleaved_1f1b")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


@dataclasses.dataclass(frozen=True)
class ModelParallelConfig(ConfigGroup):
    """The parallel sizes of a run (Megatron-Core's ``ModelParallelConfig``). The layouts
    that need the model's sizes (pipeline stages, head splits) are checked by
    :class:`jmegatron.config.model.TransformerConfig`, which extends this group."""

    CHOICES = {"pipeline_schedule": PIPELINE_SCHEDULES}

    # --- parallelism (sizes; see jmegatron.parallel.mesh) ---
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Megatron's interleaved schedule: model chunks per pipeline stage (v), given directly
    # or as layers per chunk (--num-layers-per-virtual-pipeline-stage); None: v = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    # "auto" (Megatron's choice: 1F1B, interleaved when v > 1), "gpipe", "1f1b", "interleaved_1f1b"
    pipeline_schedule: str = "auto"
    # Megatron's uneven split (--decoder-first/last-pipeline-num-layers): layers on the first /
    # last pipeline stage, the rest split evenly over the others; None: even
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    context_parallel_size: int = 1
    # Megatron's --cp-comm-type: how attention reaches the other context ranks' keys/values:
    # "p2p" (ring attention), "all_gather" (K/V gathered), "a2a" (Ulysses all-to-all heads <->
    # sequence); jmegatron.parallel.context_parallel
    cp_comm_type: str = "p2p"
    expert_model_parallel_size: int = 1
    # Megatron: --expert-tensor-parallel-size; None: = tensor_model_parallel_size (the only
    # value built: expert weights split over "tensor" like the dense MLP's)
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False  # Megatron: --sequence-parallel (activations between blocks split on seq over tensor)
    use_distributed_optimizer: bool = False  # Megatron: --use-distributed-optimizer (ZeRO-1 over data)
    use_megatron_fsdp: bool = False  # Megatron: --use-megatron-fsdp (params, grads, optimizer state over data)

    def check_parallel(self) -> None:
        """Raise ConfigError naming the field: non-positive sizes, sequence parallelism without
        tensor parallelism, two optimizer shardings, an unknown ``cp_comm_type``, FSDP with
        expert parallelism."""
        check_positive(self, ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                              "expert_model_parallel_size"))
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("config.sequence_parallel=True needs config.tensor_model_parallel_size > 1 "
                              "(Megatron disables it otherwise); set sequence_parallel=False.")
        if self.use_distributed_optimizer and self.use_megatron_fsdp:
            raise ConfigError("config.use_megatron_fsdp=True already shards the optimizer state; "
                              "set config.use_distributed_optimizer=False.")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ConfigError(f"config.cp_comm_type={self.cp_comm_type!r}: choose 'p2p', 'all_gather' or 'a2a' "
                              f"(Megatron's --cp-comm-type).")
        if self.expert_model_parallel_size > 1 and self.use_megatron_fsdp:
            raise ConfigError("config.use_megatron_fsdp=True with expert_model_parallel_size > 1 is not built; use "
                              "use_distributed_optimizer=True (ZeRO-1) with expert parallelism.")

    def data_parallel_size(self, num_devices: int) -> int:
        """Devices left for data parallelism after tensor/pipeline/context/expert sizes."""
        model = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                 * self.context_parallel_size * self.expert_model_parallel_size)
        if num_devices % model:
            raise ConfigError(
                f"{num_devices} devices are not divisible by tensor({self.tensor_model_parallel_size}) x "
                f"pipeline({self.pipeline_model_parallel_size}) x context({self.context_parallel_size}) x "
                f"expert({self.expert_model_parallel_size}) = {model}.")
        return num_devices // model

