"""`launcher=slurm` against a real SLURM cluster, single-node jobs (tests/slurm/cluster.sh installs, starts, stops
it, with slurmdbd accounting where it can be installed; the session's cluster, `slurm_cluster` in conftest.py).

The tests skip only when SLURM cannot be installed here (not root, no apt); otherwise they run.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from asyncpipe.sweep import run_sweep, sweep_states
from asyncpipe.sweep.display import SweepDisplay

pytestmark = pytest.mark.slurm


def quiet() -> SweepDisplay:
    return SweepDisplay("test", stream=io.StringIO(), live=False)


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train_loss"] for r in rows if "train_loss" in r]


def scontrol_job(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_slurm_sweep_matches_local(slurm_cluster: Path, tmp_path: Path):
    # Two runs make one job array of two tasks, as four did (each run is a process start: the cost of this test).
    grid = ["optimizer=adamw,muon", "delay=1", "train.steps=10"]
    remote = run_sweep([*grid, "launcher=slurm"], out=tmp_path / "slurm", name="grid", display=quiet())
    local = run_sweep([*grid, "launcher.parallel=2"], out=tmp_path / "local", name="grid", display=quiet())
    assert [s.state for s in remote.states] == ["completed"] * 2
    assert [s.name for s in remote.states] == [s.name for s in local.states]
    array_ids = set()
    for spec in remote.plan.runs:
        run_dir = tmp_path / "slurm" / "grid" / spec.name
        assert losses(run_dir) == pytest.approx(losses(tmp_path / "local" / "grid" / spec.name), rel=1e-5)
        assert len(losses(run_dir)) == 10
        record = json.loads((run_dir / "slurm_job.json").read_text())
        array_ids.add(record["job_id"].split("_")[0])
        assert "Job completed successfully" in (run_dir / "slurm.out").read_text()  # the link reaches the log
        assert (run_dir / "slurm.out").resolve().parent.parent == (tmp_path / "slurm" / "grid" / ".submitit")
    assert len(array_ids) == 1  # one job array for the whole grid
    _, states = sweep_states(tmp_path / "slurm" / "grid")
    assert {s.slurm_state for s in states} == {"COMPLETED"} and all(s.job_id for s in states)

    # Re-running submits nothing.
    records = {p: p.read_text() for p in (tmp_path / "slurm" / "grid").glob("*/slurm_job.json")}
    again = run_sweep([*grid, "launcher=slurm"], out=tmp_path / "slurm", name="grid", display=quiet())
    assert [s.note for s in again.states] == ["already completed"] * 2
    assert {p: p.read_text() for p in records} == records


@pytest.mark.slow
def test_pipeline_run_is_one_job_of_two_tasks(slurm_cluster: Path, tmp_path: Path):
    grid = ["seed=choice(0)", "engine=pipeline", "pipeline.stages=2", "train.steps=6", "train.eval_every=3"]
    remote = run_sweep([*grid, "launcher=slurm"], out=tmp_path / "slurm", name="pipe", display=quiet())
    run_dir = tmp_path / "slurm" / "pipe" / "seed=0"
    record = json.loads((run_dir / "slurm_job.json").read_text())
    assert (record["nodes"], record["tasks_per_node"]) == (1, 2)
    assert "NumTasks=2" in scontrol_job(record["job_id"])
    # The tasks are the two ranks of one pipeline (not each task starting its own local pipeline, which would
    # log every step twice).
    assert remote.states[0].state == "completed", (run_dir / "slurm.out").read_text()[-2000:]
    assert len(losses(run_dir)) == 6
    local = run_sweep(grid, out=tmp_path / "local", name="pipe", display=quiet())
    assert local.states[0].state == "completed"
    assert losses(run_dir) == pytest.approx(losses(tmp_path / "local" / "pipe" / "seed=0"), rel=1e-5)


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in rows), default=-1)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_requeued_and_preempted_job_finishes(slurm_cluster: Path, tmp_path: Path):
    """`scontrol requeue` mid-run, then submitit's preemption path (USR2 -> checkpoint() -> requeue): the run
    resumes each time and completes. Each interruption needs only a few trained steps before it (proof that the run
    trains again) and enough after it that the signal lands mid-run: the steps after the last one are the test's
    cost, and on a loaded machine 100 of them outlasted the join below."""
    steps = 40  # ~0.1 s each on an idle 2-core machine: >= 30 left after the preemption signal
    grid = ["seed=choice(0)", f"train.steps={steps}", f"train.eval_every={steps}", "launcher=slurm"]
    result: list = []
    sweep = threading.Thread(
        target=lambda: result.append(run_sweep(grid, out=tmp_path, name="rq", display=quiet())), daemon=True
    )
    sweep.start()
    run_dir = tmp_path / "rq" / "seed=0"
    log = run_dir / "slurm.out"

    def starts() -> int:
        return log.read_text().count("Starting with JobEnvironment") if log.exists() else 0

    _wait_for(lambda: _last_step(run_dir) >= 2, 90, "the first steps")
    first = _last_step(run_dir)
    assert first < steps, "the run finished before it could be requeued; raise `steps`"
    job_id = json.loads((run_dir / "slurm_job.json").read_text())["job_id"]
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    # Trained again means past the step it resumed at: until the second start has resumed, metrics.jsonl still holds
    # the first start's steps, and a signal during the resume would stop it before any step (not the path tested).
    def resumed_at() -> int:
        found = re.findall(r"resumed from .* at step (\d+)", log.read_text()) if log.exists() else []
        return int(found[-1]) if found else -1

    _wait_for(lambda: starts() == 2 and resumed_at() >= 0 and _last_step(run_dir) >= resumed_at() + 2, 90,
              "the requeued job to train again")  # fmt: skip
    second = _last_step(run_dir)
    assert second < steps, "the run finished before it could be preempted; raise `steps`"
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)  # what SLURM sends before preemption
    sweep.join(timeout=120)
    assert not sweep.is_alive(), "the requeued job did not finish in time"
    assert result[0].states[0].state == "completed"
    assert "Restarts=2" in scontrol_job(job_id)
    text = log.read_text()
    assert text.count("Starting with JobEnvironment") == 3 and "Calling checkpoint method" in text
    assert text.count("resumed from") == 2  # from the checkpoint each signal wrote, not from step 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
