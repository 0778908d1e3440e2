"""Helpers shared by the end-to-end tests: run the CLI in a child process and read run dirs.

The CLI starts as asyncpipe starts its own runs and ranks (`asyncpipe.forkserver`): a fork of a server that has
torch and the trainer imported once per test worker, which saves ~8 s of imports per run on a 2-core machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from asyncpipe import forkserver


def cli_env(**extra: str) -> dict:
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **extra}


def asyncpipe(*args: str, timeout: int = 300, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``python -m asyncpipe ARGS`` to its end, with its output captured (as ``subprocess.run``)."""
    argv = [sys.executable, "-m", "asyncpipe", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = forkserver.start(argv, env=env or cli_env(), stdout=out, stderr=err)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read().decode(), err.read().decode())


def truncated_dataset(root: Path) -> dict:
    """The default dataset prepared under ``root`` with the last 10 bytes of its train.bin cut off (a size that no
    longer matches its manifest); returns the CLI env that points ASYNCPIPE_DATA at it."""
    env = cli_env(ASYNCPIPE_DATA=str(root))
    assert asyncpipe("data", "prepare", env=env).returncode == 0
    train_bin = root / "hamlet-byte" / "train.bin"
    train_bin.write_bytes(train_bin.read_bytes()[:-10])
    return env


def start(*args: str, log: Path) -> "subprocess.Popen | forkserver.Child":
    with open(log, "w") as out:
        return forkserver.start([sys.executable, "-m", "asyncpipe", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=cli_env())


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(m.get("step", -1) >= step and "train_loss" in m for m in read_metrics(run_dir)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited early with {proc.returncode}")
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def losses(run_dir: Path) -> list[tuple]:
    return [(m["step"], m.get("train_loss"), m.get("val_loss")) for m in read_metrics(run_dir)]
