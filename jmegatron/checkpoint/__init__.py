"""Checkpoints: layout, saving, restoring, metadata."""
