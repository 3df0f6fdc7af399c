"""Text generation with a KV cache: one jitted prefill, then the whole decode loop in one
jitted ``lax.while_loop`` (no host round trip per token).

Follows Megatron-Core's static-batch inference (megatron/core/inference:
``StaticInferenceContext`` holds the key/value memory, the text generation controller
prefills the prompts then decodes one token per step for the whole batch, stopping each
sequence at its termination id) and its ``sample_from_logits`` (temperature, then top-k
or top-p; not both). The no-cache reference is :func:`jmegatron.inference.sample.sample`;
the tests check that both give the same greedy tokens.

Layout: prompts are **right-padded** into ``[batch, prefill_length]`` (token ``t`` of
every prompt at position ``t``, as in training and in the reference sampler). The cache
is ``[batch, max_length, num_query_groups, kv_channels]`` per layer
(:func:`jmegatron.models.gpt.init_kv_cache`); a token's cache slot is its position, so
each row writes its next token at its own length and attends to slots ``<=`` its
position (padding and stale slots are masked). Prefill lengths are rounded up to a
power of two (at least 16, at most ``max_length``), so there is one prefill compilation
per (batch, bucket, max_length) and one decode-loop compilation per (batch, max_length,
greedy, top_k, top-p on/off); temperature, top_p, seed, eod_id and the per-row
max_new_tokens are traced values. With ``return_log_probs`` the same two programs also
give Megatron's ``output_log_probs`` (log-softmax of the unfiltered logits at each next
token, megatron/inference/text_generation/generation.py), one more compilation of each.
Each compilation is announced with its time (:mod:`jmegatron.compilation`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.compilation import announced_jit
from jmegatron.config import tokenizer_type_of
from jmegatron.data.tokenizer import build_tokenizer, load_tokenizer
from jmegatron.models.gpt import init_kv_cache
from jmegatron.training.run import restore_run_params

Array = jax.Array


class GenerateError(ValueError):
    """Bad generation input (prompt, length or sampling setting); the message names the
    argument and the fix."""


# --------------------------------------------------------------------------- sampling
def filter_logits(logits: Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Array:
    """Megatron's logit modifiers: ``logits [..., vocab]`` / temperature, then top-k or
    top-p (nucleus, Holtzman et al. 2019) filtering; filtered entries become ``-inf``.

    ``top_k > 0`` keeps the ``top_k`` largest logits (ties with the k-th kept).
    ``top_p < 1`` keeps, in order of decreasing probability, every token whose preceding
    tokens' probability mass is ``<= top_p`` (Megatron's shifted cumulative sum): the
    smallest set whose mass reaches ``top_p``, the most likely token always kept (ties
    with the last kept token are kept too). Validation is :func:`check_sampling`'s;
    here ``top_k`` must be a Python int, ``temperature``/``top_p`` may be traced.
    """
    logits = logits / jnp.maximum(temperature, 1e-6)
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if not (isinstance(top_p, (int, float)) and top_p >= 1.0):
        sorted_desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_desc.astype(jnp.float32), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = jnp.sum(mass_before <= top_p, axis=-1, keepdims=True)  # >= 1: the first has 0 before it
        threshold = jnp.take_along_axis(sorted_desc, jnp.maximum(keep, 1) - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def check_sampling(temperature: float, top_k: int, top_p: float, greedy: bool, vocab_size: int) -> None:
    """Raise :class:`GenerateError` for settings Megatron's sampler refuses: temperature
    <= 0 (unless greedy), top_k < 0 or > vocab_size, top_p outside (0, 1], top-k and
    top-p together."""
    if not greedy and not temperature > 0:
        raise GenerateError(f"temperature={temperature}: must be > 0 (use greedy=True / --greedy for argmax)")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0 or top_k > vocab_size:
        raise GenerateError(f"top_k={top_k}: must be an int in [0, vocab_size={vocab_size}] (0 = off)")
    if not 0.0 < top_p <= 1.0:
        raise GenerateError(f"top_p={top_p}: must be in (0, 1] (1 = off)")
    if top_k > 0 and top_p < 1.0 and not greedy:
        raise GenerateError(f"top_k={top_k} and top_p={top_p}: use one of them (Megatron's sampler "
                            "refuses both); set top_k=0 or top_p=1.0")


def _select(logits: Array, key: Array, temperature: Array, top_p: Array, *, greedy: bool, top_k: int,
            use_top_p: bool) -> Array:
    """Next tokens int32 ``[b]`` from ``logits [b, vocab]``."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature, top_k, top_p if use_top_p else 1.0)
    return jax.random.categorical(key, filtered).astype(jnp.int32)


