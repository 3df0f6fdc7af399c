"""Orbax checkpoints: save every ``save_interval`` and at the end, resume exactly.

One Orbax ``CheckpointManager`` per run directory; each step holds two items:
``state`` (the TrainState arrays, saved shard by shard from wherever they live, and
restorable into any other sharding) and ``meta`` (JSON: iteration, consumed samples,
the resolved config, the padded vocabulary size). Follows the roles of Megatron's
megatron/training/checkpointing.py (save_checkpoint / load_checkpoint, the
``latest_checkpointed_iteration`` tracker is Orbax's step listing).
"""

from __future__ import annotations

import dataclasses

import os
from typing import Any, Optional

import orbax.checkpoint as ocp

from jmegatron.config import MODEL_FIELDS, JMegatronConfig


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or incompatible. The message names the path."""


class Checkpointer:
    """Save and restore TrainStates under ``directory`` (created if absent)."""

    def __init__(self, directory: str, max_to_keep: int = 2, async_save: bool = False,
                 create: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))

    def latest_step(self) -> Optional[int]:
        """The newest finished step (iteration), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finished step (iteration) kept in the directory."""
        return list(self._manager.all_steps())

    def save(self, iteration: int, state: Any, meta: dict) -> None:
        """Save ``state`` and JSON ``meta`` as step ``iteration`` (async if configured)."""
        self._manager.save(iteration, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def read_meta(self, iteration: Optional[int] = None) -> dict:
        """The JSON metadata of ``iteration`` (default: latest). Raises CheckpointError."""
        step = self._resolve(iteration)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises several types for unreadable files
            raise CheckpointError(f"cannot read the metadata of checkpoint step {step} in "
                                  f"{self.directory}: {e}; the checkpoint is incomplete or not jmegatron's: "
                                  f"point config.load / --load at a complete one") from e

    def restore(self, abstract_state: Any, iteration: Optional[int] = None) -> tuple[Any, dict]:
        """Restore into ``abstract_state`` (ShapeDtypeStructs carrying target shardings:
        the checkpoint is resharded to them). Returns (state, meta)."""
        step = self._resolve(iteration)
        meta = self.read_meta(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is corrupt or "
                                  f"does not match the model: {type(e).__name__}: {e}; point config.load / "
                                  f"--load at a complete checkpoint of this model (its config is in its meta)") from e
        return restored["state"], meta

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending (async) saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def _resolve(self, iteration: Optional[int]) -> int:
        steps = self.all_steps()
        if iteration is None:
            if not steps:
                raise CheckpointError(f"no checkpoint found in {self.directory}")
            return max(steps)
        if iteration not in steps:
            raise CheckpointError(f"no checkpoint for iteration {iteration} in {self.directory} "
                                  f"(available: {sorted(steps)})")
        return iteration


def has_checkpoint(directory: Optional[str]) -> bool:
    """True if ``directory`` holds at least one finished Orbax step."""
    if not directory or not os.path.isdir(directory):
        return False
    return Checkpointer(directory, create=False).latest_step() is not None


def check_compatible(cfg: JMegatronConfig, saved_config: dict, padded_vocab: int,
                     saved_padded_vocab: int, path: str) -> None:
    """Raise CheckpointError naming each architecture field whose value differs."""
    defaults = {f.name: f.default for f in dataclasses.fields(JMegatronConfig)}

    def saved(k):  # a field newer than the checkpoint has its default; JSON turned tuples into lists
        value = saved_config.get(k, defaults[k])
        return tuple(value) if isinstance(value, list) else value

    diffs = [f"{k}: checkpoint {saved(k)!r} vs config {getattr(cfg, k)!r}"
             for k in MODEL_FIELDS if saved(k) != getattr(cfg, k)]
    if saved_padded_vocab != padded_vocab:
        diffs.append(f"padded vocab size: checkpoint {saved_padded_vocab} vs config {padded_vocab} (it is a "
                     f"multiple of make_vocab_size_divisible_by x tensor_model_parallel_size; choose "
                     f"make_vocab_size_divisible_by so that both layouts pad to the same size)")
    if diffs:
        raise CheckpointError(f"checkpoint {path} was saved with a different model; " + "; ".join(diffs)
                              + ". Use the checkpoint's config or a new --config.save directory.")

