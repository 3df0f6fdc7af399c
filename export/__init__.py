"""Checkpoint export: Hugging Face / PyTorch, ModelOpt, TensorRT-LLM (imported as jmegatron.export)."""
