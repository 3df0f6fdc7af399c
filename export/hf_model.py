"""The ``transformers`` model of a jmegatron parameter tree (the golden tests', ``quantize``'s
and the PyTorch reference's model): :mod:`jmegatron.conversion.hf`'s state dict and config
loaded into the transformers class. Imports torch and transformers when called."""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from jmegatron.conversion import hf_moe
from jmegatron.conversion.hf import GEMMA3, GPT2, MOE_ARCHITECTURES, hf_config_dict, to_hf_state_dict


def hf_config_class(arch: str):
    """The transformers config class of architecture ``arch`` (a class name
    :func:`jmegatron.conversion.hf.hf_architecture` returns, e.g. ``"Qwen3ForCausalLM"`` ->
    ``Qwen3Config``). Imports transformers (ImportError if missing)."""
    import transformers

    return getattr(transformers, {GPT2: "GPT2Config", GEMMA3: "Gemma3TextConfig"}.get(
        arch, arch.replace("ForCausalLM", "Config")))


def to_hf_model(params: Mapping, cfg, vocab_size: Optional[int] = None, *,
                bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None):
    """A float32 ``transformers`` model (``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
    ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM``, eval mode) holding ``params``
    (per-layer or scanned), loaded with ``load_state_dict(strict=True)`` (MoE experts fused
    first where the installed transformers holds them fused).

    ``vocab_size`` as in :func:`jmegatron.conversion.hf.to_hf_state_dict` (default: the
    embedding's rows). Imports torch and transformers here (ImportError if missing). Raises
    ValueError as :func:`jmegatron.conversion.hf.to_hf_state_dict`.
    """
    import torch
    import transformers

    sd = to_hf_state_dict(params, cfg, vocab_size)
    emb_key = "transformer.wte.weight" if "transformer.wte.weight" in sd else "model.embed_tokens.weight"
    v = sd[emb_key].shape[0]
    conf = hf_config_dict(cfg, v, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    arch = conf["architectures"][0]
    config = hf_config_class(arch).from_dict(conf)
    if cfg.attn_logit_softcapping is not None:  # transformers' SDPA path drops Gemma-2's soft-cap
        config._attn_implementation = "eager"
    model = getattr(transformers, arch)(config).to(torch.float32)
    if arch in MOE_ARCHITECTURES:  # transformers 5 holds the experts fused in memory
        sd = hf_moe.to_module_layout(sd, arch, set(model.state_dict()))
    tensors = {k: torch.from_numpy(np.array(a, dtype=np.float32, order="C", copy=True))
               for k, a in sd.items()}
    if not cfg.untie_embeddings_and_output_weights:
        tensors["lm_head.weight"] = tensors[emb_key]
    model.load_state_dict(tensors, strict=True)
    model.eval()
    return model
