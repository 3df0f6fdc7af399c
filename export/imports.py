"""Bringing weights into jmegatron checkpoints: a Hugging Face folder (:func:`import_hf`), a
ModelOpt unified checkpoint (:func:`import_unified`), the one HF import entry point that
``--load HF_FOLDER`` of train / evaluate / generate / serve goes through
(:func:`checkpoint_of`), and :func:`save_imported`, the end every import shares
(``import-hf``, ``import-megatron``). The commands are :mod:`jmegatron.export.convert` and
:mod:`jmegatron.export.megatron`; the weight mappings are :mod:`jmegatron.conversion`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from typing import Iterator

import numpy as np

from jmegatron.checkpoint import checkpointing
from jmegatron.checkpoint.hf import is_hf_folder, read_hf_folder
from jmegatron.config import IMPORTED_FIELDS_FILE, ConfigError, base_config, from_configdict, load_config_file
from jmegatron.data.tokenizer import TOKENIZER_FILES, load_tokenizer
from jmegatron.export.common import ExportError, check_out_dir
from jmegatron.export.unified import is_unified_folder, jmegatron_fields, jmegatron_params, read_unified
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.run import build, checkpoint_meta

HF_SOURCE = "hf_source"  # import-hf's copy of the source config.json / generation_config.json


def import_hf(folder: str, out: str, config_file: str | None = None, seq_length: int | None = None):
    """Write a jmegatron checkpoint (iteration 0) holding the Hugging Face model of ``folder``.

    The architecture fields come from ``folder/config.json`` (:func:`jmegatron.checkpoint.hf.
    read_hf_folder`), everything else from ``config_file`` or jmegatron's defaults;
    The folder's tokenizer (``tokenizer.json`` with its ``tokenizer_config.json``, special
    tokens and chat template, :data:`jmegatron.data.tokenizer.TOKENIZER_FILES`), when present,
    is copied to ``out/tokenizer/`` and becomes ``tokenizer_model`` (its ``eos_token`` the
    end-of-document token); the source ``config.json`` and ``generation_config.json`` go to
    ``out/hf_source/``, from which ``export hf`` takes the bos/eos ids and generation config. Returns the resolved config. Raises ExportError for a missing
    folder or config.json, an architecture jmegatron cannot represent (HF fields named), a
    tensor that is missing or of the wrong shape, or an ``out`` that already holds files.
    """
    try:
        hf = read_hf_folder(folder)
    except ValueError as e:
        raise ExportError(f"--hf {folder}: {e}") from e
    check_out_dir(out)
    tok_files = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    tokenizer = None
    if "tokenizer.json" in tok_files:
        tokenizer = os.path.join(os.path.abspath(out), "tokenizer")
        try:  # refused before any work without an end-of-document token
            load_tokenizer(folder)
        except ValueError as e:
            raise ExportError(f"--hf {folder}: {e}") from e

    def copy_files(cfg) -> None:
        if tokenizer:
            os.makedirs(cfg.tokenizer_model)
            for name in tok_files:
                shutil.copyfile(os.path.join(folder, name), os.path.join(cfg.tokenizer_model, name))
        os.makedirs(os.path.join(out, HF_SOURCE))
        for name in ("config.json", "generation_config.json"):  # what export hf gives back (bos/eos ids, generation)
            if os.path.isfile(os.path.join(folder, name)):
                shutil.copyfile(os.path.join(folder, name), os.path.join(out, HF_SOURCE, name))

    return save_imported(hf.fields, out, config_file, hf.params,
                         source=f"{hf.architecture} from {os.path.abspath(folder)}",
                         seq_length=seq_length, tokenizer_model=tokenizer, before_save=copy_files, what=f"--hf {folder}")


def import_unified(folder: str, out: str, config_file: str | None = None, seq_length: int | None = None):
    """:func:`import_hf` for ModelOpt's unified checkpoint ``folder``
    (:func:`jmegatron.export.unified.is_unified_folder`): the parameters compute what a server
    computes (:func:`jmegatron.export.unified.jmegatron_params`: dequantized weights; FP8 through
    jmegatron's FP8 linears at the folder's scales). A quantized KV cache is noted and not
    modelled. Returns the resolved config. Raises ExportError as :func:`import_hf`, and for a
    ``quant_algo`` jmegatron's model does not compute (named, with ``check-unified``)."""
    check_out_dir(out)
    ckpt = read_unified(folder)
    fields = jmegatron_fields(ckpt)
    if ckpt.quant.get("kv_cache_quant_algo"):
        print(f"[jmegatron.export] note: {folder} quantizes the KV cache ({ckpt.quant['kv_cache_quant_algo']}); "
              f"jmegatron keeps it in the compute dtype", flush=True)
    return save_imported(fields, out, config_file, lambda cfg, padded: jmegatron_params(ckpt, cfg, padded),
                         source=f"{ckpt.algo} unified checkpoint {os.path.abspath(folder)}", seq_length=seq_length,
                         what=f"--load {folder}")


