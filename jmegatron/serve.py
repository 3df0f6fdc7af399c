"""``python -m jmegatron.serve --load CKPT [--port 5000] [--host 127.0.0.1]
[--max-batch-size N] [--max-length L] [--batch-window-ms MS] [--tokenizer-model PATH]``:
Megatron-LM's text-generation REST server (tools/run_text_generation_server.py) for a
jmegatron checkpoint, on uvicorn.

``PUT http://HOST:PORT/api`` with Megatron's JSON request (``{"prompts": [...],
"tokens_to_generate": 32, "top_k": 1, "logprobs": true}``) answers Megatron's
``{"text", "segments", "logprobs"}``; concurrent requests are batched
(:mod:`jmegatron.inference.server`, docs/SERVING.md); ``GET /metrics`` gives the batching
counters. ``--load`` may be a Hugging Face folder (imported into a temporary checkpoint
for the server's lifetime). A missing checkpoint, an unknown tokenizer or bad settings
exit with status 2 and a one-line ``error: ...`` message. Needs the ``serve`` extra
(fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from jmegatron.export.imports import checkpoint_of
from jmegatron.inference.server import TextGenerationServer, create_app
from jmegatron.checkpoint.checkpointing import CheckpointError


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point: serves until interrupted, then returns 0; 2 with ``error: ...``
    for bad input."""
    p = argparse.ArgumentParser(prog="python -m jmegatron.serve",
                                description="Megatron's text-generation REST server (PUT /api) for a checkpoint.")
    p.add_argument("--load", required=True, help="checkpoint directory (a training run's save dir) or HF folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--max-batch-size", type=int, default=32,
                   help="most prompts per generate call (and per request); concurrent requests are merged up to it")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest prompt + tokens_to_generate (the KV-cache length); default max_position_embeddings")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="how long the oldest waiting request waits for others to join its batch")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer.json; default: the checkpoint config's")
    args = p.parse_args(argv)

    try:
        import uvicorn
    except ImportError:
        print("error: the server needs fastapi and uvicorn: pip install 'jmegatron[serve]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        with checkpoint_of(args.load) as load:  # a Hugging Face folder: imported for the server's lifetime
            server = TextGenerationServer.from_checkpoint(
                load, args.tokenizer_model, max_length=args.max_length, max_batch_size=args.max_batch_size,
                batch_window_s=args.batch_window_ms / 1000)
            try:
                uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="info")
            finally:
                server.close()
    except (CheckpointError, ValueError, FileNotFoundError) as e:  # GenerateError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
