"""The SLURM launcher: a sweep's runs as submitit jobs (one job array per task layout), watched until done.

A pipeline run of P stages x D replicas is one job of P*D tasks spread evenly over launcher.nodes; a simulate
run is one task unless launcher.nodes / launcher.tasks_per_node ask for more (then its D data-parallel replicas
are the tasks). Each task runs `slurm_job.SlurmRun`. Task (= rank) r sits on node r // tasks_per_node and, in a
pipeline, runs stage r // D of replica r % D (DeepSpeed's pipe-major order): with launcher.nodes=P each node
holds one stage, and the stages of one replica sit on consecutive nodes. The tasks' rendezvous is the job's
first node (submitit's MASTER_ADDR); launcher.socket_ifname sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME.
Job logs stay in submitit's folder `SWEEP_DIR/.submitit/`; each run dir links them (`slurm.out`, `slurm.err`)
and records the job in `slurm_job.json`.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe import forkserver
from asyncpipe.errors import UserError
from asyncpipe.sweep.display import SweepDisplay
from asyncpipe.sweep.expand import RunSpec, SweepPlan, run_overrides
from asyncpipe.sweep.local import RunCommand, train_command
from asyncpipe.sweep.state import FINAL, SLURM_ACTIVE, SLURM_RECORD, Claim, RunState, claim, read_json, run_state
from asyncpipe.track.files import atomic_write_json

POLL_S = 2.0
SUBMITIT_DIR = ".submitit"


def require_slurm() -> None:
    if shutil.which("sbatch") is None:
        raise UserError("launcher=slurm needs SLURM's sbatch on PATH, and there is none here; use launcher=local")


def task_layout(cfg: DictConfig) -> tuple[int, int]:
    """(nodes, tasks per node) of one run's job: P*D tasks for a pipeline run, D for a simulate run over several
    nodes, else the launcher's request."""
    launcher = cfg.launcher
    nodes = int(launcher.nodes)
    if nodes < 1:
        raise UserError(f"launcher.nodes={nodes}: must be at least 1")
    replicas = int(cfg.pipeline.data_parallel)
    if cfg.engine != "pipeline" and nodes == 1:
        return nodes, max(1, int(launcher.tasks_per_node))
    if cfg.engine == "pipeline":
        world = int(cfg.pipeline.stages) * replicas
        what = f"a pipeline of {cfg.pipeline.stages} stages x {replicas} replicas ({world} tasks)"
    else:
        world, what = replicas, f"engine=simulate with pipeline.data_parallel={replicas} ({replicas} tasks)"
    if world % nodes:
        raise UserError(f"{what} cannot be spread evenly over launcher.nodes={nodes}")
    per_node = world // nodes
    if int(launcher.tasks_per_node) not in (1, per_node):
        raise UserError(
            f"launcher.tasks_per_node={launcher.tasks_per_node} but this run needs {per_node} tasks per node "
            f"({world} tasks on {nodes} nodes); leave tasks_per_node unset"
        )
    return nodes, per_node


