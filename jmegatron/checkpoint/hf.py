"""A Hugging Face ``save_pretrained`` folder read for import: its architecture as jmegatron
config fields and its safetensors as jmegatron parameters.

:func:`read_hf_folder` is the one way a folder enters jmegatron: ``import-hf`` and the
``--load HF_FOLDER`` of train / evaluate / generate / serve (through
:func:`jmegatron.export.imports.import_hf`) and a Hugging Face distillation teacher
(:mod:`jmegatron.distill.teacher`, in memory). The mapping itself is
:mod:`jmegatron.conversion.hf`; this module adds the files (``config.json``,
``*.safetensors`` read with ``safetensors``, sharded or not; PyTorch ``.bin`` files are not
read).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Optional

from jmegatron.conversion.hf import config_fields_from_hf, from_hf_state_dict, hf_mtp_depths


def is_hf_folder(path: str) -> bool:
    """True for a Hugging Face ``save_pretrained`` folder: a ``config.json`` with a
    ``model_type`` (a jmegatron checkpoint's config.json has ``num_layers`` instead)."""
    conf = os.path.join(path, "config.json")
    if not os.path.isfile(conf):
        return False
    with open(conf) as f:
        saved = json.load(f)
    return "model_type" in saved and "num_layers" not in saved


def hf_tensor_names(folder: str) -> list[str]:
    """The tensor names of a Hugging Face folder's ``*.safetensors`` files (no data read)."""
    from safetensors import safe_open

    names = []
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "np") as f:
            names.extend(f.keys())
    return names


def read_hf_state_dict(folder: str) -> dict:
    """Every tensor of a Hugging Face folder's ``*.safetensors`` files (sharded or not) as
    float32 numpy. Raises ValueError when the folder has none (PyTorch ``.bin`` files are
    not read)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors file (PyTorch .bin checkpoints are not read; "
                         f"re-save with save_pretrained(safe_serialization=True))")
    sd = {}
    for path in files:
        sd.update({k: v.float().numpy() for k, v in load_file(path).items()})
    return sd


@dataclasses.dataclass(frozen=True)
class HFFolder:
    """A Hugging Face folder read for import (:func:`read_hf_folder`).

    ``path``: the folder; ``config``: its ``config.json``; ``fields``: the jmegatron config
    fields of its architecture (:func:`jmegatron.conversion.hf.config_fields_from_hf`, with
    ``vocab_size`` and ``max_position_embeddings``)."""

    path: str
    config: dict[str, Any]
    fields: dict[str, Any]

    @property
    def architecture(self) -> str:
        """The folder's transformers class name (``config.json``'s first ``architectures``), "?" if unnamed."""
        return (self.config.get("architectures") or ["?"])[0]

    def params(self, cfg, padded_vocab_size: Optional[int] = None) -> dict:
        """The folder's weights as jmegatron parameters of ``cfg`` (float32 numpy, the
        embedding padded to ``padded_vocab_size`` rows:
        :func:`jmegatron.conversion.hf.from_hf_state_dict`). Raises ValueError for no
        safetensors file or a tensor missing, unused or of the wrong shape."""
        return from_hf_state_dict(read_hf_state_dict(self.path), cfg, padded_vocab_size)


def read_hf_folder(folder: str, *, mtp: bool = True) -> HFFolder:
    """The :class:`HFFolder` of ``folder``, reading its ``config.json`` (no weights).

    ``mtp``: a DeepSeek-V3 folder's multi-token prediction depths are the ones its files
    hold (:func:`jmegatron.conversion.hf.hf_mtp_depths`, whatever
    ``num_nextn_predict_layers`` says) as ``mtp_num_layers``; False leaves them out (a
    teacher runs no multi-token prediction; its MTP tensors are dropped). Raises ValueError
    for a folder without ``config.json`` or an architecture jmegatron cannot represent (the
    HF fields named)."""
    conf_path = os.path.join(folder, "config.json")
    if not os.path.isfile(conf_path):
        raise ValueError("no config.json (expected a save_pretrained folder)")
    with open(conf_path) as f:
        config = json.load(f)
    try:
        fields = config_fields_from_hf(config)
    except KeyError as e:
        raise ValueError(str(e)) from e
    if mtp and config.get("model_type") == "deepseek_v3":
        fields["mtp_num_layers"] = hf_mtp_depths(hf_tensor_names(folder), fields["num_layers"]) or None
    return HFFolder(path=folder, config=config, fields=fields)
