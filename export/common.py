"""What every export command starts from: a jmegatron checkpoint read back as plain arrays.

:func:`load_checkpoint` reads the parameters (only: no optimizer state) of a checkpoint
written by any parallel layout (tensor parallel, ZeRO-1, FSDP: Orbax reassembles the
shards) into host memory, keeps the student only (a distillation run's teacher is never
in its checkpoints, its ``kd_projection`` is dropped), and returns float32 NumPy
parameters in the per-layer layout (``decoder_layers_{i}``, scanned and pipeline
checkpoints are unstacked) with the resolved config, the true and padded vocabulary
sizes and the tokenizer. Commands raise :class:`ExportError` for bad input; the CLI
(``python -m jmegatron.export``) prints it and exits 2, before any work starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from jmegatron.checkpoint.checkpointing import CheckpointError, has_checkpoint
from jmegatron.checkpoint.metadata import SavedStep, saved_config
from jmegatron.checkpoint.restore import read_saved_params
from jmegatron.checkpoint.views import checkpoint_view
from jmegatron.config import ConfigError
from jmegatron.data.tokenizer import TOKENIZER_FILES, load_tokenizer
from jmegatron.export.hf_model import to_hf_model

__all__ = ["ExportError", "ExportSource", "check_out_dir", "checkpoint_config", "export_config", "load_checkpoint", "hf_model",
           "export_source", "load_source_tokenizer", "open_checkpoint", "refuse_moe", "source_vocab_size", "tokenizer_path"]


class ExportError(ValueError):
    """Bad input to an export command (message names the argument and the fix)."""


@dataclasses.dataclass
class ExportSource:
    """A checkpoint read for export.

    Attributes:
        cfg: the checkpoint's resolved :class:`jmegatron.config.JMegatronConfig`
            (distillation fields cleared, ``scan_layers=False``).
        params: nested dict of float32 ``np.ndarray`` in the per-layer layout (see
            ``jmegatron.conversion.hf`` for names and shapes; embedding rows = padded vocab), or
            None when not read (:func:`export_source` for the streaming export).
        vocab_size: the true vocabulary (:func:`source_vocab_size`); exports drop the
            padding rows.
        padded_vocab_size: rows of the embedding / output layer.
        tokenizer_path: the config's ``tokenizer_model`` if that file exists, else None.
        iteration: the checkpoint's iteration.
        load_dir: absolute path of the checkpoint directory.
    """

    cfg: Any
    params: Optional[dict]
    vocab_size: int
    padded_vocab_size: int
    tokenizer_path: Optional[str]
    iteration: int
    load_dir: str


def check_out_dir(out: str) -> None:
    """Refuse (ExportError) an ``--out`` that is missing, a file, or a non-empty folder:
    nothing is overwritten."""
    if not out:
        raise ExportError("--out is required: a new folder")
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out)):
        raise ExportError(f"--out {out} exists and is not empty; choose a new folder (nothing is overwritten)")


def open_checkpoint(load_dir: str, iteration: Optional[int] = None) -> SavedStep:
    """Step ``iteration`` (default: the latest) of checkpoint ``load_dir``, its metadata read
    and no array (:class:`jmegatron.checkpoint.metadata.SavedStep`): what an export reads
    once and hands to :func:`checkpoint_config` and :func:`load_checkpoint`. Raises
    ExportError naming ``--load`` for a missing or unreadable checkpoint."""
    if not load_dir:
        raise ExportError("--load is required: a jmegatron checkpoint directory (a training run's `save`)")
    if not has_checkpoint(load_dir):
        raise ExportError(f"--load {load_dir}: no checkpoint found in {os.path.abspath(load_dir)}; give a "
                          f"training run's save directory")
    try:
        return SavedStep.at(load_dir, iteration)
    except CheckpointError as e:
        raise ExportError(f"--load {load_dir}: unreadable checkpoint metadata: {e}") from e


def checkpoint_config(load_dir: str, iteration: Optional[int] = None, saved: Optional[SavedStep] = None):
    """The resolved :class:`jmegatron.config.JMegatronConfig` of a checkpoint (its ``read``
    view, :mod:`jmegatron.checkpoint.views`), read from its metadata without restoring any
    array (so commands can refuse bad input before work); ``saved``: the step already
    opened (:func:`open_checkpoint`). Raises ExportError for a missing or unreadable
    checkpoint."""
    saved = saved or open_checkpoint(load_dir, iteration)
    try:
        return saved_config(saved.meta, "read")
    except (ConfigError, KeyError) as e:
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


def load_checkpoint(load_dir: str, iteration: Optional[int] = None, saved: Optional[SavedStep] = None) -> ExportSource:
    """Read the parameters of ``load_dir`` (a jmegatron ``save`` directory) at ``iteration``
    (default latest) into host memory, as float32 NumPy in the per-layer layout; ``saved``:
    the step already opened (:func:`open_checkpoint`), so its metadata is not read again.

    Parameters only: Orbax's partial restore of the ``state`` item's ``params`` subtree
    (:func:`jmegatron.checkpoint.restore.read_saved_params`), read from the on-disk tree
    itself (no model built, no device used, no optimizer moment or float32 main copy
    read; a bf16 checkpoint gives its bf16 model parameters, widened to float32, as
    Megatron's export takes the model's). Host memory: the model's parameters in float32
    once; the streaming Hugging Face export (:mod:`jmegatron.export.stream`) holds one
    decoder layer at a time instead.

    A checkpoint of an FP8 run (``fp8_meta`` subtrees among its params, docs/PRECISION.md)
    keeps those subtrees (float32, per-layer layout): exports that do not quantize ignore
    them (they address the weights by path), ``trtllm --scales from-checkpoint`` reads them
    (:mod:`jmegatron.export.fp8_scales`).

    Raises ExportError for a missing or corrupt checkpoint (the message names ``--load``).
    """
    saved = saved or open_checkpoint(load_dir, iteration)
    try:
        params = read_saved_params(saved)
    except CheckpointError as e:
        raise ExportError(f"--load {load_dir}: {e}") from e
    return export_source(load_dir, saved, params)


def export_source(load_dir: str, saved: SavedStep, params: Optional[dict] = None) -> ExportSource:
    """The :class:`ExportSource` of an opened checkpoint step (:func:`open_checkpoint`) with
    ``params`` as read (None: not read, the streaming export reads them layer by layer).
    Raises ExportError for an unreadable saved config."""
    cfg = export_config(load_dir, saved=saved)
    padded = int(saved.meta["padded_vocab_size"])
    return ExportSource(cfg=cfg, params=params, vocab_size=source_vocab_size(cfg, padded), padded_vocab_size=padded,
                        tokenizer_path=tokenizer_path(cfg), iteration=int(saved.meta["iteration"]),
                        load_dir=os.path.abspath(load_dir))


def export_config(load_dir: str, iteration: Optional[int] = None, saved: Optional[SavedStep] = None):
    """The checkpoint's config as exports see it (the ``read``, ``one_device`` and
    ``per_layer`` views of :mod:`jmegatron.checkpoint.views`: one device, per-layer layout).
    Raises ExportError."""
    try:
        return checkpoint_config(load_dir, iteration, saved).replace(**checkpoint_view("one_device", "per_layer"))
    except ConfigError as e:
        raise ExportError(f"--load {load_dir}: unreadable checkpoint metadata: {e}") from e


def tokenizer_path(cfg) -> Optional[str]:
    """The config's ``tokenizer_model`` if it is a Hugging Face tokenizer (tokenizer_type None or
    HuggingFaceTokenizer) and exists, else None (a sentencepiece or TikTokenizer file is not one)."""
    hf = getattr(cfg, "tokenizer_type", None) in (None, "HuggingFaceTokenizer")
    return cfg.tokenizer_model if hf and cfg.tokenizer_model and os.path.exists(cfg.tokenizer_model) else None


def source_vocab_size(cfg, padded_vocab_size: int) -> int:
    """The true vocabulary: the config's (``cfg.unpadded_vocab_size()``: a NullTokenizer's
    ``vocab_size + 1``), else the tokenizer's, else the padded size."""
    vocab = cfg.unpadded_vocab_size()
    tok = tokenizer_path(cfg)
    if vocab is None and tok is not None:

        vocab = load_tokenizer(tok).vocab_size
    return int(vocab or padded_vocab_size)


