"""A ``quantize`` output read back: its file names, the config of the checkpoint it came
from (:func:`quantized_source_config`) and the fake-quantized ``transformers`` model
(:func:`load_quantized`, ModelOpt's ``mto.restore``). Used by the ``quantize``, ``trtllm`` and
``check-unified`` commands; modelopt is imported lazily.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from jmegatron.export.common import ExportError, checkpoint_config, hf_model, load_checkpoint

MODELOPT_STATE = "modelopt_state.pth"
UNIFIED_HF_DIR = "unified_hf"
INFO_FILE = "quantize_info.json"
MANIFEST = "quantize.json"


def _resolve_cfg_dir(quantized_dir: str, cfg_name: Optional[str]) -> str:
    """The folder of config ``cfg_name`` in ``quantize``'s output ``quantized_dir``."""
    info_path = os.path.join(quantized_dir, INFO_FILE)
    if os.path.isfile(info_path):  # already one config's folder
        with open(info_path) as f:
            holds = json.load(f)["quant_cfg"]
        if cfg_name is not None and cfg_name != holds:
            raise ExportError(f"{quantized_dir} holds config {holds!r}, not {cfg_name!r}")
        return quantized_dir
    manifest = os.path.join(quantized_dir, MANIFEST)
    if not os.path.isfile(manifest):
        raise ExportError(f"{quantized_dir} is not a `jmegatron.export quantize` output (no {MANIFEST} or "
                          f"{INFO_FILE}); run `python -m jmegatron.export quantize ... --out {quantized_dir}` first")
    with open(manifest) as f:
        names = list(json.load(f)["quant_cfgs"])
    if cfg_name is None:
        if len(names) != 1:
            raise ExportError(f"{quantized_dir} holds configs {names}; name one (cfg_name / --quant-cfg)")
        cfg_name = names[0]
    if cfg_name not in names:
        raise ExportError(f"{quantized_dir} has no config {cfg_name!r}; it holds {names}")
    return os.path.join(quantized_dir, cfg_name)


def quantized_source_config(quantized_dir: str, cfg_name: Optional[str] = None):
    """The resolved config of the checkpoint a ``quantize`` output came from, read from its
    metadata without restoring any array (:func:`jmegatron.export.common.checkpoint_config`),
    so a command can refuse bad input before work. Raises ExportError as
    :func:`load_quantized`."""
    cfg_dir = _resolve_cfg_dir(quantized_dir, cfg_name)
    with open(os.path.join(cfg_dir, INFO_FILE)) as f:
        source = json.load(f)["source"]
    if not os.path.isdir(source["load_dir"]):
        raise ExportError(f"{cfg_dir}: its source checkpoint {source['load_dir']} is gone")
    return checkpoint_config(source["load_dir"], source["iteration"])


def load_quantized(quantized_dir: str, cfg_name: Optional[str] = None):
    """Restore a fake-quantized model written by ``quantize``.

    Args:
        quantized_dir: the ``--out DIR`` of ``quantize`` or one config's ``DIR/<cfg>`` folder.
        cfg_name: which config of ``DIR`` (e.g. ``"int8_sq"``); may be omitted when ``DIR``
            holds a single config or is itself a config folder.

    Returns:
        ``(model, src, info)``: the float32 ``transformers`` model rebuilt from the source
        checkpoint recorded in ``quantize_info.json`` with ModelOpt's quantizers restored by
        ``mto.restore`` (eval mode, CPU; its logits equal the quantized model's before saving);
        the :class:`ExportSource` of that checkpoint; and the info dict (``quant_cfg``,
        ``modelopt_config``, ``kv_cache_quant``, ``quant_algo``, ``kv_cache_quant_algo``,
        ``unified_hf_dir``, ``source``, ``perplexity``, ...).

    Raises:
        ExportError: not a quantize output, unknown/ambiguous ``cfg_name``, or the source
            checkpoint is gone (the message names the path).
    """
    import modelopt.torch.opt as mto

    cfg_dir = _resolve_cfg_dir(quantized_dir, cfg_name)
    with open(os.path.join(cfg_dir, INFO_FILE)) as f:
        info = json.load(f)
    info["unified_hf_dir"] = os.path.join(os.path.abspath(cfg_dir), UNIFIED_HF_DIR)
    source = info["source"]
    if not os.path.isdir(source["load_dir"]):
        raise ExportError(f"{cfg_dir}: its source checkpoint {source['load_dir']} is gone; the fake-quantized "
                          "model is rebuilt from it (the unified HF folder alone does not need it)")
    src = load_checkpoint(source["load_dir"], source["iteration"])
    model = hf_model(src)
    model = mto.restore(model, os.path.join(cfg_dir, MODELOPT_STATE))
    model.eval()
    return model, src, info
