"""A training run's static pieces: mesh, model, optimizer, shardings and the jitted steps
(the role of Megatron's ``setup_model_and_optimizer`` in megatron/training/training.py),
and restoring a checkpoint into them.

:func:`build` composes; it does not know what a micro-batch computes: that comes from a
forward step provider (:mod:`jmegatron.training.forward_step`; default the language model,
distillation's from :mod:`jmegatron.distill.model_provider`). The training loop
(:mod:`jmegatron.training.loop`), evaluation, export, generation and the distillation
teacher all build through here; nothing here imports the loop.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jmegatron.checkpoint import checkpointing, restore as checkpoint_restore
from jmegatron.checkpoint.views import checkpoint_view
from jmegatron.config import DISTILLATION_RESETS, ConfigError, JMegatronConfig, from_configdict
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.data.tokenizer import vocab_size_of
from jmegatron.parallel import pipeline_layout, rules as rules_lib
from jmegatron.parallel.context_parallel import load_balance_index
from jmegatron.parallel.grad_sync import StepLayout
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training import optimizer, state as state_lib, step as step_lib
from jmegatron.training.forward_step import ForwardStep, gpt_forward_step
from jmegatron.training.losses import masked_cross_entropy
from jmegatron.training.state import stored_layer_index
from jmegatron.num_microbatches_calculator import NumMicroBatchesCalculatorError, build_num_microbatches_calculator

# (cfg, model, mesh, padded_vocab_size) -> ForwardStep
ForwardStepProvider = Callable[[JMegatronConfig, GPTModel, Mesh, int], ForwardStep]


@dataclasses.dataclass
class Run:
    """Everything built once before the first step. ``train_step(state, batch)`` and
    ``eval_step(params, batch)`` are jitted; ``state_shardings`` is a TrainState of
    NamedShardings, ``abstract_state`` its ShapeDtypeStructs."""

    cfg: JMegatronConfig
    mesh: Mesh
    model: GPTModel
    tx: optax.GradientTransformation
    padded_vocab_size: int
    num_microbatches: int
    global_batch_size: int
    abstract_state: Any
    state_shardings: Any
    grad_shardings: Any
    rules: Any
    train_step: Any
    eval_step: Any
    compute_grads: Any = None  # jitted (state, batch, *extra_args) -> (grads, report, tokens)
    extra_args: tuple = ()  # passed after the batch to train_step (the teacher's params when distilling)
    forward_step: Optional[ForwardStep] = None  # what the provider gave (its owner: e.g. the teacher)
    # trainable modules stored beside the model's params (name -> (module, example input
    # shape)): distillation's kd_projection; recorded in the checkpoint meta as "aux_params"
    aux_modules: dict = dataclasses.field(default_factory=dict)
    # jmegatron.num_microbatches_calculator: the global batch of each iteration
    # (constant, or Megatron's ramp-up); global_batch_size / num_microbatches are the final ones
    num_microbatches_calculator: Any = None

    def init_state(self) -> state_lib.TrainState:
        """A freshly initialised TrainState (seed ``cfg.seed``) in ``state_shardings``: the
        same model for every layout (under pipeline parallelism the stacked layers are
        initialised in model order, then moved to their stage slots,
        :mod:`jmegatron.parallel.pipeline_layout`)."""
        return state_lib.init_train_state(self.model, self.tx, self.cfg.seed, self.cfg.seq_length,
                                          self.state_shardings, self.aux_modules, stored_layer_index(self.cfg))

    def abstract_with_shardings(self) -> Any:
        """ShapeDtypeStructs of the TrainState carrying its shardings (a restore target)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract_state, self.state_shardings)

    def batch_rows(self) -> Optional[np.ndarray]:
        """The rows ``[0, R)`` of every micro-batch (``R = global_batch_size / num_microbatches
        = micro_batch_size x dp``) that this process's devices hold under the batch shardings
        (:func:`jmegatron.parallel.rules.batch_shardings`), sorted; None when it holds them all
        (one process, or a mesh that does not split the batch across processes). The rows
        to read with :class:`jmegatron.data.loader.BatchLoader` ``rows=`` and hand to
        :meth:`put_batch` (Megatron's sampler: each data-parallel rank reads its slice)."""
        rows = self.global_batch_size // self.num_microbatches
        held = process_rows(rules_lib.batch_shardings(self.mesh)["tokens"], rows, jax.process_index())
        return None if len(held) == rows else held

    def put_batch(self, batch: dict[str, np.ndarray], train: bool = True,
                  rows: Optional[np.ndarray] = None) -> dict[str, jax.Array]:
        """Place a host batch on the mesh: ``[num_micro, gbs / num_micro, seq]`` (the global
        batch; ``rows`` None), or ``[num_micro, len(rows), seq]``: this process's ``rows`` of
        each micro-batch (:meth:`batch_rows`), every process giving its own. Each process
        contributes its addressable shards (``jax.make_array_from_callback``).
        Under context parallelism the batch gains ``positions`` (int32, each slot's index in
        the original sequence), and a training batch (``train``) is put in Megatron's
        load-balanced sequence order (``get_batch_on_this_cp_rank``,
        :func:`jmegatron.parallel.context_parallel.load_balance_index`: every array,
        ``positions`` included, permuted together), which the model's attention reads from
        ``positions``; the eval step takes the sequence in its own order (``train=False``:
        ``positions`` ``0..s-1``). Raises ValueError when the batch's
        ``segment_ids`` key does not match ``cfg.reset_attention_mask``, or when a device of
        this process holds a row not in ``rows``."""
        if ("segment_ids" in batch) != self.cfg.reset_attention_mask:
            raise ValueError(f"config.reset_attention_mask={self.cfg.reset_attention_mask} but the batch "
                             f"{'has' if 'segment_ids' in batch else 'has no'} segment_ids: build the datasets "
                             f"with reset_attention_mask=cfg.reset_attention_mask (jmegatron.data.builder."
                             f"build_datasets does)")
        cp = self.mesh.shape.get(rules_lib.CONTEXT_AXIS, 1)
        if cp > 1:  # [num_micro, rows, seq(, ...)]: the sequence is axis 2
            shape = np.shape(batch["tokens"])
            index = load_balance_index(shape[2], cp) if train else np.arange(shape[2])
            if train:
                batch = {k: np.take(np.asarray(v), index, axis=2) for k, v in batch.items()}
            batch = dict(batch, positions=np.broadcast_to(index.astype(np.int32), shape))
        extra = self.forward_step.batch_keys if self.forward_step is not None else ()
        shardings = rules_lib.batch_shardings(self.mesh, self.cfg.reset_attention_mask, extra)
        unknown = sorted(set(batch) - set(shardings))
        if unknown:
            raise ValueError(f"the batch has keys {unknown} that this run's forward step does not read "
                             f"(ForwardStep.batch_keys: {list(extra)})")
        if rows is None:
            return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
                    for k, v in batch.items()}
        total = self.global_batch_size // self.num_microbatches
        position = np.full(total, -1, np.int64)  # global row -> its place in this process's batch
        position[np.asarray(rows)] = np.arange(len(rows))

        def local(v, idx):
            held = position[idx[1]]
            if (held < 0).any():
                raise ValueError(f"process {jax.process_index()} holds rows {np.arange(total)[idx[1]].tolist()} of "
                                 f"the batch but read only rows {np.asarray(rows).tolist()}: read Run.batch_rows()")
            return v[idx[0]][:, held][(slice(None), slice(None)) + tuple(idx[2:])]

        return {k: jax.make_array_from_callback((v.shape[0], total) + v.shape[2:], shardings[k],
                                                lambda idx, v=v: local(v, idx))
                for k, v in batch.items()}


