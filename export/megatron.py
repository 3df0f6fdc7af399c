"""Megatron-LM checkpoints in and out: ``import-megatron`` and ``megatron``.

``python -m jmegatron.export import-megatron --load DIR --out CKPT [--iteration N] [--config FILE]``
reads a checkpoint that Megatron-LM wrote (its ``--save`` directory: the tracker
``latest_checkpointed_iteration.txt`` and ``iter_{N:07d}/`` or ``release/``) in either of its
formats and writes a jmegatron checkpoint at the same iteration (fresh optimizer state):

* ``torch`` (``--ckpt-format torch``, Megatron's "legacy" format): one
  ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` per model-parallel rank
  (megatron/training/checkpointing.py ``get_checkpoint_name``), each a ``torch.save`` of
  ``{"args", "checkpoint_version", "iteration", "model" (or "model0", "model1", ... per
  virtual stage)}``; the model entries are ``GPTModel.state_dict()`` shards, which this
  module concatenates following megatron-core's tensor-parallel layers (see below);
* ``torch_dist`` (the default since Megatron-LM core 0.8): ``metadata.json``, ``common.pt``
  (the args) and a PyTorch Distributed Checkpoint whose keys are megatron-core's
  ``sharded_state_dict`` keys, global tensors independent of the layout (layers stacked on a
  leading ``[L]`` axis under ``decoder.layers.*``); read with ``torch.distributed.checkpoint``
  alone.

The architecture comes from the checkpoint's ``args`` (Megatron's argument names map one to
one onto jmegatron's; fields jmegatron cannot represent are refused by name), the training
settings from ``--config``.

``python -m jmegatron.export megatron --load CKPT --out DIR [--format torch|torch_dist]
[--tensor-model-parallel-size N] [--pipeline-model-parallel-size N] [--expert-model-parallel-size N]``
writes the other way: ``torch`` with pure PyTorch, one file per rank of the requested layout;
``torch_dist`` through megatron-core itself (``dist_checkpointing.save`` of a ``GPTModel``
built on the CPU; the format reshards at load, so the layout is only recorded in the args).
Both carry ``args`` that Megatron-LM's ``load_checkpoint`` and ``--use-checkpoint-args`` read
(``no_save_optim`` / ``no_save_rng`` set: it loads the model and starts a fresh optimizer).

The state dict layout, tensor-parallel split and merge and the argument mapping are
:mod:`jmegatron.conversion.megatron`.

Sources followed: Megatron-LM ``megatron/training/checkpointing.py`` (tracker, directory and
file names, what a checkpoint holds), ``megatron/training/arguments.py`` (argument names),
megatron-core ``models/gpt``, ``transformer/attention.py``, ``transformer/mlp.py``,
``transformer/moe/experts.py`` and ``dist_checkpointing`` (tests/test_megatron_checkpoint.py
builds megatron-core models on the CPU and checks logits both ways).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import shutil
from typing import Any, Callable, Mapping, Optional

import numpy as np

from jmegatron.config import from_configdict, no_rope_layer_pattern, tokenizer_type_of, tokenizer_vocab_size
from jmegatron.conversion import hf_moe
from jmegatron.conversion.megatron import (CHECKPOINT_VERSION, FORMATS, MOE_MODEL_FIELDS, TRACKER, canonical_key,
                                          config_fields_from_megatron_args, from_megatron_state_dict, merge_shards,
                                          rank_dir, refuse_blocks, shard_state_dict, to_megatron_state_dict)
from jmegatron.conversion.tree import to_numpy
from jmegatron.export.common import ExportError, check_out_dir, checkpoint_config, load_checkpoint, open_checkpoint
from jmegatron.export.imports import save_imported

__all__ = ["megatron_args", "read_megatron_checkpoint", "write_legacy_checkpoint", "import_megatron", "export_megatron",
           "register"]


# ----------------------------------------------------------------------------- files
def megatron_args(cfg, padded_vocab_size: int, vocab_size: int, *, tensor_model_parallel_size: int = 1,
                  pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                  iteration: int = 0, ckpt_format: str = "torch") -> argparse.Namespace:
    """The ``args`` a Megatron-LM checkpoint carries, for ``cfg`` in layout (tp, pp, ep).

    ``vocab_size``: the true vocabulary (ids counted); the args hold Megatron's ``--vocab-size``
    (a NullTokenizer's is ``cfg.vocab_size``, one less: :func:`jmegatron.config.tokenizer_vocab_size`).
    Argument names and meanings are megatron/training/arguments.py's; the set covers what
    ``load_checkpoint``'s ``check_checkpoint_args`` compares and what ``--use-checkpoint-args``
    (``load_args_from_checkpoint``) copies, plus ``no_save_optim`` / ``no_save_rng`` (True:
    Megatron-LM loads the model only). Values are primitives and ``torch.dtype``, which
    ``torch.load(weights_only=True)`` accepts. Raises ValueError for the blocks a Megatron
    GPT checkpoint cannot hold.
    """
    import torch

    refuse_blocks(cfg)
    moe = cfg.num_moe_experts is not None
    a = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels,
        group_query_attention=cfg.num_query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, max_position_embeddings=cfg.max_position_embeddings,
        seq_length=cfg.seq_length, position_embedding_type=cfg.position_embedding_type,
        add_position_embedding=cfg.position_embedding_type == "learned_absolute",
        rotary_base=cfg.rotary_base, rotary_percent=1.0, rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
        use_rope_scaling=cfg.rope_scaling, rope_scaling_factor=cfg.rope_scaling_factor,
        normalization=cfg.normalization, norm_epsilon=cfg.norm_epsilon, apply_layernorm_1p=False,
        swiglu=cfg.swiglu, squared_relu=False, openai_gelu=cfg.openai_gelu, add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias or cfg.add_bias_linear, qk_layernorm=cfg.qk_layernorm,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        multi_latent_attention=False, mtp_num_layers=cfg.mtp_num_layers,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
        vocab_size=cfg.vocab_size if tokenizer_vocab_size(cfg.tokenizer_type, cfg.vocab_size) else vocab_size,
        padded_vocab_size=padded_vocab_size,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout, init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tensor_model_parallel_size, pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size, expert_tensor_parallel_size=tensor_model_parallel_size,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, sequence_parallel=False,
        micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size,
        bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32,
        iteration=iteration, ckpt_format=ckpt_format, no_save_optim=True, no_save_rng=True,
        consumed_train_samples=0, consumed_valid_samples=0, seed=cfg.seed,
        tokenizer_type=tokenizer_type_of(cfg),
        tokenizer_model=cfg.tokenizer_model, vocab_file=cfg.vocab_file, merge_file=cfg.merge_file,
        num_experts=cfg.num_moe_experts,
        no_rope_freq=list(cfg.no_rope_freq) if isinstance(cfg.no_rope_freq, tuple) else cfg.no_rope_freq,
    )
    if moe:
        freq = cfg.moe_layer_freq
        a.update({k: getattr(cfg, k) for k in MOE_MODEL_FIELDS},
                 moe_layer_freq=list(hf_moe.moe_layers(cfg)) if not isinstance(freq, int) else freq,
                 moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
                 moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_grouped_gemm=False,
                 moe_token_dispatcher_type=cfg.moe_token_dispatcher_type)
    return argparse.Namespace(**a)


def _torch_load(path: str, trust_pickle: bool) -> Any:
    """``torch.load`` of a Megatron file: ``weights_only`` with ``argparse.Namespace`` and
    megatron-core's safe globals allowed, unless ``trust_pickle``."""
    import pickle

    import torch

    if trust_pickle:
        return torch.load(path, map_location="cpu", weights_only=False)
    allowed: list = [argparse.Namespace]
    try:  # the classes megatron-core allows in its own checkpoints (enums of the args)
        from megatron.core.safe_globals import SAFE_GLOBALS

        allowed += list(SAFE_GLOBALS)
    except ImportError:
        pass
    registered = set(map(id, torch.serialization.get_safe_globals()))
    allowed = [g for g in allowed if id(g) not in registered]  # the context removes what it adds on exit
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ExportError(f"{path}: holds Python objects beyond tensors and plain values ({str(e).splitlines()[0]}); "
                          f"if you trust this checkpoint, pass --trust-pickle") from e


def _checkpoint_dir(load: str, iteration: Optional[int]) -> tuple[str, int]:
    """Megatron's checkpoint folder and iteration from a ``--save`` directory (tracker),
    an ``iter_*`` / ``release`` folder, or ``iteration``."""
    load = os.path.abspath(load)
    base = os.path.basename(load.rstrip("/"))
    if re.fullmatch(r"iter_\d{7}", base) or base == "release":
        return load, int(base[5:]) if base != "release" else 0
    if iteration is not None:
        path = os.path.join(load, f"iter_{iteration:07d}")
        if not os.path.isdir(path):
            raise ExportError(f"--load {load}: no iter_{iteration:07d} folder for --iteration {iteration}")
        return path, iteration
    tracker = os.path.join(load, TRACKER)
    if not os.path.isfile(tracker):
        raise ExportError(f"--load {load}: no {TRACKER} (a Megatron-LM --save directory has one) and no "
                          f"iter_NNNNNNN / release folder given; pass the folder or --iteration")
    text = open(tracker).read().strip()
    if text == "release":
        return os.path.join(load, "release"), 0
    if not text.isdigit():
        raise ExportError(f"--load {load}: {TRACKER} holds {text!r}, not an iteration or 'release'")
    return os.path.join(load, f"iter_{int(text):07d}"), int(text)


def checkpoint_format(path: str) -> str:
    """``torch_dist`` (``metadata.json``), ``torch`` (``mp_rank_*`` folders), else ExportError
    (megatron/training/checkpointing.py ``_get_checkpoint_format``)."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return "torch_dist"
    if glob.glob(os.path.join(path, "mp_rank_0*")):
        return "torch"
    if os.path.isfile(os.path.join(path, ".metadata")):
        raise ExportError(f"{path}: a torch_dcp / fsdp_dtensor checkpoint (only .metadata); re-save it with "
                          f"--ckpt-format torch_dist or torch")
    raise ExportError(f"{path}: neither a torch_dist (metadata.json) nor a torch (mp_rank_*) Megatron checkpoint")


def _args_get(args: Any, name: str, default=None):
    return getattr(args, name, default) if not isinstance(args, Mapping) else args.get(name, default)


def _read_legacy(path: str, cfg_of: Callable, trust_pickle: bool) -> tuple[Any, dict, Any]:
    dirs = sorted(d for d in os.listdir(path) if d.startswith("mp_rank_"))
    first = _torch_load(os.path.join(path, dirs[0], "model_optim_rng.pt"), trust_pickle)
    args = first.get("args")
    if args is None:
        raise ExportError(f"{path}/{dirs[0]}/model_optim_rng.pt holds no 'args' (an old or foreign file); "
                          f"jmegatron needs them for the architecture")
    if first.get("checkpoint_version", 0) < 3.0:
        raise ExportError(f"{path}: checkpoint_version {first.get('checkpoint_version')} < 3.0 (an old QKV "
                          f"layout); convert it with a Megatron-LM of its time first")
    cfg = cfg_of(args)
    tp = _args_get(args, "tensor_model_parallel_size", 1) or 1
    pp = _args_get(args, "pipeline_model_parallel_size", 1) or 1
    ep = _args_get(args, "expert_model_parallel_size", 1) or 1
    vp = _args_get(args, "virtual_pipeline_model_parallel_size") or 1
    shards = {}
    for t in range(tp):
        for s in range(pp):
            for x in range(ep):
                name = rank_dir(t, s, x, pp, ep)
                f = os.path.join(path, name, "model_optim_rng.pt")
                if not os.path.isfile(f):
                    raise ExportError(f"{path}: no {name}/model_optim_rng.pt (args say tensor {tp} x pipeline {pp} "
                                      f"x expert {ep})")
                state = first if name == dirs[0] else _torch_load(f, trust_pickle)
                if vp > 1:
                    shards[(t, s, x)] = {f"model{v}/{k}": w for v in range(vp) for k, w in state[f"model{v}"].items()}
                else:
                    shards[(t, s, x)] = state["model"]
    try:
        return args, merge_shards(shards, cfg, tp, pp, ep, vp), first.get("iteration")
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from e


def _read_torch_dist(path: str, trust_pickle: bool) -> tuple[Any, dict, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    common = _torch_load(os.path.join(path, "common.pt"), trust_pickle)
    reader = dcp.FileSystemReader(path)
    try:
        meta = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - a pickle of megatron-core classes, or a corrupt file
        raise ExportError(f"{path}/.metadata is unreadable ({type(e).__name__}: {e}); with megatron-core "
                          f"installed it reads") from e
    wanted = {}
    for key, md in meta.state_dict_metadata.items():
        if re.match(r"^(embedding|decoder|output_layer)\.", key) and hasattr(md, "size") and \
                not key.endswith("_extra_state"):
            wanted[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    dcp.load(wanted, storage_reader=reader, no_dist=True)
    args = common.get("args")
    num_layers = _args_get(args, "num_layers")
    sd = {}
    for key, value in wanted.items():
        a = to_numpy(value)
        m = re.match(r"^decoder\.layers\.(?!\d)(.+)$", key)
        if not m:
            mm = re.match(r"^(decoder\.layers\.\d+\.mlp\.experts)(?:\.experts)?\.(linear_fc[12]\.weight)$", key)
            if mm:  # per-layer keys, experts global: [E, ...]
                for x in range(a.shape[0]):
                    sd[f"{mm[1]}.local_experts.{x}.{mm[2]}"] = a[x]
            else:
                sd[key] = a
            continue
        if a.shape[0] != num_layers:
            raise ExportError(f"{path}: {key} has {a.shape[0]} layers, the args {num_layers}")
        rest = m[1]
        em = re.match(r"^mlp\.experts(?:\.experts)?\.(linear_fc[12]\.weight)$", rest)
        for i in range(num_layers):
            if em:
                for x in range(a.shape[1]):
                    sd[f"decoder.layers.{i}.mlp.experts.local_experts.{x}.{em[1]}"] = a[i, x]
            else:
                sd[f"decoder.layers.{i}.{rest}"] = a[i]
    return args, {canonical_key(k): v for k, v in sd.items()}, common.get("iteration")


def read_megatron_checkpoint(load: str, iteration: Optional[int] = None, trust_pickle: bool = False):
    """Read a Megatron-LM checkpoint: ``(args, global state dict, iteration, format)``.

    ``load``: a ``--save`` directory (its tracker picks the iteration, or ``iteration``),
    or one ``iter_NNNNNNN`` / ``release`` folder. Files are read with
    ``torch.load(weights_only=True)`` (``argparse.Namespace`` and megatron-core's safe
    globals allowed) unless ``trust_pickle``. Raises ExportError naming the path for a
    missing tracker, folder or rank file, an unknown format, an old checkpoint version or
    args jmegatron cannot represent.
    """
    path, it = _checkpoint_dir(load, iteration)
    if not os.path.isdir(path):
        raise ExportError(f"--load {load}: {path} does not exist")
    fmt = checkpoint_format(path)

    def cfg_of(args):
        try:
            fields = config_fields_from_megatron_args(args)
        except ValueError as e:
            raise ExportError(f"--load {load}: {e}") from e
        fields.pop("vocab_size", None)
        return from_configdict(dict(fields, mock_data=True, vocab_size=1))

    if fmt == "torch":
        args, sd, saved_it = _read_legacy(path, cfg_of, trust_pickle)
    else:
        args, sd, saved_it = _read_torch_dist(path, trust_pickle)
        cfg_of(args)  # refusals before any conversion
    return args, sd, int(saved_it if saved_it is not None else it), fmt


def write_legacy_checkpoint(out: str, sd: Mapping[str, np.ndarray], cfg, args: argparse.Namespace, iteration: int,
                            tp: int = 1, pp: int = 1, ep: int = 1, dtype: str = "float32") -> list[str]:
    """Write the ``torch`` format under ``out`` (tracker + ``iter_NNNNNNN/mp_rank_*``):
    each rank's ``{"args", "checkpoint_version", "iteration", "model"}`` in ``dtype``.
    Returns the files written."""
    import torch

    tdtype = getattr(torch, dtype)
    folder = os.path.join(out, f"iter_{iteration:07d}")
    files = []
    for rank, model in shard_state_dict(sd, cfg, tp, pp, ep).items():
        os.makedirs(os.path.join(folder, rank), exist_ok=True)
        tensors = {k: None if v is None else torch.from_numpy(np.ascontiguousarray(v)).to(tdtype)
                   for k, v in model.items()}
        f = os.path.join(folder, rank, "model_optim_rng.pt")
        torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                    "model": tensors}, f)
        files.append(f)
    with open(os.path.join(out, TRACKER), "w") as f:
        f.write(str(iteration))
    return files


# ----------------------------------------------------------------------------- megatron-core on the CPU
@contextlib.contextmanager
def cpu_megatron_core():
    """megatron-core assumes CUDA even for CPU tensors (its checkpoint writer calls
    ``torch.cuda.synchronize()`` and reduces a flag on ``torch.cuda.current_device()``, its
    router makes the expert-bias buffers there); on a machine without CUDA both become CPU
    no-ops for the duration of the block."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def init_megatron_core_cpu(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                           expert_model_parallel_size: int = 1) -> None:
    """One-process megatron-core on the CPU: a gloo process group of world size 1 (unless one
    exists) and megatron-core's model-parallel groups. Raises ExportError without megatron-core."""
    try:
        import torch
        from megatron.core import parallel_state
    except ImportError as e:
        raise ExportError(f"--format torch_dist needs megatron-core (pip install megatron-core): {e}") from e
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                                 expert_model_parallel_size=expert_model_parallel_size)


