"""Benchmark harness in the ByteMLPerf manner (python -m jmegatron.bench)."""
