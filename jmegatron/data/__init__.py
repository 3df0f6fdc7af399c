"""Megatron's data pipeline: IndexedDataset (.bin/.idx), GPTDataset, blends, tokenizers and the batch loader."""
