"""``PUT /api`` (Megatron's text-generation REST API) over real HTTP: concurrent requests are
merged into batches and each answer's tokens are greedy ``generate``'s for its prompt alone,
``logprobs`` equal the model's own log-softmax, ``random_seed`` reproduces an answer, and
Megatron's bad requests are answered 400 with its messages while the server keeps serving."""

import re
import socket
import threading
import time
import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jmegatron.config import base_config, from_configdict
from jmegatron.inference.generate import generate

import fastapi  # noqa: E402,F401
import requests  # noqa: E402
import uvicorn  # noqa: E402

from jmegatron.inference.server import TextGenerationServer, create_app, stop_index  # noqa: E402

MAX_LENGTH = 64
TEXT = ("ROMEO: But soft, what light through yonder window breaks?\n"
        "JULIET: O Romeo, Romeo, wherefore art thou Romeo?\n\n") * 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A 1-layer GPT of random weights (init std 0.3: peaked logits, no near-ties for the
    argmax) with a small BPE tokenizer, saved as a checkpoint (no training), served by
    uvicorn in a thread on a free port of 127.0.0.1 (batch window 0.3 s, 16 rows)."""
    from jmegatron.data.tokenizer import train_bpe_tokenizer
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.checkpoint import checkpointing
    from jmegatron.training.run import build, checkpoint_meta

    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "text.txt").write_text(TEXT)
    tok = train_bpe_tokenizer([tmp / "text.txt"], 300, tmp / "tokenizer.json")
    c = base_config()
    c.mock_data, c.tokenizer_model, c.init_method_std = True, str(tmp / "tokenizer.json"), 0.3
    c.num_layers, c.hidden_size, c.num_attention_heads = 1, 32, 2
    c.seq_length = c.max_position_embeddings = MAX_LENGTH
    c.micro_batch_size = c.global_batch_size = 1
    c.save = str(tmp / "ckpt")
    cfg = from_configdict(c)
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    ckpt = checkpointing.Checkpointer(cfg.save)
    ckpt.save(1, run.init_state(), checkpoint_meta(cfg, run, 1, 0))
    ckpt.close()

    server = TextGenerationServer.from_checkpoint(cfg.save, max_batch_size=16, batch_window_s=0.3)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started
    model, params = server.batcher.model, server.batcher.params
    forward = jax.jit(lambda p, t: jax.nn.log_softmax(model.apply({"params": p}, t).astype(jnp.float32)))
    yield types.SimpleNamespace(url=f"http://127.0.0.1:{sock.getsockname()[1]}", server=server, tok=tok,
                                model=model, params=params, forward=forward)
    uv.should_exit = True
    thread.join(timeout=30)
    server.close()
    sock.close()


def put(served, body, **kw):
    return requests.put(served.url + "/api", json=body, timeout=120, **kw)


def greedy_reference(served, row, new_tokens):
    """``generate`` on this one row alone (batch 1)."""
    return generate(served.model, served.params, [row], new_tokens, greedy=True, eod_id=served.tok.eod,
                    max_length=MAX_LENGTH)[0]


def model_log_probs(served, full):
    """log p(full[j+1] | full[:j+1]) from one forward pass over ``full`` (right-padded)."""
    buf = np.zeros((1, MAX_LENGTH), np.int32)
    buf[0, :len(full)] = full
    lp = np.asarray(served.forward(served.params, buf))[0]
    return lp[np.arange(len(full) - 1), full[1:]]


def test_concurrent_requests_are_batched_and_equal_generate_alone(served):
    tok = served.tok
    words = ["ROMEO:", "JULIET: O", "But soft, what", "wherefore", "O Romeo, Romeo, wherefore art", "light",
             "yonder window", "breaks?"]
    bodies = [{"prompts": [w], "tokens_to_generate": 4 + i, "top_k": 1} for i, w in enumerate(words[:6])]
    # several prompts in one request (Megatron: each continued to the longest + tokens_to_generate),
    # add_BOS (the EOD token first) and logprobs
    bodies.append({"prompts": [words[6], "O Romeo, Romeo, wherefore art thou"], "tokens_to_generate": 6,
                   "top_k": 1, "logprobs": True, "no_log": True})
    bodies.append({"prompts": [words[7]], "tokens_to_generate": 9, "top_k": 1, "add_BOS": True, "logprobs": True})
    before = requests.get(served.url + "/metrics", timeout=30).json()
    barrier = threading.Barrier(len(bodies))
    answers = [None] * len(bodies)

    def client(i):
        barrier.wait()
        answers[i] = put(served, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = requests.get(served.url + "/metrics", timeout=30).json()

    assert [a.status_code for a in answers] == [200] * len(bodies), [a.text for a in answers]
    # batched: 8 requests (9 rows) in fewer generate calls, several rows in one
    assert after["requests"] - before["requests"] == len(bodies)
    assert after["batches"] - before["batches"] < len(bodies)
    assert after["max_rows_per_batch"] > 1
    n_new = []
    for body, answer in zip(bodies, answers):
        out = answer.json()
        rows = [([tok.eod] if body.get("add_BOS") else []) + tok.tokenize(p) for p in body["prompts"]]
        longest = max(len(r) for r in rows)
        assert len(out["text"]) == len(out["segments"]) == len(rows)
        for i, row in enumerate(rows):
            new = greedy_reference(served, row, longest + body["tokens_to_generate"] - len(row))
            n_new.append(len(new))
            full = row + new
            assert out["text"][i] == tok.detokenize(full)
            assert out["segments"][i] == [tok.detokenize([t]) for t in full]
            if body.get("logprobs"):
                lp = out["logprobs"][i]
                assert len(lp) == len(full) - 1
                np.testing.assert_allclose(lp, model_log_probs(served, full), rtol=1e-4, atol=1e-4)
            else:
                assert out["logprobs"] is None
    assert sum(n_new) > 40  # the rows did generate (no EOD at once): the comparison has teeth
    assert out["text"][0].startswith("<|endoftext|>breaks?")
    # generate's own default cache length gives the same tokens as the server's fixed one
    row = tok.tokenize(words[0])
    assert generate(served.model, served.params, [row], 4, greedy=True, eod_id=tok.eod) == \
        [greedy_reference(served, row, 4)]


def test_a_new_sampling_variant_announces_its_compilation(served, capsys):
    """A request that needs a new program (here top-k 7 sampling for the 4-row bucket)
    announces its compilation with its time; one that changes only traced values
    (temperature, seed) compiles nothing."""
    capsys.readouterr()
    three = {"prompts": ["ROMEO:", "JULIET: O", "light"], "tokens_to_generate": 3, "top_k": 7}  # 3 rows: 4-row bucket
    assert put(served, three).status_code == 200
    out = capsys.readouterr().out
    # (the server asks for log-probabilities: the same programs give Megatron's logprobs)
    assert "[jmegatron] compiling the decode loop for 4 rows, cache 64, top-k 7 sampling, log-probabilities ...\n" \
        in out, out
    assert re.search(r"^\[jmegatron\] compiled the decode loop for 4 rows, cache 64, top-k 7 sampling, "
                     r"log-probabilities in [0-9.]+ s$", out, re.M), out
    assert put(served, dict(three, temperature=0.5, random_seed=3)).status_code == 200
    assert "compiling" not in capsys.readouterr().out


def test_bad_requests_are_answered_400_and_the_server_keeps_serving(served):
    long_prompt = " ".join(str(i) for i in range(60))  # digits: well over 64 tokens
    cases = [
        ({}, "prompts argument required"),
        ({"prompts": "ROMEO:"}, "prompts is not a list of strings"),
        ({"prompts": [1, 2]}, "prompts is not a list of strings"),
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": ["a"] * 17}, "Maximum number of prompts is 16"),
        ({"prompts": ["a"], "max_len": 5}, "max_len is no longer used"),
        ({"prompts": ["a"], "tokens_to_generate": -1},
         "tokens_to_generate must be an integer greater than or equal to 0"),
        ({"prompts": ["a"], "tokens_to_generate": "5"}, "tokens_to_generate must be an integer"),
        ({"prompts": ["a"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
        ({"prompts": ["a"], "logprobs": "yes"}, "logprobs must be a boolean value"),
        ({"prompts": ["a"], "temperature": 0.0}, "temperature must be a positive number"),
        ({"prompts": ["a"], "temperature": "hot"}, "temperature must be a positive number"),
        ({"prompts": ["a"], "top_k": 2.5}, "top_k must be an integer"),
        ({"prompts": ["a"], "top_k": 5, "top_p": 0.5}, "cannot set both top-k and top-p samplings."),
        ({"prompts": ["a"], "top_p": 1}, "top_p must be a positive float"),
        ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
        ({"prompts": ["a"], "random_seed": -3}, "random_seed must be a positive integer"),
        ({"prompts": [long_prompt], "tokens_to_generate": 8}, "Length of prompt + tokens_to_generate longer than"),
        ({"prompts": ["a"], "beam_width": 2}, "beam_width is not supported"),
        ({"prompts": ["a"], "top_p": 0.5, "top_p_decay": 0.9}, "top_p_decay is not supported"),
        ({"prompts": ["a"], "prompt": "typo"}, "unknown field 'prompt'"),
    ]
    for body, message in cases:
        r = put(served, body)
        assert r.status_code == 400 and message in r.json()["message"], (body, r.status_code, r.text)
    r = requests.put(served.url + "/api", data=b"{not json", timeout=30)
    assert r.status_code == 400 and "not JSON" in r.json()["message"]
    # still serving: scoring (tokens_to_generate 0) gives the prompt's log-probs, and a
    # seeded sampled request gives the same answer again (another seed another one)
    # (two prompts of different lengths: each is scored alone, nothing generated for the shorter)
    row, short = served.tok.tokenize("ROMEO: But soft"), served.tok.tokenize("ROMEO:")
    assert len(short) < len(row)
    r = put(served, {"prompts": ["ROMEO: But soft", "ROMEO:"], "tokens_to_generate": 0, "logprobs": True})
    assert r.status_code == 200
    assert r.json()["text"] == ["ROMEO: But soft", "ROMEO:"]
    np.testing.assert_allclose(r.json()["logprobs"][0], model_log_probs(served, row), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(r.json()["logprobs"][1], model_log_probs(served, short), rtol=1e-4, atol=1e-4)
    sampled = {"prompts": ["JULIET:"], "tokens_to_generate": 12, "top_k": 5, "temperature": 50.0,
               "random_seed": 5}
    a, b = put(served, sampled).json(), put(served, sampled).json()
    c = put(served, dict(sampled, random_seed=6)).json()
    assert a == b and a["text"] != c["text"]


def test_stop_on_eol_keeps_tokens_up_to_the_newline():
    eol, double = 10, 20
    assert stop_index([1, 2, 10, 3], 5, eol, double, True, False) == 3
    assert stop_index([1, 20, 3], 5, eol, double, True, False) == 2
    assert stop_index([1, 10, 3, 10, 10, 4], 5, eol, double, False, True) == 5  # two newlines in a row
    assert stop_index([10, 3], 10, eol, double, False, True) == 1  # the prompt ended with one
    assert stop_index([1, 10, 3], 5, eol, None, False, False) == 3
