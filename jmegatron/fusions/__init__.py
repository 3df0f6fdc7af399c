"""Fused elementwise functions with hand-written backward passes (Megatron's
megatron/core/fusions): they store less for the backward and let XLA fuse each direction
into one pass over memory."""
