"""The training groups of a run's config: :class:`MixedPrecisionConfig` (compute dtype and
fp16 loss scaling), :class:`TrainingConfig` (batch sizes, length, learning-rate schedule,
optimizer), :class:`LoggingConfig` (logging, evaluation, checkpoints, stop rules) and
:class:`DistillationConfig` (a teacher to distil from).

Field names, defaults and meanings follow megatron/training/arguments.py
(``_add_mixed_precision_args``, ``_add_training_args``, ``_add_learning_rate_args``,
``_add_logging_args``, ``_add_checkpointing_args``) and Megatron's ``--export-kd-*`` flags.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from jmegatron.config.common import ConfigError, ConfigGroup, check_nonnegative, check_positive
from jmegatron.num_microbatches_calculator import NumMicroBatchesCalculatorError, update_train_iters

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD", "multi-step")  # multi-step: ByteMLPerf
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclasses.dataclass(frozen=True)
class MixedPrecisionConfig(ConfigGroup):
    """The compute dtype and fp16's loss scaling (:mod:`jmegatron.training.grad_scaler`)."""

    # --- precision (megatron/training/arguments.py: _add_mixed_precision_args; docs/PRECISION.md) ---
    # bf16 / fp16: parameters and compute in that dtype, float32 main parameters and
    # optimizer state held by the optimizer (Megatron's Float16OptimizerWithFloat16Params)
    bf16: bool = False
    fp16: bool = False  # with loss scaling: dynamic unless loss_scale is set
    loss_scale: Optional[float] = None  # fp16: a constant loss scale; None: dynamic
    initial_loss_scale: float = 2.0 ** 32  # fp16 dynamic loss scaling (megatron/core/optimizer/grad_scaler.py)
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # clean iterations before the scale doubles
    hysteresis: int = 2  # overflowing iterations tolerated before the scale halves
    # gradients accumulated over micro-batches and all-reduced in float32 (forced True
    # under bf16, as Megatron's validate_args does); False: in the parameters' dtype
    accumulate_allreduce_grads_in_fp32: bool = False

    def check_precision(self) -> None:
        """Raise ConfigError naming the field: both dtypes, a non-positive scale, a window
        or hysteresis below 1."""
        if self.bf16 and self.fp16:
            raise ConfigError("config.bf16=True and config.fp16=True: choose one compute dtype.")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ConfigError(f"config.loss_scale={self.loss_scale} must be > 0 (or None: dynamic).")
        for name in ("initial_loss_scale", "min_loss_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be > 0.")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"config.min_loss_scale={self.min_loss_scale} exceeds config.initial_loss_scale="
                              f"{self.initial_loss_scale}; lower min_loss_scale.")
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be >= 1.")


