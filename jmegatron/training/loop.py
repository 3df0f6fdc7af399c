"""The pretraining loop: config -> mesh -> model/state -> data -> jitted step -> logs
and checkpoints (the role of Megatron's ``pretrain``/``train`` in
megatron/training/training.py).

Everything with side effects lives here; the step itself is pure (``step.py``), the
static pieces are built by :func:`jmegatron.training.run.build` (a :class:`Run`: mesh,
model, optimizer, shardings, jitted steps), and what a micro-batch computes comes from the
forward step provider given to :func:`pretrain` (:mod:`jmegatron.training.forward_step`),
the datasets from :func:`jmegatron.data.builder.build_datasets`: the loop composes them and
imports none of distillation, the pipeline schedule or the loss. :func:`train` is Megatron's
``train`` made of small parts with their own state: :class:`StopRules`, :class:`NaNGuard`,
:class:`StepFlags`, :class:`TrainingLog`, :class:`Evaluation` and :class:`Saving`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh

from jmegatron.checkpoint import checkpointing
from jmegatron.config import JMegatronConfig
from jmegatron.data.builder import build_datasets
from jmegatron.data.loader import BatchLoader
from jmegatron.parallel.rules import data_parallel_size
from jmegatron.reporting import memory
from jmegatron.reporting.flops import num_floating_point_operations, num_parameters
from jmegatron.reporting.peak import resolve_peak_for_config
from jmegatron.training.float16_optimizer import Float16OptimizerState, all_finite
from jmegatron.training.logging import MetricsLogger, init_wandb
from jmegatron.training.run import ForwardStepProvider, Run, build, checkpoint_meta, restore_latest


def evaluate(run: Run, params: Any, dataset: Any, num_iters: int, consumed_samples: int = 0,
             dataloader_type: Optional[str] = None, split: str = "valid") -> float:
    """Mean per-token validation loss (nats) over ``num_iters`` global batches (the run's
    final global batch, as Megatron's ``evaluate``) of ``dataset`` starting at sample
    ``consumed_samples`` (Megatron's ``consumed_valid_samples``; 0: the first batches).
    Each process reads only its rows (:meth:`Run.batch_rows`). Past the end of the split:
    ``dataloader_type`` (default ``run.cfg.dataloader_type``) ``"single"`` raises
    :class:`jmegatron.data.loader.DataExhaustedError` naming ``split``, ``"cyclic"`` starts
    the split again (Megatron's valid iterator of that type)."""
    rows = run.batch_rows()
    loader = BatchLoader(dataset, run.global_batch_size, run.num_microbatches, rows=rows, split=split,
                         dataloader_type=dataloader_type or run.cfg.dataloader_type)
    sums = [run.eval_step(params, run.put_batch(loader.batch_at(consumed_samples + i * run.global_batch_size),
                                                    train=False, rows=rows))
            for i in range(num_iters)]
    total, count = jax.device_get(jax.tree.map(lambda *x: sum(x), *sums))  # one host sync
    return float(total) / max(float(count), 1.0)


def step_memory(run: Run, state: Any, batch: dict, longest_length: Optional[int] = None) -> tuple[Any, list]:
    """``(analysis, pool)`` for the CPU memory line
    (:meth:`jmegatron.training.logging.MetricsLogger.log_memory`): the ``memory_analysis()``
    of the train step compiled for ``batch`` and those of every step program the run holds.
    ``longest_length``: the longest padded length variable data can give; its program
    (``batch``'s shapes with that sequence length) is compiled (announced) if not yet, so
    the pool is the same whichever lengths came first."""
    analysis = run.train_step.compiled(state, batch, *run.extra_args).memory_analysis()
    if longest_length is not None and batch["tokens"].shape[2] != longest_length:
        longest = {k: jax.ShapeDtypeStruct(v.shape[:2] + (longest_length,) + v.shape[3:], v.dtype, sharding=v.sharding)
                   for k, v in batch.items()}
        run.train_step.compiled(state, longest, *run.extra_args)
    return analysis, [p.memory_analysis() for p in run.train_step.programs()]


class _StopRequest:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and exits cleanly
    (Megatron's --exit-signal-handler).

    With several processes every rank must stop at the same iteration (the save ends in a
    barrier). Each step carries this process's flag into the jitted step
    (:meth:`jmegatron.training.step.TrainStep`, ``stop``) and returns the maximum over all
    processes as metric ``stop``; the loop reads it one step later (after dispatching the
    next step), so the ranks agree every iteration without a collective or a host round
    trip of their own, and every rank stops after the same iteration: the one after the
    first step that carried any process's request (at most two iterations after the step
    running when the first rank got the signal), whatever ``log_interval``.
    (Megatron's DistributedSignalHandler all-gathers the flags likewise.)"""

    def __init__(self, enabled: bool):
        self.event = threading.Event()
        self.signum = None
        self.noticed = None  # the iteration whose step first carried this process's request
        self._previous = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        # Only set the flag (printing from a handler can re-enter a busy stdout); a second
        # signal gets the default behaviour, so a stuck run can still be killed.
        self.signum = signum
        self.event.set()
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def requested(self, iteration: int) -> bool:
        """This process's request, to pass into the step of ``iteration`` (remembers the
        first such iteration and says so once)."""
        if self.event.is_set() and self.noticed is None:
            self.noticed = iteration
            print(f"[jmegatron] process {jax.process_index()}: signal {self.signum} noticed at iteration "
                  f"{iteration}; the ranks agree through the step's 'stop' flag", flush=True)
        return self.event.is_set()

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _duration_exceeded(start: float, minutes: Optional[float]) -> bool:
    """Megatron's ``exit_duration_in_mins`` check (every iteration): more than ``minutes``
    since ``start`` (time.time()), on this process. The loop passes it into the step's stop
    flag, so with several processes the ranks agree (a maximum over them, as Megatron's
    all-reduce MAX) without a collective of their own, and all save the same iteration."""
    return bool(minutes) and (time.time() - start) / 60.0 > minutes


def load_or_init(run: Run, ckpt: Optional[checkpointing.Checkpointer]) -> tuple[Any, int, int, int]:
    """(state, iteration, consumed_train_samples, consumed_valid_samples): restored from the
    latest complete checkpoint (resharded to this run's layout) or freshly initialised. A
    checkpoint in ``cfg.save`` wins over ``cfg.load`` (a rerun continues its own progress), except
    with kd_finalize. The validation position resumes where it was saved, as Megatron's
    ``consumed_valid_samples`` (a checkpoint without one gets Megatron's fallback
    ``iteration // eval_interval * eval_iters * gbs``).

    A corrupt checkpoint (:class:`~jmegatron.checkpoint.checkpointing.CorruptCheckpointError`)
    is skipped with a printed ``ckpt_fallback`` warning and the previous one is used
    (``cfg.ckpt_fallback``; off: the error stops the run). Megatron's load options apply
    when the checkpoint comes from ``cfg.load`` rather than the run's own ``cfg.save``:
    ``finetune`` (params only: iteration, consumed samples, optimizer and RNG start afresh),
    ``no_load_optim`` (fresh optimizer moments; the iteration and the learning-rate
    schedule continue), ``no_load_rng`` (the dropout base key from ``cfg.seed``, not the
    saved one), see :func:`_apply_load_options`.

    Raises CheckpointError: ``cfg.load`` given but empty, every checkpoint corrupt (or the
    newest with ``ckpt_fallback`` off), or one of a different model (both values named)."""
    cfg = run.cfg
    load_dir = cfg.load
    if cfg.save and not cfg.kd_finalize and checkpointing.has_checkpoint(cfg.save):
        load_dir = cfg.save
    incomplete = set(ckpt.incomplete) if ckpt else set()
    if load_dir:
        incomplete |= set(checkpointing.incomplete_saves(load_dir))
    for path in sorted(incomplete):  # Orbax lists only renamed (complete) steps; a writer deletes these
        print(f"[jmegatron] WARNING: ignoring {path}: an incomplete save (the process was killed while "
              f"writing it)", flush=True)
    if load_dir and checkpointing.has_checkpoint(load_dir):
        loader_ckpt = ckpt if ckpt and ckpt.directory == os.path.abspath(load_dir) else \
            checkpointing.Checkpointer(load_dir, create=False)
        try:
            state, meta = restore_latest(run, loader_ckpt)
        finally:
            if loader_ckpt is not ckpt:
                loader_ckpt.close()
        print(f"[jmegatron] resumed from {loader_ckpt.directory} at iteration {meta['iteration']}", flush=True)
        iteration = int(meta["iteration"])
        consumed_valid = meta.get("consumed_valid_samples")
        if consumed_valid is None:  # Megatron's build_train_valid_test_data_loaders fallback
            consumed_valid = (iteration // cfg.eval_interval * cfg.eval_iters * run.global_batch_size
                              if cfg.eval_interval and cfg.train_samples is None else 0)
        consumed = int(meta["consumed_train_samples"])
        from_load = os.path.abspath(load_dir) != os.path.abspath(cfg.save or "")
        if from_load and (cfg.finetune or cfg.no_load_optim or cfg.no_load_rng):
            state = _apply_load_options(run, state)
            if cfg.finetune:
                print("[jmegatron] finetune: parameters loaded; iteration, samples, optimizer and RNG start "
                      "afresh", flush=True)
                iteration = consumed = consumed_valid = 0
        return state, iteration, consumed, int(consumed_valid)
    if cfg.load and os.path.abspath(cfg.load) != os.path.abspath(cfg.save or ""):
        raise checkpointing.CheckpointError(f"config.load={cfg.load!r} holds no checkpoint; point it at a run's "
                                            f"save directory, or drop config.load to start from scratch")
    return run.init_state(), 0, 0, 0


def fresh_rng(seed: int) -> jax.Array:
    """uint32 [2]: the base dropout key a run initialised with ``seed`` has (as
    :func:`jmegatron.training.state.init_train_state` draws it)."""
    return jax.random.key_data(jax.random.split(jax.random.key(seed))[1])


def _apply_load_options(run: Run, state: Any) -> Any:
    """Megatron's load options on a state restored from ``cfg.load``
    (megatron/training/checkpointing.py load_checkpoint). ``finetune``: a fresh optimizer
    (moments, Adam's count, the learning-rate schedule, fp16 loss scale) and ``step`` 0;
    ``no_load_optim``: fresh moments and loss scale, the schedule's count kept (the
    iteration continues, so does the learning rate; Megatron does not load its scheduler
    then); ``finetune`` or ``no_load_rng``: the dropout base key of ``cfg.seed``
    (:func:`fresh_rng`). Under bf16 / fp16 the fresh optimizer starts from the saved
    float32 main parameters (Megatron re-copies them from the bf16 model, losing bits)."""
    import optax

    cfg = run.cfg
    if cfg.finetune or cfg.no_load_optim:
        old = state.opt_state
        main = old.main_params if isinstance(old, Float16OptimizerState) else state.params
        fresh = jax.jit(run.tx.init, out_shardings=run.state_shardings.opt_state)(main)
        if not cfg.finetune:
            is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
            fresh = jax.tree.map(lambda f, o: f._replace(count=o.count) if is_schedule(f) else f, fresh, old,
                                 is_leaf=is_schedule)
        state = state.replace(opt_state=fresh)
    if cfg.finetune:
        state = state.replace(step=jax.device_put(np.zeros((), np.int32), run.state_shardings.step))
    if cfg.finetune or cfg.no_load_rng:
        state = state.replace(rng=jax.device_put(fresh_rng(cfg.seed), run.state_shardings.rng))
    return state


def _truncate_metrics(path: str, iteration: int) -> None:
    """Drop metrics.jsonl records past the resumed iteration (written by a run that died
    after its last checkpoint), so every iteration appears once."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [l for l in f if l.strip() and json.loads(l).get("iteration", 0) <= iteration]
    with open(path, "w") as f:
        f.writelines(lines)


def finalize_student(run: Run) -> dict:
    """``kd_finalize``: the distilled run's latest checkpoint (``cfg.load``) saved to
    ``cfg.save`` as a plain student (no distillation settings, no ``kd_projection``:
    :func:`jmegatron.training.run.checkpoint_meta`) at the same iteration, with its
    ``config.json``; reads no data and takes no step, and prints what it wrote. Returns
    :func:`pretrain`'s summary keys (no losses). Raises CheckpointError (nothing to load)."""
    cfg = run.cfg
    if not checkpointing.has_checkpoint(cfg.load):
        raise checkpointing.CheckpointError(f"config.kd_finalize=True: config.load={cfg.load!r} holds no checkpoint "
                                            f"(the distillation run's config.save)")
    state, iteration, consumed, consumed_valid = load_or_init(run, None)
    meta = checkpoint_meta(cfg, run, iteration, consumed, consumed_valid)
    os.makedirs(cfg.save, exist_ok=True)
    ckpt = checkpointing.Checkpointer(cfg.save, cfg.keep_checkpoints, cfg.async_save)
    try:
        if jax.process_index() == 0:
            with open(os.path.join(cfg.save, "config.json"), "w") as f:
                f.write(json.dumps(meta["config"], indent=1, sort_keys=True))
        ckpt.save(iteration, state, meta)
        ckpt.wait()
    finally:
        ckpt.close()
    if jax.process_index() == 0:
        print(f"[jmegatron] kd_finalize: wrote the plain student of {cfg.load} to {cfg.save}: iteration "
              f"{iteration}, {cfg.num_layers} layers x {cfg.hidden_size} hidden, "
              f"{num_parameters(cfg, run.padded_vocab_size):,} parameters, no distillation settings",
              flush=True)
    return {"iteration": iteration, "losses": {}, "val_loss": None, "interrupted": False, "summary": None,
            "state": state, "run": run}


class StopRules:
    """When :func:`train` stops (Megatron's checks in ``train``): ``train_iters`` (the loop's
    bound), ``exit_interval``, ``exit_duration_in_mins`` (:func:`_duration_exceeded`),
    SIGTERM / SIGINT (:class:`_StopRequest`) and, with several processes, the ranks' agreed
    stop: the step's ``stop`` metric, read one step late by :class:`StepFlags`."""

    def __init__(self, cfg: JMegatronConfig, train_start: float):
        self.cfg = cfg
        self.train_start = train_start  # time.time() of the run's start (the setup counts)
        self.signal = _StopRequest(cfg.exit_signal_handler)
        self.multi = jax.process_count() > 1
        self.agreed = False  # every process asked to stop (several processes)
        self.out_of_time = False

    def step_flag(self, iteration: int) -> bool:
        """This process's stop request for the step of ``iteration``: a signal, or
        ``exit_duration_in_mins`` passed (with several processes the step's 'stop' flag is
        their maximum, as Megatron all-reduces the elapsed-time check MAX)."""
        self.out_of_time = _duration_exceeded(self.train_start, self.cfg.exit_duration_in_mins)
        return self.signal.requested(iteration) or self.out_of_time

    def agree(self, stop: bool) -> None:
        """Record a step's agreed ``stop`` flag (the maximum over the processes)."""
        self.agreed = stop or self.agreed

    def signalled(self) -> bool:
        """Stop after this iteration for a signal or the time limit: several processes stop
        after the step following the agreed one, all at the same iteration."""
        return self.agreed if self.multi else (self.signal.event.is_set() or self.out_of_time)

    def exit_interval_reached(self, iteration: int) -> bool:
        """``iteration`` is a multiple of ``exit_interval`` (Megatron's --exit-interval)."""
        return bool(self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0)

    def reason(self) -> str:
        """Why :meth:`signalled` stops the run, for the closing line."""
        if self.signal.signum:
            return f"received signal {self.signal.signum}"
        if self.out_of_time:
            return (f"exit_duration_in_mins={self.cfg.exit_duration_in_mins} reached after "
                    f"{(time.time() - self.train_start) / 60:.2f} minutes")
        return "another process asked to stop"

    def restore(self) -> None:
        """Give the signals their previous handlers back."""
        self.signal.restore()


class NaNGuard:
    """Megatron's ``check_for_nan_in_loss_and_grad`` and ``max_consecutive_nan_iterations``:
    counts the iterations in a row whose loss or gradients were non-finite (skipped, no
    update; an fp16 dynamic loss scaler's overflow above ``min_loss_scale`` does not count,
    it backs off), raises FloatingPointError at the limit, and never lets a state holding
    inf / nan be checkpointed (:meth:`state_is_finite`). Without the check a non-finite
    logged loss raises at once (:meth:`check_loss`)."""

    def __init__(self, cfg: JMegatronConfig):
        self.cfg = cfg
        self.check = cfg.check_for_nan_in_loss_and_grad
        self.recoverable = cfg.fp16 and cfg.loss_scale is None  # the dynamic scaler backs off from overflows
        self.consecutive = 0
        self._finite = jax.jit(lambda s: all_finite((s.params, s.opt_state)))  # compiled at the first save

    def count(self, iteration: int, flags: dict) -> None:
        """Count step ``iteration``'s host ``flags`` (``nan``, ``skipped``, ``loss_scale``);
        raises FloatingPointError after ``max_consecutive_nan_iterations`` bad ones in a row."""
        cfg = self.cfg
        bad = bool(flags["nan"]) or (bool(flags["skipped"]) and not (
            self.recoverable and float(flags["loss_scale"]) > cfg.min_loss_scale))
        self.consecutive = self.consecutive + 1 if bad else 0
        if cfg.max_consecutive_nan_iterations and self.consecutive >= cfg.max_consecutive_nan_iterations:
            raise FloatingPointError(
                f"iteration {iteration}: {self.consecutive} consecutive iterations with a non-finite loss or "
                f"gradients (each skipped, no update applied); stopping at "
                f"config.max_consecutive_nan_iterations={cfg.max_consecutive_nan_iterations}. The last "
                f"checkpoint holds finite values: lower config.lr, check the data, or raise the limit "
                f"(0: never stop)")

    def check_loss(self, iteration: int, metrics: dict) -> None:
        """Without the check, raise FloatingPointError for a logged non-finite ``loss`` (with
        it such an iteration is skipped and counted)."""
        if not self.check and not math.isfinite(float(metrics["loss"])):
            raise FloatingPointError(f"loss is {metrics['loss']} at iteration {iteration}")

    def state_is_finite(self, state: Any) -> bool:
        """Whether the parameters and optimizer state hold only finite values."""
        return bool(self._finite(state))


class StepFlags:
    """Each step's flags (``skipped`` / ``nan`` / the agreed ``stop``) read one step late,
    after the next step is dispatched: the device never waits for the host, and no step
    adds a round trip. Feeds :class:`NaNGuard` and :class:`StopRules`."""

    def __init__(self, guard: NaNGuard, stop: StopRules):
        self.guard, self.stop = guard, stop
        self.unread = None  # (iteration, metrics) of the newest step whose flags are not read yet

    def push(self, iteration: int, metrics: dict) -> None:
        """Read the previous step's flags (it ran while this one was queued); keep this one's."""
        self.flush()
        self.unread = (iteration, metrics) if self.guard.check or self.stop.multi else None

    def flush(self) -> None:
        """Read the newest unread step's flags (the last step's: its non-finite iteration counts)."""
        if self.unread is None:
            return
        iteration, m = self.unread
        self.unread = None
        f = jax.device_get({k: m[k] for k in ("skipped", "nan", "stop", "loss_scale") if k in m})
        if self.guard.check:
            self.guard.count(iteration, f)
        self.stop.agree(bool(f.get("stop", 0.0)))


class TrainingLog:
    """Megatron's ``training_log``: the iterations since the last log line (their metrics,
    global batch and FLOPs), the interval's time less what compiling and saving took, the
    memory line (the first log; every log under ``test_memory``) and each iteration's
    summary loss (the forward step's ``loss_key``)."""

    def __init__(self, run: Run, logger: MetricsLogger, guard: NaNGuard, longest_length: Optional[int]):
        self.run, self.logger, self.guard = run, logger, guard
        fwd = run.forward_step
        self.loss_key, self.loss_name = fwd.loss_key, fwd.loss_name
        self.losses: dict = {}  # iteration -> its loss
        self.pending: list[tuple[int, dict, int, float]] = []  # (iteration, metrics, global batch, FLOPs)
        self.memory_reports = 0
        self.last_log = time.perf_counter()
        # under variable data the memory line's reserved pool is sized by the longest length the data can give
        self.longest_length = longest_length
        self.compile_counted = run.train_step.compile_seconds

    def count_compiles(self, iteration: int) -> float:
        """Seconds the train step spent compiling since the last count (0.0: none)."""
        seconds = self.run.train_step.compile_seconds - self.compile_counted
        self.compile_counted += seconds
        if seconds:
            self.logger.count_compile(seconds, iteration)
        return seconds

    def add(self, iteration: int, metrics: dict, global_batch_size: int, seq_length: int) -> None:
        """Queue an iteration of ``global_batch_size`` sequences padded to ``seq_length``
        (both vary under ramp-up / variable data)."""
        # a new batch shape compiled (announced by jmegatron.compilation): not this iteration's time
        self.pause(self.count_compiles(iteration))
        run = self.run
        # Megatron's formula over the tokens actually computed (padded to the batch's longest)
        flops = num_floating_point_operations(run.cfg, global_batch_size, run.padded_vocab_size,
                                              total_tokens=global_batch_size * seq_length,
                                              seqlen_squared_sum=global_batch_size * seq_length * seq_length)
        self.pending.append((iteration, metrics, global_batch_size, flops))

    def due(self, iteration: int, stopping: bool) -> bool:
        """A line at every ``log_interval``, the last iteration and before stopping."""
        cfg = self.run.cfg
        return iteration % cfg.log_interval == 0 or iteration == cfg.train_iters or stopping

    def log(self, iteration: int, consumed_samples: int, state: Any, batch: dict) -> None:
        """Write the line of the queued iterations (one host sync)."""
        run, cfg = self.run, self.run.cfg
        host = jax.device_get([m for _, m, _, _ in self.pending])
        now = time.perf_counter()
        report_memory = self.memory_reports == 0 or cfg.test_memory  # Megatron: first log; ByteMLPerf: all
        self.logger.log_train(iteration, host, now - self.last_log, consumed_samples, self.pending[-1][2],
                              flops=sum(f for _, _, _, f in self.pending),
                              memory_devices=jax.local_devices() if report_memory else None,
                              memory_rank=jax.process_index(),
                              compiled_memory=lambda: step_memory(run, state, batch, self.longest_length))
        self.count_compiles(iteration)  # the longest length's program, compiled for the memory line
        self.memory_reports += report_memory
        for (it, _, _, _), m in zip(self.pending, host):
            self.losses[it] = float(m.get(self.loss_key, m["loss"]))
            self.loss_name = self.run.forward_step.loss_name if self.loss_key in m else "loss"
            self.guard.check_loss(it, m)
        self.pending = []
        self.restart_timer()

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (compiling, saving) out of the interval's time."""
        self.last_log += seconds

    def restart_timer(self) -> None:
        """Start the interval's time now (after an evaluation, which is not timed)."""
        self.last_log = time.perf_counter()

    def final_loss(self) -> Optional[float]:
        """The loss of the last logged iteration (None: none logged)."""
        return self.losses[max(self.losses)] if self.losses else None


class Evaluation:
    """Megatron's ``evaluate_and_print_results`` every ``eval_interval`` iterations and at
    the end: the validation loss over ``eval_iters`` batches of ``valid_ds``, the iterator
    continuing between evaluations (``consumed_valid``, Megatron's
    ``consumed_valid_samples``) unless ``eval_fixed_batches``."""

    def __init__(self, run: Run, valid_ds: Any, consumed_valid: int, logger: MetricsLogger):
        self.run, self.valid_ds, self.consumed_valid, self.logger = run, valid_ds, consumed_valid, logger
        self.val_loss: Optional[float] = None

    def due(self, iteration: int) -> bool:
        """``iteration`` is a multiple of ``eval_interval``."""
        interval = self.run.cfg.eval_interval
        return bool(interval) and iteration % interval == 0

    def due_at_end(self, iteration: int) -> bool:
        """The closing evaluation: the run reached ``train_iters`` off the interval."""
        cfg = self.run.cfg
        return iteration == cfg.train_iters and bool(cfg.eval_interval) and bool(iteration % cfg.eval_interval)

    def evaluate_and_print_results(self, iteration: int, params: Any) -> None:
        """Evaluate ``params`` and log the validation block (nothing without a validation
        split or ``eval_iters``)."""
        cfg, run = self.run.cfg, self.run
        if self.valid_ds is None or not len(self.valid_ds) or not cfg.eval_iters:
            return
        start = 0 if cfg.eval_fixed_batches else self.consumed_valid
        val = evaluate(run, params, self.valid_ds, cfg.eval_iters, start)
        if not cfg.eval_fixed_batches:
            self.consumed_valid += cfg.eval_iters * run.global_batch_size
        self.logger.log_eval(iteration, val)
        self.val_loss = val


class Saving:
    """Megatron's ``save_checkpoint_and_time``: a checkpoint every ``save_interval``
    iterations and at the end, each iteration at most once, never one whose state holds
    inf / nan (:meth:`NaNGuard.state_is_finite`; the last checkpoint is kept). ``saved_at``:
    the newest iteration in ``cfg.save`` (-1: none)."""

    def __init__(self, run: Run, ckpt: Optional[checkpointing.Checkpointer], guard: NaNGuard, saved_at: int):
        self.run, self.ckpt, self.guard, self.saved_at = run, ckpt, guard, saved_at

    def due(self, iteration: int) -> bool:
        """``iteration`` is a multiple of ``save_interval``."""
        interval = self.run.cfg.save_interval
        return bool(interval) and iteration % interval == 0

    def save_checkpoint(self, iteration: int, state: Any, consumed_train: int, consumed_valid: int) -> None:
        """Save ``state`` at ``iteration`` with the samples consumed so far (no-op without
        ``cfg.save``, or when that iteration is saved already)."""
        if not self.ckpt or self.saved_at == iteration:
            return
        if not self.guard.state_is_finite(state):  # never checkpoint inf / nan
            print(f"[jmegatron] not saving iteration {iteration}: the parameters or optimizer state hold inf/nan "
                  f"values; the last checkpoint ({self.saved_at if self.saved_at >= 0 else 'none'}) is kept",
                  flush=True)
            return
        self.ckpt.save(iteration, state, checkpoint_meta(self.run.cfg, self.run, iteration, consumed_train,
                                                         consumed_valid))
        self.saved_at = iteration

    def save_checkpoint_and_time(self, iteration: int, state: Any, consumed_train: int,
                                 consumed_valid: int) -> float:
        """Save and return the seconds it took: Megatron stops 'interval-time' while saving,
        so the save is not timed as part of the next logged iteration (the step itself still is)."""
        jax.block_until_ready(state)
        started = time.perf_counter()
        self.save_checkpoint(iteration, state, consumed_train, consumed_valid)
        return time.perf_counter() - started

    def describe(self) -> Optional[str]:
        """The closing line's checkpoint (None: nothing saved)."""
        return f"{self.run.cfg.save} (iteration {self.saved_at})" if self.ckpt and self.saved_at >= 0 else None


def train(run: Run, state: Any, iteration: int, loader: BatchLoader, batch_rows: Optional[np.ndarray],
          stop: StopRules, flags: StepFlags, log: TrainingLog, evaluation: Evaluation,
          saving: Saving) -> tuple[Any, int, bool]:
    """Megatron's ``train``: steps from ``iteration`` until ``train_iters`` or a stop rule,
    logging, evaluating and saving at their intervals. Returns ``(state, iteration,
    interrupted)`` (interrupted: a signal, the time limit or another process stopped it)."""
    cfg = run.cfg
    while iteration < cfg.train_iters:
        host_batch = next(loader)
        batch = run.put_batch(host_batch, rows=batch_rows)
        state, metrics = run.train_step(state, batch, *run.extra_args, stop=stop.step_flag(iteration + 1))
        iteration += 1
        log.add(iteration, metrics, loader.last_global_batch_size, host_batch["tokens"].shape[-1])
        flags.push(iteration, metrics)
        signalled = stop.signalled()
        if log.due(iteration, signalled or stop.exit_interval_reached(iteration)):
            log.log(iteration, loader.consumed_samples, state, batch)
        if evaluation.due(iteration):
            evaluation.evaluate_and_print_results(iteration, state.params)
            log.restart_timer()
        if saving.due(iteration):
            log.pause(saving.save_checkpoint_and_time(iteration, state, loader.consumed_samples,
                                                      evaluation.consumed_valid))
        if signalled:
            print(f"[jmegatron] {stop.reason()}: saving a checkpoint at iteration {iteration} and exiting", flush=True)
            return state, iteration, True
        if stop.exit_interval_reached(iteration):
            print(f"[jmegatron] exiting at iteration {iteration} (exit_interval)", flush=True)
            break
    return state, iteration, False


def open_save_dir(cfg: JMegatronConfig, iteration: int, main_process: bool) -> Optional[checkpointing.Checkpointer]:
    """The run's Checkpointer of ``cfg.save`` (None without it); the main process writes
    ``config.json`` there and drops ``metrics.jsonl`` records past ``iteration``."""
    if not cfg.save:
        return None
    os.makedirs(cfg.save, exist_ok=True)
    ckpt = checkpointing.Checkpointer(cfg.save, cfg.keep_checkpoints, cfg.async_save)
    if main_process:
        with open(os.path.join(cfg.save, "config.json"), "w") as f:
            f.write(cfg.to_json())
        _truncate_metrics(os.path.join(cfg.save, "metrics.jsonl"), iteration)
    return ckpt


def build_train_loader(run: Run, train_ds: Any, consumed: int, batch_rows: Optional[np.ndarray]) -> BatchLoader:
    """The training split's :class:`BatchLoader` from sample ``consumed`` (this process's
    ``batch_rows``), announcing a batch-size ramp-up and variable sample lengths."""
    cfg = run.cfg
    loader = BatchLoader(train_ds, run.global_batch_size, run.num_microbatches, consumed,
                         run.num_microbatches_calculator, rows=batch_rows, dataloader_type=cfg.dataloader_type,
                         num_workers=cfg.num_workers)
    if cfg.rampup_batch_size is not None:  # Megatron's calculator logs the same
        start, inc, ramp = cfg.rampup_batch_size
        print(f"[jmegatron] batch size ramp-up from {start} by {inc} to {run.global_batch_size} over {ramp} "
              f"samples: {cfg.train_iters} iterations for {cfg.train_samples} samples", flush=True)
    if cfg.variable_data and train_ds is not None:
        print(f"[jmegatron] variable data: sample lengths {sorted(train_ds.lengths)} (padded to each batch's "
              f"longest; one compilation per length)", flush=True)
    return loader


def build_logger(run: Run, start_iteration: int, main_process: bool) -> MetricsLogger:
    """The run's :class:`MetricsLogger` (files and TensorBoard / W&B on the main process
    only) with the FLOPs per iteration and the MFU peaks; prints the run's layout line and,
    on the main process, the peak in use and the theoretical memory."""
    cfg = run.cfg
    num_devices = run.mesh.devices.size
    flops_per_iter = num_floating_point_operations(cfg, run.global_batch_size, run.padded_vocab_size)
    tb_dir = cfg.tensorboard_dir or (os.path.join(cfg.save, "tensorboard") if cfg.save else None)
    # CPU devices of this process share its cores: the host's peak is split among those in the mesh.
    peak_choice = resolve_peak_for_config(cfg, num_local_devices=sum(
        d.process_index == jax.process_index() for d in run.mesh.devices.flat))
    wandb_run = None
    if main_process and cfg.wandb_project:  # one process logs, as Megatron's _set_wandb_writer
        wandb_run = init_wandb(cfg.wandb_project, cfg.wandb_exp_name,
                               cfg.wandb_save_dir or os.path.join(cfg.save, "wandb"), json.loads(cfg.to_json()),
                               cfg.wandb_entity)
    try:
        logger = MetricsLogger(cfg.save if main_process else None, tb_dir if main_process else None,
                               flops_per_iter, num_devices, peak_choice.tflops, cfg.train_iters,
                               stream=None if main_process else open(os.devnull, "w"),
                               theoretical_peak_tflops=peak_choice.theoretical_tflops, wandb_run=wandb_run,
                               start_iteration=start_iteration)
    except BaseException:
        if wandb_run is not None:  # (the logger finishes it from here on)
            wandb_run.finish(exit_code=1)
        raise
    print(f"[jmegatron] process {jax.process_index()}/{jax.process_count()}, {num_devices} devices, mesh {dict(run.mesh.shape)}, "
          f"{num_parameters(cfg, run.padded_vocab_size):,} parameters, global batch "
          f"{run.global_batch_size} = {run.num_microbatches} micro-batches x {cfg.micro_batch_size} x dp "
          f"{data_parallel_size(run.mesh)}", flush=True)
    if main_process:
        print(f"[jmegatron] {peak_choice.describe()}", flush=True)
        report_theoretical_memory(run)
    return logger


def report_theoretical_memory(run: Run) -> None:
    """Megatron's ``report_theoretical_memory``: weights, gradients, optimizer state and
    activations per device (MiB), plus the forward step's frozen inputs (a teacher's
    parameters) as laid out."""
    cfg = run.cfg
    est = memory.theoretical_memory(cfg, run.padded_vocab_size,
                                    memory.ParallelLayout.from_config(cfg, run.mesh.shape["data"]))
    mib = 1024 ** 2
    frozen = memory.bytes_per_device(run.extra_args)
    print(f"[jmegatron] theoretical memory per device (MiB): weights {est.weights / mib:.1f}, gradients "
          f"{est.gradients / mib:.1f}, optimizer {est.optimizer_state / mib:.1f}, activations "
          f"{est.activations / mib:.1f} (recompute {cfg.recompute_granularity})"
          + (f", frozen inputs {frozen / mib:.1f} (e.g. a teacher)" if frozen else "")
          + f", total {(est.total + frozen) / mib:.1f}", flush=True)


def pretrain(cfg: JMegatronConfig, mesh: Optional[Mesh] = None,
             forward_step_provider: Optional[ForwardStepProvider] = None) -> dict:
    """Train ``cfg.train_iters`` iterations (resuming from ``cfg.load``), evaluating every
    ``eval_interval``, saving every ``save_interval`` and at the end. Returns a summary
    dict: ``iteration``, ``losses`` (iteration -> loss of this process's run),
    ``val_loss``, ``interrupted``, ``summary`` (the closing line's figures:
    :meth:`jmegatron.training.logging.MetricsLogger.log_summary`). With
    ``cfg.wandb_project`` the main process also logs the TensorBoard scalars to a W&B run
    (:func:`jmegatron.training.logging.init_wandb`; files under ``cfg.wandb_save_dir``,
    default ``<save>/wandb``). ``forward_step_provider``: what each micro-batch computes
    (:class:`jmegatron.training.forward_step.ForwardStep`; default the language model;
    :func:`jmegatron.pretrain_gpt.pretrain` picks distillation's for a ``kd_teacher_load``
    config). ``cfg.kd_finalize``: :func:`finalize_student` instead (no data, no step).

    Composes :func:`build_datasets`, :func:`load_or_init`, :func:`build_logger` and
    :func:`train` with its parts: :class:`StopRules`, :class:`NaNGuard` (read through
    :class:`StepFlags`), :class:`TrainingLog`, :class:`Evaluation` and :class:`Saving`.
    """
    train_start = time.time()  # Megatron's _TRAIN_START_TIME (exit_duration_in_mins counts the setup too)
    run = build(cfg, mesh, forward_step_provider=forward_step_provider)
    if cfg.kd_finalize:  # a conversion: no data, no step
        return finalize_student(run)
    main_process = jax.process_index() == 0
    # Bad input fails before anything is written: the datasets are built and the checkpoint is
    # checked and restored first, so a bad data path or another model's checkpoint leaves an
    # existing run's config.json, metrics.jsonl and checkpoints as they were.
    train_ds, valid_ds, _ = build_datasets(cfg, run.global_batch_size)
    state, iteration, consumed, consumed_valid = load_or_init(run, None)
    start_iteration = iteration
    ckpt = open_save_dir(cfg, iteration, main_process)
    batch_rows = run.batch_rows()  # this process reads only the rows its devices hold
    loader = build_train_loader(run, train_ds, consumed, batch_rows)
    logger = build_logger(run, start_iteration, main_process)
    stop = StopRules(cfg, train_start)
    guard = NaNGuard(cfg)
    log = TrainingLog(run, logger, guard,
                      max(train_ds.lengths) if cfg.variable_data and train_ds is not None else None)
    evaluation = Evaluation(run, valid_ds, consumed_valid, logger)
    # Loaded from another directory: the final save writes it to `save`.
    resumed_from_save = bool(cfg.save) and iteration > 0 and checkpointing.has_checkpoint(cfg.save)
    saving = Saving(run, ckpt, guard, iteration if resumed_from_save else -1)
    flags = StepFlags(guard, stop)
    summary = {"losses": log.losses, "val_loss": None, "interrupted": False}
    failed = True  # until the loop ends normally (the W&B run is finished with its exit code)
    try:
        state, iteration, summary["interrupted"] = train(run, state, iteration, loader, batch_rows, stop, flags,
                                                         log, evaluation, saving)
        flags.flush()  # the last step's flags (count its non-finite iteration)
        if evaluation.due_at_end(iteration):
            evaluation.evaluate_and_print_results(iteration, state.params)
        saving.save_checkpoint(iteration, state, loader.consumed_samples, evaluation.consumed_valid)
        summary["val_loss"] = evaluation.val_loss
        summary["summary"] = logger.log_summary(iteration, time.time() - train_start, log.final_loss(),
                                                evaluation.val_loss, saving.describe(), log.loss_name)
        failed = False
    finally:
        loader.close()  # stops and joins the prefetch thread (errors, signals and normal ends alike)
        stop.restore()
        if ckpt:
            ckpt.close()
        logger.close(failed)
    summary["iteration"] = iteration
    summary["state"] = state
    summary["run"] = run
    return summary
