"""The one table of how a reader sees a saved config: the fields each view resets.

A checkpoint read by a run that did not save it (evaluation, generation, export, a
distillation teacher, ``kd_finalize``) sees the saved config through these views:

* ``read``: the run's distillation settings (its teacher), where it saved and loaded from,
  and what it did at its start (``finetune``, ``no_load_optim``, ``no_load_rng``,
  ``use_checkpoint_args``);
* ``one_device``: every parallel size 1 (Orbax gathers whatever layout the checkpoint was
  saved in);
* ``per_layer``: ``scan_layers`` off (the decoder layers as ``decoder_layers_{i}``).

Imports only :mod:`jmegatron.config` (no JAX, no Orbax): the command-line parser reads it
before JAX starts.
"""

from __future__ import annotations

from jmegatron.config import DISTILLATION_RESETS

__all__ = ["CHECKPOINT_VIEWS", "checkpoint_view"]

# view -> the saved config's fields it resets (see the module doc)
CHECKPOINT_VIEWS = {
    "read": dict(DISTILLATION_RESETS, save=None, load=None, finetune=False, no_load_optim=False,
                 no_load_rng=False, use_checkpoint_args=False),
    "one_device": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                       expert_model_parallel_size=1, sequence_parallel=False,
                       virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
                       pipeline_schedule="auto", decoder_first_pipeline_num_layers=None,
                       decoder_last_pipeline_num_layers=None),
    "per_layer": dict(scan_layers=False),
}


def checkpoint_view(*views: str) -> dict:
    """The field -> value resets of the named :data:`CHECKPOINT_VIEWS`, merged in order.
    Raises KeyError for an unknown view."""
    out = {}
    for view in views:
        out.update(CHECKPOINT_VIEWS[view])
    return out