# --------------------------------------------------------------------------- model steps
def _token_log_probs(logits: Array, tokens: Array) -> Array:
    """float32 ``log_softmax(logits)[..., tokens]``: logits ``[..., vocab]``, tokens ``[...]``."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]


def _prefill_program(a: dict) -> str:
    """The prefill's announcement (jmegatron.compilation): its batch shape."""
    rows, width = a["tokens"].shape
    return f"the prefill for {rows} rows x {width} prompt tokens, cache {a['max_length']}" + (
        ", log-probabilities" if a["log_probs"] else "")


@announced_jit(what=_prefill_program, static_argnames=("model", "max_length", "log_probs"))
def _prefill(model: Any, params: Any, tokens: Array, lengths: Array, max_length: int, log_probs: bool = False):
    batch, length = tokens.shape
    cache = init_kv_cache(model.cfg, batch, max_length)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    logits, cache = model.apply({"params": params}, tokens, positions, kv_cache=cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    if not log_probs:
        return last, cache
    return last, cache, _token_log_probs(logits[:, :-1], tokens[:, 1:])  # [b, s - 1]


def prefill(model: Any, params: Any, tokens: Array, lengths: Array, max_length: int) -> tuple[Array, Any]:
    """Encode right-padded prompts ``tokens`` int32 ``[b, s]`` (row ``i`` valid for its
    first ``lengths[i]`` tokens, ``1 <= lengths[i] <= s <= max_length``) into a new KV
    cache of ``max_length`` slots. Returns (float32 logits ``[b, vocab]`` at each row's
    last prompt token, the cache as :func:`jmegatron.models.gpt.init_kv_cache`)."""
    return _prefill(model, params, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), max_length)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def _decode_step(model: Any, params: Any, cache: Any, tokens: Array, positions: Array):
    logits, cache = model.apply({"params": params}, tokens[:, None], positions[:, None], kv_cache=cache)
    return logits[:, 0], cache


def decode_step(model: Any, params: Any, cache: Any, tokens: Array, positions: Array) -> tuple[Array, Any]:
    """One decode step: tokens int32 ``[b]`` at positions int32 ``[b]`` (each
    ``< max_length``; the slot they are written to) -> (float32 logits ``[b, vocab]`` for
    the next position, updated cache). The cache passed in is donated (do not reuse it)."""
    return _decode_step(model, params, cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32))


def _decode_program(a: dict) -> str:
    """The decode loop's announcement (jmegatron.compilation): its batch and sampling variant."""
    variant = "greedy" if a["greedy"] else f"top-k {a['top_k']} sampling" if a["top_k"] else \
        "top-p sampling" if a["use_top_p"] else "sampling"
    cache = jax.tree.leaves(a["cache"])[0].shape[-3]
    return f"the decode loop for {a['lengths'].shape[0]} rows, cache {cache}, {variant}" + (
        ", log-probabilities" if a["log_probs"] else "")


