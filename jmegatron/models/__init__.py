"""Flax model blocks with logical axis names (Megatron-Core's megatron/core/transformer and models/gpt)."""
