"""Parallelism on one jax.sharding.Mesh: the logical-axis rules, data / tensor / sequence / context / expert / pipeline parallelism and gradient synchronisation."""