def process_rows(sharding: jax.sharding.Sharding, rows: int, process_index: int,
                 process_of: Callable[[Any], int] = lambda device: device.process_index) -> np.ndarray:
    """int64, sorted: the rows (axis 1 of a ``[num_micro, rows, seq]`` batch under
    ``sharding``) held by the devices of process ``process_index``; ``process_of(device)``
    gives a device's process (tests pass a fake mapping)."""
    held = set()
    seq = len(sharding.device_set)  # any length the sequence's sharding divides
    for device, idx in sharding.devices_indices_map((1, rows, seq)).items():
        if process_of(device) == process_index:
            held.update(range(rows)[idx[1]])
    return np.array(sorted(held), np.int64)


def build(cfg: JMegatronConfig, mesh: Optional[Mesh] = None, vocab_size: Optional[int] = None,
          forward_step_provider: Optional[ForwardStepProvider] = None) -> Run:
    """Build mesh, model, optimizer and the jitted steps for ``cfg`` (nothing allocated yet).

    ``forward_step_provider(cfg, model, mesh, padded_vocab_size)`` gives what each
    micro-batch computes (:class:`~jmegatron.training.forward_step.ForwardStep`; None:
    :func:`~jmegatron.training.forward_step.gpt_forward_step`, the language model). Raises ConfigError when the parallel sizes or batch sizes do not
    fit the devices, or when the provider cannot pipeline and
    pipeline_model_parallel_size > 1.
    """
    pipeline = None
    if cfg.pipeline_model_parallel_size > 1:
        if cfg.use_megatron_fsdp:
            raise ConfigError("config.use_megatron_fsdp=True with pipeline_model_parallel_size > 1 is not built; "
                              "use use_distributed_optimizer=True (ZeRO-1) with the pipeline.")
        pipeline = (cfg.resolved_pipeline_schedule(), cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_size())
    mesh = mesh or create_mesh(cfg)
    dp = rules_lib.data_parallel_size(mesh)  # data x expert: Megatron's data-parallel size
    num_micro = cfg.num_microbatches(dp)
    gbs = num_micro * cfg.micro_batch_size * dp
    try:
        calculator = build_num_microbatches_calculator(gbs, cfg.micro_batch_size, dp, cfg.rampup_batch_size)
    except NumMicroBatchesCalculatorError as e:
        raise ConfigError(str(e)) from None
    padded = cfg.padded_vocab_size(vocab_size if vocab_size is not None else vocab_size_of(cfg))
    cfg.check_parallel_divisibility(padded, dp)
    model = GPTModel(ModelConfig.from_config(cfg, padded))
    rules = rules_lib.make_rules(cfg)
    forward_step_provider = forward_step_provider or gpt_forward_step
    fwd = forward_step_provider(cfg, model, mesh, padded)
    # bf16 / fp16: buffers (the routers' expert_bias) stay float32 in the model too
    tx = optimizer.make_optimizer(cfg, gbs, keep_float32=fwd.buffers.is_buffer if fwd.buffers else None)
    if pipeline is not None and fwd.pipeline_stages is None:
        raise ConfigError(f"config.pipeline_model_parallel_size={cfg.pipeline_model_parallel_size}: the forward "
                          f"step {getattr(forward_step_provider, '__name__', forward_step_provider)} has no "
                          f"pipeline stages; use pipeline_model_parallel_size=1")
    abstract, shardings, grad_shardings = state_lib.state_shardings(
        model, tx, cfg.seq_length, mesh, rules, cfg.use_distributed_optimizer, fwd.aux_modules,
        stored_layer_index(cfg))
    layout = StepLayout(mesh, shardings.params, grad_shardings, rules, fwd.extra_shardings, pipeline,
                        cfg.pipeline_layout() if pipeline else None,
                        accumulate_grads_in_fp32=cfg.accumulate_allreduce_grads_in_fp32 or not cfg.fp16)
    step_fn = step_lib.make_train_step(model, fwd, tx, optimizer.lr_schedule(cfg, gbs), layout,
                                       cfg.log_num_zeros_in_grad, cfg.check_for_nan_in_loss_and_grad)
    train_step = step_lib.jit_train_step(step_fn, mesh, shardings, fwd.extra_shardings, cfg.reset_attention_mask,
                                         fwd.batch_keys)
    # eval runs the whole model (GSPMD gathers each stage's layers), in the model's layer order
    canonical = pipeline_layout.gather_index(cfg.pipeline_layout(), pipeline_layout.PipelineLayout(cfg.num_layers))
    eval_step = step_lib.jit_eval_step(step_lib.make_eval_step(model, masked_cross_entropy, rules, canonical), mesh, shardings.params,
                                       cfg.reset_attention_mask)
    return Run(cfg=cfg, mesh=mesh, model=model, tx=tx, padded_vocab_size=padded,
               num_microbatches=num_micro, global_batch_size=gbs, num_microbatches_calculator=calculator,
               abstract_state=abstract, state_shardings=shardings, grad_shardings=grad_shardings,
               rules=rules, train_step=train_step, eval_step=eval_step,
               compute_grads=jax.jit(step_fn.compute_grads), extra_args=tuple(fwd.extra_args),
               forward_step=fwd, aux_modules=dict(fwd.aux_modules))