@dataclasses.dataclass(frozen=True)
class TrainingConfig(ConfigGroup):
    """Batch sizes, the training length (iterations or samples), the learning-rate
    schedule and the Adam optimizer."""

    CHOICES = {"lr_decay_style": LR_DECAY_STYLES, "lr_wsd_decay_style": WSD_DECAY_STYLES}

    # --- batch sizes and schedule (megatron/training/arguments.py: _add_training_args) ---
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # None: micro_batch_size * data_parallel_size
    # (start global batch, increment, ramp-up samples): Megatron's --rampup-batch-size
    # (needs train_samples, as Megatron); see jmegatron.num_microbatches_calculator
    rampup_batch_size: Optional[tuple] = None
    # iteration- or sample-based (Megatron: exactly one of --train-iters / --train-samples);
    # None: derived from train_samples (Megatron's update_train_iters), else 100
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0  # the warm-up starts from this rate
    lr_warmup_fraction: Optional[float] = None  # warm-up = this fraction of the decay length
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0  # sample-based runs
    lr_decay_iters: Optional[int] = None  # None: = train_iters (iteration-based runs)
    lr_decay_samples: Optional[int] = None  # None: = train_samples (sample-based runs)
    lr_decay_style: str = "linear"
    # multi-step (ByteMLPerf's --lr-decay-multi-step): shares of the decay at lr, lr/sqrt(10), lr/10
    lr_decay_multi_step: tuple = (0.6, 0.3, 0.1)
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: Optional[int] = None  # WSD: the final annealing phase length
    lr_wsd_decay_samples: Optional[int] = None  # WSD, sample-based runs
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping

    def check_training_length(self) -> None:
        """Raise ConfigError for iteration- and sample-based fields mixed, as Megatron's validate_args
        asserts them, and for a bad warm-up fraction or multi-step decay."""
        if self.train_samples is None:
            for name, unset in (("lr_warmup_samples", 0), ("lr_decay_samples", None),
                                ("lr_wsd_decay_samples", None), ("rampup_batch_size", None)):
                if getattr(self, name) != unset:
                    why = ("Megatron ramps the batch size only in sample-based training"
                           if name == "rampup_batch_size" else "it belongs to sample-based training")
                    raise ConfigError(f"config.{name}={getattr(self, name)!r} needs config.train_samples "
                                      f"({why}); set train_samples instead of train_iters, or drop {name}.")
        else:
            if self.train_samples <= 0:
                raise ConfigError(f"config.train_samples={self.train_samples} must be > 0.")
            for name, unset in (("lr_warmup_iters", 0), ("lr_decay_iters", None), ("lr_wsd_decay_iters", None)):
                if getattr(self, name) != unset:
                    raise ConfigError(
                        f"config.{name}={getattr(self, name)!r} is iteration-based but config.train_samples="
                        f"{self.train_samples} makes the run sample-based (Megatron allows one of the two); use "
                        f"{name.replace('iters', 'samples')}.")
            if self.global_batch_size is None:
                raise ConfigError("config.train_samples needs config.global_batch_size (the number of "
                                  "iterations is derived from it); set global_batch_size.")
        if self.lr_warmup_fraction is not None:
            if not 0.0 <= self.lr_warmup_fraction <= 1.0:
                raise ConfigError(f"config.lr_warmup_fraction={self.lr_warmup_fraction} must be in [0, 1].")
            if self.lr_warmup_iters or self.lr_warmup_samples:
                raise ConfigError("config.lr_warmup_fraction is set together with lr_warmup_iters/"
                                  "lr_warmup_samples; Megatron takes one of them: drop one.")
        ratios = self.lr_decay_multi_step
        if len(ratios) != 3 or any(isinstance(r, bool) or not isinstance(r, (int, float)) or r < 0 for r in ratios):
            raise ConfigError(f"config.lr_decay_multi_step={ratios!r} must be three shares >= 0 "
                              "(at lr, at lr/sqrt(10), at lr/10), e.g. (0.6, 0.3, 0.1).")
        if abs(sum(ratios) - 1.0) >= 1e-6:  # ByteMLPerf's assert in get_lr
            raise ConfigError(f"config.lr_decay_multi_step={ratios!r} sums to {sum(ratios):.6g}; the three "
                              "shares of the decay must sum to 1.")

    def derived_train_iters(self) -> int:
        """train_iters as Megatron's update_train_iters derives it from train_samples."""
        if self.train_samples is None:
            return 100 if self.train_iters is None else self.train_iters
        try:
            iters = update_train_iters(self.train_samples, self.global_batch_size, self.rampup_batch_size)
        except NumMicroBatchesCalculatorError as e:
            raise ConfigError(str(e)) from None
        if self.train_iters is not None and self.train_iters != iters:
            raise ConfigError(
                f"config.train_iters={self.train_iters} and config.train_samples={self.train_samples} are both "
                f"set (Megatron takes one): train_samples gives {iters} iterations; set train_iters=None.")
        return iters


    def check_training(self) -> None:
        """Raise ConfigError naming the field: signs and ranges, a minimum or initial rate
        above ``lr``, a warm-up longer than the decay, WSD without its annealing length, a
        global batch that micro-batches do not divide."""
        check_positive(self, ("micro_batch_size",))
        check_nonnegative(self, ("train_iters", "lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad",
                                 "adam_eps", "lr_decay_iters", "lr_warmup_samples", "lr_decay_samples",
                                 "lr_warmup_init"))
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"config.{name}={getattr(self, name)} must be in [0, 1).")
        if self.min_lr > self.lr:
            raise ConfigError(f"config.min_lr={self.min_lr} exceeds config.lr={self.lr}; lower min_lr.")
        if self.lr_warmup_init > self.lr:
            raise ConfigError(f"config.lr_warmup_init={self.lr_warmup_init} exceeds config.lr={self.lr}.")
        unit = "iters" if self.train_samples is None else "samples"
        warmup, decay = getattr(self, f"lr_warmup_{unit}"), getattr(self, f"lr_decay_{unit}")
        if warmup > decay and self.lr_decay_style != "constant":
            raise ConfigError(f"config.lr_warmup_{unit}={warmup} exceeds config.lr_decay_{unit}={decay}.")
        if self.lr_decay_style == "WSD" and getattr(self, f"lr_wsd_decay_{unit}") is None:
            raise ConfigError(f"config.lr_decay_style='WSD' needs config.lr_wsd_decay_{unit} (the annealing length).")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"config.global_batch_size={self.global_batch_size} is not a multiple of "
                f"config.micro_batch_size={self.micro_batch_size}.")

    def num_microbatches(self, dp: int) -> int:
        """global_batch_size / (micro_batch_size * dp), as Megatron's num_microbatches_calculator."""
        gbs = self.global_batch_size or self.micro_batch_size * dp
        if gbs % (self.micro_batch_size * dp):
            raise ConfigError(
                f"config.global_batch_size={gbs} is not divisible by config.micro_batch_size="
                f"{self.micro_batch_size} x data_parallel_size={dp}.")
        return gbs // (self.micro_batch_size * dp)


