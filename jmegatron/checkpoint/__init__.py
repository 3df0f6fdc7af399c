"""The checkpoint room: everything that knows how a jmegatron checkpoint lies on disk.

* :mod:`~jmegatron.checkpoint.layout`: a step's folders (Orbax's ``<dir>/<step>/<item>``)
  and the decoder layers' storage (per-layer <-> stacked <-> pipeline stage order);
* :mod:`~jmegatron.checkpoint.checkpointing`: saving (Orbax ``CheckpointManager``,
  fingerprints, atomic steps), :class:`~jmegatron.checkpoint.checkpointing.CheckpointError`,
  and the resume checks (model fields, learning-rate schedule);
* :mod:`~jmegatron.checkpoint.metadata`: the meta, the saved config and its read-only /
  one-device / per-layer views (one table), a step's array metadata;
* :mod:`~jmegatron.checkpoint.restore`: every reading form (state, sharded params, host
  numpy, one layer at a time);
* :mod:`~jmegatron.checkpoint.hf`: a Hugging Face folder read into config fields and
  parameters (``import-hf``, ``--load HF_FOLDER``, the distillation teacher).

It imports only :mod:`jmegatron.config`, :mod:`jmegatron.parallel` and :mod:`jmegatron.conversion` (never the trainer or
anything above it). Megatron-LM's counterparts: megatron/training/checkpointing.py and
megatron/core/dist_checkpointing.
"""
