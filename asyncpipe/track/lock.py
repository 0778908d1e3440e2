"""The one lock of run dirs: an exclusive, non-blocking `fcntl.flock` on a file in the run dir.

A run dir has two lock files, for two holders that may be different processes, each taken through `DirLock`:
- ``RUN/.lock`` (`DirLock.sweep`): the sweep or SLURM job that runs the run holds it for the run's whole life and
  hands it to the run's process (``pass_fds``), so two sweeps never run one run and `sweep status` tells running
  from dead;
- ``RUN/.writer.lock`` (`DirLock.writer`): the process that writes the run dir (a one-process run, the launcher of
  local ranks, rank 0 under torchrun/SLURM) holds it, with or without a sweep around it.
They cannot be one file: an flock belongs to an open file, so the run's own open of a file its sweep has locked
would be refused. The kernel drops a lock when the last process holding its open file ends, however it ends, so
a killed sweep or run never leaves a stale lock. Only the standard library.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any, Optional, Union

from asyncpipe.track.files import SWEEP_LOCK, WRITER_LOCK


class DirLock:
    """An exclusive, non-blocking `flock` on ``DIR/NAME``: whoever holds it owns what the name stands for."""

    def __init__(self, run_dir: Union[str, "os.PathLike[str]"], name: str) -> None:
        self.path = Path(run_dir) / name
        self.fd: Optional[int] = None

    @classmethod
    def sweep(cls, run_dir: Union[str, "os.PathLike[str]"]) -> "DirLock":
        """``RUN/.lock``: held by the sweep (or SLURM job) running the run, and by the run's process it starts."""
        return cls(run_dir, SWEEP_LOCK)

    @classmethod
    def writer(cls, run_dir: Union[str, "os.PathLike[str]"]) -> "DirLock":
        """``RUN/.writer.lock``: held by the one process writing the run dir."""
        return cls(run_dir, WRITER_LOCK)

    def acquire(self) -> bool:
        """Take the lock (creating the directory and the lock file as needed); False when another holds it. The
        descriptor is not inherited by child processes unless passed (``pass_fds=(lock.fd,)``)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        """Close our descriptor; a child holding a copy keeps the lock until it exits."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def held_elsewhere(self) -> bool:
        """True while some process (this one included, through another open file) holds the lock; never blocks and
        never creates the file (a FIFO in its place must not hang `sweep status`)."""
        if not self.path.exists():
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also drops the probe's lock if it got it
        return False
