"""A plain autoregressive sampler (no KV cache): the whole buffer is re-encoded each step.

The reference for the KV-cache generator (jmegatron.inference.generate, which the demo
and the CLI use): both must give the same greedy tokens. One jitted function over a
fixed ``[batch, max_len]`` buffer, so there is one compilation per (batch, max_len).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.inference.generate import filter_logits


def sample(model: Any, params: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           *, temperature: float = 1.0, top_k: int = 0, greedy: bool = False, seed: int = 0,
           eod_id: Optional[int] = None, max_length: Optional[int] = None,
           top_p: float = 1.0) -> list[list[int]]:
    """Continue each prompt (list of token ids) by up to ``max_new_tokens`` tokens.

    Returns the new tokens per prompt (stopping after ``eod_id``). ``max_length`` caps
    prompt + new tokens (the model's ``max_position_embeddings`` for learned positions);
    prompts longer than that keep their last tokens. Sampling is from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` best (0: all) or the
    ``top_p`` nucleus (1: all; :func:`jmegatron.inference.generate.filter_logits`), or
    argmax with ``greedy``. Each prompt stops on its own when it reaches ``max_length``.
    """
    max_length = max_length or max(len(p) for p in prompts) + max_new_tokens
    prompts = [list(p)[-(max_length - 1):] for p in prompts]
    batch = len(prompts)
    buf = np.zeros((batch, max_length), np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = p

    @jax.jit
    def next_token(params, buf, pos, key):
        logits = model.apply({"params": params}, buf)
        last = jnp.take_along_axis(logits, (pos - 1)[:, None, None], axis=1)[:, 0]
        if greedy:
            return jnp.argmax(last, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, filter_logits(last, temperature, top_k, top_p)).astype(jnp.int32)

    key = jax.random.key(seed)
    out: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    pos = lengths.copy()
    for t in range(max_new_tokens):
        if (done | (pos >= max_length)).all():
            break
        tok = np.asarray(next_token(params, jnp.asarray(buf), jnp.asarray(pos), jax.random.fold_in(key, t)))
        for i in range(batch):
            if done[i] or pos[i] >= max_length:
                continue
            buf[i, pos[i]] = tok[i]
            out[i].append(int(tok[i]))
            pos[i] += 1
            if eod_id is not None and tok[i] == eod_id:
                done[i] = True
    return out
