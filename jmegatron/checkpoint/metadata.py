"""What a checkpoint says about itself, read without restoring any array: its JSON meta, its
saved config (and the views of it that readers build on), and the ``state`` item's tree of
array metadata.

The meta (written by :meth:`jmegatron.checkpoint.checkpointing.Checkpointer.save`, built by
``jmegatron.training.run.checkpoint_meta``) holds ``iteration``, the consumed samples,
``padded_vocab_size``, the resolved ``config`` (a dict), ``aux_params`` and the arrays'
``fingerprints``. A reader that is not the run that saved it (evaluation, generation,
export, a distillation teacher) sees the saved config through the views of
:mod:`jmegatron.checkpoint.views`. The roles follow Megatron-LM's
megatron/training/checkpointing.py (``read_metadata``, ``load_args_from_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Optional

import orbax.checkpoint as ocp
from etils import epath

from jmegatron.checkpoint.checkpointing import Checkpointer, CheckpointError, has_checkpoint
from jmegatron.checkpoint.layout import LayerLayout, item_dir
from jmegatron.checkpoint.views import checkpoint_view
from jmegatron.config import JMegatronConfig, from_configdict

__all__ = ["SavedStep", "read_meta", "saved_config", "saved_state_metadata",
           "state_item_dir"]

def read_meta(load_dir: str, iteration: Optional[int] = None) -> dict:
    """The JSON meta of checkpoint ``load_dir`` at ``iteration`` (default: the latest).
    Raises CheckpointError naming the directory when it holds no checkpoint or no such
    step, CorruptCheckpointError for an unreadable meta."""
    if not has_checkpoint(load_dir):
        raise CheckpointError(f"no checkpoint found in {os.path.abspath(load_dir)}")
    ckpt = Checkpointer(load_dir, create=False)
    try:
        return ckpt.read_meta(iteration)
    finally:
        ckpt.close()


def saved_config(meta: Mapping, *views: str) -> JMegatronConfig:
    """The resolved config of a checkpoint's ``meta`` (:func:`read_meta`) seen through
    ``views`` (:func:`checkpoint_view`, e.g. ``"read"``). Raises ConfigError for a saved
    config this version cannot build, KeyError for a meta without one."""
    return from_configdict(dict(meta["config"], **checkpoint_view(*views)))


def state_item_dir(ckpt: Checkpointer, iteration: Optional[int] = None) -> tuple[str, int, dict]:
    """(directory of the ``state`` item, step, meta) of checkpoint ``ckpt`` at ``iteration``
    (default: the latest finished step; :func:`jmegatron.checkpoint.layout.item_dir`).
    Raises CheckpointError for a missing step or item."""
    step = ckpt.latest_step() if iteration is None else int(iteration)
    if step is None:
        raise CheckpointError(f"no checkpoint found in {ckpt.directory}")
    meta = ckpt.read_meta(step)  # CheckpointError for a step it does not hold
    path = item_dir(ckpt.directory, step)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory} has no state item at {path}")
    return path, step, meta


def saved_state_metadata(state_dir: str) -> dict:
    """The ``state`` item's tree of Orbax ``ArrayMetadata`` (shape, dtype, saved sharding),
    nested dicts keyed like the saved TrainState (``step``, ``params``, ``opt_state``,
    ``rng``); reads no array. Raises CheckpointError for an unreadable item."""
    try:
        tree = ocp.StandardCheckpointHandler().metadata(epath.Path(state_dir))
    except Exception as e:  # orbax raises several types for unreadable metadata
        raise CheckpointError(f"cannot read the array metadata of {state_dir}: {type(e).__name__}: {e}") from e
    return dict(getattr(tree, "tree", tree))


@dataclasses.dataclass(frozen=True)
class SavedStep:
    """One finished step of a checkpoint, its metadata read and no array: what every reader
    of :mod:`jmegatron.checkpoint.restore` starts from.

    Attributes: ``directory`` (absolute), ``step``, ``state_dir`` (the ``state`` item),
    ``meta`` (the JSON meta), ``tree`` (:func:`saved_state_metadata` of the item)."""

    directory: str
    step: int
    state_dir: str
    meta: dict
    tree: dict

    @classmethod
    def of(cls, ckpt: Checkpointer, iteration: Optional[int] = None) -> "SavedStep":
        """Step ``iteration`` (default: the latest) of an open ``ckpt``. Raises
        CheckpointError for a missing step or item, or unreadable metadata."""
        state_dir, step, meta = state_item_dir(ckpt, iteration)
        return cls(ckpt.directory, step, state_dir, meta, saved_state_metadata(state_dir))

    @classmethod
    def at(cls, load_dir: str, iteration: Optional[int] = None) -> "SavedStep":
        """Step ``iteration`` (default: the latest) of checkpoint directory ``load_dir``.
        Raises CheckpointError naming the directory when it holds no checkpoint, and as
        :meth:`of`."""
        if not has_checkpoint(load_dir):
            raise CheckpointError(f"no checkpoint found in {os.path.abspath(load_dir)}")
        ckpt = Checkpointer(load_dir, create=False)
        try:
            return cls.of(ckpt, iteration)
        finally:
            ckpt.close()

    @property
    def num_layers(self) -> int:
        """The saved model's decoder layers (its config's ``num_layers``)."""
        return int(self.meta["config"]["num_layers"])

    @property
    def layout(self) -> LayerLayout:
        """How the step stores its decoder layers (:meth:`LayerLayout.of_config` of the saved config)."""
        return LayerLayout.of_config(self.meta["config"])

    def model_params(self) -> dict:
        """The ``params`` subtree of :attr:`tree` without the auxiliary modules the meta names
        (``aux_params``: a distillation run's ``kd_projection``). Raises CheckpointError when
        the item holds no ``params``."""
        params = self.tree.get("params")
        if not isinstance(params, Mapping):
            raise CheckpointError(f"checkpoint step {self.step} in {self.directory}: its state holds no params "
                                  f"subtree")
        aux = set(self.meta.get("aux_params") or {})
        return {k: v for k, v in params.items() if k not in aux}
