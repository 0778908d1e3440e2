"""Starting the ranks of one job on this machine: `launch` starts them with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and sees them through. Simulate replicas, pipeline ranks and the
pipeline benchmark all start through `launch`. (A sweep's runs are started by `asyncpipe/sweep/local.py`.)

Every rank runs ``python -m asyncpipe.rank SPEC`` (a fork of a server that has its imports done, see
`asyncpipe.forkserver`) and gets the same resolved configs from the spec file; it runs
the spec's jobs back to back (process start and imports paid once), each through its `asyncpipe.trainer.Trainer`
(whose rank 0 prepares the data: a missing corpus comes back as one user error). Results, errors and rank 0's
step records come back as files in a temporary directory, so nothing depends on how this launcher itself was
started.
Stop signals sent here are forwarded to every rank (each checkpoints at the next agreed step and ends
``interrupted``); a failing rank stops them all; ranks are killed when this process dies (even by SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from asyncpipe import forkserver
from asyncpipe.dist import free_port
from asyncpipe.errors import UserError
from asyncpipe.runtime.signals import SIGNALS
from asyncpipe.status import INTERRUPTED, exit_code


@dataclass
class Job:
    """One run for the ranks: its config (every rank gets it resolved, as JSON) and where its record goes."""

    cfg: DictConfig
    run_dir: Optional[Path] = None  # None: nothing is written (a benchmark)
    show_progress: bool = True  # rank 0 prints the description and progress lines


class RankFailed(RuntimeError):
    """A rank died or raised something other than a `UserError`."""


def world_of(cfg: DictConfig) -> int:
    """Processes of one run: P x D for engine=pipeline, D data-parallel replicas for engine=simulate."""
    return cfg.pipeline.data_parallel * (cfg.pipeline.stages if cfg.engine == "pipeline" else 1)


def rank_environ(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's rank environment for local rank ``rank`` of ``world`` on this machine (every rank sees this
    process's GPUs; rank r uses visible GPU r, `asyncpipe.runtime.device.pick_device`)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


class _Forward:
    """While active (main thread only), stop signals sent to the launcher go to every rank; the launcher keeps
    waiting for them to checkpoint and finish."""

    def __init__(self, procs: list) -> None:
        self.procs, self.previous, self.seen = procs, {}, None
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._relay)

    def _relay(self, signum: int, frame: Any) -> None:
        self.seen = signum
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def again(self) -> None:
        """Relay a signal that came while the ranks were starting to every rank (the later ones missed it)."""
        if self.seen is not None:
            self._relay(self.seen, None)

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def launch(
    jobs: Sequence[Job],
    on_step: Optional[Callable[[int, dict], None]] = None,
    timeout_s: Optional[float] = None,
    stopped: Optional[str] = None,
) -> list[dict]:
    """Run ``jobs`` (one world size) back to back in one set of local rank processes; returns rank 0's result
    per job, in order (the run summary with its step ``history``).

    ``on_step(job_index, record)`` is called here as rank 0 reports steps. A rank's `UserError` is raised here as
    one line; any other failure as `RankFailed`. ``stopped``: the name of a stop signal that reached the caller
    before the ranks existed (they start with it requested)."""
    if not jobs:
        return []
    worlds = {world_of(j.cfg) for j in jobs}
    if len(worlds) != 1:
        raise ValueError(f"jobs of one launch must share their world size, got {sorted(worlds)}")
    world = worlds.pop()
    with tempfile.TemporaryDirectory(prefix="asyncpipe-launch-") as tmp:
        out = Path(tmp)
        spec = {
            "out": str(out),
            "stopped": stopped,
            "jobs": [
                {
                    "config": OmegaConf.to_container(j.cfg, resolve=True),
                    "show_progress": j.show_progress,
                    "run_dir": None if j.run_dir is None else str(j.run_dir),
                }
                for j in jobs
            ],
        }
        (out / "spec.json").write_text(json.dumps(spec))
        (out / "events.jsonl").touch()
        threads = max(j.cfg.pipeline.threads for j in jobs)
        port = free_port()
        procs: list = []
        forwarding = _Forward(procs)  # before the first rank starts: no moment when a stop signal kills the launcher
        try:
            for r in range(world):
                env = dict(os.environ, **rank_environ(r, world, port), OMP_NUM_THREADS=str(threads))
                argv = forkserver.python_module("asyncpipe.rank", str(out / "spec.json"))
                procs.append(forkserver.start(argv, env=env, parent_death_signal=signal.SIGKILL))
            forwarding.again()
            try:
                _supervise(out, procs, len(jobs), on_step, timeout_s)
            except RankFailed:
                if forwarding.seen is None and stopped is None:
                    raise
                # A stop signal reached a rank still starting, before it could take it: the launch was stopped.
        finally:
            forwarding.close()
            for proc in procs:  # only our own children, by handle
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        unfinished = {"status": INTERRUPTED, "steps": 0, "exit_code": exit_code(INTERRUPTED)}
        return [
            json.loads(p.read_text()) if p.exists() else dict(unfinished)
            for p in (out / f"result-{i}-0.json" for i in range(len(jobs)))
        ]


def _supervise(
    out: Path, procs: list, n_jobs: int, on_step: Optional[Callable[[int, dict], None]], timeout_s: Optional[float]
) -> None:
    """Relay rank 0's step records until every rank has reported every job; raise on the first failure."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with open(out / "events.jsonl") as events:

        def relay() -> None:
            for line in events.readlines():
                if on_step is not None and line.strip():
                    ev = json.loads(line)
                    on_step(ev["job"], ev["metrics"])

        def finished(r: int) -> bool:
            return all((out / f"result-{i}-{r}.json").exists() for i in range(n_jobs))

        while True:
            relay()
            errors = sorted(out.glob("error-*.json"))
            if errors:
                err = json.loads(errors[0].read_text())
                if err["kind"] == "user_error":
                    raise UserError(err["text"])
                raise RankFailed(f"{errors[0].stem.replace('error-', 'rank ')} failed:\n{err['text']}")
            if all(finished(r) for r in range(len(procs))):
                relay()
                for proc in procs:  # every job is done; give the ranks a moment to tear down together
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                return
            lost = [(r, p.poll()) for r, p in enumerate(procs) if p.poll() is not None and not finished(r)]
            if lost:
                time.sleep(0.5)  # a dying rank's error report may still be landing
                if not list(out.glob("error-*.json")):
                    r, code = lost[0]
                    code = 128 - code if code < 0 else code  # killed by signal N: reported as a shell does
                    raise RankFailed(f"rank {r} exited with code {code} mid-run")
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailed(f"the ranks did not finish within {timeout_s:.0f} s")
            time.sleep(0.05)
