"""What runs inside each task of a SLURM job: `SlurmRun`, a submitit Checkpointable around `asyncpipe train`.

Every task gives its run torch.distributed's env from SLURM (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK; SLURM's
CUDA_VISIBLE_DEVICES untouched, see `task_rank_env`) and runs the same command a local sweep runs, in a child process. On timeout/preemption submitit calls `checkpoint()`,
which lets the run save and stop, then requeues the job; any restart (also `scontrol requeue`) adds resume=true.

Every task records itself in `RUN_DIR/tasks/rank-R.json` (node, attempt, exit code). When a multi-task run fails,
rank 0 names the ranks responsible in `launch.json`: those that exited non-zero and those that never reported
an exit (lost: their node or task died). A run that lost a rank is `resumable`: re-running the sweep resumes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from submitit.helpers import Checkpointable, DelayedSubmission

from asyncpipe.sweep.state import read_json, write_launch_record
from asyncpipe.status import COMPLETED, DIVERGED, FAILED
from asyncpipe.errors import EXIT_DIVERGED, EXIT_INTERRUPTED
from asyncpipe.track.files import atomic_write_json
from asyncpipe.track.lock import DirLock

LOCK_WAIT_S = 120.0  # a job may start while the submitting sweep still holds the run's lock
CHILD_STOP_S = 60.0  # time a run gets to checkpoint after the preemption signal (submitit signals 90 s early)
DOOMED_WAIT_S = 300.0  # after SIGTERM, SLURM's SIGKILL follows within KillWait: wait for it, report nothing
PEERS_WAIT_S = 10.0  # after a failure, how long rank 0 waits for the other ranks to report their exit
TASKS_DIR = "tasks"


def task_record(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / TASKS_DIR / f"rank-{rank}.json"


def failed_ranks(run_dir: Path, attempt: str, world: int) -> tuple[list[dict], list[dict]]:
    """(lost, failed) ranks of this attempt: lost never reported an exit, failed exited non-zero."""
    lost, failed = [], []
    for rank in range(world):
        record = read_json(task_record(run_dir, rank)) or {}
        if record.get("attempt") != attempt or record.get("exit_code") is None:
            lost.append({"rank": rank, "node": record.get("node") if record.get("attempt") == attempt else None})
        elif record["exit_code"] not in (0, EXIT_DIVERGED, EXIT_INTERRUPTED):
            failed.append({"rank": rank, "node": record.get("node"), "exit_code": record["exit_code"]})
    return lost, failed


def failure_note(lost: list[dict], failed: list[dict]) -> str:
    """One line naming the ranks that failed, lost ones first (a lost rank is usually why the others failed)."""
    parts = [f"rank {r['rank']} on {r['node'] or 'an unknown node'} lost (no exit status)" for r in lost]
    parts += [f"rank {r['rank']} on {r['node']} exited with code {r['exit_code']}" for r in failed]
    return "; ".join(parts)


def task_rank_env(num_tasks: int) -> dict[str, str]:
    """torch.distributed's rank environment of this task (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR/PORT) from SLURM's, for a run of several tasks (one task: nothing).

    CUDA_VISIBLE_DEVICES is left as SLURM set it (the node's GPUs of this job, or this task's own under a
    per-task binding): the rank picks its GPU among those (`asyncpipe.runtime.device.pick_device`). submitit's
    own export would replace it with the bare local rank, which names another job's GPU when SLURM gave this one
    GPUs 4,5, and leaves rank 1 asking for cuda:1 of a single visible GPU."""
    if num_tasks <= 1:
        return {}
    from submitit.helpers import TorchDistributedEnvironment

    dist_env = TorchDistributedEnvironment()
    return {
        "MASTER_ADDR": dist_env.master_addr,
        "MASTER_PORT": str(dist_env.master_port),
        "RANK": str(dist_env.rank),
        "WORLD_SIZE": str(dist_env.world_size),
        "LOCAL_RANK": str(dist_env.local_rank),
        "LOCAL_WORLD_SIZE": str(dist_env.local_world_size),
    }


def _ignore_usr2() -> None:
    # SLURM delivers the preemption signal (USR2) to every process of the step; the run must not die of it.
    # It is asked to stop with SIGTERM by checkpoint() below, after saving.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class SlurmRun(Checkpointable):
    """The callable every task of a run's job executes: `asyncpipe train ...` with the distributed env set.

    A `submitit.helpers.Checkpointable`: on timeout/preemption submitit calls `checkpoint()`, which stops the
    run (it saves on SIGTERM) and returns this callable again marked `requeued`, so the next start resumes.
    """

    def __init__(
        self,
        argv: Sequence[str],
        run_dir: str,
        threads: int = 1,
        gpus: int = 0,
        requeued: bool = False,
        env: Optional[dict[str, str]] = None,
        peers_wait_s: float = PEERS_WAIT_S,
    ) -> None:
        self.argv, self.run_dir = list(argv), str(run_dir)
        self.threads, self.gpus, self.requeued = threads, gpus, requeued
        self.env, self.peers_wait_s = dict(env or {}), peers_wait_s
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

        job_env = submitit.JobEnvironment()
        # A previous attempt of this job may have left its result behind before being requeued.
        job_env.paths.result_pickle.unlink(missing_ok=True)
        restarted = self.requeued or int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
        argv = list(self.argv)
        if restarted and "resume=true" not in argv:
            argv.append("resume=true")
        env = dict(os.environ, **task_rank_env(job_env.num_tasks), OMP_NUM_THREADS=str(self.threads), **self.env)
        run_dir = Path(self.run_dir)
        rank, world = job_env.global_rank, job_env.num_tasks
        attempt = f"{job_env.job_id}.{os.environ.get('SLURM_RESTART_COUNT') or 0}"
        me = {"rank": rank, "node": os.environ.get("SLURMD_NODENAME") or job_env.hostname, "attempt": attempt}
        if world > 1:
            atomic_write_json(task_record(run_dir, rank), {**me, "exit_code": None})
        lock = DirLock.sweep(run_dir) if job_env.global_rank == 0 else None
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
        if world > 1:
            atomic_write_json(task_record(run_dir, rank), {**me, "exit_code": code})
        summary = read_json(run_dir / "summary.json") or {}
        if code in (0, EXIT_DIVERGED, EXIT_INTERRUPTED):  # interrupted: checkpointed, the next launch resumes
            return summary
        if rank == 0 and summary.get("status") not in (COMPLETED, DIVERGED):
            self._record_failure(run_dir, code, job_env.job_id, attempt, world)
        raise RuntimeError(f"run exited with code {code}; see {run_dir} and this job's log")

    def _record_failure(self, run_dir: Path, code: Optional[int], job_id: str, attempt: str, world: int) -> None:
        """launch.json: failed, naming the ranks at fault (after giving the others time to report)."""
        details: dict[str, Any] = {}
        if world > 1:
            deadline = time.monotonic() + self.peers_wait_s
            lost, failed = failed_ranks(run_dir, attempt, world)
            while lost and time.monotonic() < deadline:
                time.sleep(0.5)
                lost, failed = failed_ranks(run_dir, attempt, world)
            details = {"lost_ranks": lost, "failed_ranks": failed, "note": failure_note(lost, failed)}
            if lost:  # a node or task died under the run: not the run's fault, a re-run resumes it
                details["resumable"] = True
        write_launch_record(run_dir, code, FAILED, **details)
        if details.get("lost_ranks"):
            # srun would wait for the lost tasks until SLURM declares their node dead (SlurmdTimeout, minutes on
            # real clusters), and the job runs with --no-kill: end it here, now that the failure is recorded.
            subprocess.run(["scancel", job_id], capture_output=True, timeout=60)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit on rank 0 at timeout/preemption: let the run checkpoint and stop, then requeue."""
        self._signal_child(signal.SIGTERM)
        if self._proc is not None and not self._child_exited(CHILD_STOP_S):
            self._signal_child(signal.SIGKILL)
        again = SlurmRun(self.argv, self.run_dir, self.threads, self.gpus, True, self.env, self.peers_wait_s)
        return DelayedSubmission(again)