@announced_jit(what=_decode_program, static_argnames=("model", "greedy", "top_k", "use_top_p", "log_probs"))
def _decode_loop(model: Any, params: Any, cache: Any, first_logits: Array, lengths: Array, key: Array,
                 temperature: Array, top_p: Array, max_new_tokens: Array, eod_id: Array, *,
                 greedy: bool, top_k: int, use_top_p: bool, log_probs: bool = False):
    """Tokens int32 ``[b, max_length]`` (row ``i`` valid for its first ``counts[i]``),
    counts int32 ``[b]`` (at most ``max_new_tokens[i]``, int32 ``[b]``) and, with
    ``log_probs``, each new token's float32 log-probability ``[b, max_length]`` (else
    None). Step ``t`` samples with ``fold_in(key, t)`` for the whole batch, the key
    schedule of the reference sampler."""
    select = functools.partial(_select, temperature=temperature, top_p=top_p, greedy=greedy, top_k=top_k,
                               use_top_p=use_top_p)
    batch = lengths.shape[0]
    max_length = jax.tree.leaves(cache)[0].shape[-3]
    tok = select(first_logits, jax.random.fold_in(key, 0))
    out = jnp.zeros((batch, max_length), jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((batch, max_length if log_probs else 0), jnp.float32)
    if log_probs:
        lps = lps.at[:, 0].set(_token_log_probs(first_logits, tok))
    # Each row's newest token sits at position ``pos``; a row is done after EOD, after
    # max_new_tokens, or when pos is the last slot (nothing more fits).
    pos = lengths
    done = (tok == eod_id) | (pos + 1 >= max_length) | (max_new_tokens <= 1)

    def cond(state):
        t, _, _, done, _, _, _ = state
        return (t < jnp.max(max_new_tokens)) & ~jnp.all(done)

    def body(state):
        t, tok, pos, done, out, lps, cache = state
        logits, cache = model.apply({"params": params}, tok[:, None], pos[:, None], kv_cache=cache)
        new = select(logits[:, 0], jax.random.fold_in(key, t))
        active = ~done
        out = out.at[:, t].set(jnp.where(active, new, 0))
        if log_probs:
            lps = lps.at[:, t].set(jnp.where(active, _token_log_probs(logits[:, 0], new), 0.0))
        pos = jnp.where(active, pos + 1, pos)  # finished rows keep rewriting their last slot
        tok = jnp.where(active, new, tok)
        done = done | (new == eod_id) | (pos + 1 >= max_length) | (t + 1 >= max_new_tokens)
        return t + 1, tok, pos, done, out, lps, cache

    state = (jnp.int32(1), tok, pos, done, out, lps, cache)
    _, _, pos, _, out, lps, _ = jax.lax.while_loop(cond, body, state)
    return out, jnp.minimum(pos - lengths + 1, max_new_tokens), lps if log_probs else None


# --------------------------------------------------------------------------- public API
def _prefill_bucket(longest: int, max_length: int) -> int:
    bucket = 16
    while bucket < longest:
        bucket *= 2
    return min(bucket, max_length)


def generate(model: Any, params: Any, prompts: Sequence[Sequence[int]], max_new_tokens: Union[int, Sequence[int]],
             *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
             seed: int = 0, eod_id: Optional[int] = None, max_length: Optional[int] = None,
             return_log_probs: bool = False) -> Union[list[list[int]], tuple[list[list[int]], list[list[float]]]]:
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens with
    a KV cache; returns the new tokens per prompt (including ``eod_id`` when it ends one).

    ``model`` is a :class:`jmegatron.models.gpt.GPTModel` (per-layer or ``scan_layers``
    params ``params``). ``max_new_tokens`` is one int for every prompt or one per prompt
    (a row with 0 gets no token). ``max_length`` (prompt + new tokens, the cache length)
    defaults to the largest prompt length + ``max_new_tokens`` of a row, capped at
    ``max_position_embeddings``; each row stops when it fills ``max_length``; prompts longer
    than ``max_length - 1`` keep their last tokens (as the reference sampler). Sampling:
    argmax with ``greedy``, else ``softmax(filter_logits(logits, temperature, top_k, top_p))``
    with the key ``fold_in(key(seed), step)`` per step, the same draws as
    :func:`jmegatron.inference.sample.sample`.

    With ``return_log_probs``: ``(new tokens, log_probs)``, ``log_probs[i]`` the float
    log-probabilities (log-softmax of the unfiltered logits, no temperature) of every
    token after the first of (kept prompt ``i`` + its new tokens), ``len(prompt) +
    len(new) - 1`` values: Megatron's ``output_log_probs``.

    Raises:
        GenerateError: empty prompt list or prompt, token ids outside ``[0, vocab)``,
            ``max_new_tokens < 0`` or not one per prompt, ``max_length`` below 2 or beyond
            the learned position table, or bad sampling settings (:func:`check_sampling`).
    """
    cfg = model.cfg
    if not prompts:
        raise GenerateError("prompts is empty: give at least one prompt (a list of token ids)")
    new_tokens = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (len(prompts),)) \
        if np.ndim(max_new_tokens) == 0 or len(max_new_tokens) == len(prompts) else None
    if new_tokens is None:
        raise GenerateError(f"max_new_tokens has {len(max_new_tokens)} values for {len(prompts)} prompts: "
                            "give one int, or one per prompt")
    if new_tokens.min() < 0:
        raise GenerateError(f"max_new_tokens={int(new_tokens.min())}: must be >= 0")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise GenerateError(f"prompt {i} is empty: give at least one token (e.g. the EOD id as a start token)")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= cfg.vocab_size:
            raise GenerateError(f"prompt {i} has token id {lo if lo < 0 else hi} outside [0, {cfg.vocab_size})")
    check_sampling(temperature, top_k, top_p, greedy, cfg.vocab_size)
    if new_tokens.max() == 0 and not return_log_probs:
        return [[] for _ in prompts]
    learned = cfg.position_embedding_type == "learned_absolute"
    if max_length is None:
        max_length = min(max(len(p) + int(n) for p, n in zip(prompts, new_tokens)), cfg.max_position_embeddings)
    if max_length < 2:
        raise GenerateError(f"max_length={max_length}: must be >= 2 (one prompt token and one new token)")
    if learned and max_length > cfg.max_position_embeddings:
        raise GenerateError(f"max_length={max_length} exceeds the learned position table "
                            f"(max_position_embeddings={cfg.max_position_embeddings}); lower it")

    prompts = [list(p)[-(max_length - 1):] for p in prompts]
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = _prefill_bucket(int(lengths.max()), max_length)
    buf = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = p

    first_logits, cache, *prompt_lps = _prefill(model, params, jnp.asarray(buf), jnp.asarray(lengths), max_length,
                                                log_probs=return_log_probs)
    out, counts, new_lps = _decode_loop(
        model, params, cache, first_logits, jnp.asarray(lengths), jax.random.key(seed),
        jnp.float32(temperature), jnp.float32(top_p), jnp.asarray(new_tokens, jnp.int32),
        jnp.int32(-1 if eod_id is None else eod_id),
        # greedy ignores the filters: one compilation for every greedy call
        greedy=bool(greedy), top_k=0 if greedy else int(top_k), use_top_p=not greedy and top_p < 1.0,
        log_probs=return_log_probs)
    out, counts = np.asarray(out), np.asarray(counts)
    tokens = [out[i, :counts[i]].tolist() for i in range(len(prompts))]
    if not return_log_probs:
        return tokens
    prompt_lps, new_lps = np.asarray(prompt_lps[0]), np.asarray(new_lps)
    log_probs = [prompt_lps[i, :lengths[i] - 1].tolist() + new_lps[i, :counts[i]].tolist()
                 for i in range(len(prompts))]
    return tokens, log_probs


def load_generator(load_dir: str, tokenizer_model: Optional[str] = None) -> tuple[Any, Any, Any]:
    """``(run, params, tokenizer)`` for generation from the checkpoint in ``load_dir``: the
    model's parameters only (:func:`jmegatron.training.run.restore_run_params`, one device,
    no optimizer state) and the tokenizer ``tokenizer_model`` or the checkpoint config's
    (``tokenizer_model`` / ``tokenizer_type``).

    Raises:
        jmegatron.checkpoint.checkpointing.CheckpointError: no or unreadable checkpoint.
        GenerateError: no tokenizer known.
        FileNotFoundError: the tokenizer file does not exist.
    """
    run, params, _ = restore_run_params(load_dir)
    if tokenizer_model:
        tok = load_tokenizer(tokenizer_model)
    elif tokenizer_type_of(run.cfg):
        tok = build_tokenizer(run.cfg)
    else:
        raise GenerateError(f"the checkpoint in {load_dir} has no tokenizer_model in its config; "
                            "pass tokenizer_model= (--tokenizer-model)")
    return run, params, tok


def generate_text(load_dir: str, prompts: Sequence[str], max_new_tokens: int, *,
                  tokenizer_model: Optional[str] = None, **sampling: Any) -> list[str]:
    """The continuations (new text only, EOD included when generated) of text
    ``prompts`` from the checkpoint in ``load_dir``.

    Restores the model's parameters only with
    :func:`jmegatron.training.run.restore_run_params` (one device, no optimizer state),
    tokenizes with ``tokenizer_model`` or the checkpoint config's ``tokenizer_model``,
    generates with :func:`generate` (``sampling``: its keyword arguments; ``eod_id``
    defaults to the tokenizer's EOD) and detokenizes.

    Raises:
        jmegatron.checkpoint.checkpointing.CheckpointError: no or unreadable checkpoint.
        GenerateError: no tokenizer known, or bad input (see :func:`generate`).
        FileNotFoundError: the tokenizer file does not exist.
    """
    run, params, tok = load_generator(load_dir, tokenizer_model)
    sampling.setdefault("eod_id", tok.eod)
    outs = generate(run.model, params, [tok.tokenize(t) for t in prompts], max_new_tokens, **sampling)
    return [tok.detokenize(o) for o in outs]
