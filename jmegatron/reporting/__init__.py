"""What a run reports about itself, computed from its config and the machine (Megatron's
megatron/training/utils.py and theoretical_memory_usage.py): model FLOPs and parameter counts
(``flops``), theoretical memory per device (``memory``), the peak TFLOP/s that MFU divides by
(``peak``) and the measured core clock it may use (``core_clock``). Imports config, kernels and
models only, never training/."""
