"""Process-group plumbing shared by both engines: who am I (torchrun / SLURM / `asyncpipe.spawn` environment),
the one process-group set-up (backend and timeout), teardown, and `Comm`, the few collectives the run's trainer
needs (barrier, gather, any) on a group of the engine's choosing.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta
from typing import Any, Iterator, Optional

from asyncpipe.errors import UserError


def rank_env() -> Optional[tuple[int, int, int]]:
    """(rank, world, local_rank) when this process is one rank of a multi-process job, else None.

    torchrun, submitit's `TorchDistributedEnvironment().export()` and `asyncpipe.spawn` all set RANK / WORLD_SIZE /
    LOCAL_RANK (and MASTER_ADDR / MASTER_PORT for the rendezvous).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = _env_int("WORLD_SIZE", minimum=1)
    rank = _env_int("RANK")
    if rank >= world:
        raise UserError(f"RANK={rank} must be below WORLD_SIZE={world} (ranks count from 0)")
    return rank, world, _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank


def _env_int(name: str, minimum: int = 0) -> int:
    """An integer from the rank environment; anything else (an empty export, a typo) is one line."""
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UserError(
            f"{name}={text!r} in the environment must be an integer >= {minimum} (torchrun and SLURM set "
            "it; unset RANK and WORLD_SIZE for a run that starts its own processes)"
        )
    return value


def backend_for(device_type: str, configured: str = "auto") -> str:
    """`pipeline.backend`, where auto is nccl on CUDA and gloo otherwise."""
    if configured != "auto":
        return configured
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(backend: str, timeout_s: Optional[float] = None) -> None:
    """The default group from the rank environment (MASTER_ADDR / MASTER_PORT rendezvous); a no-op when already
    initialised. The timeout (default $ASYNCPIPE_PG_TIMEOUT, else 1800 s) bounds how long a rank waits for a dead
    peer."""
    import torch.distributed as tdist

    if tdist.is_initialized():
        return
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


def groups_alive() -> list:
    """The process groups this process holds besides the default one, oldest first ([] before `init_process_group`).
    Torch keeps them in its private world map; where a torch version has none, [] (nothing is torn down)."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return []
    from torch.distributed import distributed_c10d as c10d

    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    default = tdist.group.WORLD
    return [pg for pg in list(pg_map or {}) if pg is not default]


@contextlib.contextmanager
def job_groups() -> Iterator[None]:
    """The process groups created inside the block (an engine's own, DeepSpeed's topology and p2p groups) are
    destroyed when it ends normally, every rank together after a barrier on the default group. The ranks of a
    launch run its jobs back to back in one process, and each job's groups otherwise stay alive with their gloo
    threads and sockets. Not after an exception: a peer may be gone and the barrier would wait for it."""
    before = {id(pg) for pg in groups_alive()}
    yield
    created = [pg for pg in groups_alive() if id(pg) not in before]
    if created:
        import gc

        import torch.distributed as tdist

        tdist.barrier()  # no rank tears a group down while a peer may still talk over it
        for pg in reversed(created):
            tdist.destroy_process_group(pg)
        del created, pg
        gc.collect()  # a group's threads end with its last reference; the job's engine objects hold them in cycles


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Comm:
    """The trainer's collectives over ``group`` (None: the default group); trivial in a one-process run."""

    def __init__(self, world: int = 1, group: Any = None) -> None:
        self.world, self.group = world, group

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as tdist

            tdist.barrier(group=self.group)

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as tdist

        out: list = [None] * self.world
        tdist.all_gather_object(out, obj, group=self.group)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank says so."""
        return any(self.gather(bool(flag)))