# Auxiliary modules recorded before their meta named a Python module (earlier checkpoints).
_LEGACY_AUX_MODULES = {"ProjectionLayer": "jmegatron.distill.losses"}


def aux_spec(module, input_shape: tuple) -> dict:
    """JSON description of an auxiliary Flax module (rebuilt by :func:`aux_from_meta`): its
    class (Python module and name), example input shape and JSON-typed fields."""
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
              if f.name not in ("parent", "name") and isinstance(getattr(module, f.name), (bool, int, float, str))}
    return {"type": type(module).__name__, "module": type(module).__module__, "input_shape": list(input_shape),
            **fields}


def aux_from_meta(meta: dict) -> dict:
    """The auxiliary modules a checkpoint's params hold besides the model's (``aux_params``):
    name -> (module, example input shape). Raises CheckpointError for a class that is not
    one of jmegatron's."""
    out = {}
    for name, spec in (meta.get("aux_params") or {}).items():
        spec = dict(spec)
        type_name = spec.pop("type", None)
        module_path = spec.pop("module", _LEGACY_AUX_MODULES.get(type_name))
        shape = spec.pop("input_shape", None)
        cls = None
        if module_path and module_path.startswith("jmegatron.") and type_name:
            cls = getattr(importlib.import_module(module_path), type_name, None)
        if cls is None:
            raise checkpointing.CheckpointError(f"unknown auxiliary parameters {name!r}: {meta['aux_params'][name]}")
        if shape is None:  # a legacy ProjectionLayer: its input is [..., student_hidden_size]
            shape = (1, 1, spec["student_hidden_size"])
        out[name] = (cls(**spec), tuple(shape))
    return out


