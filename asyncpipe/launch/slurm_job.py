"""What runs inside each task of a SLURM job: `SlurmRun`, a submitit Checkpointable around `asyncpipe train`.

Every task exports torch.distributed's env from SLURM (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK) and runs
the same command a local sweep runs, in a child process. On timeout/preemption submitit calls `checkpoint()`,
which lets the run save and stop, then requeues the job; any restart (also `scontrol requeue`) adds resume=true.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from submitit.helpers import Checkpointable, DelayedSubmission

from asyncpipe.launch.state import FAILED, FINAL, RunLock, read_json, write_launch_record
from asyncpipe.errors import EXIT_DIVERGED, EXIT_INTERRUPTED

LOCK_WAIT_S = 120.0  # a job may start while the submitting sweep still holds the run's lock
CHILD_STOP_S = 60.0  # time a run gets to checkpoint after the preemption signal (submitit signals 90 s early)
DOOMED_WAIT_S = 300.0  # after SIGTERM, SLURM's SIGKILL follows within KillWait: wait for it, report nothing


def _ignore_usr2() -> None:
    # SLURM delivers the preemption signal (USR2) to every process of the step; the run must not die of it.
    # It is asked to stop with SIGTERM by checkpoint() below, after saving.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class SlurmRun(Checkpointable):
    """The callable every task of a run's job executes: `asyncpipe train ...` with the distributed env set.

    A `submitit.helpers.Checkpointable`: on timeout/preemption submitit calls `checkpoint()`, which stops the
    run (it saves on SIGTERM) and returns this callable again marked `requeued`, so the next start resumes.
    """

    def __init__(self, argv: Sequence[str], run_dir: str, threads: int = 1, gpus: int = 0, requeued: bool = False) -> None:
        self.argv, self.run_dir = list(argv), str(run_dir)
        self.threads, self.gpus, self.requeued = threads, gpus, requeued
        self._proc: Optional[subprocess.Popen] = None
        self._terminated = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_proc"], state["_terminated"] = None, False  # process handles never travel in the pickle
        return state

    def _on_sigterm(self, signum: int, frame: object) -> None:
        # SLURM is cancelling or requeueing the job: pass it on, and never report a result for this attempt.
        self._terminated = True
        self._signal_child(signal.SIGTERM)

    def _signal_child(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass

    def _child_exited(self, timeout: float) -> bool:
        """Wait for the child to exit without reaping it: this runs inside a signal handler that interrupted
        `Popen.wait()`, which holds the Popen's wait lock (so `Popen.wait` here would block until the timeout)."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:
                return True
            time.sleep(0.1)
        return False

    def __call__(self) -> dict:
        import submitit
        from submitit.helpers import TorchDistributedEnvironment

        job_env = submitit.JobEnvironment()
        # A previous attempt of this job may have left its result behind before being requeued.
        job_env.paths.result_pickle.unlink(missing_ok=True)
        restarted = self.requeued or int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
        argv = list(self.argv)
        if restarted and "resume=true" not in argv:
            argv.append("resume=true")
        if job_env.num_tasks > 1:
            TorchDistributedEnvironment().export(set_cuda_visible_devices=self.gpus > 0, overwrite=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        run_dir = Path(self.run_dir)
        lock = RunLock(run_dir) if job_env.global_rank == 0 else None
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        code = None
        try:
            if lock is not None:
                deadline = time.monotonic() + LOCK_WAIT_S
                while not lock.acquire():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{run_dir} is locked by another process (another sweep runs it)")
                    time.sleep(1.0)
            if not self._terminated:  # SLURM may cancel the job while it waits for the lock
                self._proc = subprocess.Popen(
                    argv,
                    start_new_session=True,
                    preexec_fn=_ignore_usr2,
                    env=env,
                    pass_fds=(lock.fd,) if lock is not None and lock.fd is not None else (),
                )
                code = self._proc.wait()
        finally:
            self._signal_child(signal.SIGTERM)
            signal.signal(signal.SIGTERM, previous)
            if lock is not None:
                lock.release()
        if self._terminated:
            # Cancelled or requeued: SLURM kills this process shortly; returning would record a false result.
            time.sleep(DOOMED_WAIT_S)
            raise RuntimeError("terminated by SLURM")
        summary = read_json(run_dir / "summary.json") or {}
        if code in (0, EXIT_DIVERGED, EXIT_INTERRUPTED):  # interrupted: checkpointed, the next launch resumes
            return summary
        if job_env.global_rank == 0 and summary.get("status") not in FINAL:
            write_launch_record(run_dir, code, FAILED)
        raise RuntimeError(f"run exited with code {code}; see {run_dir} and this job's log")

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit on rank 0 at timeout/preemption: let the run checkpoint and stop, then requeue."""
        self._signal_child(signal.SIGTERM)
        if self._proc is not None and not self._child_exited(CHILD_STOP_S):
            self._signal_child(signal.SIGKILL)
        return DelayedSubmission(SlurmRun(self.argv, self.run_dir, self.threads, self.gpus, requeued=True))

