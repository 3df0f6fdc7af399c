"""The pretraining loop: config -> mesh -> model/state -> data -> jitted step -> logs
and checkpoints (the role of Megatron's ``pretrain``/``train`` in
megatron/training/training.py).

Everything with side effects lives here; the step itself is pure (``step.py``), the
static pieces are built by :func:`jmegatron.training.run.build` (a :class:`Run`: mesh,
model, optimizer, shardings, jitted steps), and what a micro-batch computes comes from the
forward step provider given to :func:`pretrain` (:mod:`jmegatron.training.forward_step`):
the loop composes them and imports none of distillation, the pipeline schedule or the loss.
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
from jmegatron.config import JMegatronConfig, tokenizer_type_of
from jmegatron.data.blended_dataset import build_train_valid_test_datasets
from jmegatron.data.gpt_variable_dataset import GPTVariableDataset
from jmegatron.data.loader import BatchLoader
from jmegatron.data.teacher_logits import TeacherLogitsDataset
from jmegatron.data.tokenizer import build_tokenizer
from jmegatron.parallel.rules import data_parallel_size
from jmegatron.training import flops, memory
from jmegatron.training.float16_optimizer import Float16OptimizerState, all_finite
from jmegatron.training.logging import MetricsLogger, init_wandb
from jmegatron.training.peak import resolve_peak_for_config
from jmegatron.training.run import ForwardStepProvider, Run, build, checkpoint_meta, restore_latest, vocab_size_of


def get_train_valid_test_num_samples(cfg: JMegatronConfig, global_batch_size: int) -> tuple[int, int, int]:
    """Samples per split, as Megatron's ``get_train_valid_test_num_samples``
    (megatron/training/training.py): ``train_samples`` (or ``train_iters * gbs``);
    ``(train_iters // eval_interval + 1) * eval_iters * gbs`` validation samples, enough for
    every evaluation plus the one at the end, since the validation iterator continues from
    one evaluation to the next; ``eval_iters * gbs`` test samples. With
    ``eval_fixed_batches`` every evaluation reads the same first ``eval_iters`` batches, so
    only those are built. ``eval_interval = 0`` (no evaluation during training) counts one
    evaluation."""
    train = cfg.train_samples if cfg.train_samples is not None else cfg.train_iters * global_batch_size
    evaluations = 1 if cfg.eval_fixed_batches or not cfg.eval_interval else cfg.train_iters // cfg.eval_interval + 1
    return train, evaluations * cfg.eval_iters * global_batch_size, cfg.eval_iters * global_batch_size


def build_datasets(cfg: JMegatronConfig, global_batch_size: int):
    """(train, valid, test) datasets sized by :func:`get_train_valid_test_num_samples`; with
    ``cfg.variable_data`` each is wrapped in ByteMLPerf's
    :class:`~jmegatron.data.gpt_variable_dataset.GPTVariableDataset` (ByteMLPerf uses it for
    all three splits). With ``cfg.kd_teacher_logits_path`` the training split carries the
    cached teacher top-K (:class:`jmegatron.data.teacher_logits.TeacherLogitsDataset`).
    ``cfg.sft``: every prefix's splits are packed chat conversations
    (:class:`jmegatron.data.sft_dataset.SFTDataset`, padding with the tokenizer's eod);
    ``cfg.fim_data``: fill-in-the-middle samples
    (:class:`jmegatron.data.fim_dataset.GPTFIMDataset` with the ``fim_*`` fields).
    Raises ValueError (data_path, split, FIM tokens; CacheMismatchError for a cache of other
    data) or FileNotFoundError for missing prefixes, loss masks or cache."""
    num_samples = get_train_valid_test_num_samples(cfg, global_batch_size)
    kind = tokenizer_type_of(cfg)
    if kind == "GPT2BPETokenizer" and not cfg.tokenizer_type:
        print("[jmegatron] tokenizer_type not given: GPT2BPETokenizer, for vocab_file and merge_file (Megatron's "
              "pretrain_gpt.py default)", flush=True)
    tokenizer = build_tokenizer(cfg) if kind else None
    eod = None if tokenizer is None else tokenizer.eod
    fim = None
    if cfg.fim_data:
        fim = dict(tokenizer=tokenizer, fim_rate=cfg.fim_rate, fim_spm_rate=cfg.fim_spm_rate,
                   fim_split_sample=cfg.fim_split_sample, fim_fragment_rate=cfg.fim_fragment_rate,
                   fim_no_prefix=cfg.fim_no_prefix,
                   fim_extra_tokens=dict(prefix=cfg.fim_prefix_token, middle=cfg.fim_middle_token,
                                         suffix=cfg.fim_suffix_token, pad=cfg.fim_pad_token, eod=cfg.fim_eod_token))
    data_path = cfg.data_path.split() if cfg.data_path else []
    splits = build_train_valid_test_datasets(
        data_path=data_path, split=cfg.split, train_valid_test_num_samples=num_samples,
        seq_length=cfg.seq_length, seed=cfg.seed, eod_id=eod, mock=cfg.mock_data,
        vocab_size=vocab_size_of(cfg), eod_mask_loss=cfg.eod_mask_loss,
        reset_position_ids=cfg.reset_position_ids, reset_attention_mask=cfg.reset_attention_mask,
        sft=cfg.sft, fim=fim)
    if cfg.kd_teacher_logits_path and not cfg.kd_finalize:  # offline distillation: the cached teacher top-K
        splits = (TeacherLogitsDataset(splits[0], cfg.kd_teacher_logits_path, cfg, num_samples[0]),) + tuple(splits[1:])
    if not cfg.variable_data:
        return splits
    return tuple(None if ds is None else GPTVariableDataset(ds, cfg.seq_length, cfg.seq_length_step, cfg.seed,
                                                            0 if eod is None else eod, cfg.eod_mask_loss,
                                                            seq_length_min=cfg.seq_length_min)
                 for ds in splits)


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
              f"{flops.num_parameters(cfg, run.padded_vocab_size):,} parameters, no distillation settings",
              flush=True)
    return {"iteration": iteration, "losses": {}, "val_loss": None, "interrupted": False, "summary": None,
            "state": state, "run": run}


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
    ckpt = None
    if cfg.save:
        os.makedirs(cfg.save, exist_ok=True)
        ckpt = checkpointing.Checkpointer(cfg.save, cfg.keep_checkpoints, cfg.async_save)
        if main_process:
            with open(os.path.join(cfg.save, "config.json"), "w") as f:
                f.write(cfg.to_json())
    if main_process and cfg.save:
        _truncate_metrics(os.path.join(cfg.save, "metrics.jsonl"), iteration)
    batch_rows = run.batch_rows()  # this process reads only the rows its devices hold
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
    num_devices = run.mesh.devices.size
    flops_per_iter = flops.num_floating_point_operations(cfg, run.global_batch_size, run.padded_vocab_size)
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
          f"{flops.num_parameters(cfg, run.padded_vocab_size):,} parameters, global batch "
          f"{run.global_batch_size} = {run.num_microbatches} micro-batches x {cfg.micro_batch_size} x dp "
          f"{data_parallel_size(run.mesh)}", flush=True)
    if main_process:
        print(f"[jmegatron] {peak_choice.describe()}", flush=True)
    if main_process:  # Megatron's report_theoretical_memory
        est = memory.theoretical_memory(cfg, run.padded_vocab_size,
                                        memory.ParallelLayout.from_config(cfg, run.mesh.shape["data"]))
        mib = 1024 ** 2
        # the forward step's frozen inputs (a distillation teacher's parameters), as laid out
        frozen = memory.bytes_per_device(run.extra_args)
        print(f"[jmegatron] theoretical memory per device (MiB): weights {est.weights / mib:.1f}, gradients "
              f"{est.gradients / mib:.1f}, optimizer {est.optimizer_state / mib:.1f}, activations "
              f"{est.activations / mib:.1f} (recompute {cfg.recompute_granularity})"
              + (f", frozen inputs {frozen / mib:.1f} (e.g. a teacher)" if frozen else "")
              + f", total {(est.total + frozen) / mib:.1f}", flush=True)
    stop = _StopRequest(cfg.exit_signal_handler)
    summary = {"losses": {}, "val_loss": None, "interrupted": False}
    pending: list[tuple[int, dict, int, float]] = []  # (iteration, metrics, global batch, FLOPs)

    def iteration_flops(gbs: int, seq: int) -> float:
        # Megatron's formula over the tokens actually computed (padded to the batch's longest)
        return flops.num_floating_point_operations(cfg, gbs, run.padded_vocab_size, total_tokens=gbs * seq,
                                                   seqlen_squared_sum=gbs * seq * seq)

    memory_reports = 0
    last_log = time.perf_counter()
    # under variable data the memory line's reserved pool is sized by the longest length the data can give
    longest_length = max(train_ds.lengths) if cfg.variable_data and train_ds is not None else None
    compile_counted = run.train_step.compile_seconds

    def count_compiles(it: int) -> float:
        """Seconds the train step spent compiling since the last count (0.0: none)."""
        nonlocal compile_counted
        seconds = run.train_step.compile_seconds - compile_counted
        compile_counted += seconds
        if seconds:
            logger.count_compile(seconds, it)
        return seconds
    # Loaded from another directory: the final save writes it to `save`.
    resumed_from_save = bool(cfg.save) and iteration > 0 and checkpointing.has_checkpoint(cfg.save)
    saved_at = iteration if resumed_from_save else -1

    state_is_finite = jax.jit(lambda s: all_finite((s.params, s.opt_state)))  # compiled at the first save

    def save(it: int):
        nonlocal saved_at
        if ckpt and saved_at != it and not bool(state_is_finite(state)):  # never checkpoint inf / nan
            print(f"[jmegatron] not saving iteration {it}: the parameters or optimizer state hold inf/nan "
                  f"values; the last checkpoint ({saved_at if saved_at >= 0 else 'none'}) is kept", flush=True)
            return
        if ckpt and saved_at != it:
            ckpt.save(it, state, checkpoint_meta(cfg, run, it, loader.consumed_samples, consumed_valid))
            saved_at = it

    def run_eval(it: int):
        nonlocal consumed_valid
        if valid_ds is not None and len(valid_ds) and cfg.eval_iters:
            # Megatron's valid iterator continues between evaluations (consumed_valid_samples)
            start = 0 if cfg.eval_fixed_batches else consumed_valid
            val = evaluate(run, state.params, valid_ds, cfg.eval_iters, start)
            if not cfg.eval_fixed_batches:
                consumed_valid += cfg.eval_iters * run.global_batch_size
            logger.log_eval(it, val)
            summary["val_loss"] = val

    # Each step's flags (skipped / nan / the agreed stop) are read one step late, after the next
    # step is dispatched: the device never waits for the host, and no step adds a round trip.
    multi = jax.process_count() > 1
    check = cfg.check_for_nan_in_loss_and_grad
    recoverable = cfg.fp16 and cfg.loss_scale is None  # the dynamic scaler backs off from overflows
    consecutive_nan = 0
    unread = None  # (iteration, metrics) of the newest step whose flags are not read yet
    agreed = False  # every process asked to stop (several processes)
    loss_name = "lm loss"  # the summary's name of summary["losses"]
    failed = True  # until the loop ends normally (the W&B run is finished with its exit code)

    def read_flags(it: int, m: dict) -> bool:
        """Count step ``it``'s non-finite iteration; raise after max_consecutive_nan_iterations
        in a row; return the processes' agreed stop request."""
        nonlocal consecutive_nan
        f = jax.device_get({k: m[k] for k in ("skipped", "nan", "stop", "loss_scale") if k in m})
        if check:
            bad = bool(f["nan"]) or (bool(f["skipped"]) and not (
                recoverable and float(f["loss_scale"]) > cfg.min_loss_scale))
            consecutive_nan = consecutive_nan + 1 if bad else 0
            if cfg.max_consecutive_nan_iterations and consecutive_nan >= cfg.max_consecutive_nan_iterations:
                raise FloatingPointError(
                    f"iteration {it}: {consecutive_nan} consecutive iterations with a non-finite loss or "
                    f"gradients (each skipped, no update applied); stopping at "
                    f"config.max_consecutive_nan_iterations={cfg.max_consecutive_nan_iterations}. The last "
                    f"checkpoint holds finite values: lower config.lr, check the data, or raise the limit "
                    f"(0: never stop)")
        return bool(f.get("stop", 0.0))

    try:
        while iteration < cfg.train_iters:
            host_batch = next(loader)
            batch = run.put_batch(host_batch, rows=batch_rows)
            # exit_duration_in_mins joins this process's stop request: with several processes the
            # step's 'stop' flag is their maximum (Megatron all-reduces the elapsed-time check MAX)
            out_of_time = _duration_exceeded(train_start, cfg.exit_duration_in_mins)
            state, metrics = run.train_step(state, batch, *run.extra_args,
                                            stop=stop.requested(iteration + 1) or out_of_time)
            iteration += 1
            # a new batch shape compiled (announced by jmegatron.compilation): not this iteration's time
            last_log += count_compiles(iteration)
            # this iteration's global batch and (padded) length: both vary under ramp-up / variable data
            gbs, seq = loader.last_global_batch_size, host_batch["tokens"].shape[-1]
            pending.append((iteration, metrics, gbs, iteration_flops(gbs, seq)))
            if unread is not None:  # the previous step's flags: it ran while this one was queued
                agreed = read_flags(*unread) or agreed
            unread = (iteration, metrics) if check or multi else None
            # several processes stop after the step following the agreed one: all at the same iteration
            signalled = agreed if multi else (stop.event.is_set() or out_of_time)
            stopping = signalled or bool(cfg.exit_interval and iteration % cfg.exit_interval == 0)
            if iteration % cfg.log_interval == 0 or iteration == cfg.train_iters or stopping:
                host = jax.device_get([m for _, m, _, _ in pending])
                now = time.perf_counter()
                report_memory = memory_reports == 0 or cfg.test_memory  # Megatron: first log; ByteMLPerf: all
                logger.log_train(iteration, host, now - last_log, loader.consumed_samples, pending[-1][2],
                                 flops=sum(f for _, _, _, f in pending),
                                 memory_devices=jax.local_devices() if report_memory else None,
                                 memory_rank=jax.process_index(),
                                 compiled_memory=lambda: step_memory(run, state, batch, longest_length))
                count_compiles(iteration)  # the longest length's program, compiled for the memory line
                memory_reports += report_memory
                for (it, _, _, _), m in zip(pending, host):
                    summary["losses"][it] = float(m.get("lm_loss", m["loss"]))
                    loss_name = "lm loss" if "lm_loss" in m else "loss"
                    if not check and not math.isfinite(float(m["loss"])):  # (checked: skipped, counted)
                        raise FloatingPointError(f"loss is {m['loss']} at iteration {it}")
                pending, last_log = [], time.perf_counter()
            if cfg.eval_interval and iteration % cfg.eval_interval == 0:
                run_eval(iteration)
                last_log = time.perf_counter()
            if cfg.save_interval and iteration % cfg.save_interval == 0:
                # Megatron's save_checkpoint_and_time stops 'interval-time' while saving: the save
                # is not timed as part of the next logged iteration (the step itself still is)
                jax.block_until_ready(state)
                save_started = time.perf_counter()
                save(iteration)
                last_log += time.perf_counter() - save_started
            if signalled:
                reason = (f"received signal {stop.signum}" if stop.signum else
                          f"exit_duration_in_mins={cfg.exit_duration_in_mins} reached after "
                          f"{(time.time() - train_start) / 60:.2f} minutes" if out_of_time else
                          "another process asked to stop")
                print(f"[jmegatron] {reason}: saving a checkpoint at iteration {iteration} and exiting", flush=True)
                summary["interrupted"] = True
                break
            if cfg.exit_interval and iteration % cfg.exit_interval == 0:
                print(f"[jmegatron] exiting at iteration {iteration} (exit_interval)", flush=True)
                break
        if unread is not None:  # the last step's flags (count its non-finite iteration)
            read_flags(*unread)
        if iteration == cfg.train_iters and cfg.eval_interval and iteration % cfg.eval_interval:
            run_eval(iteration)
        save(iteration)
        final = summary["losses"][max(summary["losses"])] if summary["losses"] else None
        summary["summary"] = logger.log_summary(
            iteration, time.time() - train_start, final, summary["val_loss"],
            f"{cfg.save} (iteration {saved_at})" if ckpt and saved_at >= 0 else None, loss_name)
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