def megatron_core_model(cfg, padded_vocab_size: int, initialize: bool = False):
    """megatron-core's ``GPTModel`` (local spec, float32, on the CPU; its weights
    initialised only with ``initialize``, from torch's global generator) of ``cfg`` in the
    current model-parallel layout (:func:`init_megatron_core_cpu`).

    The modules megatron-core builds for Megatron-LM's ``pretrain_gpt.py`` with
    ``--transformer-impl local``: ``get_gpt_layer_local_spec`` for dense models,
    ``get_gpt_decoder_block_spec`` for mixture-of-experts ones, ``get_gpt_mtp_block_spec``
    for the multi-token prediction layers."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    refuse_blocks(cfg)
    act = F.silu if cfg.swiglu else (lambda x: F.gelu(x, approximate="tanh")) if cfg.openai_gelu else F.gelu
    kw = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
              num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
              normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon, gated_linear_unit=cfg.swiglu,
              activation_func=act, add_bias_linear=cfg.add_bias_linear,
              add_qkv_bias=cfg.add_qkv_bias or cfg.add_bias_linear, qk_layernorm=cfg.qk_layernorm,
              hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, perform_initialization=initialize,
              params_dtype=torch.float32, init_method_std=cfg.init_method_std, bias_activation_fusion=False,
              tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
              pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(), pipeline_dtype=torch.float32,
              expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
              expert_tensor_parallel_size=ps.get_tensor_model_parallel_world_size(),
              sequence_parallel=False, mtp_num_layers=cfg.mtp_num_layers,
              mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor)
    if cfg.num_moe_experts is not None:
        kw.update({k: getattr(cfg, k) for k in MOE_MODEL_FIELDS}, num_moe_experts=cfg.num_moe_experts,
                  moe_layer_freq=list(hf_moe.moe_layers(cfg)), moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_token_dispatcher_type="allgather")
    if cfg.no_rope_freq is not None:  # megatron-core's NoPE layers (1 = skip RoPE)
        kw["no_rope_freq"] = list(no_rope_layer_pattern(cfg.no_rope_freq, cfg.num_layers))
    config = TransformerConfig(**kw)
    if cfg.num_moe_experts is not None:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=cfg.normalization)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization)
    rope = dict(rotary_base=cfg.rotary_base, seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
                rope_scaling=cfg.rope_scaling, rope_scaling_factor=cfg.rope_scaling_factor)
    mtp = None if not cfg.mtp_num_layers else get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    with cpu_megatron_core():  # the router's expert-bias buffers are made on torch.cuda.current_device()
        return GPTModel(config, spec, vocab_size=padded_vocab_size, max_sequence_length=cfg.max_position_embeddings,
                        position_embedding_type=cfg.position_embedding_type,
                        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
                        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                        mtp_block_spec=mtp, **rope)


def torch_state_dict(sd: Mapping[str, np.ndarray], model, dtype: str = "float32") -> dict:
    """A global numpy state dict as the torch state dict ``model.load_state_dict(strict=True)``
    takes: tensors in ``dtype`` plus the ``_extra_state`` entries the model's own
    ``state_dict()`` has."""
    import torch

    out = {k: torch.from_numpy(np.ascontiguousarray(v)).to(getattr(torch, dtype)) for k, v in sd.items()}
    for k, v in model.state_dict().items():
        if k.endswith("_extra_state"):
            out[k] = v
    return out


def write_torch_dist_checkpoint(out: str, sd: Mapping[str, np.ndarray], cfg, args: argparse.Namespace,
                                iteration: int, padded_vocab_size: int) -> str:
    """Write the ``torch_dist`` format under ``out`` with megatron-core's own
    ``dist_checkpointing.save`` of a one-process CPU ``GPTModel`` holding ``sd`` (loaded
    with ``strict=True``), ``args`` / ``checkpoint_version`` / ``iteration`` as common
    items (``common.pt``), then the tracker. Returns the iteration folder."""
    from megatron.core import dist_checkpointing

    init_megatron_core_cpu()
    model = megatron_core_model(cfg, padded_vocab_size)
    model.load_state_dict(torch_state_dict(sd, model), strict=True)
    folder = os.path.join(out, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    with cpu_megatron_core():
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args,
                                 "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}, folder)
    with open(os.path.join(out, TRACKER), "w") as f:
        f.write(str(iteration))
    return folder


# ----------------------------------------------------------------------------- the commands
def register(sub) -> None:
    """Add ``import-megatron`` and ``megatron`` to an argparse subparsers object."""
    q = sub.add_parser("import-megatron", help="a Megatron-LM checkpoint (torch or torch_dist) -> a jmegatron checkpoint")
    q.add_argument("--load", required=True, help="Megatron-LM --save directory, or one iter_NNNNNNN / release folder")
    q.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    q.add_argument("--out", required=True, help="jmegatron checkpoint directory to create (must hold none)")
    q.add_argument("--config", default=None, help="config file for the training settings (architecture from args)")
    q.add_argument("--vocab-size", type=int, default=None,
                   help="the true vocabulary, ids counted (default: the args' --tokenizer-type and --vocab-size by "
                        "Megatron's rule of that type (NullTokenizer: vocab_size + 1, its end of document), else "
                        "the args' vocab_size, else the padded rows)")
    q.add_argument("--trust-pickle", action="store_true",
                   help="torch.load with weights_only=False (only for checkpoints you trust)")
    q.set_defaults(func=lambda a: import_megatron(a.load, a.out, a.config, a.iteration, a.vocab_size,
                                                  a.trust_pickle) and 0)

    p = sub.add_parser("megatron", help="write a Megatron-LM checkpoint (torch or torch_dist)")
    p.add_argument("--load", required=True, help="jmegatron checkpoint directory")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    p.add_argument("--format", choices=FORMATS, default="torch_dist")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.set_defaults(func=lambda a: export_megatron(a.load, a.out, a.format, a.iteration, a.dtype,
                                                  a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                                  a.expert_model_parallel_size) and 0)


def import_megatron(load: str, out: str, config_file: Optional[str] = None, iteration: Optional[int] = None,
                    vocab_size: Optional[int] = None, trust_pickle: bool = False):
    """Write a jmegatron checkpoint holding the Megatron-LM checkpoint ``load`` (at its
    iteration; fresh optimizer state). The architecture comes from the checkpoint's args,
    the training settings from ``config_file`` (default: jmegatron's defaults, mock data).
    The vocabulary (``vocab_size``: ids counted) defaults to the args' ``--tokenizer-type`` and
    ``--vocab-size`` by Megatron's rule of that type (:func:`jmegatron.config.tokenizer_vocab_size`:
    a NullTokenizer keeps its end-of-document row ``vocab_size``), else the args' ``vocab_size``,
    else the embedding's rows.
    Returns the resolved config. Raises ExportError (naming the path or argument) for what
    :func:`read_megatron_checkpoint` refuses, a tensor that is missing, misshapen or unused,
    or an ``out`` that already holds files."""
    check_out_dir(out)
    args, sd, it, fmt = read_megatron_checkpoint(load, iteration, trust_pickle)
    fields = config_fields_from_megatron_args(args)
    rows = sd["embedding.word_embeddings.weight"].shape[0]
    arg = fields.pop("vocab_size", None)  # Megatron's --vocab-size: its tokenizer type says what it counts
    v = vocab_size or tokenizer_vocab_size(fields.get("tokenizer_type"), arg) or arg or rows
    fields["vocab_size"] = v - 1 if fields.get("tokenizer_type") == "NullTokenizer" else v
    copies = {}  # the tokenizer's files travel into out/tokenizer/, as import-hf's do
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        if fields.get(name):
            src = fields[name]
            fields[name] = os.path.join(os.path.abspath(out), "tokenizer",
                                        "" if os.path.isdir(src) else os.path.basename(src)).rstrip("/")
            copies[src] = fields[name]

    def copy_tokenizer(cfg) -> None:
        for src, dst in copies.items():
            if os.path.isdir(src):
                shutil.copytree(src, dst)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copyfile(src, dst)

    cfg = save_imported(fields, out, config_file, lambda cfg, padded: from_megatron_state_dict(sd, cfg, padded, v),
                        iteration=it, source=f"Megatron-LM {fmt} checkpoint {os.path.abspath(load)}",
                        before_save=copy_tokenizer)
    return cfg


def export_megatron(load: str, out: str, fmt: str = "torch_dist", iteration: Optional[int] = None,
                    dtype: str = "float32", tp: int = 1, pp: int = 1, ep: int = 1) -> dict:
    """Write the jmegatron checkpoint ``load`` as a Megatron-LM checkpoint under ``out``
    (``fmt`` "torch": one file per rank of (tp, pp, ep); "torch_dist": megatron-core's
    resharding format, the layout recorded in the args). Returns a summary dict. Raises
    ExportError for a missing checkpoint, a block Megatron's GPT model lacks, sizes that do
    not divide the model, or a non-empty ``out``."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {FORMATS}")
    check_out_dir(out)
    saved = open_checkpoint(load, iteration)
    cfg = checkpoint_config(load, iteration, saved)
    try:
        refuse_blocks(cfg)
    except ValueError as e:
        raise ExportError(f"--load {load}: {e}") from e
    if fmt == "torch_dist" and dtype != "float32":
        raise ExportError("--dtype applies to --format torch; torch_dist is written in float32 (Megatron-LM casts "
                          "at load to its --bf16 / --fp16)")
    for name, size, total in (("tensor", tp, cfg.num_query_groups), ("pipeline", pp, cfg.num_layers)):
        if size < 1 or total % size:
            raise ExportError(f"--{name}-model-parallel-size {size} does not divide the model ({total})")
    src = load_checkpoint(load, iteration, saved)
    multiple = cfg.make_vocab_size_divisible_by * tp
    padded = -(-src.vocab_size // multiple) * multiple
    try:
        sd = to_megatron_state_dict(src.params, cfg, padded, src.vocab_size)
        args = megatron_args(cfg, padded, src.vocab_size, tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                             iteration=src.iteration, ckpt_format=fmt)
        os.makedirs(out, exist_ok=True)
        if fmt == "torch":
            files = write_legacy_checkpoint(out, sd, cfg, args, src.iteration, tp, pp, ep, dtype)
        else:
            files = [write_torch_dist_checkpoint(out, sd, cfg, args, src.iteration, padded)]
    except ValueError as e:
        raise ExportError(f"--load {load}: {e}") from e
    print(f"[jmegatron.export megatron] {src.load_dir} iteration {src.iteration} -> Megatron-LM {fmt} checkpoint "
          f"{os.path.abspath(out)} (tensor {tp}, pipeline {pp}, expert {ep}; vocab {src.vocab_size} padded to {padded})")
    return {"format": fmt, "iteration": src.iteration, "files": files, "padded_vocab_size": padded}