def placement(cfg: DictConfig, nodes: int, tasks_per_node: int) -> list[dict[str, int]]:
    """Where each rank of a run's job runs: node index (SLURM's block distribution of tasks), and for a
    pipeline its stage and replica (DeepSpeed's PipeDataParallelTopology: rank = stage * D + replica)."""
    replicas = int(cfg.pipeline.data_parallel)
    out = []
    for rank in range(nodes * tasks_per_node):
        where = {"rank": rank, "node": rank // tasks_per_node}
        if cfg.engine == "pipeline":
            where.update(stage=rank // replicas, replica=rank % replicas)
        else:
            where.update(replica=rank)
        out.append(where)
    return out


def task_env(launcher: DictConfig) -> dict[str, str]:
    """Environment every task adds: the network interface for gloo and NCCL when launcher.socket_ifname names one
    (otherwise whatever the submitting shell exported, e.g. NCCL_SOCKET_IFNAME, reaches the tasks unchanged)."""
    ifname = launcher.get("socket_ifname")
    return {"GLOO_SOCKET_IFNAME": str(ifname), "NCCL_SOCKET_IFNAME": str(ifname)} if ifname else {}


def job_python() -> str:
    """The interpreter command of submitit's job script (``python -u -m submitit.core._submit``): never importing
    from the job's working directory, the sweep's (`forkserver.SAFE_PATH`), and finding this asyncpipe as the
    sweep does (the submitting environment reaches the job, and the run it starts, with the checkout first on its
    PYTHONPATH)."""
    path = forkserver.child_environ().get("PYTHONPATH")
    argv = [*(["env", f"PYTHONPATH={path}"] if path else []), sys.executable, *forkserver.SAFE_PATH]
    return " ".join(shlex.quote(a) for a in argv)  # srun runs it: `env` sets the path, as no shell is there


def executor_parameters(name: str, launcher: DictConfig, nodes: int, tasks_per_node: int) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (sbatch names) from the launcher config."""
    params: dict[str, Any] = {
        "job_name": name,
        "time": int(launcher.timeout_min),
        "nodes": nodes,
        "ntasks_per_node": tasks_per_node,
        "cpus_per_task": int(launcher.cpus_per_task),
        "array_parallelism": int(launcher.array_parallelism),
    }
    for key in ("partition", "account", "qos"):
        if launcher[key]:
            params[key] = str(launcher[key])
    if launcher.gpus_per_node:
        params["gpus_per_node"] = int(launcher.gpus_per_node)
    if launcher.mem_gb:
        params["mem"] = f"{int(launcher.mem_gb)}GB"
    extra = launcher.extra
    if extra:
        if not isinstance(extra, DictConfig):
            raise UserError(
                "launcher.extra must be a mapping of sbatch options, e.g. launcher.extra={constraint: a100}"
            )
        params["additional_parameters"] = {str(k): v for k, v in extra.items()}
    if nodes > 1:
        # A node failing under a multi-node job: SLURM ends its step rather than killing and requeueing the job,
        # so the run records which rank was lost and ends `failed`; re-running the sweep resumes it.
        params.setdefault("additional_parameters", {}).setdefault("no-kill", True)
    return params


# --- SLURM's view of jobs --------------------------------------------------------------------------------


def _run_quiet(argv: list[str]) -> Optional[str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def slurm_states(job_ids: Sequence[str]) -> dict[str, str]:
    """SLURM state (PENDING, RUNNING, COMPLETED, ...) of each job id (`123` or array task `123_4`) it knows.

    squeue first (cheap, and the only source on clusters without accounting), then sacct for the rest.
    """
    wanted = {str(j) for j in job_ids if j}
    if not wanted or shutil.which("squeue") is None:
        return {}
    states: dict[str, str] = {}
    out = _run_quiet(["squeue", "--states=all", "--array", "--noheader", "--format=%i|%T", "-u", getpass.getuser()])
    for line in (out or "").splitlines():
        jid, _, state = line.strip().partition("|")
        if jid in wanted:
            states[jid] = state.strip()
    missing = sorted(wanted - set(states))
    if missing and shutil.which("sacct"):
        out = _run_quiet(["sacct", "--noheader", "--parsable2", "-X", "--format=JobID,State", "-j", ",".join(missing)])
        for line in (out or "").splitlines():
            jid, _, state = line.strip().partition("|")
            if jid in wanted and state:
                states[jid] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return states


# --- submission and watching ------------------------------------------------------------------------------


def _sbatch_message(exc: Exception) -> str:
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l.lower() or "fatal" in l.lower()]
    return (errors or lines or [type(exc).__name__])[-1]


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))


def _active(state: RunState) -> bool:
    """Still to watch: queued or running in SLURM, unless only SLURM's clean-up of a finished run is left (a job
    whose node died stays COMPLETING until SLURM declares the node down)."""
    if state.slurm_state == "COMPLETING" and state.state in FINAL:
        return False
    return state.slurm_state in SLURM_ACTIVE


class SlurmLauncher:
    """Submits the runs that need running (job arrays grouped by task layout), then watches them to the end."""

    def __init__(
        self,
        plan: SweepPlan,
        sweep_dir: Path,
        cfgs: dict[str, DictConfig],
        launcher: DictConfig,
        retry_failed: bool = False,
        command: RunCommand = train_command,
        display: Optional[SweepDisplay] = None,
    ) -> None:
        self.plan, self.sweep_dir = plan, Path(sweep_dir).resolve()
        self.cfgs, self.launcher = cfgs, launcher
        self.retry_failed, self.command = retry_failed, command
        self.display = display or SweepDisplay(f"sweep {plan.name} (slurm)")
        self.notes: dict[str, str] = {}

    def _job_of(self, spec: RunSpec) -> Optional[str]:
        record = read_json(self.sweep_dir / spec.name / SLURM_RECORD)
        return str(record["job_id"]) if record and record.get("job_id") else None

    def submit(self) -> None:
        """Claim every run, submit those to start, record their jobs; locks are released once recorded."""
        import submitit

        from asyncpipe.sweep.slurm_job import SlurmRun

        known = {s.name: j for s in self.plan.runs if (j := self._job_of(s))}
        states = slurm_states(list(known.values()))
        claims: dict[str, Claim] = {}
        try:
            for spec in self.plan.runs:
                job = known.get(spec.name)
                active = job if job is not None and states.get(job) in SLURM_ACTIVE else None
                c = claim(self.sweep_dir / spec.name, self.retry_failed, active_job=active)
                if c.start:
                    claims[spec.name] = c
                elif c.note:
                    self.notes[spec.name] = c.note
            groups: dict[tuple[int, int], list[RunSpec]] = {}
            for spec in self.plan.runs:
                if spec.name in claims:
                    groups.setdefault(task_layout(self.cfgs[spec.name]), []).append(spec)
            for (nodes, per_node), specs in groups.items():
                executor = submitit.SlurmExecutor(folder=self.sweep_dir / SUBMITIT_DIR / "%j", python=job_python())
                executor.update_parameters(**executor_parameters(self.plan.name, self.launcher, nodes, per_node))
                calls = []
                for spec in specs:
                    run_dir = self.sweep_dir / spec.name
                    argv = self.command(run_overrides(self.plan, spec, run_dir, claims[spec.name].resume))
                    threads, gpus = int(self.launcher.cpus_per_task), int(self.launcher.gpus_per_node)
                    calls.append(SlurmRun(argv, str(run_dir), threads, gpus, env=task_env(self.launcher)))
                try:
                    with executor.batch():
                        jobs = [executor.submit(call) for call in calls]
                except Exception as exc:  # sbatch refused: bad partition, account, limits...
                    raise UserError(f"sbatch refused the jobs: {_sbatch_message(exc)}") from None
                for spec, job in zip(specs, jobs):
                    self._record(spec, job, nodes, per_node)
                    if claims[spec.name].note:
                        self.notes[spec.name] = claims[spec.name].note
        finally:
            for c in claims.values():
                if c.lock is not None:
                    c.lock.release()

    def _record(self, spec: RunSpec, job: Any, nodes: int, per_node: int) -> None:
        from submitit.core.utils import JobPaths

        run_dir = self.sweep_dir / spec.name
        tasks = [JobPaths(self.sweep_dir / SUBMITIT_DIR / "%j", job.job_id, t) for t in range(nodes * per_node)]
        atomic_write_json(
            run_dir / SLURM_RECORD,
            {
                "job_id": job.job_id,
                "submitted": datetime.now().isoformat(timespec="seconds"),
                "nodes": nodes,
                "tasks_per_node": per_node,
                "placement": placement(self.cfgs[spec.name], nodes, per_node),
                "folder": str(job.paths.folder),
                "stdout": [str(p.stdout) for p in tasks],
                "stderr": [str(p.stderr) for p in tasks],
            },
        )
        _link(run_dir / "slurm.out", tasks[0].stdout)
        _link(run_dir / "slurm.err", tasks[0].stderr)

    def states(self) -> list[RunState]:
        jobs = {s.name: j for s in self.plan.runs if (j := self._job_of(s))}
        slurm = slurm_states(list(jobs.values()))
        out = []
        for spec in self.plan.runs:
            state = run_state(self.sweep_dir / spec.name, spec.name, slurm)
            state.note = state.note or self.notes.get(spec.name, "")
            out.append(state)
        return out

    def watch(self) -> list[RunState]:
        """Poll SLURM and the run dirs until no job of this sweep is queued or running."""
        try:
            with self.display:
                while True:
                    states = self.states()
                    self.display.update(states)
                    if not any(_active(s) for s in states):
                        return states
                    time.sleep(POLL_S)
        except KeyboardInterrupt:
            print(f"stopped watching; the jobs keep running (asyncpipe sweep status {self.sweep_dir})", flush=True)
            raise

    def run(self, wait: bool = True) -> list[RunState]:
        self.submit()
        if wait:
            return self.watch()
        states = self.states()
        self.display.update(states)
        return states
