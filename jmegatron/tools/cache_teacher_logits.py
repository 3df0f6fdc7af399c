"""``python -m jmegatron.tools.cache_teacher_logits --config C [--config.FIELD=VALUE ...]
--output DIR --top-k K [--batch-size B]``: a teacher's top-K log-probabilities over a
training run's samples, written once, for offline distillation.

The config is the student's training config: its data fields (``data_path`` / blend,
``split``, ``seq_length``, ``seed``, ``mock_data``, the tokenizer, ``train_iters`` x
``global_batch_size``) define the training split exactly as
:func:`jmegatron.data.builder.build_datasets` builds it, and ``kd_teacher_load`` names the
teacher (a jmegatron checkpoint or a Hugging Face folder). The teacher runs forward only,
on the config's parallel layout over the local devices, ``B`` samples per call.

Output, ``DIR``:

* ``ids.npy`` int32 ``[N, seq_length, K]`` and ``logprobs.npy`` float32 ``[N,
  seq_length, K]`` (``numpy.lib.format``; read with ``mmap_mode="r"``): for training
  sample ``i`` (the index :class:`jmegatron.data.loader.BatchLoader` reads at
  ``consumed_samples + row``, blends included) and position ``t``, the teacher's K most
  likely next tokens and their log-probabilities ``log softmax(teacher logits)``, largest
  first (:func:`jmegatron.distill.losses.teacher_top_k`);
* ``meta.json``: the format version, K, N, the sequence length, the vocabulary, the
  teacher (its path and iteration) and the data (the fields above and a SHA-256 of the
  first samples' tokens): :func:`jmegatron.data.teacher_logits.check_cache` refuses a
  cache built for other data or another K, naming the field;
* ``progress.json``: the samples written so far. It is replaced (written, fsynced,
  renamed) only after the arrays up to it are flushed, so a killed run loses at most the
  batch in flight: run the same command again and it goes on from there (and says so).

Progress is a tqdm bar on stderr (samples done of N, rate, time left).

**Across tokenizers** (``--teacher-tokenizer PATH``, the teacher's tokenizer.json or
folder): each student sample's text (its tokens decoded by the config's tokenizer) is
tokenized by the teacher's tokenizer and run through the teacher, and student position
``t`` gets the teacher's K largest log-probabilities at the teacher position whose token
ends at the same character (:func:`jmegatron.distill.cross_tokenizer.align_positions`);
``ids`` are the teacher's own token ids there, all -1 at positions without a match.
``meta.json`` records ``"cross_tokenizer": true`` and the teacher's tokenizer and
vocabulary; training reads it with Universal Logit Distillation
(:func:`jmegatron.distill.losses.uld_loss`).

Raises ConfigError (no ``kd_teacher_load``, a bad argument), CacheMismatchError (an
existing ``DIR`` for other data, teacher or K), CheckpointError (the teacher).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jmegatron.command_line import parse_args
from jmegatron.config import ConfigError, JMegatronConfig, load_config_file
from jmegatron.data.builder import build_datasets, get_train_valid_test_num_samples
from jmegatron.data.teacher_logits import (FORMAT_VERSION, CacheMismatchError, check_cache, data_fingerprint,
                                           samples_done)
from jmegatron.data.tokenizer import build_tokenizer, load_tokenizer, vocab_size_of
from jmegatron.distill.cross_tokenizer import align_positions
from jmegatron.distill.losses import teacher_top_k
from jmegatron.distill.teacher import load_teacher
from jmegatron.parallel.mesh import create_mesh

def cache_meta(cfg: JMegatronConfig, dataset: Any, num_samples: int, top_k: int, vocab: int,
               teacher_iteration: Optional[int], teacher_tokenizer: Optional[str] = None) -> dict:
    """What identifies a cache (:mod:`jmegatron.data.teacher_logits`): the format, K, N, the
    sequence length, the teacher's padded vocabulary, the teacher (and its tokenizer when it
    is not the student's) and the data."""
    meta = {"format_version": FORMAT_VERSION, "top_k": int(top_k), "num_samples": int(num_samples),
            "seq_length": int(cfg.seq_length), "vocab": int(vocab),
            "teacher": {"load": os.path.abspath(cfg.kd_teacher_load), "iteration": teacher_iteration},
            "data": data_fingerprint(cfg, dataset)}
    if teacher_tokenizer is not None:
        meta.update(cross_tokenizer=True, teacher_tokenizer=os.path.abspath(teacher_tokenizer))
    return meta


def _write_json(path: str, value: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def teacher_top_k_fn(teacher, top_k: int, vocab_shards: int):
    """``(params, tokens [b, s], position_ids [b, s]) -> (ids, logprobs)`` ``[b, s, K]``: the
    teacher's forward (deterministic) and its top-K log-probabilities, jitted."""
    def fn(params, tokens, position_ids):
        logits = teacher.model.apply({"params": params}, tokens, position_ids, deterministic=True)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        values, ids = teacher_top_k(logp, top_k, vocab_shards)
        return ids, values
    return jax.jit(fn)


def aligned_top_k_fn(teacher, top_k: int, vocab_shards: int):
    """Across tokenizers: ``(params, teacher_tokens [b, s_t], index [b, s]) -> (ids,
    logprobs)`` ``[b, s, K]``, the teacher's top-K at teacher position ``index`` of each
    student position (ids -1 where ``index`` is -1), jitted."""
    def fn(params, tokens, index):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits = teacher.model.apply({"params": params}, tokens, positions, deterministic=True)
        logits = jnp.take_along_axis(logits, jnp.maximum(index, 0)[..., None], axis=1)
        values, ids = teacher_top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), top_k, vocab_shards)
        return jnp.where(index[..., None] >= 0, ids, -1), values
    return jax.jit(fn)


