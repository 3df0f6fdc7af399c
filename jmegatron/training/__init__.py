"""The training layer (Megatron's megatron/training): state, optimizer, the jitted train step, the loop, checkpoints, logs."""
