"""Requests/s and latency of ``python -m jmegatron.serve`` under concurrent clients.

    python benchmarks/serve_load.py [--clients 8] [--requests 16] [--rounds 3] [--tokens 32]
        [--layers 4] [--hidden 512] [--max-length 64] [--batch-window-ms 5]
        [--out serve_load.json]

Builds a tiny random-weight GPT checkpoint (``--layers`` 4 x ``--hidden`` 512, float32,
a 512-token BPE tokenizer: 50 MB of weights against an 8 MB KV cache at 8 rows x 64
slots, so a decode step reads mostly weights, once for the whole batch: the regime
batching is for) in a temporary folder and starts two real servers as subprocesses (the
CLI): one batching (``--max-batch-size`` = clients, ``--batch-window-ms``) and one with batching
off (``--max-batch-size 1``). After a warm-up that compiles every batch bucket, each round
runs, alternately, ``clients`` concurrent clients against the batching server, one client
against it, and ``clients`` clients against the non-batching one; each client sends
``requests`` greedy ``PUT /api`` requests (one prompt, ``tokens`` new tokens) one after
another. Prints, per setting, requests/s (median and min-max over rounds), latency
p50/p90/p99 over every request and the spread of the per-round p50, and the batches the
server ran; writes the same as JSON to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import requests

WORDS = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
         "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.").split()


def make_checkpoint(folder: str, layers: int, hidden: int, max_length: int) -> str:
    """A GPT of random weights (init std 0.3, the EOD token never the argmax) + BPE
    tokenizer saved in ``folder``."""
    import jax

    from jmegatron.config import base_config, from_configdict
    from jmegatron.data.tokenizer import train_bpe_tokenizer
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.checkpoint import checkpointing
    from jmegatron.training.run import build, checkpoint_meta

    text = os.path.join(folder, "text.txt")
    rng = np.random.default_rng(0)
    with open(text, "w") as f:
        for _ in range(400):
            f.write(" ".join(rng.choice(WORDS, 12)) + "\n")
    tok = train_bpe_tokenizer([text], 512, os.path.join(folder, "tokenizer.json"))
    c = base_config()
    c.mock_data, c.tokenizer_model, c.init_method_std = True, os.path.join(folder, "tokenizer.json"), 0.3
    c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size = layers, hidden, 4, 4 * hidden
    c.seq_length = c.max_position_embeddings = max_length
    c.micro_batch_size = c.global_batch_size = 1
    c.save = os.path.join(folder, "ckpt")
    cfg = from_configdict(c)
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    ckpt = checkpointing.Checkpointer(cfg.save)
    state = run.init_state()
    # the EOD row of the (tied) embedding zeroed: its logit is 0, below the argmax, so
    # greedy rows run their full tokens_to_generate instead of ending at a random EOD
    emb = state.params["word_embeddings"]["embedding"]
    state = state.replace(params=dict(state.params, word_embeddings={"embedding": emb.at[tok.eod].set(0.0)}))
    ckpt.save(1, state, checkpoint_meta(cfg, run, 1, 0))
    ckpt.close()
    return cfg.save


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: str, max_batch_size: int, max_length: int, window_ms: float,
                 log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "jmegatron.serve", "--load", ckpt, "--port", str(port),
           "--max-batch-size", str(max_batch_size), "--max-length", str(max_length),
           "--batch-window-ms", str(window_ms)]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: see {log_path}")
        try:
            requests.get(url + "/metrics", timeout=1)
            return proc, url
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start in 300 s: see {log_path}")


def prompt(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(2, 6))))


def load(url: str, clients: int, per_client: int, tokens: int, seed: int) -> tuple[float, list[float]]:
    """(wall seconds, per-request latencies in seconds) of ``clients`` threads sending
    ``per_client`` requests each, one after another; every answer must be 200."""
    latencies: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    errors: list[str] = []

    def client(i: int) -> None:
        rng = np.random.default_rng([seed, i])
        session = requests.Session()
        barrier.wait(timeout=60)
        try:
            for _ in range(per_client):
                body = {"prompts": [prompt(rng)], "tokens_to_generate": tokens, "top_k": 1, "no_log": True}
                t0 = time.perf_counter()
                r = session.put(url + "/api", json=body, timeout=300)
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    errors.append(r.text)
                elif len(r.json()["segments"][0]) < tokens + 1:  # prompt + every new token
                    errors.append(f"the answer ended early: {r.json()['segments'][0]}")
                with lock:
                    latencies.append(dt)
        except Exception as e:  # reported by the caller
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait(timeout=60)
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return wall, latencies


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests per client per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="tokens_to_generate of every request")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--max-length", type=int, default=64, help="the servers' --max-length")
    p.add_argument("--batch-window-ms", type=float, default=5.0, help="the batching server's")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="serve_load-")
    ckpt = make_checkpoint(tmp, args.layers, args.hidden, args.max_length)
    batched, batched_url = start_server(ckpt, args.clients, args.max_length, args.batch_window_ms,
                                        os.path.join(tmp, "batched.log"))
    single, single_url = start_server(ckpt, 1, args.max_length, 0.0, os.path.join(tmp, "single.log"))
    settings = {f"batched, {args.clients} clients": (batched_url, args.clients),
                "batched, 1 client": (batched_url, 1),
                f"batching off, {args.clients} clients": (single_url, args.clients)}
    try:
        # warm-up: a request of n prompts runs in a batch of n rows or more, so requests of
        # 1, 2, 4, ... prompts compile every batch bucket (and the prompts' prefill bucket)
        n, rng = 1, np.random.default_rng(1000)
        while n <= args.clients:
            body = {"prompts": [prompt(rng) for _ in range(n)], "tokens_to_generate": args.tokens, "top_k": 1}
            assert requests.put(batched_url + "/api", json=body, timeout=600).status_code == 200
            n *= 2
        load(batched_url, args.clients, 2, args.tokens, seed=2000)
        load(single_url, 2, 2, args.tokens, seed=2000)
        before = {url: requests.get(url + "/metrics").json() for url in (batched_url, single_url)}
        results = {name: {"req_s": [], "latencies": [], "p50": []} for name in settings}
        for r in range(args.rounds):
            for name, (url, clients) in settings.items():
                wall, lat = load(url, clients, args.requests, args.tokens, seed=r)
                results[name]["req_s"].append(len(lat) / wall)
                results[name]["latencies"] += lat
                results[name]["p50"].append(float(np.percentile(lat, 50)))
                print(f"round {r}: {name}: {len(lat) / wall:.1f} req/s, p50 {1e3 * np.percentile(lat, 50):.0f} ms",
                      flush=True)
        after = {url: requests.get(url + "/metrics").json() for url in (batched_url, single_url)}
    finally:
        for proc in (batched, single):
            proc.terminate()
            proc.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

    summary = {"clients": args.clients, "requests_per_client": args.requests, "rounds": args.rounds,
               "tokens_to_generate": args.tokens, "batch_window_ms": args.batch_window_ms,
               "model": f"gpt {args.layers} layers x {args.hidden} hidden, max_length {args.max_length}",
               "settings": {}}
    print(f"\n{'setting':<28} {'req/s (min-max)':>22} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
          f"{'p50 spread ms':>16}")
    for name, res in results.items():
        lat = np.array(res["latencies"]) * 1e3
        row = {"req_s_median": statistics.median(res["req_s"]), "req_s_min": min(res["req_s"]),
               "req_s_max": max(res["req_s"]), "p50_ms": float(np.percentile(lat, 50)),
               "p90_ms": float(np.percentile(lat, 90)), "p99_ms": float(np.percentile(lat, 99)),
               "p50_per_round_ms": [1e3 * x for x in res["p50"]], "requests": len(lat)}
        summary["settings"][name] = row
        print(f"{name:<28} {row['req_s_median']:>8.1f} ({row['req_s_min']:.1f}-{row['req_s_max']:.1f}) "
              f"{row['p50_ms']:>10.0f} {row['p90_ms']:>8.0f} {row['p99_ms']:>8.0f} "
              f"{min(row['p50_per_round_ms']):>7.0f}-{max(row['p50_per_round_ms']):.0f}")
    for url, label in ((batched_url, "batching server"), (single_url, "non-batching server")):
        d = {k: after[url][k] - before[url][k] for k in ("requests", "rows", "batches", "padded_rows")}
        summary[label] = d
        print(f"{label}: {d['requests']} requests in {d['batches']} batches "
              f"({d['rows'] / max(d['batches'], 1):.2f} rows per batch, {d['padded_rows']} padding rows)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