def checkpoint_meta(cfg: JMegatronConfig, run: Run, iteration: int, consumed: int, consumed_valid: int = 0) -> dict:
    """The JSON meta saved with a checkpoint: iteration, consumed train / valid samples, the
    padded vocabulary, the resolved config (a kd_finalize run saves a plain student's) and
    the auxiliary modules (``aux_params``, :func:`aux_spec`)."""
    if cfg.kd_finalize:  # a plain student checkpoint: nothing of the distillation remains
        cfg = cfg.replace(**DISTILLATION_RESETS)
    meta = {"iteration": iteration, "consumed_train_samples": consumed, "consumed_valid_samples": consumed_valid,
            "padded_vocab_size": run.padded_vocab_size, "config": cfg.to_dict()}
    if run.aux_modules and not cfg.kd_finalize:
        meta["aux_params"] = {name: aux_spec(module, shape) for name, (module, shape) in run.aux_modules.items()}
    return meta


def restore_state(run: Run, ckpt: checkpointing.Checkpointer, iteration: Optional[int] = None) -> tuple[Any, dict]:
    """(state, meta) of ``ckpt`` in ``run``'s layout and structure.

    Auxiliary params (``aux_params`` in the meta, e.g. a distillation run's
    ``kd_projection``) are matched by name: a checkpoint holding some the run does not
    train (read by kd_finalize, evaluation, export, a teacher load) is restored whole and
    pruned, giving a plain student state; a run training some the checkpoint lacks (a
    distillation started from a pretrained student) gets them, and their optimizer
    moments, freshly initialised. A checkpoint whose decoder layers are stored in another
    layout (scan_layers, pipeline stage order) is converted
    (:func:`jmegatron.checkpoint.restore.restore`). A checkpoint of another precision
    (float32 vs bf16 / fp16 with float32 main parameters) is converted through its float32
    parameters (:func:`jmegatron.training.state.convert_precision`). Raises CheckpointError.
    """
    meta = ckpt.read_meta(iteration)
    saved_aux = aux_from_meta(meta)
    saved_tx = _saved_optimizer(run, meta)
    if set(saved_aux) == set(run.aux_modules) and saved_tx is run.tx:
        return checkpoint_restore.restore(ckpt, run.abstract_with_shardings(), run.cfg, iteration)
    abstract, shardings, _ = state_lib.state_shardings(
        run.model, saved_tx, run.cfg.seq_length, run.mesh, run.rules, run.cfg.use_distributed_optimizer, saved_aux)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    state, meta = checkpoint_restore.restore(ckpt, target, run.cfg, iteration)
    state = state_lib.convert_precision(state, saved_tx, run.tx)
    fill = run.init_state() if set(run.aux_modules) - set(saved_aux) else None
    state = state_lib.prune_to(state, run.abstract_state, fill)
    return (state if saved_tx is run.tx else jax.device_put(state, run.state_shardings)), meta