def build_cache(cfg: JMegatronConfig, output: str, top_k: int, batch_size: int = 8,
                stop_after: Optional[int] = None, teacher_tokenizer: Optional[str] = None) -> dict:
    """Write (or go on writing) the cache of ``cfg``'s training samples in ``output`` (see the
    module docstring); returns its meta with ``samples_done``. ``stop_after``: stop once
    that many samples are done (tests). ``teacher_tokenizer``: the teacher's tokenizer when
    it is not the student's (module docstring). Raises as the module docstring says."""
    if not cfg.kd_teacher_load:
        raise ConfigError("cache_teacher_logits needs the teacher: set --config.kd_teacher_load=CHECKPOINT "
                          "(a jmegatron checkpoint or a Hugging Face folder)")
    if top_k < 1:
        raise ConfigError(f"--top-k={top_k} must be >= 1")
    train, _, _ = build_datasets(cfg, cfg.global_batch_size)
    num_samples = get_train_valid_test_num_samples(cfg, cfg.global_batch_size)[0]
    mesh = create_mesh(cfg)
    vocab = cfg.padded_vocab_size(vocab_size_of(cfg))
    cross = teacher_tokenizer is not None
    if cross:
        student_tok, teacher_tok = build_tokenizer(cfg), load_tokenizer(teacher_tokenizer)
    teacher = load_teacher(cfg.kd_teacher_load, cfg, None if cross else vocab, mesh, cfg.kd_teacher_bf16)
    vocab = int(teacher.model.cfg.vocab_size) if cross else vocab  # the padded vocabulary
    if top_k > vocab:
        raise ConfigError(f"--top-k={top_k} exceeds the teacher's vocabulary {vocab}")
    meta = cache_meta(cfg, train, num_samples, top_k, vocab, teacher.iteration, teacher_tokenizer)
    os.makedirs(output, exist_ok=True)
    ids_path, logp_path = os.path.join(output, "ids.npy"), os.path.join(output, "logprobs.npy")
    shape = (num_samples, cfg.seq_length, top_k)
    if os.path.isfile(os.path.join(output, "meta.json")):
        check_cache(output, meta)
        ids = np.lib.format.open_memmap(ids_path, mode="r+")
        logp = np.lib.format.open_memmap(logp_path, mode="r+")
    else:
        ids = np.lib.format.open_memmap(ids_path, mode="w+", dtype=np.int32, shape=shape)
        logp = np.lib.format.open_memmap(logp_path, mode="w+", dtype=np.float32, shape=shape)
        _write_json(os.path.join(output, "meta.json"), meta)
    tp = cfg.tensor_model_parallel_size
    fn = aligned_top_k_fn(teacher, top_k, tp) if cross else teacher_top_k_fn(teacher, top_k, tp)
    done = samples_done(output)
    rows = max(batch_size, 1)
    if 0 < done < num_samples:
        print(f"cache_teacher_logits: {output} holds {done}/{num_samples} samples; going on from sample {done}",
              flush=True)
    bar = tqdm(total=num_samples, initial=done, unit="sample", desc="cache_teacher_logits", file=sys.stderr,
               disable=done >= num_samples)
    while done < num_samples and (stop_after is None or done < stop_after):
        index = np.arange(done, done + rows) % num_samples  # the last batch padded with samples again
        samples = [train[int(i)] for i in index]
        tokens = np.stack([np.asarray(s["tokens"], np.int32) for s in samples])
        if cross:
            pairs = [align_positions(student_tok, teacher_tok, t, cfg.seq_length) for t in tokens]
            second = np.stack([index for _, index in pairs])
            tokens = np.stack([t for t, _ in pairs])
        else:
            second = np.stack([np.asarray(s["position_ids"], np.int32) for s in samples])
        got_ids, got_logp = jax.device_get(fn(teacher.params, tokens, second))
        n = min(rows, num_samples - done)
        ids[done:done + n], logp[done:done + n] = got_ids[:n], got_logp[:n]
        ids.flush()
        logp.flush()
        done += n
        _write_json(os.path.join(output, "progress.json"), {"samples_done": done})
        bar.update(n)
    bar.close()
    return dict(meta, samples_done=done)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jmegatron.tools.cache_teacher_logits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="the cache directory (created; an existing one is continued)")
    p.add_argument("--top-k", type=int, required=True, help="tokens kept per position (ModelOpt's logit_kl_topk)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per teacher forward (default 8)")
    p.add_argument("--teacher-tokenizer", default=None,
                   help="the teacher's tokenizer (tokenizer.json or its folder) when it is not the student's: "
                        "positions are matched by text (cross-tokenizer distillation, Universal Logit Distillation)")
    args, rest = p.parse_known_args(argv)
    try:
        path, overrides = parse_args(rest)
        if path is None:
            raise ConfigError("give the student's training config: --config CONFIG_FILE")
        cfg = load_config_file(path, overrides)
        meta = build_cache(cfg, args.output, args.top_k, args.batch_size, teacher_tokenizer=args.teacher_tokenizer)
    except (ConfigError, CacheMismatchError, FileNotFoundError) as e:
        print(f"cache_teacher_logits: {e}", file=sys.stderr)
        return 2
    print(f"cache_teacher_logits: {args.output}: {meta['samples_done']} samples x {meta['seq_length']} positions x "
          f"top {meta['top_k']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
