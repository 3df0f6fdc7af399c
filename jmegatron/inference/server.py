"""Megatron-LM's text-generation REST API (megatron/inference/text_generation_server.py,
``MegatronGenerate``; tools/run_text_generation_server.py) on FastAPI + uvicorn, with
concurrent requests merged into batches of the KV-cache generator.

``PUT /api`` takes Megatron's JSON request (``prompts``, ``tokens_to_generate``,
``logprobs``, ``temperature``, ``top_k``, ``top_p``, ``add_BOS``, ``stop_on_eol``,
``stop_on_double_eol``, ``random_seed``, ``no_log``), checks it in Megatron's order with
Megatron's messages (every failed check answers 400 with ``{"message": ...}``, the form
flask_restful gives errors and Megatron's tools/text_generation_cli.py reads) and answers Megatron's ``{"text": [...], "segments":
[[...]], "logprobs": [[...]] | null}``: each prompt plus its continuation, the text of
each of its tokens, and the log-probability of every token after the first (only with
``logprobs``). As in Megatron's ``_tokenize_prompts_and_batch``, every prompt of a request
is continued up to the request's longest prompt + ``tokens_to_generate`` tokens;
``top_k`` 1 is argmax, ``top_p`` 0 is off; ``add_BOS`` prepends the EOD token. Megatron's
fields that jmegatron cannot honour (beam search, ``top_p_decay``, ``top_p_bound``,
``prevent_newline_after_colon``, ``ignore_special_tokens``) and fields Megatron does not
know are answered 400 naming the field; a batch that fails answers its requests 500.
``GET /metrics`` gives the batching counters.

Batching (:class:`Batcher`): one worker thread owns the model. A request's prompts stay
together; the worker takes the oldest waiting request, waits up to ``batch_window_s`` from
its arrival for more, and runs every waiting request of the same sampling group, oldest
first, up to ``max_batch_size`` rows, as one :func:`jmegatron.inference.generate.generate`
call; the rows are padded to a power of two (one-token rows that generate nothing), and
the cache is always ``max_length`` long, so the jitted programs compile once per
(batch bucket, prefill bucket, sampling variant), each compilation announced with its time
(:mod:`jmegatron.compilation`). Groups: every greedy request (``top_k``
1, or nothing to generate) shares one; unseeded sampled requests share one per
(temperature, top_k, top_p), the batch drawing one seed; a request with a
``random_seed`` runs alone under that seed, so the same request gives the same answer.
Rows are independent: a greedy row's tokens are those of ``generate`` on its prompt alone.
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import queue
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from jmegatron.inference.generate import GenerateError, check_sampling, generate, load_generator

log = logging.getLogger("jmegatron.serve")

# Megatron's MegatronGenerate.put: its request fields, in the order it checks them
MEGATRON_FIELDS = ("prompts", "max_len", "sentences", "tokens_to_generate", "logprobs", "temperature", "top_k",
                   "top_p", "top_p_decay", "top_p_bound", "add_BOS", "stop_on_double_eol", "stop_on_eol",
                   "prevent_newline_after_colon", "random_seed", "no_log", "beam_width", "stop_token",
                   "length_penalty", "ignore_special_tokens")
MAX_PROMPTS = 128  # Megatron's limit per request


class RequestError(ValueError):
    """A request the server refuses: ``str(e)`` is the answer's message, ``status`` its
    HTTP status (400)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A checked ``PUT /api`` request, Megatron's names and defaults (``top_k`` 0 and
    ``top_p`` 0.0: off; ``random_seed`` -1: none)."""

    prompts: tuple[str, ...]
    tokens_to_generate: int = 64
    logprobs: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    add_BOS: bool = False
    stop_on_double_eol: bool = False
    stop_on_eol: bool = False
    random_seed: int = -1
    no_log: bool = False

    @property
    def greedy(self) -> bool:
        """Megatron's sampler takes the argmax for ``top_k == 1``; nothing to sample when
        nothing is generated."""
        return self.top_k == 1 or self.tokens_to_generate == 0


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_request(body: Any, max_prompts: int = MAX_PROMPTS) -> GenerationRequest:
    """Check a decoded JSON request body as Megatron's ``MegatronGenerate.put`` does, in
    its order and with its messages (a bool is not accepted as an int here), then refuse
    what jmegatron cannot honour. ``max_prompts``: the most prompts per request.

    Raises:
        RequestError: the first failed check (400), its message naming the field.
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object with a prompts field")
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    if "max_len" in body:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in body:
        raise RequestError("sentences is no longer used.  Replace with prompts")
    unknown = sorted(set(body) - set(MEGATRON_FIELDS))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}: Megatron's /api takes {', '.join(MEGATRON_FIELDS[3:])}")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if len(prompts) == 0:
        raise RequestError("prompts is empty")
    if len(prompts) > max_prompts:
        raise RequestError(f"Maximum number of prompts is {max_prompts}")
    kw: dict[str, Any] = {"prompts": tuple(prompts)}

    def field(name: str, ok, message: str):
        if name in body:
            if not ok(body[name]):
                raise RequestError(message)
            kw[name] = body[name]
        return kw.get(name, getattr(GenerationRequest, name, None))

    ttg = field("tokens_to_generate", _is_int, "tokens_to_generate must be an integer greater than 0")
    if ttg < 0:
        raise RequestError("tokens_to_generate must be an integer greater than or equal to 0")
    logprobs = field("logprobs", lambda v: isinstance(v, bool), "logprobs must be a boolean value")
    if ttg == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    temperature = field("temperature", lambda v: type(v) in (int, float),
                        "temperature must be a positive number less than or equal to 100.0")
    if not 0.0 < temperature <= 100.0:
        raise RequestError("temperature must be a positive number less than or equal to 100.0")
    kw["temperature"] = float(temperature)
    top_k = field("top_k", lambda v: type(v) is int,
                  "top_k must be an integer equal to or greater than 0 and less than or equal to 1000")
    if not 0 <= top_k <= 1000:
        raise RequestError("top_k must be equal to or greater than 0 and less than or equal to 1000")
    top_p = field("top_p", lambda v: type(v) is float, "top_p must be a positive float less than or equal to 1.0")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    if not 0.0 <= top_p <= 1.0:
        raise RequestError("top_p must be less than or equal to 1.0")
    for name in ("top_p_decay", "top_p_bound"):
        if name in body:
            if type(body[name]) is not float:
                raise RequestError(f"{name} must be a positive float less than or equal to 1.0")
            if top_p == 0.0:
                raise RequestError(f"{name} cannot be set without top_p")
    add_bos = field("add_BOS", lambda v: isinstance(v, bool), "add_BOS must be a boolean value")
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true")
    for name in ("stop_on_double_eol", "stop_on_eol"):
        field(name, lambda v: isinstance(v, bool), f"{name} must be a boolean value")
    if "prevent_newline_after_colon" in body and not isinstance(body["prevent_newline_after_colon"], bool):
        raise RequestError("prevent_newline_after_colon must be a boolean value")
    seed = field("random_seed", _is_int, "random_seed must be integer")
    if seed < 0 and "random_seed" in body:
        raise RequestError("random_seed must be a positive integer")
    field("no_log", lambda v: isinstance(v, bool), "no_log must be a boolean value")

    # Megatron's fields this server cannot honour: refused by name rather than ignored
    refused = {
        "beam_width": "beam search is not implemented (jmegatron.inference.generate samples or takes the argmax)",
        "stop_token": "it belongs to beam search, which is not implemented",
        "length_penalty": "it belongs to beam search, which is not implemented",
        "top_p_decay": "the decode loop keeps top_p fixed; leave it out or send 0.0",
        "top_p_bound": "the decode loop keeps top_p fixed; leave it out or send 0.0",
        "prevent_newline_after_colon": "the decode loop has no logit bias; leave it out or send false",
        "ignore_special_tokens": "texts keep the tokenizer's special tokens; leave it out",
    }
    defaults = {"top_p_decay": 0.0, "top_p_bound": 0.0, "prevent_newline_after_colon": False}
    for name, why in refused.items():
        if name in body and not (name in defaults and body[name] == defaults[name]):
            raise RequestError(f"{name} is not supported by this server: {why}")
    return GenerationRequest(**kw)


