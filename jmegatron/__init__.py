"""jmegatron: Megatron-LM training on JAX/XLA."""
