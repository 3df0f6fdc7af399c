"""Pallas kernels (GPU; the CPU runs the same kernel code in Pallas interpret mode):
flash attention and the vocab-parallel cross-entropy, each with an XLA reference path."""