def load_source_tokenizer(src: ExportSource):
    """The checkpoint's :class:`jmegatron.data.tokenizer.HFTokenizer`, or None without one."""
    if src.tokenizer_path is None:
        return None

    return load_tokenizer(src.tokenizer_path)


def write_hf_tokenizer(tokenizer: str, out: str, model_max_length: int) -> None:
    """The checkpoint's tokenizer as a transformers tokenizer in ``out``: a transformers
    tokenizer folder (``import-hf`` carries the source's, with ``tokenizer_config.json``) is
    copied file by file (its special tokens and chat template kept); a ``tokenizer.json``
    (or a folder with only that) is saved as ``PreTrainedTokenizerFast`` with the
    end-of-document token as bos and eos."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    if os.path.isdir(tokenizer) and os.path.isfile(os.path.join(tokenizer, "tokenizer_config.json")):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer, name)):
                shutil.copyfile(os.path.join(tokenizer, name), os.path.join(out, name))
        return
    eod = load_tokenizer(tokenizer).eod_token
    tok_file = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_file=tok_file, bos_token=eod, eos_token=eod, unk_token=None,
                                  model_max_length=model_max_length)
    tok.save_pretrained(out)


def hf_model(src: ExportSource):
    """The float32, eval-mode ``transformers`` model (``GPT2LMHeadModel`` or
    ``LlamaForCausalLM``) of ``src`` with the true vocabulary; bos/eos are the tokenizer's
    end-of-document id when there is a tokenizer. Raises ExportError when the
    architecture has no Hugging Face target (the fields are named)."""
    tok = load_source_tokenizer(src)
    eod = tok.eod if tok is not None else None
    try:
        return to_hf_model(src.params, src.cfg, src.vocab_size, bos_token_id=eod, eos_token_id=eod)
    except ValueError as e:
        raise ExportError(str(e)) from e
