"""Your own loss through the forward-step seam, trained by jmegatron's loop (the research API).

    python examples/custom_loss.py [--iterations 20] [--label-smoothing 0.1] [--save DIR]

Megatron's ``pretrain(..., forward_step_func)`` takes what a micro-batch computes from the
caller (pretrain_gpt.py passes its ``forward_step`` and ``loss_func``). Here
``jmegatron.training.loop.pretrain(cfg, forward_step_provider=...)`` does: the provider is
called once with the model and returns a :class:`jmegatron.training.forward_step.ForwardStep`
whose ``loss_fn(params, micro, rng, num_tokens, extra, data_sum) -> (loss, report)`` gives
one micro-batch's loss and a dict of scalars. Every scalar of ``report`` is printed on
Megatron's iteration line (`` name: value |``, as Megatron prints every key of its loss
dict), written to ``metrics.jsonl`` and TensorBoard (and W&B with ``config.wandb_project``)
under its key; the loop never names them.

The loss here is label-smoothed cross-entropy as Megatron-Core's ``--label-smoothing``
(megatron/core/tensor_parallel/cross_entropy.py, VocabParallelCrossEntropy): with ``V`` the
(padded) vocabulary and ``s = eps * V / (V - 1)``, a token's loss is ``(1 - s) * nll - s *
mean_v log p_v``. It reports ``lm_loss`` (the plain cross-entropy, comparable with any run),
``label_smoothed_loss`` (what is optimised) and ``token_accuracy`` (the share of next tokens
the model ranks first). The mock documents count up (1, 2, 3, ...), so the accuracy rises
within a few iterations.
"""

import argparse
import json
import os
import tempfile

import jax
import jax.numpy as jnp

from jmegatron.config import base_config, from_configdict
from jmegatron.training.forward_step import ForwardStep, model_buffers
from jmegatron.training.loop import pretrain


def label_smoothing_forward_step(label_smoothing: float):
    """A forward step provider ``(cfg, model, mesh, padded_vocab_size) -> ForwardStep``
    training on label-smoothed cross-entropy (module docstring); ``0 < label_smoothing < 1``.

    The micro-batch's token mean runs over every data-parallel rank: each rank's masked sums
    go through ``data_sum`` and are divided by ``num_tokens`` (the micro-batch's unmasked
    tokens on all ranks), so loss and report are the same on every rank, as the train step
    requires. No ``pipeline_stages``: ``build`` refuses pipeline_model_parallel_size > 1 for it."""
    if not 0.0 < label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in (0, 1)")

    def provider(cfg, model, mesh, padded_vocab_size):
        smoothing = label_smoothing * padded_vocab_size / (padded_vocab_size - 1)

        def loss_fn(params, micro, rng, num_tokens, extra, data_sum):
            logits = model.apply({"params": params}, micro["tokens"], micro["position_ids"], deterministic=False,
                                 rngs={"dropout": rng}, sample_offset=micro["sample_offset"],
                                 segment_ids=micro.get("segment_ids"))  # [b, s, V]
            log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(log_probs, micro["labels"][..., None], axis=-1)[..., 0]  # [b, s]
            smoothed = (1.0 - smoothing) * nll - smoothing * jnp.mean(log_probs, axis=-1)
            mask = micro["loss_mask"].astype(jnp.float32)

            def token_mean(x):  # over the micro-batch's unmasked tokens on every data rank
                return data_sum(jnp.sum(x * mask)) / jnp.maximum(num_tokens, 1.0)

            loss = token_mean(smoothed)
            correct = (jnp.argmax(logits, axis=-1) == micro["labels"]).astype(jnp.float32)
            return loss, {"lm_loss": token_mean(nll), "label_smoothed_loss": loss,
                          "token_accuracy": token_mean(correct)}

        return ForwardStep(loss_fn=loss_fn, buffers=model_buffers(cfg, model))

    return provider


def main(iterations: int = 20, label_smoothing: float = 0.1, save: str = None) -> list[dict]:
    # A tiny GPT on mock data (Megatron's argument names, validated on construction).
    c = base_config()
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 2, 64, 4, 64
    c.vocab_size, c.mock_data = 1000, True
    c.micro_batch_size, c.global_batch_size, c.train_iters = 2, 8, iterations
    c.lr, c.log_interval, c.eval_iters = 3e-3, 5, 2
    c.save = save or tempfile.mkdtemp(prefix="jmegatron_custom_loss_")
    cfg = from_configdict(c)

    # The loop: data, the jitted step built around this loss, logs, evaluation, checkpoint.
    summary = pretrain(cfg, forward_step_provider=label_smoothing_forward_step(label_smoothing))

    # The custom metrics are in metrics.jsonl (and TensorBoard) under their keys.
    with open(os.path.join(cfg.save, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "token_accuracy" in r]
    for r in records:
        print(f"iteration {r['iteration']}: lm loss {r['lm_loss']:.4f}, label-smoothed loss "
              f"{r['label_smoothed_loss']:.4f}, token accuracy {r['token_accuracy']:.3f}")
    print(f"{summary['iteration']} iterations; metrics in {cfg.save}/metrics.jsonl, TensorBoard in {cfg.save}/tensorboard")
    return records


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20, help="training iterations (default 20)")
    parser.add_argument("--label-smoothing", type=float, default=0.1, help="epsilon in (0, 1) (default 0.1)")
    parser.add_argument("--save", default=None, help="run directory (default: a new temporary one)")
    args = parser.parse_args()
    main(args.iterations, args.label_smoothing, args.save)
