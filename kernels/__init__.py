"""Pallas kernels with XLA reference paths (imported as jmegatron.kernels)."""
