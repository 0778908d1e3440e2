"""Where a run came from: `provenance.json` (overrides as typed, command line, git commit and dirty flag, library
versions) and `train.log` (the progress lines the run printed), both in the run dir.

`asyncpipe train` wraps a run in `recorded(cfg, overrides)`: the provenance is written once the run dir exists
(a resumed run appends its own start under "resumed"), and stdout's plain lines are copied into train.log.
Never imports torch: versions come from the installed package metadata.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

from asyncpipe.errors import UserError
from asyncpipe.terminal import broken_streams
from asyncpipe.track.files import CONFIG_FILE, PROVENANCE_FILE, atomic_write_bytes, atomic_write_json, redact_secrets

TRAIN_LOG = "train.log"
PACKAGES = ("asyncpipe", "torch", "deepspeed", "hydra-core", "omegaconf", "wandb", "numpy")


def git_state(path: Path) -> Optional[dict]:
    """{"commit", "dirty"} of the git checkout holding `path`, or None (an installed package, no git)."""

    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def torch_threads() -> Optional[int]:
    """Intra-op threads of this process (a different count changes summation order, hence the last bits)."""
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


def versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> Optional[str]:
    """The CPU model name: runs are bit-reproducible on one CPU kind only (another differs at ~1e-7 after step 1)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def provenance(overrides: Sequence[str], revisions: Optional[dict] = None) -> dict[str, Any]:
    """The record of where a run came from; `revisions`: `asyncpipe.schedules.revisions(cfg)`, the declared revision
    of the optimizer's and the compensation method's rule (a report never pools runs of different revisions)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return {
        "started": datetime.now().isoformat(timespec="seconds"),
        "overrides": list(overrides),
        "command": redact_secrets(shlex.join(argv)),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "threads": torch_threads(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "python": sys.version.split()[0],
        "git": git_state(Path(__file__).resolve().parent),
        "versions": versions(),
        **({"revisions": revisions} if revisions else {}),
    }


def write_provenance(run_dir: Path, record: dict) -> None:
    """Write provenance.json; when one is there (a resume), keep it and add this start under "resumed". A rank that
    an `asyncpipe train` started (data-parallel ranks) defers to that launcher's record, which has the overrides
    as the user typed them."""
    path = Path(run_dir) / PROVENANCE_FILE
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict):
        if old.get("host") == record.get("host") and old.get("pid") == record.get("ppid"):
            return  # our launcher recorded this start
        if old.get("host") == record.get("host") and old.get("ppid") == record.get("pid"):
            record = {**record, "resumed": old.get("resumed", [])}  # a rank we started wrote first: ours replaces it
        else:
            old.setdefault("resumed", []).append(record)
            record = old
    atomic_write_json(path, record)


class LogTee:
    """Stands in for sys.stdout: writes through, and appends each plain line (no terminal control codes) to
    train.log once the run dir exists (lines printed before are kept and written then)."""

    def __init__(self, stream: TextIO, run_dir: Path, record: Optional[dict] = None) -> None:
        self.stream, self.run_dir = stream, Path(run_dir)
        self.record = record  # provenance, written with the first line once the run has started
        self.pending: list[str] = []
        self.partial = ""
        self.started = time.time()
        self.noted: set[str] = set()  # streams noted as gone (`asyncpipe.terminal`), once each

    def run_started(self) -> bool:
        """True once this run wrote its config.yaml (every start does, a resume too): a refused run writes nothing."""
        try:
            return (
                self.run_dir / CONFIG_FILE
            ).stat().st_mtime >= self.started - 0.05  # a coarse fs clock lags a little
        except OSError:
            return False

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        self.partial += text
        *lines, self.partial = self.partial.split("\n")
        self.log_only(*(line for line in lines if "\x1b" not in line and "\r" not in line))
        return n

    def log_only(self, *lines: str) -> None:
        """Append lines to train.log only (a progress bar's plain twin); the first time stdout or stderr is found
        closed or gone, a line saying so comes first (training goes on, its lines reach train.log only)."""
        for why in broken_streams():
            if why not in self.noted:
                self.noted.add(why)
                self.pending.append(f"note: {why}; training goes on, its progress is written to train.log only")
        self.pending.extend(lines)
        if not self.run_started():
            return
        if self.record is not None:
            write_provenance(self.run_dir, self.record)
            self.record = None
        if self.pending:
            with open(self.run_dir / TRAIN_LOG, "a", encoding="utf-8") as f:
                f.write("".join(redact_secrets(line) + "\n" for line in self.pending))
            self.pending.clear()

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class _Earlier:
    """provenance.json and train.log of an existing run dir as a start found them: a refused resume (a damaged
    checkpoint found only after the record was written) puts them back, so it leaves no trace of a start."""

    def __init__(self, run_dir: Path) -> None:
        self.provenance, self.log = Path(run_dir) / PROVENANCE_FILE, Path(run_dir) / TRAIN_LOG
        self.existed = Path(run_dir).is_dir()  # a new run dir: a refused start removes it whole (`RunRecord`)
        self.record = _read_or_none(self.provenance)
        self.log_size = self.log.stat().st_size if self.log.is_file() else None

    def restore(self) -> None:
        if not self.existed:
            return
        if self.record is None:
            self.provenance.unlink(missing_ok=True)
        elif _read_or_none(self.provenance) != self.record:
            atomic_write_bytes(self.provenance, self.record)
        if self.log_size is None:
            self.log.unlink(missing_ok=True)
        elif self.log.is_file() and self.log.stat().st_size > self.log_size:
            os.truncate(self.log, self.log_size)


def _read_or_none(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


@contextmanager
def recorded(cfg: Any, overrides: Sequence[str], rank: int = 0, revisions: Optional[dict] = None) -> Iterator[None]:
    """Record provenance (with the rules' `revisions`) and train.log for the run in cfg.run.dir (rank 0 only)."""
    if rank != 0:
        yield
        return
    earlier = _Earlier(Path(cfg.run.dir))
    tee = LogTee(sys.stdout, Path(cfg.run.dir), provenance(overrides, revisions))
    sys.stdout = tee  # type: ignore[assignment]
    try:
        yield
    except UserError:  # a refused start (say, a bad resume) leaves an existing run dir exactly as it was
        tee.record, tee.pending, tee.partial = None, [], ""
        with suppress(OSError):  # the refusal is what the user must see
            earlier.restore()
        raise
    finally:
        sys.stdout = tee.stream
        # Only into a run dir this run started in: a refused run leaves no file behind.
        tee.log_only(*([tee.partial] if tee.partial.strip() else []))