@dataclasses.dataclass(frozen=True)
class LoggingConfig(ConfigGroup):
    """Logging, evaluation, checkpoints (where, how often, what a resume reads) and the
    rules that stop a run."""

    # --- logging, evaluation, checkpoints ---
    log_interval: int = 10
    eval_interval: int = 100  # 0 disables evaluation during training
    eval_iters: int = 10
    # jmegatron-only: evaluate the same first eval_iters global batches every time (curves
    # compare point to point); False (default): Megatron's validation iterator, which
    # continues through the validation split from one evaluation to the next
    eval_fixed_batches: bool = False
    save_interval: Optional[int] = None  # None: save only at the end
    save: Optional[str] = None
    load: Optional[str] = None  # None: = save (resume automatically)
    # jmegatron-only: None keeps every save (Megatron); N: Orbax's max_to_keep, the newest N kept and
    # each deletion of an older one printed
    keep_checkpoints: Optional[int] = None
    async_save: bool = False  # Megatron: --async-save
    tensorboard_dir: Optional[str] = None  # None: <save>/tensorboard
    wandb_project: Optional[str] = None  # Megatron: --wandb-project (log the TensorBoard scalars to this W&B project)
    wandb_exp_name: Optional[str] = None  # Megatron: --wandb-exp-name (the W&B run name; needed with wandb_project)
    wandb_save_dir: Optional[str] = None  # Megatron: --wandb-save-dir (W&B's local files; None: <save>/wandb)
    wandb_entity: Optional[str] = None  # Megatron: --wandb-entity (W&B team or user; None: the account's default)
    exit_interval: Optional[int] = None  # Megatron: --exit-interval (save and stop when iteration % N == 0)
    exit_signal_handler: bool = True  # Megatron: --exit-signal-handler (SIGTERM/SIGINT save and exit 0)
    exit_duration_in_mins: Optional[float] = None  # Megatron: --exit-duration-in-mins (save and stop after N minutes)
    finetune: bool = False  # Megatron: --finetune (load params only from `load`; iteration, optimizer, RNG reset)
    # Megatron: --use-checkpoint-args: the architecture (MODEL_FIELDS, vocab_size, and the
    # tokenizer when none is given) comes from `load`'s config.json (load_config_file)
    use_checkpoint_args: bool = False
    # Megatron's resume rule for the learning-rate schedule (optimizer_param_scheduler.py): a
    # schedule (SCHEDULER_FIELDS) other than the checkpoint's is refused unless one of these says
    # which wins (both: an error)
    override_opt_param_scheduler: bool = False  # Megatron: --override-opt_param-scheduler (the config's schedule wins)
    use_checkpoint_opt_param_scheduler: bool = False  # Megatron: --use-checkpoint-opt_param-scheduler (the checkpoint's wins)
    no_load_optim: bool = False  # Megatron: --no-load-optim (fresh optimizer moments, iteration kept)
    no_load_rng: bool = False  # Megatron: --no-load-rng (dropout base key from `seed`, not the checkpoint's)
    ckpt_fallback: bool = True  # jmegatron-only: a corrupt checkpoint is skipped (warning) for the previous one
    # Megatron: --check-for-nan-in-loss-and-grad: every step, inside the jitted step, a non-finite
    # loss or gradient skips the update (counted as skipped / nan iterations; docs/RELIABILITY.md)
    check_for_nan_in_loss_and_grad: bool = True
    # jmegatron-only: stop with an error after this many non-finite iterations in a row (fp16
    # overflows the dynamic loss scaler can still back off from are not counted); 0: never stop
    max_consecutive_nan_iterations: int = 5
    peak_tflops: Optional[float] = None  # jmegatron-only: per-device peak for MFU; None: measured / default
    log_num_zeros_in_grad: bool = False  # Megatron: --log-num-zeros-in-grad (count zero gradients each step)
    test_memory: bool = False  # ByteMLPerf: --test-memory (memory line at every log, not only the first)
    seed: int = 1234

    def check_logging(self) -> None:
        """Raise ConfigError naming the field: non-positive intervals, a resume flag without a
        checkpoint to read, both schedule rules, W&B without its run name or directory."""
        check_positive(self, ("log_interval", "eval_iters"))
        if self.keep_checkpoints is not None and self.keep_checkpoints <= 0:
            raise ConfigError(f"config.keep_checkpoints={self.keep_checkpoints} must be > 0, or None to keep every "
                              f"save (Megatron's behaviour).")
        check_nonnegative(self, ("eval_interval", "max_consecutive_nan_iterations"))
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ConfigError(f"config.exit_duration_in_mins={self.exit_duration_in_mins} must be > 0 "
                              "(or None: no time limit).")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:  # Megatron's assert
            raise ConfigError("config.override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=True: "
                              "the first keeps the config's learning-rate schedule, the second the checkpoint's; "
                              "set one.")
        for name in ("finetune", "no_load_optim", "no_load_rng"):
            if getattr(self, name) and (not self.load or os.path.abspath(self.load) == os.path.abspath(self.save or "")):
                where = f"config.load={self.load!r} is config.save" if self.load else "config.load is not set"
                raise ConfigError(f"config.{name}=True applies to the checkpoint read from config.load, but {where} "
                                  f"(a rerun resumes its own save exactly); set config.load to the checkpoint to "
                                  f"start from and config.save to a new directory.")
        if self.wandb_project and not self.wandb_exp_name:  # Megatron's _set_wandb_writer
            raise ConfigError(f"config.wandb_project={self.wandb_project!r} needs config.wandb_exp_name (the W&B run "
                              "name), as Megatron's --wandb-exp-name.")
        if self.wandb_project and not (self.wandb_save_dir or self.save):
            raise ConfigError("config.wandb_project needs config.wandb_save_dir or config.save (W&B writes its local "
                              "files to <save>/wandb by default).")