def restore_latest(run: Run, ckpt: checkpointing.Checkpointer) -> tuple[Any, dict]:
    """(state, meta) of the newest checkpoint of ``ckpt`` that is compatible with ``run``
    (:func:`jmegatron.checkpoint.checkpointing.check_compatible`), restores and matches its
    fingerprints (:func:`restore_state`); older ones are tried in turn under
    ``cfg.ckpt_fallback`` (a printed warning each). Raises CorruptCheckpointError when the
    newest is corrupt and ``ckpt_fallback`` is off (naming the step to fall back to) or
    every step is; CheckpointError for an incompatible or missing checkpoint."""
    cfg = run.cfg
    steps = sorted(ckpt.all_steps(), reverse=True)
    for i, step in enumerate(steps):
        try:
            meta = ckpt.read_meta(step)
            checkpointing.check_compatible(cfg, meta["config"], run.padded_vocab_size,
                                           meta["padded_vocab_size"], ckpt.directory, iteration=step)
            return restore_state(run, ckpt, step)
        except checkpointing.CorruptCheckpointError as e:
            if i + 1 == len(steps):
                raise checkpointing.CorruptCheckpointError(e.step, e.path, f"{e.reason}; no earlier complete "
                                                           f"checkpoint to fall back to") from e
            if not cfg.ckpt_fallback:
                raise checkpointing.CorruptCheckpointError(e.step, e.path, f"{e.reason}. Set config.ckpt_fallback="
                                                           f"True to resume from step {steps[i + 1]} instead") from e
            print(f"[jmegatron] WARNING ckpt_fallback: {e}; falling back to step {steps[i + 1]}", flush=True)
    raise checkpointing.CheckpointError(f"no checkpoint found in {ckpt.directory}")


def _saved_optimizer(run: Run, meta: dict) -> Any:
    """The optimizer the checkpoint's state was saved with: ``run.tx`` when its precision
    (bf16 / fp16 / float32) and loss scaling are the run's, else the saved config's."""
    saved = meta.get("config") or {}
    fields = ("bf16", "fp16", "loss_scale")
    if all(saved.get(f, getattr(JMegatronConfig, f)) == getattr(run.cfg, f) for f in fields):
        return run.tx
    src = run.cfg.replace(**{f: saved.get(f, getattr(JMegatronConfig, f)) for f in fields})
    return optimizer.make_optimizer(src, run.global_batch_size, keep_float32=getattr(run.tx, "keep_float32", None))


