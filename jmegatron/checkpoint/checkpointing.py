"""Orbax checkpoints: save every ``save_interval`` and at the end, resume exactly.

One Orbax ``CheckpointManager`` per run directory; each step holds two items:
``state`` (the TrainState arrays, saved shard by shard from wherever they live, and
restorable into any other sharding) and ``meta`` (JSON: iteration, consumed samples,
the resolved config, the padded vocabulary size). Follows the roles of Megatron's
megatron/training/checkpointing.py (save_checkpoint / load_checkpoint, the
``latest_checkpointed_iteration`` tracker is Orbax's step listing). :func:`check_compatible`
refuses a checkpoint of another model, or of another learning-rate schedule (Megatron's
resume rule, :func:`check_schedule`).

Integrity (docs/RELIABILITY.md, "checkpoints"): a save is atomic (Orbax writes into
``<step>.orbax-checkpoint-tmp*`` and renames it when every item is written, so a killed
save leaves no step); each save also records a fingerprint of every array's values in the
meta (:func:`state_fingerprints`), checked after every restore, so a file cut short,
garbage bytes or a missing item raise :class:`CorruptCheckpointError` instead of training
on wrong numbers. ``JMEGATRON_CHECKPOINT_KILL`` (tests only) kills the process during a save.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import signal
import threading
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jmegatron.checkpoint.layout import ITEMS
from jmegatron.config import MODEL_FIELDS, SCHEDULER_FIELDS, JMegatronConfig


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or incompatible. The message names the path."""


class CorruptCheckpointError(CheckpointError):
    """Checkpoint ``step`` in ``path`` is unreadable or its arrays differ from the values
    saved (a file cut short, garbage bytes, a missing item). The loop falls back to the
    previous complete checkpoint under ``ckpt_fallback``."""

    def __init__(self, step: int, path: str, reason: str):
        super().__init__(f"checkpoint step {step} in {path} is corrupt: {reason}; point config.load / "
                         f"--load at a complete checkpoint of this model")
        self.step, self.path, self.reason = step, path, reason


FINGERPRINTS_KEY = "fingerprints"
# Orbax splits the write of an array replicated on several devices across its replicas,
# each slice cut by a compiled ``slice`` program per array shape (the default off GPUs).
# Below this many bytes per slice the compile costs more than the write it shares.
MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL = 1 << 20


