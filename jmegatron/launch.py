"""``python -m jmegatron.launch --nproc N [--devices-per-proc D] [--port P] -- CMD ...``

Starts ``N`` copies of ``CMD`` on this machine as one JAX multi-process run (the role of
``torchrun`` for Megatron): each gets ``JMEGATRON_COORDINATOR=127.0.0.1:P``,
``JMEGATRON_NUM_PROCESSES``, ``JMEGATRON_PROCESS_ID`` (see :mod:`jmegatron.distributed`)
and, with ``--devices-per-proc``, that many simulated CPU devices. If any process
exits with an error or is killed, the others are terminated (SIGTERM, then SIGKILL
after ``--grace`` seconds) and the launcher exits non-zero naming the rank: nothing
hangs. Exit status 0 only when every process exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from jmegatron.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m jmegatron.launch --nproc N [--devices-per-proc D] -- CMD ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m jmegatron.launch")
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--devices-per-proc", type=int, default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    args = p.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd or args.nproc < 1:
        print("error: need --nproc >= 1 and a command after --", file=sys.stderr)
        return 2
    port = args.port or _free_port()
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ)
        env.update({ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(args.nproc),
                    ENV_PROCESS_ID: str(rank), "JAX_PLATFORMS": env.get("JAX_PLATFORMS", "cpu")})
        if args.devices_per_proc:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                                f" --xla_force_host_platform_device_count={args.devices_per_proc}").strip()
        procs.append(subprocess.Popen(cmd, env=env))
        print(f"[jmegatron.launch] rank {rank}: pid {procs[-1].pid}", flush=True)

    def stop_all(sig=signal.SIGTERM):
        for q in procs:
            if q.poll() is None:
                q.send_signal(sig)

    forwarded = {"sig": None}

    def forward(signum, frame):  # Ctrl-C / SIGTERM to the launcher: pass it on, let them save
        forwarded["sig"] = signum
        stop_all(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    failed = None
    forwarded_at = None
    while any(q.poll() is None for q in procs):
        if forwarded["sig"] is not None:
            forwarded_at = forwarded_at or time.time()
            if time.time() - forwarded_at > 6 * args.grace:  # saving took too long: stop for good
                stop_all(signal.SIGKILL)
        for rank, q in enumerate(procs):
            code = q.poll()
            if code not in (None, 0) and failed is None:
                failed = (rank, code)
                print(f"[jmegatron.launch] rank {rank} exited with {code}; stopping the other ranks",
                      file=sys.stderr, flush=True)
                stop_all()
                deadline = time.time() + args.grace
                while time.time() < deadline and any(x.poll() is None for x in procs):
                    time.sleep(0.1)
                stop_all(signal.SIGKILL)
        time.sleep(0.1)
    codes = [q.wait() for q in procs]
    if failed is None and any(codes):
        failed = next((r, c) for r, c in enumerate(codes) if c)
    if failed:
        print(f"[jmegatron.launch] error: rank {failed[0]} failed with exit code {failed[1]}; "
              f"exit codes {codes}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
