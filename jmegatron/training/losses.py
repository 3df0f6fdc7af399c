"""The language model's losses (Megatron's ``loss_func`` in pretrain_gpt.py): per-token
cross-entropy by backend, its masked sum, and the unpipelined micro-batch loss the train
step takes from a forward step (:mod:`jmegatron.training.forward_step`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jmegatron.fusions.fused_cross_entropy import softmax_cross_entropy
from jmegatron.kernels.pallas.cross_entropy import lm_cross_entropy
from jmegatron.models.backend import resolve_cross_entropy_impl
from jmegatron.models.moe.moe_layer import MOE_COLLECTIONS, add_moe_losses
from jmegatron.models.multi_token_prediction import MTP_COLLECTION, mtp_losses


def token_cross_entropy(logits: jax.Array, labels: jax.Array, impl: str = "xla") -> jax.Array:
    """Per-token cross-entropy float32 ``[b, s]`` of logits ``[b, s, V]`` and int labels
    ``[b, s]`` by ``impl`` (``config.cross_entropy_impl``): ``"xla"``
    (:func:`jmegatron.fusions.fused_cross_entropy.softmax_cross_entropy`, GSPMD partitions it
    over a vocabulary split), ``"pallas"`` (the Pallas kernels,
    :func:`jmegatron.kernels.pallas.cross_entropy.lm_cross_entropy`: vocab-parallel over the
    ``tensor`` axis; interpret mode off a GPU) or ``"auto"`` ("pallas" on a GPU backend, else
    "xla"). Raises ValueError for another ``impl``."""
    impl = resolve_cross_entropy_impl(impl)
    if impl == "xla":
        return softmax_cross_entropy(logits, labels)
    if impl == "pallas":
        return lm_cross_entropy(logits, labels)
    raise ValueError(f"cross_entropy_impl={impl!r}: choose 'auto', 'xla' or 'pallas'")


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, loss_mask: jax.Array, impl: str = "xla"):
    """(sum of masked token losses, number of unmasked tokens), both float32 scalars.

    logits ``[b, s, V]`` float32, labels ``[b, s]`` int32, loss_mask ``[b, s]``. The
    cross-entropy is :func:`token_cross_entropy` by ``impl`` (default "xla":
    :func:`jmegatron.fusions.fused_cross_entropy.softmax_cross_entropy`, whose backward
    recomputes the softmax from the saved log-sum-exp).
    """
    ce = token_cross_entropy(logits, labels, impl)
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def lm_loss(cfg, logits: jax.Array, sown: dict, micro: dict, num_tokens: jax.Array, data_sum: Callable,
            cross_entropy_impl: str = "xla", rank_share: bool = False) -> tuple[jax.Array, dict]:
    """pretrain_gpt's ``loss_func`` on one micro-batch's forward, pipelined or not: the
    masked token mean of the cross-entropy of ``logits`` (float32 ``[b, s, V]``) against
    ``micro["labels"]`` under ``micro["loss_mask"]`` (``[b, s]``) over the whole micro-batch
    (``num_tokens``: its unmasked tokens over every data rank), reported as ``lm_loss``;
    with ``cfg.mtp_num_layers`` plus the multi-token prediction losses of ``sown``'s
    :data:`MTP_COLLECTION` (``mtp_{k}_loss``,
    :func:`jmegatron.models.multi_token_prediction.mtp_losses`). ``data_sum``: the psum over
    the ranks that split the batch. ``rank_share``: the loss and report are this rank's
    share of the global values (its masked sums over the global token counts), which a
    pipeline schedule sums over the data ranks; else the global values themselves.
    ``cross_entropy_impl``: :func:`token_cross_entropy`. Float32 scalars."""
    def cross_entropy(logits, labels, mask):
        return masked_cross_entropy(logits, labels, mask, cross_entropy_impl)

    share_sum = (lambda x: x) if rank_share else data_sum
    total, _ = cross_entropy(logits, micro["labels"], micro["loss_mask"])
    loss = share_sum(total) / jnp.maximum(num_tokens, 1.0)
    report = {"lm_loss": loss}
    if getattr(cfg, "mtp_num_layers", None):
        added, mtp_report = mtp_losses(sown[MTP_COLLECTION]["logits"], micro["labels"], micro["loss_mask"],
                                       data_sum, cross_entropy, cfg.mtp_loss_scaling_factor, share_sum=share_sum)
        loss, report = loss + added, {**report, **mtp_report}
    return loss, report


def lm_loss_fn(model, cross_entropy_impl: str = "xla") -> Callable:
    """The language-model loss of one micro-batch, ``loss_fn(params, micro, rng,
    num_tokens, extra, data_sum) -> (loss, report)`` (the interface of
    :func:`jmegatron.training.step.make_train_step`): ``model`` applied in training, then
    :func:`lm_loss` (the global values). An MoE model's router losses are added to it and
    reported beside ``lm_loss`` (:func:`jmegatron.models.moe.moe_layer.add_moe_losses`)."""
    cfg = getattr(model, "cfg", None)
    moe = getattr(cfg, "moe", None)
    mtp = bool(getattr(cfg, "mtp_num_layers", None))
    mutable = (list(MOE_COLLECTIONS) if moe is not None else []) + ([MTP_COLLECTION] if mtp else [])

    def loss_fn(params, micro, rng, num_tokens, extra, data_sum):
        out = model.apply({"params": params}, micro["tokens"], micro["position_ids"],
                          deterministic=False, rngs={"dropout": rng}, sample_offset=micro["sample_offset"],
                          segment_ids=micro.get("segment_ids"), positions=micro.get("positions"),
                          mutable=mutable or False)
        logits, sown = out if mutable else (out, {})
        loss, report = lm_loss(cfg, logits, sown, micro, num_tokens, data_sum, cross_entropy_impl)
        if moe is not None:
            loss, report = add_moe_losses(cfg, loss, report, sown, micro, data_sum)
        return loss, report

    return loss_fn