IMPORTED_MARKER = "imported_from.json"  # written last by checkpoint_of: the import is complete


def _import_once(folder: str, out: str, timeout_s: float) -> str:
    """``out``, holding the import of ``folder`` (see :func:`checkpoint_of`)."""
    marker = os.path.join(out, IMPORTED_MARKER)
    source = os.path.abspath(folder)

    def done() -> bool:
        if not os.path.isfile(marker):
            return False
        with open(marker) as f:
            recorded = json.load(f)["hf"]
        if recorded != source:
            raise ExportError(f"{out} holds the import of {recorded}, not of {source}; remove it or choose "
                              f"another config.save")
        return True

    if done():
        return out
    if int(os.environ.get("JMEGATRON_PROCESS_ID") or 0):
        deadline = time.time() + timeout_s
        while not done():
            if time.time() > deadline:
                raise ExportError(f"waited {timeout_s:.0f} s for process 0 to import {source} into {out}")
            time.sleep(1.0)
        return out
    shutil.rmtree(out, ignore_errors=True)  # a partial import (killed before its marker)
    (import_unified if is_unified_folder(folder) else import_hf)(folder, out)
    with open(marker, "w") as f:
        json.dump({"hf": source}, f)
    return out


@contextlib.contextmanager
def checkpoint_of(load: str, out: str | None = None, timeout_s: float = 3600.0) -> Iterator[str]:
    """The jmegatron checkpoint of ``--load``: ``load`` itself when it is one; for a Hugging
    Face folder (a ``config.json`` with ``model_type``), its import (:func:`import_hf`, or
    :func:`import_unified` for ModelOpt's unified checkpoint): how train, ``evaluate``,
    ``generate`` and ``serve`` take such a folder as ``--load``.

    ``out`` None: the import goes to a temporary directory removed on exit. ``out`` given
    (train's ``<save>/hf_import``): it is kept, and imported unless it already holds this
    folder's import (its :data:`IMPORTED_MARKER`, written when the import is complete; a
    partial one is redone); in a multi-process run only process 0
    (``JMEGATRON_PROCESS_ID``, set by ``jmegatron.launch``) imports, the others wait for
    the marker up to ``timeout_s`` seconds. Raises ExportError as :func:`import_hf`, for a
    marker naming another folder, or on the timeout."""
    if not is_hf_folder(load) and not is_unified_folder(load):
        yield load
        return
    if out is not None:
        yield _import_once(load, out, timeout_s)
        return
    with tempfile.TemporaryDirectory(prefix="jmegatron-hf-") as tmp:
        kind = "ModelOpt unified checkpoint" if is_unified_folder(load) else "Hugging Face folder (import-hf)"
        print(f"[jmegatron] {load} is a {kind}: importing it into {tmp}", flush=True)
        yield _import_once(load, os.path.join(tmp, "checkpoint"), timeout_s)