@dataclasses.dataclass(frozen=True)
class DistillationConfig(ConfigGroup):
    """Knowledge distillation from a teacher checkpoint, online or from its cached top-K
    (:mod:`jmegatron.distill`)."""

    # --- knowledge distillation (Megatron's --export-kd-teacher-load, --export-kd-cfg,
    # --export-kd-finalize; see jmegatron.distill) ---
    kd_teacher_load: Optional[str] = None  # checkpoint dir of the teacher (its own config is read from it)
    kd_cfg: Optional[str] = None  # distillation YAML; None: logits-only with Megatron's defaults
    kd_finalize: bool = False  # save a plain student (no kd settings): load the distilled run, save elsewhere
    kd_teacher_bf16: bool = False  # run the frozen teacher in bf16 (params cast at load)
    # offline distillation: a cache of the teacher's top-K log-probabilities per training sample
    # (python -m jmegatron.tools.cache_teacher_logits); the teacher does not run
    kd_teacher_logits_path: Optional[str] = None
    # the teacher on its own layout: its parameters sharded over the data ranks (ZeRO-3, whatever
    # the student's use_megatron_fsdp), its top-K computed before the student's micro-batch loop
    # under GSPMD (jmegatron.distill.loss_func.teacher_top_k_prologue); None: the student's layout
    kd_teacher_use_megatron_fsdp: Optional[bool] = None

    def check_distillation(self) -> None:
        """Raise ConfigError naming the field: an online and an offline teacher together, a
        teacher layout or a distillation YAML without a teacher."""
        if self.kd_finalize:
            return
        if self.kd_teacher_logits_path is not None and self.kd_teacher_load is not None:
            raise ConfigError("config.kd_teacher_logits_path (offline distillation: the teacher's cached top-K) and "
                              "config.kd_teacher_load (online: the teacher runs) are both set; keep one.")
        if self.kd_teacher_use_megatron_fsdp is not None and self.kd_teacher_load is None:
            raise ConfigError("config.kd_teacher_use_megatron_fsdp lays out the teacher of config.kd_teacher_load, "
                              "which is not set; set it or unset kd_teacher_use_megatron_fsdp.")
        if self.kd_cfg is not None and self.kd_teacher_load is None and self.kd_teacher_logits_path is None:
            raise ConfigError("config.kd_cfg is set but config.kd_teacher_load is not; give the teacher's "
                              "checkpoint directory.")


# The distillation settings, at their defaults: what a plain student (kd_finalize's checkpoint) and
# a read checkpoint keep of them.
DISTILLATION_RESETS = dict(kd_teacher_load=None, kd_teacher_logits_path=None, kd_cfg=None, kd_finalize=False,
                           kd_teacher_bf16=False, kd_teacher_use_megatron_fsdp=None)