def _register_array_handler() -> None:
    """Orbax's ``jax.Array`` handler with :data:`MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL`.
    Orbax's ``StandardCheckpointHandler`` reads its type handlers from the process-wide
    registry only, so the handler is registered there (once; other Orbax users in the
    process save their arrays the same way)."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "_min_slice_bytes_for_replica_parallel", None) != MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL:
        absl = logging.getLogger("absl")  # Orbax warns of the override it was asked for
        level = absl.level
        absl.setLevel(logging.ERROR)
        try:
            ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
                min_slice_bytes_for_replica_parallel=MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL), override=True)
        finally:
            absl.setLevel(level)
KILL_ENV = "JMEGATRON_CHECKPOINT_KILL"


def _leaf_name(path) -> str:
    """'params/decoder_layers_0/kernel': a key path without the container types (a
    TrainState and Orbax's restored dicts name a leaf alike)."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _mix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _fingerprint(x: jax.Array) -> jax.Array:
    """uint32 []: a hash of ``x``'s bits and their positions. Sums wrap modulo 2^32, so the
    value is the same whatever the sharding or reduction order (no collective beyond the
    final sum, no reshape of a sharded array)."""
    if x.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    elif x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):  # the flat position, without flattening
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[d]
    return jnp.sum(_mix32(bits ^ _mix32(index + jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)


@jax.jit
def _fingerprints(tree: Any) -> Any:
    return jax.tree.map(_fingerprint, tree)


def state_fingerprints(tree: Any) -> dict[str, list]:
    """``{leaf name: [uint32 fingerprint, dtype name]}`` of a pytree of arrays (any
    sharding; one jitted pass over the values and one small host transfer). Equal values
    give equal fingerprints whatever their sharding; a changed bit changes it (but for a
    2^-32 chance)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    values = jax.device_get(_fingerprints([x for _, x in leaves]))
    return {_leaf_name(p): [int(v), str(np.dtype(x.dtype))] for (p, x), v in zip(leaves, values)}


def _kill_hook(save_number: int) -> None:
    """Tests only (``JMEGATRON_CHECKPOINT_KILL=<n>:<seconds>``): SIGKILL this process
    ``seconds`` after the n-th save of this process starts (1-based), wherever the save
    (or, when async, the training that overlaps it) is by then."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    n, delay = spec.split(":")
    if int(n) != save_number:
        return
    print(f"[jmegatron] fault injection: SIGKILL in {float(delay):.4f} s", flush=True)

    def kill():
        time.sleep(float(delay))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


class Checkpointer:
    """Save and restore TrainStates under ``directory`` (created if absent).

    ``max_to_keep`` (``config.keep_checkpoints``): None keeps every save, as Megatron-LM does;
    N hands retention to Orbax (``CheckpointManagerOptions.max_to_keep``: the newest N steps
    stay), and each save that makes Orbax delete older steps names them first on process 0
    (``[jmegatron] keep_checkpoints=N: deleting checkpoint iteration(s) [...]``)."""

    def __init__(self, directory: str, max_to_keep: Optional[int] = None, async_save: bool = False,
                 create: bool = True):
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.incomplete = incomplete_saves(self.directory)  # before a writer removes them
        # A writer removes the leftovers of killed saves (Orbax ignores them when listing steps).
        _register_array_handler()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                               enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=create)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=ITEMS)
        self._saves = 0

    def latest_step(self) -> Optional[int]:
        """The newest finished step (iteration), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finished step (iteration) kept in the directory."""
        return list(self._manager.all_steps())

    def save(self, iteration: int, state: Any, meta: dict) -> None:
        """Save ``state`` and JSON ``meta`` (plus the state's :func:`state_fingerprints`) as
        step ``iteration``. Async (``async_save``): returns once Orbax has copied the arrays
        to host memory (its default synchronous device-to-host transfer), so the caller may
        donate ``state`` to the next step at once; the files are written in the background
        and the step appears only when complete. A previous async save is waited for first."""
        self._saves += 1
        _kill_hook(self._saves)
        if self.max_to_keep is not None:  # Orbax's LatestN: the oldest steps beyond max_to_keep go
            deleted = sorted(set(self.all_steps()) | {iteration})[:-self.max_to_keep]
            if deleted and jax.process_index() == 0:
                print(f"[jmegatron] keep_checkpoints={self.max_to_keep}: deleting checkpoint iteration(s) {deleted} "
                      f"in {self.directory} after saving iteration {iteration} (keep_checkpoints=None keeps every "
                      f"save, as Megatron)", flush=True)
        meta = dict(meta, **{FINGERPRINTS_KEY: state_fingerprints(state)})
        self._manager.save(iteration, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def read_meta(self, iteration: Optional[int] = None) -> dict:
        """The JSON metadata of ``iteration`` (default: latest). Raises
        CorruptCheckpointError (unreadable) or CheckpointError (no such step)."""
        step = self._resolve(iteration)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises several types for unreadable files
            raise CorruptCheckpointError(step, self.directory, f"cannot read its metadata: "
                                         f"{type(e).__name__}: {e}") from e
        if not isinstance(meta, dict) or "iteration" not in meta:
            raise CorruptCheckpointError(step, self.directory, f"its metadata is not a jmegatron checkpoint's "
                                         f"(no 'iteration'): {str(meta)[:200]}")
        return meta

    def restore(self, abstract_state: Any, iteration: Optional[int] = None) -> tuple[Any, dict]:
        """Restore into ``abstract_state`` (ShapeDtypeStructs carrying target shardings:
        the checkpoint is resharded to them). Returns (state, meta)."""
        step = self._resolve(iteration)
        meta = self.read_meta(step)
        error = None
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))["state"]
        except Exception as e:
            error = e
        failed = error is not None
        if jax.process_count() > 1:  # every process must take the same branch (the check below is collective)
            from jax.experimental import multihost_utils

            failed = bool(np.any(multihost_utils.process_allgather(np.array(failed))))
        if failed:
            # TensorStore appends its whole spec (kilobytes); the first part names the array
            detail = str(error).split("See full TensorStore details")[0].strip()[:500]
            reason = f"{type(error).__name__}: {detail}" if error else "another process could not read its part"
            raise CorruptCheckpointError(step, self.directory, "cannot restore its arrays (corrupt or does not "
                                         f"match the model): {reason}") from error
        self.verify(restored, meta, step)
        return restored, meta

    def verify(self, state: Any, meta: dict, step: int) -> None:
        """Compare ``state``'s :func:`state_fingerprints` with those saved in ``meta``: the
        leaves present in both with the saved dtype (a restore that casts, e.g. into a
        bfloat16 target, cannot be compared bit for bit; a checkpoint older than the
        fingerprints is not checked). Raises CorruptCheckpointError naming the leaves whose
        values differ."""
        saved = meta.get(FINGERPRINTS_KEY)
        if not saved:
            return
        now = state_fingerprints(state)
        bad = sorted(k for k in now.keys() & saved.keys() if now[k][1] == saved[k][1] and now[k][0] != saved[k][0])
        if bad:
            raise CorruptCheckpointError(step, self.directory, f"{len(bad)} array(s) differ from the values "
                                         f"saved (fingerprint mismatch): {', '.join(bad[:5])}"
                                         + (" ..." if len(bad) > 5 else ""))

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


def incomplete_saves(directory: str) -> list[str]:
    """The step directories a killed save left in ``directory`` (``<step>.orbax-checkpoint-tmp*``:
    Orbax renames a step only once every item is written, and lists only renamed ones)."""
    return sorted(glob.glob(os.path.join(os.path.abspath(directory), "*.orbax-checkpoint-tmp*")))


def has_checkpoint(directory: Optional[str]) -> bool:
    """True if ``directory`` holds at least one finished Orbax step."""
    if not directory or not os.path.isdir(directory):
        return False
    return Checkpointer(directory, create=False).latest_step() is not None