def stop_index(new: Sequence[int], previous: int, eol: Optional[int], double_eol: Optional[int],
               stop_on_eol: bool, stop_on_double_eol: bool) -> int:
    """How many of the new tokens ``new`` to keep under Megatron's ``stop_on_eol`` /
    ``stop_on_double_eol`` (generation.py: a row ends at the newline token ``eol`` or the
    double-newline token ``double_eol``; with ``stop_on_double_eol`` only at
    ``double_eol`` or at ``eol`` right after ``eol``; ``previous``: the prompt's last
    token). The stopping token is kept; ``len(new)`` when nothing stops."""
    prev = previous
    for j, t in enumerate(new):
        if stop_on_double_eol:
            if (double_eol is not None and t == double_eol) or (t == eol and prev == eol):
                return j + 1
        elif stop_on_eol and (t == eol or (double_eol is not None and t == double_eol)):
            return j + 1
        prev = t
    return len(new)


# --------------------------------------------------------------------------- batcher
@dataclasses.dataclass
class _Job:
    rows: list[list[int]]
    new_tokens: list[int]
    sampling: dict
    group: tuple
    seed: Optional[int]
    arrived: float
    future: concurrent.futures.Future


class Batcher:
    """Merges concurrently submitted rows into batched calls of
    :func:`jmegatron.inference.generate.generate` on one worker thread (the module
    docstring gives the policy).

    Args:
        model, params: a :class:`jmegatron.models.gpt.GPTModel` and its parameters.
        eod_id: the termination token (each row stops after it; also the padding rows' token).
        max_length: the KV-cache length of every batch (prompt + new tokens of any row).
        max_batch_size: the most rows per call (a request's prompts are never split).
        batch_window_s: how long, in seconds, the oldest waiting request waits for others.
        seed: seeds the generator of the seeds of unseeded sampled batches.

    Raises:
        GenerateError: ``max_batch_size < 1``, ``batch_window_s < 0`` or ``max_length``
            below 2 or beyond the learned position table.
    """

    def __init__(self, model: Any, params: Any, *, eod_id: int, max_length: int, max_batch_size: int = 32,
                 batch_window_s: float = 0.005, seed: int = 0):
        cfg = model.cfg
        if max_batch_size < 1:
            raise GenerateError(f"max_batch_size={max_batch_size}: must be >= 1")
        if batch_window_s < 0:
            raise GenerateError(f"batch_window_s={batch_window_s}: must be >= 0")
        if max_length < 2 or (cfg.position_embedding_type == "learned_absolute"
                              and max_length > cfg.max_position_embeddings):
            raise GenerateError(f"max_length={max_length}: must be in [2, max_position_embeddings="
                                f"{cfg.max_position_embeddings}]")
        self.model, self.params, self.eod_id = model, params, int(eod_id)
        self.max_length, self.max_batch_size, self.batch_window_s = max_length, max_batch_size, batch_window_s
        self._rng = np.random.default_rng(seed)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "rows": 0, "batches": 0, "padded_rows": 0, "errors": 0,
                       "max_rows_per_batch": 0, "batch_rows": collections.Counter()}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="jmegatron-batcher", daemon=True)
        self._thread.start()

    def submit(self, rows: list[list[int]], new_tokens: list[int], *, greedy: bool, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None) -> concurrent.futures.Future:
        """Queue prompts ``rows`` (token ids; each with ``len(row) + new_tokens[i] <=
        max_length``) for generation. ``top_p`` 1.0 is off; ``seed`` None: the batch's.
        Returns a Future of ``(new tokens per row, log-probs per row)`` as
        :func:`generate` with ``return_log_probs`` gives them (raises what it raises)."""
        if self._closed:
            raise GenerateError("the server is shutting down: no new requests are taken")
        if len(rows) > self.max_batch_size:
            raise GenerateError(f"{len(rows)} prompts: at most max_batch_size={self.max_batch_size} per request")
        check_sampling(temperature, top_k, top_p, greedy, self.model.cfg.vocab_size)
        future: concurrent.futures.Future = concurrent.futures.Future()
        if greedy:
            sampling, group = {"greedy": True}, ("greedy",)
        else:
            sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
            group = ("sample", temperature, top_k, top_p) if seed is None else ("seeded", id(future))
        self._queue.put(_Job(rows, list(new_tokens), sampling, group, seed, time.monotonic(), future))
        return future

    def stats(self) -> dict:
        """Counters since start: requests, rows, batches (generate calls), padded_rows,
        errors (failed batches), max_rows_per_batch, batch_rows (rows per batch ->
        batches)."""
        with self._lock:
            return dict(self._stats, batch_rows={str(k): v for k, v in sorted(self._stats["batch_rows"].items())})

    def close(self) -> None:
        """Stop the worker after the requests already queued; :meth:`submit` then raises
        GenerateError."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=60)

    # the worker -------------------------------------------------------------
    def _loop(self) -> None:
        pending: collections.deque = collections.deque()
        closing = False
        while not (closing and not pending):
            if not pending:
                job = self._queue.get()
                if job is None:
                    return
                pending.append(job)
            first = pending[0]
            deadline = first.arrived + self.batch_window_s
            while not closing:
                if sum(len(j.rows) for j in pending if j.group == first.group) >= self.max_batch_size:
                    break
                try:
                    job = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                else:
                    pending.append(job)
            batch, rows, rest = [], 0, collections.deque()
            for job in pending:
                if job.group == first.group and rows + len(job.rows) <= self.max_batch_size:
                    batch.append(job)
                    rows += len(job.rows)
                else:
                    rest.append(job)
            pending = rest
            # a request whose client went away (its awaiting task cancelled) is dropped here
            batch = [job for job in batch if job.future.set_running_or_notify_cancel()]
            if batch:
                try:
                    self._run(batch)
                except Exception as e:  # never lose the worker: what is unanswered gets the error
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(e)

    def _run(self, batch: list[_Job]) -> None:
        rows = [r for job in batch for r in job.rows]
        new_tokens = [n for job in batch for n in job.new_tokens]
        size = 1
        while size < len(rows):
            size *= 2
        size = max(min(size, self.max_batch_size), len(rows))
        padding = size - len(rows)
        seed = batch[0].seed if batch[0].seed is not None else int(self._rng.integers(2 ** 31))
        try:
            tokens, log_probs = generate(
                self.model, self.params, rows + [[self.eod_id]] * padding, new_tokens + [0] * padding,
                eod_id=self.eod_id, max_length=self.max_length, seed=seed, return_log_probs=True,
                **batch[0].sampling)
        except Exception as e:  # every waiting request gets the error; the worker goes on
            with self._lock:
                self._stats["errors"] += 1
            for job in batch:
                job.future.set_exception(e)
            return
        with self._lock:
            s = self._stats
            s["requests"] += len(batch)
            s["rows"] += len(rows)
            s["batches"] += 1
            s["padded_rows"] += padding
            s["max_rows_per_batch"] = max(s["max_rows_per_batch"], len(rows))
            s["batch_rows"][len(rows)] += 1
        start = 0
        for job in batch:
            end = start + len(job.rows)
            job.future.set_result((tokens[start:end], log_probs[start:end]))
            start = end


# --------------------------------------------------------------------------- the server
class TextGenerationServer:
    """Megatron's ``MegatronGenerate`` over a :class:`Batcher`: request checks,
    tokenization, per-row lengths, stopping and the answer.

    Args:
        model, params, tokenizer: the model, its parameters, and a tokenizer with ``eod``,
            ``tokenize`` and ``detokenize`` (:mod:`jmegatron.data.tokenizer`).
        max_length: the longest prompt + generation (the cache length); default the
            model's ``max_position_embeddings``.
        max_batch_size, batch_window_s: :class:`Batcher`'s.

    Raises:
        GenerateError: bad ``max_length``, ``max_batch_size`` or ``batch_window_s``.
    """

    def __init__(self, model: Any, params: Any, tokenizer: Any, *, max_length: Optional[int] = None,
                 max_batch_size: int = 32, batch_window_s: float = 0.005):
        self.tokenizer = tokenizer
        self.max_length = int(max_length or model.cfg.max_position_embeddings)
        self.max_prompts = min(MAX_PROMPTS, max_batch_size)
        self.batcher = Batcher(model, params, eod_id=tokenizer.eod, max_length=self.max_length,
                               max_batch_size=max_batch_size, batch_window_s=batch_window_s)
        self.eol = self._single_token("\n")
        self.double_eol = self._single_token("\n\n")

    @classmethod
    def from_checkpoint(cls, load_dir: str, tokenizer_model: Optional[str] = None, **kw: Any) -> "TextGenerationServer":
        """The server of the checkpoint in ``load_dir``
        (:func:`jmegatron.inference.generate.load_generator`; raises what it raises)."""
        run, params, tok = load_generator(load_dir, tokenizer_model)
        return cls(run.model, params, tok, **kw)

    def _single_token(self, text: str) -> Optional[int]:
        try:
            ids = self.tokenizer.tokenize(text)
        except ValueError:
            return None
        return ids[0] if len(ids) == 1 else None

    def prepare(self, body: Any) -> tuple[GenerationRequest, list[list[int]], list[int]]:
        """(request, prompt token ids, new tokens per prompt) of a decoded JSON body.
        Raises RequestError (400) for what Megatron refuses and what this model cannot
        do (too long, no newline token for ``stop_on_eol``)."""
        req = parse_request(body, self.max_prompts)
        if (req.stop_on_eol or req.stop_on_double_eol) and self.eol is None:
            raise RequestError(f"{'stop_on_double_eol' if req.stop_on_double_eol else 'stop_on_eol'}: the "
                               "tokenizer has no single newline token to stop at")
        if not req.greedy and req.top_k > self.batcher.model.cfg.vocab_size:
            raise RequestError(f"top_k={req.top_k} is larger than the vocabulary "
                               f"({self.batcher.model.cfg.vocab_size})")
        try:
            rows = [([self.tokenizer.eod] if req.add_BOS else []) + self.tokenizer.tokenize(p) for p in req.prompts]
        except ValueError as e:
            raise RequestError(f"prompts: {e}") from e
        longest = max(len(r) for r in rows)
        # the generator keeps one cache slot for the token it reads next, even when scoring
        if longest + max(req.tokens_to_generate, 1) > self.max_length:
            raise RequestError(f"Length of prompt + tokens_to_generate longer than allowed "
                               f"({longest} + {req.tokens_to_generate} > max_length {self.max_length}"
                               f"{' - 1 when scoring' if not req.tokens_to_generate else ''})")
        if not req.tokens_to_generate:  # scoring: the prompts alone (Megatron's score_and_return_on_first_stage)
            return req, rows, [0] * len(rows)
        # Megatron pads every prompt of a request to the longest + tokens_to_generate
        return req, rows, [longest + req.tokens_to_generate - len(r) for r in rows]

    def submit(self, req: GenerationRequest, rows: list[list[int]], new_tokens: list[int]) -> concurrent.futures.Future:
        """Queue a prepared request on the batcher (see :meth:`Batcher.submit`)."""
        top_p = req.top_p if req.top_p > 0.0 else 1.0
        return self.batcher.submit(rows, new_tokens, greedy=req.greedy, temperature=req.temperature,
                                   top_k=0 if req.greedy else req.top_k, top_p=top_p,
                                   seed=req.random_seed if req.random_seed >= 0 else None)

    def answer(self, req: GenerationRequest, rows: list[list[int]], result: tuple) -> dict:
        """Megatron's JSON answer ``{"text", "segments", "logprobs"}`` of a finished request."""
        tokens, log_probs = result
        texts, segments, lps = [], [], []
        for row, new, lp in zip(rows, tokens, log_probs):
            keep = stop_index(new, row[-1], self.eol, self.double_eol, req.stop_on_eol, req.stop_on_double_eol)
            full = row + new[:keep]
            texts.append(self.tokenizer.detokenize(full))
            segments.append([self.tokenizer.detokenize([t]) for t in full])
            lps.append(lp[:len(full) - 1])
        return {"text": texts, "segments": segments, "logprobs": lps if req.logprobs else None}

    def close(self) -> None:
        """Stop the batcher after the requests already queued (:meth:`Batcher.close`)."""
        self.batcher.close()


