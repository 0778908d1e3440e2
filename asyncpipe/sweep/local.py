"""Running a sweep's runs on this machine (`launcher=local`): each run is an `asyncpipe train` child process,
one at a time or `parallel` at once. (The ranks inside one run are started by `asyncpipe/spawn.py`.)

With `parallel` > 1 and GPUs visible, runs that train on CUDA get disjoint GPUs: a run of W ranks (`gpus` below)
starts once W GPUs are free and sees only those (CUDA_VISIBLE_DEVICES), so parallel runs spread over the GPUs
instead of all using cuda:0; runs that need more GPUs than this machine shows start alone with all of them (and
stop at their own clear error). With `parallel=1` a run sees every GPU, as started.

Each run is its own process group (so Ctrl-C or a kill of the sweep takes down the run's whole tree), writes
its output to `RUN_DIR/launch.log`, and holds the run dir's lock for as long as it lives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Sequence

from asyncpipe import forkserver
from asyncpipe.errors import EXIT_DIVERGED, EXIT_INTERRUPTED
from asyncpipe.runtime.device import visible_gpus
from asyncpipe.sweep.display import SweepDisplay
from asyncpipe.sweep.expand import RunSpec, SweepPlan, run_overrides
from asyncpipe.sweep.state import (
    COMPLETED,
    DIVERGED,
    FAILED,
    FINAL,
    INTERRUPTED,
    PENDING,
    RUNNING,
    RunState,
    claim,
    read_json,
    run_state,
    write_launch_record,
)
from asyncpipe.track.lock import DirLock

# overrides -> argv of one run; tests swap in a fake, the sweep uses `asyncpipe train`.
RunCommand = Callable[[Sequence[str]], list[str]]
KILL_GRACE_S = 30.0  # a run stopped by SIGTERM writes a checkpoint first
POLL_S = 0.25


def train_command(overrides: Sequence[str]) -> list[str]:
    return forkserver.python_module("asyncpipe", "train", *overrides)


@dataclass
class _Active:
    spec: RunSpec
    run_dir: Path
    proc: subprocess.Popen
    lock: DirLock
    log: object
    gpus: tuple[str, ...] = ()  # the GPUs this run was given (CUDA_VISIBLE_DEVICES), back to the pool when it ends


def _outcome(run_dir: Path, returncode: int) -> str:
    """A finished child's state: its summary's status, else what its exit code says (and record a crash)."""
    summary = read_json(run_dir / "summary.json") or {}
    if summary.get("status") in FINAL:
        return str(summary["status"])
    if returncode == EXIT_INTERRUPTED:  # stopped by a signal after writing a checkpoint: resumable
        return INTERRUPTED
    if returncode == 0:
        status = COMPLETED if summary else FAILED
    else:
        status = DIVERGED if returncode == EXIT_DIVERGED else FAILED
    if status != COMPLETED:
        write_launch_record(run_dir, returncode, status)
    return status


class LocalLauncher:
    """Runs a sweep's runs here; `run()` returns every run's final `RunState` in grid order."""

    def __init__(
        self,
        plan: SweepPlan,
        sweep_dir: Path,
        parallel: int = 1,
        retry_failed: bool = False,
        command: RunCommand = train_command,
        display: Optional[SweepDisplay] = None,
        gpus: Optional[dict[str, int]] = None,
    ) -> None:
        """``gpus``: run name -> GPUs it uses (its ranks when it trains on CUDA, 0 on CPU); unknown runs: none."""
        self.plan, self.sweep_dir = plan, Path(sweep_dir)
        self.parallel = max(1, int(parallel))
        self.retry_failed = retry_failed
        self.command = command
        self.display = display or SweepDisplay(f"sweep {plan.name}")
        self.states = {s.name: RunState(s.name, PENDING, note="waiting") for s in plan.runs}
        self.active: dict[str, _Active] = {}
        self.needs = dict(gpus or {})
        self.pool = visible_gpus() if self.parallel > 1 and any(self.needs.values()) else []

    def _env(self, gpus: Sequence[str] = ()) -> dict[str, str]:
        env = dict(os.environ)
        # Runs at once share the cores; without this each would start one thread per core.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.parallel)))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return env

    def _free_gpus(self) -> list[str]:
        taken = {g for job in self.active.values() for g in job.gpus}
        return [g for g in self.pool if g not in taken]

    def _gpus_for(self, spec: RunSpec) -> Optional[tuple[str, ...]]:
        """The GPUs ``spec`` gets now (empty: no split, it sees what this sweep sees), or None: wait for some."""
        need = self.needs.get(spec.name, 0)
        if not self.pool or need <= 0:
            return ()
        free = self._free_gpus()
        if need > len(self.pool):  # more than this machine shows: alone, with all of them (its error says why)
            return tuple(self.pool) if len(free) == len(self.pool) else None
        return tuple(free[:need]) if need <= len(free) else None

    def _start(self, spec: RunSpec, gpus: tuple[str, ...] = ()) -> None:
        run_dir = self.sweep_dir / spec.name
        c = claim(run_dir, self.retry_failed)
        if not c.start:
            self.states[spec.name] = RunState(spec.name, c.state, note=c.note)
            return
        assert c.lock is not None and c.lock.fd is not None
        argv = self.command(run_overrides(self.plan, spec, run_dir.resolve(), c.resume))
        log = open(run_dir / "launch.log", "ab")
        log.write(f"--- {datetime.now().isoformat(timespec='seconds')} {' '.join(argv)}\n".encode())
        log.flush()
        try:
            proc = forkserver.start(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: killpg reaches the run's children too
                pass_fds=(c.lock.fd,),  # the child holds the run lock even if this sweep dies
                parent_death_signal=signal.SIGTERM,  # no run outlives the sweep, even a SIGKILLed one
                env=self._env(gpus),
            )
        except OSError as exc:
            log.close()
            c.lock.release()
            write_launch_record(run_dir, -1, FAILED)
            self.states[spec.name] = RunState(spec.name, FAILED, note=f"could not start: {exc}")
            return
        self.active[spec.name] = _Active(spec, run_dir, proc, c.lock, log, gpus)
        self.states[spec.name] = RunState(spec.name, RUNNING, note=c.note)

    def _reap(self) -> None:
        for name, job in list(self.active.items()):
            code = job.proc.poll()
            if code is None:
                fresh = run_state(job.run_dir, name, parent=job.spec.parent)
                for key in ("step", "steps", "val_loss", "val_step"):
                    setattr(self.states[name], key, getattr(fresh, key))
                continue
            del self.active[name]
            job.log.close()
            status = _outcome(job.run_dir, code)
            job.lock.release()
            final = run_state(job.run_dir, name, parent=job.spec.parent)
            final.state = status
            if status == FAILED and not final.note:
                final.note = f"exit code {code}, see {name}/launch.log"
            self.states[name] = final

    def _kill_all(self) -> None:
        """Stop every run we started (whole process groups); they stay resumable (no final state written)."""
        for job in self.active.values():
            try:
                os.killpg(job.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        for job in self.active.values():
            try:
                job.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(job.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                job.proc.wait()
            job.log.close()
            job.lock.release()
            self.states[job.spec.name].state = INTERRUPTED
        self.active.clear()

    def run(self) -> list[RunState]:
        queue = deque(self.plan.runs)
        previous = None
        in_main = _in_main_thread()
        if in_main:
            # `kill SWEEP_PID` must clean up like Ctrl-C does.
            previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            return self._loop(queue)
        except KeyboardInterrupt:
            stopped = len(self.active)
            if self.active:
                self._kill_all()
            done = sum(1 for s in self.states.values() if s.state in FINAL)
            print(
                f"sweep {self.plan.name} interrupted: {stopped} running run(s) stopped (resumable), {done} of "
                f"{len(self.states)} finished; re-running the same command resumes it",
                file=sys.stderr,
                flush=True,
            )
            raise
        finally:
            if self.active:
                self._kill_all()
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    def _next(self, queue: "deque[RunSpec]") -> Optional[RunSpec]:
        """The first queued run that may start: a budget branch waits until its parent has completed, and is left
        pending (with why) once its parent can no longer complete in this sweep."""
        for spec in list(queue):
            parent = self.states.get(spec.parent) if spec.parent is not None else None
            if parent is None or parent.state == COMPLETED:
                queue.remove(spec)
                return spec
            waiting = spec.parent in self.active or any(q.name == spec.parent for q in queue)
            if not waiting:
                queue.remove(spec)
                self.states[spec.name] = RunState(
                    spec.name, PENDING, note=f"not started: it branches from {spec.parent}, which is {parent.state}"
                )
        return None

    def _loop(self, queue: "deque[RunSpec]") -> list[RunState]:
        with self.display:
            while queue or self.active:
                while queue and len(self.active) < self.parallel:
                    spec = self._next(queue)
                    if spec is None:
                        break
                    gpus = self._gpus_for(spec)
                    if gpus is None:  # its GPUs are still in use: wait for a run to end
                        queue.appendleft(spec)
                        break
                    self._start(spec, gpus)
                self._reap()
                self.display.update(list(self.states.values()))
                if self.active:
                    time.sleep(POLL_S)
            self.display.update(list(self.states.values()))
        return [self.states[s.name] for s in self.plan.runs]


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