def restore_run(load_dir: str, mesh: Optional[Mesh] = None,
                iteration: Optional[int] = None, **overrides) -> tuple[Run, Any, dict]:
    """(Run, TrainState, meta) rebuilt from a checkpoint's own resolved config: the whole
    state, optimizer moments included (what a resumed or continued training needs).
    Evaluation, sampling, export and a teacher need the parameters only: use
    :func:`restore_run_params`. ``overrides`` replace config fields (e.g. batch sizes).
    Raises CheckpointError for a missing or corrupt checkpoint."""
    run, ckpt, _ = _run_of_checkpoint(load_dir, mesh, iteration, overrides)
    try:
        state, meta = restore_state(run, ckpt, iteration)
    finally:
        ckpt.close()
    return run, state, meta


def restore_run_params(load_dir: str, mesh: Optional[Mesh] = None, iteration: Optional[int] = None,
                       source: str = "model", **overrides) -> tuple[Run, Any, dict]:
    """(Run, params, meta): a checkpoint's model rebuilt from its own resolved config and
    only its parameters restored, straight into the run's parameter shardings
    (:func:`jmegatron.checkpoint.restore.restore_params`: Orbax partial restore, no
    optimizer state read, each device reads its own shards; any saved layer layout
    converted). For evaluation, generation and export.

    ``mesh`` None: one device (the checkpoint's parallel sizes reset to 1; Orbax reads
    whatever layout it was saved in). A ``mesh``: the saved parallel layout (or
    ``overrides``') on that mesh, each parameter in its NamedSharding.

    ``source``: ``"model"`` (default) the model's parameters as training computed with
    them (bf16 under bf16, as Megatron's export takes the model's); ``"main"`` the float32
    main parameters of a bf16 / fp16 checkpoint (its optimizer's copy; a float32
    checkpoint's params), the run then built in float32 (``bf16=False, fp16=False`` unless
    ``overrides`` say otherwise). ``overrides`` replace config fields (batch sizes,
    dropout). Raises CheckpointError for a missing, corrupt or mismatched checkpoint,
    ValueError for an unknown ``source``.
    """
    if source == "main":
        overrides = {"bf16": False, "fp16": False, **overrides}
    run, ckpt, _ = _run_of_checkpoint(load_dir, mesh, iteration, overrides)
    try:
        target = run.abstract_with_shardings().params
        params, meta = checkpoint_restore.restore_params(ckpt, target, run.cfg, iteration, source)
    finally:
        ckpt.close()
    return run, params, meta


def _run_of_checkpoint(load_dir: str, mesh: Optional[Mesh], iteration: Optional[int],
                       overrides: dict) -> tuple[Run, checkpointing.Checkpointer, dict]:
    """(Run built from the checkpoint's saved config, its open Checkpointer, meta): the
    student only; under ``mesh`` None the parallel sizes are reset to one device."""
    if not checkpointing.has_checkpoint(load_dir):
        raise checkpointing.CheckpointError(f"no checkpoint found in {os.path.abspath(load_dir)}")
    ckpt = checkpointing.Checkpointer(load_dir, create=False)
    try:
        meta = ckpt.read_meta(iteration)
        saved = dict(meta["config"])
        # evaluation, sampling and export need the student only, never its teacher; under mesh None one
        # device: Orbax gathers whatever layout the checkpoint was saved in
        saved.update(checkpoint_view("read", *(("one_device",) if mesh is None else ())))
        saved.update(overrides)
        cfg = from_configdict(saved)
        run = build(cfg, mesh or create_mesh(cfg, jax.devices()[:1]), vocab_size=_unpadded_vocab(cfg, meta))
    except BaseException:
        ckpt.close()
        raise
    return run, ckpt, meta


def _unpadded_vocab(cfg: JMegatronConfig, meta: dict) -> int:
    # Any vocabulary size that pads to the saved one rebuilds the same model.
    return cfg.unpadded_vocab_size() or meta["padded_vocab_size"]
