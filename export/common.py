"""What every export command starts from: a jmegatron checkpoint read back as plain arrays.

:func:`load_checkpoint` restores a checkpoint written by any parallel layout (tensor
parallel, ZeRO-1, FSDP: Orbax reassembles the shards) onto one device, keeps the student
only (a distillation run's teacher is never in its checkpoints), and returns float32
NumPy parameters in the per-layer layout (``decoder_layers_{i}``, scanned checkpoints are
unstacked) with the resolved config, the true and padded vocabulary sizes and the
tokenizer. Commands raise :class:`ExportError` for bad input; the CLI
(``python -m jmegatron.export``) prints it and exits 2, before any work starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import numpy as np

__all__ = ["ExportError", "ExportSource", "checkpoint_config", "load_checkpoint", "hf_model",
           "load_source_tokenizer", "refuse_moe"]


class ExportError(ValueError):
    """Bad input to an export command (message names the argument and the fix)."""


@dataclasses.dataclass
class ExportSource:
    """A checkpoint read for export.

    Attributes:
        cfg: the checkpoint's resolved :class:`jmegatron.config.JMegatronConfig`
            (distillation fields cleared, ``scan_layers=False``).
        params: nested dict of float32 ``np.ndarray`` in the per-layer layout (see
            ``jmegatron.export.hf`` for names and shapes; embedding rows = padded vocab).
        vocab_size: the true vocabulary (``cfg.vocab_size``, else the tokenizer's, else
            the padded size); exports drop the padding rows.
        padded_vocab_size: rows of the embedding / output layer.
        tokenizer_path: the config's ``tokenizer_model`` if that file exists, else None.
        iteration: the checkpoint's iteration.
        load_dir: absolute path of the checkpoint directory.
    """

    cfg: Any
    params: dict
    vocab_size: int
    padded_vocab_size: int
    tokenizer_path: Optional[str]
    iteration: int
    load_dir: str


def checkpoint_config(load_dir: str, iteration: Optional[int] = None):
    """The resolved :class:`jmegatron.config.JMegatronConfig` of a checkpoint, read from its
    metadata without restoring any array (so commands can refuse bad input before work).
    Raises ExportError for a missing or unreadable checkpoint."""
    from jmegatron.config import ConfigError, from_configdict
    from jmegatron.training import checkpointing

    if not load_dir:
        raise ExportError("--load is required: a jmegatron checkpoint directory (a training run's `save`)")
    if not checkpointing.has_checkpoint(load_dir):
        raise ExportError(f"--load {load_dir}: no checkpoint found in {os.path.abspath(load_dir)}; give a "
                          f"training run's save directory")
    try:
        ckpt = checkpointing.Checkpointer(load_dir, create=False)
        saved = dict(ckpt.read_meta(iteration)["config"])
        ckpt.close()
        saved.update(kd_teacher_load=None, kd_cfg=None, kd_finalize=False, save=None, load=None)
        return from_configdict(saved)
    except (checkpointing.CheckpointError, ConfigError, KeyError) as e:
        raise ExportError(f"--load {load_dir}: unreadable checkpoint metadata: {e}") from e


def refuse_moe(cfg, command: str, missing: str, instead: Optional[str] = None) -> None:
    """Raise ExportError when ``cfg`` is a mixture-of-experts model (``num_moe_experts``
    set) and ``command`` (e.g. ``"trtllm --quantized"``) handles dense models only;
    ``missing`` names what is not built, ``instead`` what to use (default: ``export hf``).
    Called before any array is restored, so a dense-only path never fails later on a
    missing ``mlp/linear_fc1`` key."""
    if cfg.num_moe_experts is None:
        return
    instead = instead or ("`python -m jmegatron.export hf` exports it to Hugging Face (MixtralForCausalLM, or "
                          "Qwen2MoeForCausalLM with a shared expert)")
    raise ExportError(
        f"{command}: this checkpoint is a mixture-of-experts model (num_moe_experts={cfg.num_moe_experts}, "
        f"moe_router_topk={cfg.moe_router_topk}), and {missing} is not built yet; {instead}")


def load_checkpoint(load_dir: str, iteration: Optional[int] = None) -> ExportSource:
    """Read ``load_dir`` (a jmegatron ``save`` directory) at ``iteration`` (default latest).

    A checkpoint of an FP8 run (``fp8_meta`` subtrees among its params, docs/PRECISION.md)
    is read from its on-disk tree instead of through the model, and its ``params`` keep
    those subtrees (float32, per-layer layout): exports that do not quantize ignore them
    (they address the weights by path), ``trtllm --scales from-checkpoint`` reads them
    (:mod:`jmegatron.export.fp8_scales`).

    Raises ExportError for a missing or corrupt checkpoint (the message comes from
    ``jmegatron.training.checkpointing.CheckpointError``).
    """
    import jax

    from jmegatron.export.fp8_scales import saved_fp8_meta_paths
    from jmegatron.export.hf import _plain, unstack_layers
    from jmegatron.training.checkpointing import CheckpointError
    from jmegatron.training.run import restore_run

    if not load_dir:
        raise ExportError("--load is required: a jmegatron checkpoint directory (a training run's `save`)")
    if saved_fp8_meta_paths(load_dir, iteration):
        return _load_fp8_checkpoint(load_dir, iteration)
    try:
        run, state, meta = restore_run(load_dir, iteration=iteration)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        raise ExportError(f"--load {load_dir}: {e}") from e
    params = jax.tree.map(lambda a: np.asarray(jax.device_get(a), dtype=np.float32), _plain(state.params))
    cfg = run.cfg
    if cfg.scan_layers:
        params = unstack_layers(params, cfg.num_layers)
        cfg = cfg.replace(scan_layers=False)
    tok = cfg.tokenizer_model if cfg.tokenizer_model and os.path.exists(cfg.tokenizer_model) else None
    vocab = cfg.vocab_size
    if vocab is None and tok is not None:
        from jmegatron.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(tok).vocab_size
    return ExportSource(cfg=cfg, params=params, vocab_size=int(vocab or run.padded_vocab_size),
                        padded_vocab_size=int(run.padded_vocab_size), tokenizer_path=tok,
                        iteration=int(meta["iteration"]), load_dir=os.path.abspath(load_dir))


# the one-device view restore_run takes of any saved layout
_SINGLE_DEVICE = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                      expert_model_parallel_size=1, sequence_parallel=False, virtual_pipeline_model_parallel_size=None,
                      num_layers_per_virtual_pipeline_stage=None, pipeline_schedule="auto",
                      decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                      scan_layers=False)


def _load_fp8_checkpoint(load_dir: str, iteration: Optional[int]) -> ExportSource:
    """An FP8-trained checkpoint (``fp8_meta`` among its params) read from its own on-disk
    tree (:func:`jmegatron.export.fp8_scales.read_saved_params`) rather than through the
    model: the ``fp8_meta`` subtrees come back with the weights (per-layer layout) whether
    or not the installed model declares them, and no optimizer state is restored."""
    from jmegatron.config import ConfigError
    from jmegatron.export.fp8_scales import read_saved_params

    params, meta, step = read_saved_params(load_dir, iteration)
    try:
        cfg = checkpoint_config(load_dir, step).replace(**_SINGLE_DEVICE)
    except ConfigError as e:
        raise ExportError(f"--load {load_dir}: unreadable checkpoint metadata: {e}") from e
    padded = int(meta["padded_vocab_size"])
    tok = cfg.tokenizer_model if cfg.tokenizer_model and os.path.exists(cfg.tokenizer_model) else None
    vocab = cfg.vocab_size
    if vocab is None and tok is not None:
        from jmegatron.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(tok).vocab_size
    return ExportSource(cfg=cfg, params=params, vocab_size=int(vocab or padded), padded_vocab_size=padded,
                        tokenizer_path=tok, iteration=int(meta["iteration"]), load_dir=os.path.abspath(load_dir))


def load_source_tokenizer(src: ExportSource):
    """The checkpoint's :class:`jmegatron.data.tokenizer.HFTokenizer`, or None without one."""
    if src.tokenizer_path is None:
        return None
    from jmegatron.data.tokenizer import load_tokenizer

    return load_tokenizer(src.tokenizer_path)


def hf_model(src: ExportSource):
    """The float32, eval-mode ``transformers`` model (``GPT2LMHeadModel`` or
    ``LlamaForCausalLM``) of ``src`` with the true vocabulary; bos/eos are the tokenizer's
    end-of-document id when there is a tokenizer. Raises ExportError when the
    architecture has no Hugging Face target (the fields are named)."""
    from jmegatron.export.hf import to_hf_model

    tok = load_source_tokenizer(src)
    eod = tok.eod if tok is not None else None
    try:
        return to_hf_model(src.params, src.cfg, src.vocab_size, bos_token_id=eod, eos_token_id=eod)
    except ValueError as e:
        raise ExportError(str(e)) from e