def check_compatible(cfg: JMegatronConfig, saved_config: dict, padded_vocab: int,
                     saved_padded_vocab: int, path: str, iteration: Optional[int] = None) -> None:
    """Raise CheckpointError naming each architecture field whose value differs, and each
    learning-rate schedule value that differs (:func:`check_schedule`; ``iteration``: the
    checkpoint's; None: not known, checked as a trained one)."""
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
    check_schedule(cfg, {k: saved(k) for k in SCHEDULER_FIELDS + ("train_samples",)}, path, iteration)


def schedule_of(config: dict) -> dict:
    """The learning-rate schedule a config (field -> value, derived fields resolved) gives,
    in its training unit, as Megatron's OptimizerParamScheduler holds it: ``lr``, ``min_lr``,
    the warm-up length (``lr_warmup_fraction`` x the decay length, else
    ``lr_warmup_iters`` / ``_samples``), the decay length (``lr_decay_iters``, which is
    ``train_iters`` when not set; ``lr_decay_samples`` likewise), ``lr_decay_style``, and the
    style's own values (WSD: ``lr_wsd_decay_style``, ``lr_wsd_decay_*``; multi-step: its
    shares). Keys name the fields; ``"unit"`` is "iters" or "samples"."""
    unit = "iters" if config.get("train_samples") is None else "samples"
    decay = config[f"lr_decay_{unit}"]
    fraction = config["lr_warmup_fraction"]
    out = {"unit": unit, "lr": config["lr"], "min_lr": config["min_lr"],
           f"lr_warmup_{unit}": fraction * decay if fraction is not None and decay is not None
           else config[f"lr_warmup_{unit}"],
           f"lr_decay_{unit}": decay, "lr_decay_style": config["lr_decay_style"]}
    if config["lr_decay_style"] == "WSD":
        out.update({"lr_wsd_decay_style": config["lr_wsd_decay_style"],
                    f"lr_wsd_decay_{unit}": config[f"lr_wsd_decay_{unit}"]})
    if config["lr_decay_style"] == "multi-step":
        out["lr_decay_multi_step"] = tuple(config["lr_decay_multi_step"])
    return out


_SCHEDULE_NOTES = {"lr_warmup_iters": " (or lr_warmup_fraction x the decay)",
                   "lr_warmup_samples": " (or lr_warmup_fraction x the decay)",
                   "lr_decay_iters": " (train_iters when not set)",
                   "lr_decay_samples": " (train_samples when not set)"}


def check_schedule(cfg: JMegatronConfig, saved_config: dict, path: str, iteration: Optional[int]) -> None:
    """Megatron's resume rule for the learning-rate schedule
    (megatron/core/optimizer_param_scheduler.py ``load_state_dict`` / ``_check_and_set``):
    raise CheckpointError naming each value of :func:`schedule_of` that differs between the
    checkpoint (``saved_config``) and ``cfg``, both values, and the fix. Not checked:
    ``override_opt_param_scheduler`` (the config's schedule wins), a checkpoint at iteration
    0 (nothing of its schedule has run: an import-hf checkpoint), ``kd_finalize`` (no
    training), and ``finetune`` / ``no_load_optim`` from ``load`` (the schedule starts afresh,
    or Megatron does not load it). ``use_checkpoint_opt_param_scheduler`` took the
    checkpoint's fields when the config was loaded, so it is checked too: a difference then
    means the checkpoint is not the run whose config.json gave them."""
    from_load = os.path.abspath(path) != os.path.abspath(cfg.save or "")
    if (cfg.override_opt_param_scheduler or iteration == 0 or cfg.kd_finalize
            or (from_load and (cfg.finetune or cfg.no_load_optim))):
        return
    mine, theirs = schedule_of(cfg.to_dict()), schedule_of(saved_config)
    diffs = [f"{k}{_SCHEDULE_NOTES.get(k, '')}: checkpoint {theirs.get(k)!r} vs config {mine.get(k)!r}"
             for k in dict.fromkeys([*theirs, *mine]) if theirs.get(k) != mine.get(k)]
    if not diffs:
        return
    if cfg.use_checkpoint_opt_param_scheduler:
        fix = ("use_checkpoint_opt_param_scheduler takes the checkpoint's schedule where the config is loaded "
               "(load_config_file, from the config.json beside the checkpoints), and this config's differs from this "
               "checkpoint's; load the config that way, or set the schedule fields to the checkpoint's values")
    else:
        fix = ("Megatron's rule: set --config.override_opt_param_scheduler=True (--override-opt_param-scheduler) to "
               "train on with the config's schedule, --config.use_checkpoint_opt_param_scheduler=True "
               "(--use-checkpoint-opt_param-scheduler) to keep the checkpoint's, or give the checkpoint's values")
    at = f" (iteration {iteration})" if iteration is not None else ""
    raise CheckpointError(f"checkpoint {path}{at} was saved with a different learning-rate schedule; "
                          + "; ".join(diffs) + f". {fix}.")