def create_app(server: TextGenerationServer):
    """A ``fastapi.FastAPI`` application: ``PUT /api`` (Megatron's) and ``GET /metrics``
    (:meth:`Batcher.stats` plus ``max_length`` and ``max_batch_size``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="jmegatron text generation", docs_url=None, redoc_url=None)

    @app.put("/api")
    async def generate_api(request: Request):
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise RequestError(f"the request body is not JSON: {e}") from e
            req, rows, new_tokens = server.prepare(body)
            if not req.no_log:
                log.info("request from %s: %d prompt(s), tokens_to_generate=%d, %s", request.client.host if
                         request.client else "?", len(rows), req.tokens_to_generate,
                         {k: v for k, v in body.items() if k != "prompts"})
            result = await asyncio.wrap_future(server.submit(req, rows, new_tokens))
        except RequestError as e:
            return JSONResponse({"message": str(e)}, status_code=e.status)
        except GenerateError as e:  # Megatron answers its generator's ValueErrors with 400
            return JSONResponse({"message": str(e)}, status_code=400)
        except Exception as e:  # a failed batch: this request's answer; the server goes on
            log.exception("generation failed")
            return JSONResponse({"message": f"generation failed: {type(e).__name__}: {e}"}, status_code=500)
        return JSONResponse(server.answer(req, rows, result))

    @app.get("/metrics")
    def metrics():
        return dict(server.batcher.stats(), max_length=server.max_length,
                    max_batch_size=server.batcher.max_batch_size)

    return app
