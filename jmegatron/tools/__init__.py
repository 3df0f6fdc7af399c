"""Command-line tools (python -m jmegatron.tools.<name>): data preparation, reports, fault injection, GPU checks."""
