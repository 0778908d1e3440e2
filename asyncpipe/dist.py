"""Process-group plumbing shared by both engines: who am I (torchrun / SLURM environment), start the group
without DeepSpeed's JIT-compiled extras, and spawn local ranks of one job.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Optional, Sequence


def rank_env() -> Optional[tuple[int, int, int]]:
    """(rank, world, local_rank) when this process is one rank of a multi-process job, else None.

    torchrun and submitit's `TorchDistributedEnvironment().export()` both set RANK / WORLD_SIZE / LOCAL_RANK.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def init_process_group(device_type: str, timeout_s: Optional[float] = None) -> None:
    """gloo on CPU, nccl on CUDA, rendezvous from MASTER_ADDR / MASTER_PORT; a no-op when already initialised.

    The timeout (default $ASYNCPIPE_PG_TIMEOUT, else 1800 s) bounds how long a rank waits for a dead peer."""
    import torch.distributed as tdist

    if tdist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    env = rank_env()
    assert env is not None, "init_process_group needs RANK and WORLD_SIZE in the environment"
    rank, world, _ = env
    if timeout_s is None:
        timeout_s = float(os.environ.get("ASYNCPIPE_PG_TIMEOUT", "1800"))
    tdist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def destroy_process_group() -> None:
    """Tear the group down, together, before the interpreter exits: gloo's threads otherwise abort a rank at exit
    ("terminate called without an active exception") after the run itself succeeded."""
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.barrier()  # no rank tears down while a peer still talks to it
        tdist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(world: int, argv: Sequence[str], threads: int = 1, poll_s: float = 0.1) -> int:
    """Run ``python -m asyncpipe ARGV`` as `world` local ranks with torchrun's environment; returns the exit code.

    Any rank failing stops the others (a collective would otherwise wait for it forever); SIGTERM to this
    process is forwarded so every rank can checkpoint.
    """
    import signal

    port = free_port()
    procs: list[subprocess.Popen] = []
    for r in range(world):
        env = {
            **os.environ,
            "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads),
        }  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-m", "asyncpipe", *argv], env=env))

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
    try:
        while True:
            # A rank killed by signal N reports -N; report it the way a shell does (128 + N).
            codes = [None if c is None else (128 - c if c < 0 else c) for c in (p.poll() for p in procs)]
            if all(c is not None for c in codes):
                return max(codes, key=lambda c: (c != 0, c))  # type: ignore[arg-type]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                time.sleep(2.0)  # let the failing rank's error reach the terminal, then stop the rest
                for p in procs:
                    if p.poll() is None:
                        p.kill()  # not SIGTERM: a checkpoint collective with a dead rank would hang
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