def imported_config(fields: dict, config_file: str | None = None, *, seq_length: int | None = None,
                    what: str = "the import", **overrides):
    """The one-device run config of imported architecture ``fields`` (config fields with
    ``vocab_size`` and ``max_position_embeddings``) laid over ``config_file``'s settings
    (default: jmegatron's defaults with mock data): every parallel size 1, micro and global
    batch 1, no load and no distillation, ``seq_length`` (default the base's) capped at
    ``max_position_embeddings``, then ``overrides``. Raises ExportError (prefixed by
    ``what``) for a bad ``config_file`` or an invalid resulting config."""
    try:
        base = load_config_file(config_file).to_dict() if config_file else base_config().to_dict()
    except (ConfigError, FileNotFoundError) as e:
        raise ExportError(f"--config {config_file}: {e}") from e
    base.update(fields)
    if not config_file and not base.get("data_path"):
        base["mock_data"] = True  # jmegatron's defaults name no data; a training run gives its own config
    base["seq_length"] = min(seq_length or base["seq_length"], fields["max_position_embeddings"])
    base.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                expert_model_parallel_size=1, sequence_parallel=False, load=None,
                kd_teacher_load=None, kd_cfg=None, kd_finalize=False, micro_batch_size=1, global_batch_size=1,
                virtual_pipeline_model_parallel_size=None)
    base.update(overrides)
    try:
        return from_configdict(base)
    except ConfigError as e:
        raise ExportError(f"{what}: the imported config is invalid: {e}") from e


def save_imported(fields: dict, out: str, config_file: str | None, to_params, *, iteration: int = 0,
                  source: str, seq_length: int | None = None, tokenizer_model: str | None = None,
                  before_save=None, what: str = "the import"):
    """Write a jmegatron checkpoint of imported weights (the end of ``import-hf`` and
    ``import-megatron``).

    ``fields``: the architecture (config fields with ``vocab_size`` and
    ``max_position_embeddings``), laid over ``config_file``'s settings (default: jmegatron's
    defaults with mock data), one device, ``save=out``; ``to_params(cfg, padded_vocab_size)``
    gives the parameters; ``before_save(cfg)`` writes side files (tokenizer, sources).
    The checkpoint is saved at ``iteration`` with fresh optimizer state, ``config.json`` and
    the names of ``fields`` (:data:`jmegatron.config.IMPORTED_FIELDS_FILE`: a run that takes
    its architecture from the import keeps these values, :func:`jmegatron.config.imported_args`).
    Returns the resolved config. Raises ExportError (prefixed by ``what``) for a bad
    ``config_file``, an invalid resulting config or weights that do not fit it.
    """
    import jax

    cfg = imported_config(fields, config_file, seq_length=seq_length, what=what, save=os.path.abspath(out),
                          **({"tokenizer_model": tokenizer_model} if tokenizer_model else {}))
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]), vocab_size=fields["vocab_size"])
    try:
        params = to_params(cfg, run.padded_vocab_size)
    except ValueError as e:
        raise ExportError(f"{what}: {e}") from e
    state = run.init_state()
    state = state.replace(params=jax.device_put(params, run.state_shardings.params),
                          step=jax.device_put(np.int32(iteration), state.step.sharding))
    os.makedirs(out, exist_ok=True)
    if before_save:
        before_save(cfg)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write(cfg.to_json())
    with open(os.path.join(out, IMPORTED_FIELDS_FILE), "w") as f:  # what a run from it keeps (imported_args)
        json.dump({"fields": sorted(fields)}, f, indent=1)
    ckpt = checkpointing.Checkpointer(out)
    ckpt.save(iteration, state, checkpoint_meta(cfg, run, iteration, 0))
    ckpt.wait()
    ckpt.close()
    print(f"[jmegatron.export] {source} -> jmegatron checkpoint {os.path.abspath(out)} (iteration {iteration})")
    return cfg
