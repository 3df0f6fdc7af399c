"""``python -m jmegatron.launch --nproc N [--devices-per-proc D] [--port P] -- CMD ...``

Starts ``N`` copies of ``CMD`` on this machine as one JAX multi-process run (the role of
``torchrun`` for Megatron): each gets ``JMEGATRON_COORDINATOR=127.0.0.1:P``,
``JMEGATRON_NUM_PROCESSES``, ``JMEGATRON_PROCESS_ID`` (see :mod:`jmegatron.distributed`)
and, with ``--devices-per-proc D``, that many devices: simulated CPU devices on the CPU
platform, GPUs ``rank * D .. rank * D + D - 1`` on a GPU machine
(``JMEGATRON_LOCAL_DEVICE_IDS``). The platform is the user's ``JAX_PLATFORMS``, passed
through when set; otherwise nothing is set on a machine with an NVIDIA GPU (JAX picks the
GPU) and ``JAX_PLATFORMS=cpu`` elsewhere (:func:`jmegatron.distributed.target_platform`;
gloo collectives on the CPU only). If any process
exits with an error or is killed, the others are terminated (SIGTERM, then SIGKILL
after ``--grace`` seconds) and the launcher exits non-zero naming the rank: nothing
hangs. Exit status 0 only when every process exits 0.

SIGTERM / SIGINT to the launcher is forwarded to every rank, which agree on an iteration,
save it and exit 0 (:mod:`jmegatron.training.loop`); the launcher waits for them up to
``--stop-timeout`` seconds (default 600: a save of a large model must not be cut short;
a cluster's own kill deadline, e.g. SLURM's KillWait, may be shorter and wins), then
SIGKILLs what is left and says so. A second SIGTERM / SIGINT to the launcher forwards
SIGKILL at once. The ranks run in their own process group, so a terminal's Ctrl-C reaches
them once, through the launcher.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

from jmegatron.distributed import (ENV_COORDINATOR, ENV_LOCAL_DEVICE_IDS, ENV_NUM_PROCESSES, ENV_PROCESS_ID,
                                   nvidia_gpu_count, target_platform)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(base: Mapping[str, str], rank: int, nproc: int, port: int, devices_per_proc: Optional[int] = None,
             gpu_count: Optional[int] = None) -> dict[str, str]:
    """The environment of process ``rank`` of ``nproc``: ``base`` plus the coordinator
    variables; ``JAX_PLATFORMS`` as in ``base`` when set, else unset on a machine with an
    NVIDIA GPU (``gpu_count``: tests; None: :func:`jmegatron.distributed.nvidia_gpu_count`)
    and "cpu" elsewhere; ``devices_per_proc`` simulated CPU devices (XLA_FLAGS) on the CPU
    platform, or that many GPUs per rank on a GPU platform. Raises ValueError when the
    ranks ask for more GPUs than the machine has."""
    env = dict(base)
    env.update({ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(nproc), ENV_PROCESS_ID: str(rank)})
    gpus = nvidia_gpu_count() if gpu_count is None else gpu_count
    if not env.get("JAX_PLATFORMS") and gpus == 0:
        env["JAX_PLATFORMS"] = "cpu"
    platform = target_platform(env, gpus)
    if devices_per_proc and platform == "cpu":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={devices_per_proc}").strip()
    elif devices_per_proc and platform == "gpu":
        if nproc * devices_per_proc > gpus:
            raise ValueError(f"--nproc {nproc} x --devices-per-proc {devices_per_proc} needs "
                             f"{nproc * devices_per_proc} GPUs; this machine has {gpus}")
        env[ENV_LOCAL_DEVICE_IDS] = ",".join(str(rank * devices_per_proc + i) for i in range(devices_per_proc))
    return env


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
    p.add_argument("--grace", type=float, default=10.0,
                   help="after a rank fails: seconds between SIGTERM to the others and SIGKILL")
    p.add_argument("--stop-timeout", type=float, default=600.0,
                   help="after SIGTERM/SIGINT to the launcher: seconds the ranks get to save and exit "
                        "before SIGKILL (default 600)")
    args = p.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if args.stop_timeout <= 0 or args.grace < 0:
        print("error: --stop-timeout must be > 0 and --grace >= 0", file=sys.stderr)
        return 2
    if not cmd or args.nproc < 1:
        print("error: need --nproc >= 1 and a command after --", file=sys.stderr)
        return 2
    port = args.port or _free_port()
    try:
        envs = [rank_env(os.environ, rank, args.nproc, port, args.devices_per_proc) for rank in range(args.nproc)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    procs = []

    def stop_all(sig=signal.SIGTERM):
        for q in procs:
            if q.poll() is None:
                q.send_signal(sig)

    forwarded = {"sig": None, "count": 0}

    def forward(signum, frame):  # Ctrl-C / SIGTERM to the launcher: pass it on, let them save
        forwarded["sig"] = signum
        forwarded["count"] += 1
        stop_all(signum if forwarded["count"] == 1 else signal.SIGKILL)  # a second one: stop for good

    # before the ranks start: a signal while they start must not kill the launcher and orphan them
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    for rank, env in enumerate(envs):
        # own process group: a terminal's Ctrl-C reaches the launcher only, which forwards it once
        # (a rank getting it twice would take the second as "stop now" and lose its save)
        procs.append(subprocess.Popen(cmd, env=env, process_group=0))
        print(f"[jmegatron.launch] rank {rank}: pid {procs[-1].pid}", flush=True)
        if forwarded["sig"] is not None:  # signalled while starting: the new rank gets it too
            procs[-1].send_signal(forwarded["sig"] if forwarded["count"] == 1 else signal.SIGKILL)
    failed = None
    forwarded_at = None
    while any(q.poll() is None for q in procs):
        if forwarded["sig"] is not None:
            forwarded_at = forwarded_at or time.time()
            if time.time() - forwarded_at > args.stop_timeout:  # saving took too long: stop for good
                if any(q.poll() is None for q in procs):
                    print(f"[jmegatron.launch] ranks still running {args.stop_timeout:.0f} s after signal "
                          f"{forwarded['sig']} (--stop-timeout): killing them", file=sys.stderr, flush=True)
                stop_all(signal.SIGKILL)
                forwarded_at = float("inf")  # (once)
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
