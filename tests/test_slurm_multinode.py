"""`launcher=slurm launcher.nodes=2` on a real 2-node SLURM cluster: each slurmd in a network namespace of its
own, with its own address (tests/slurm/cluster.sh up DIR 2), so a pipeline's stages talk across hosts.

The session's cluster (`slurm_cluster` in conftest.py, shared with test_slurm.py) serves the module. The tests
skip only where SLURM cannot be installed or network namespaces cannot be made (not root, no apt, no `ip netns`);
otherwise they run.
"""

from __future__ import annotations

import functools
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

import asyncpipe.sweep.slurm_job as slurm_job
from asyncpipe.sweep import run_sweep, sweep_states
from asyncpipe.runtime.checkpoint import MARKER
from helpers import asyncpipe
from slurm_cluster import CLUSTER, client_env, node_count
from test_slurm import losses, quiet

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PG_TIMEOUT_S = 20  # the process-group timeout of the runs here: no rank may wait longer for a dead peer
# How long rank 0 of a failed job waits for the other ranks to report (`SlurmRun.peers_wait_s`, 10 s by default):
# the killed node's rank never does, so the killed-node test waits it out in full; 3 s is plenty for a live rank.
PEERS_WAIT_S = 3.0


@pytest.fixture(scope="module")
def cluster2(slurm_cluster: Path) -> Iterator[Path]:
    """The session's cluster when it has 2 nodes (else a skip), with this module's process-group timeout."""
    if node_count(slurm_cluster) < 2:
        pytest.skip("the session's SLURM cluster has one node (network namespaces cannot be made here)")
    with client_env(ASYNCPIPE_PG_TIMEOUT=str(PG_TIMEOUT_S)):  # reaches the jobs: sbatch exports the environment
        yield slurm_cluster


def cluster(cmd: str, root: Path, node: str) -> None:
    subprocess.run(["bash", str(CLUSTER), cmd, str(root), node], check=True, capture_output=True, timeout=120)


def processes_of(sweep_dir: Path) -> list[str]:
    """Command lines of live processes that belong to a sweep's jobs (they name its directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(sweep_dir) in text and state not in ("Z", "X"):
            found.append(text)
    return found


def nodes_of_ranks(run_dir: Path) -> dict[int, str]:
    """Where each rank actually ran, from the task records the job wrote (SLURM's node names)."""
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "tasks").glob("rank-*.json"))]
    return {r["rank"]: r["node"] for r in records}


def pipeline_grid(stages: int, replicas: int, steps: int) -> list[str]:
    return [
        "seed=choice(0)", "engine=pipeline", "delay=1", "model.tie_embeddings=false", f"pipeline.stages={stages}",
        f"pipeline.data_parallel={replicas}", f"train.steps={steps}", f"train.eval_every={steps}",
    ]  # fmt: skip


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return max((r["step"] for r in rows), default=-1)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _sweep_in_thread(grid: list[str], out: Path, name: str) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(run_sweep(grid, out=out, name=name, display=quiet())))
    thread.daemon = True
    thread.start()
    return thread, result


# --- one uninterrupted reference run (local) for the 2-node run, its requeue and its node failure -----------

# Long enough that a requeue (at step 3) or a node failure (after step 6) lands mid-run with >= 20 steps to spare on
# an idle 2-core machine; every step past that is paid four times (the reference and three cluster runs).
REF_STEPS = 30
REF_GRID = [*pipeline_grid(2, 1, REF_STEPS), "checkpoint.every=5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The uninterrupted run's losses (local launcher: the same two processes, on this host)."""
    out = tmp_path_factory.mktemp("reference")
    result = run_sweep(REF_GRID, out=out, name="ref", display=quiet())
    assert result.states[0].state == "completed"
    return losses(out / "ref" / "seed=0")


def test_two_stage_2bw_pipeline_one_stage_per_node(cluster2: Path, tmp_path: Path, reference: list[float]):
    remote = run_sweep([*REF_GRID, "launcher=slurm", "launcher.nodes=2"], out=tmp_path, name="p2", display=quiet())
    run_dir = tmp_path / "p2" / "seed=0"
    assert remote.states[0].state == "completed", (run_dir / "slurm.out").read_text()[-3000:]
    record = json.loads((run_dir / "slurm_job.json").read_text())
    assert (record["nodes"], record["tasks_per_node"]) == (2, 1)
    # Stage s on node s: rank 0 (stage 0) on the job's first node, rank 1 (stage 1) on the second.
    assert [(p["rank"], p["node"], p["stage"]) for p in record["placement"]] == [(0, 0, 0), (1, 1, 1)]
    assert nodes_of_ranks(run_dir) == {0: "node1", 1: "node2"}
    if "ACCOUNTING=slurmdbd" in (cluster2 / "cluster.env").read_text():  # the real sacct, from slurmdbd's database
        argv = ["sacct", "-X", "-n", "-P", "-o", "State,NNodes,NodeList", "-j", record["job_id"]]
        sacct = lambda: subprocess.run(argv, capture_output=True, text=True).stdout.strip()  # noqa: E731
        _wait_for(lambda: sacct() == "COMPLETED|2|node[1-2]", 30, f"sacct to report the job (it says {sacct()!r})")
    assert len(losses(run_dir)) == REF_STEPS
    assert losses(run_dir) == pytest.approx(reference, rel=1e-5, abs=1e-5)


def test_two_by_two_pipeline_and_data_parallel_simulate_across_nodes(cluster2: Path, tmp_path: Path):
    # Named interface: every node's namespace has an eth0 holding its address, as a cluster's hosts have ib0.
    slurm = ["launcher=slurm", "launcher.nodes=2", "launcher.socket_ifname=eth0"]
    grid = pipeline_grid(2, 2, 4)
    remote = run_sweep([*grid, *slurm], out=tmp_path / "slurm", name="p2d2", display=quiet())
    run_dir = tmp_path / "slurm" / "p2d2" / "seed=0"
    assert remote.states[0].state == "completed", (run_dir / "slurm.out").read_text()[-3000:]
    record = json.loads((run_dir / "slurm_job.json").read_text())
    assert (record["nodes"], record["tasks_per_node"]) == (2, 2)
    # DeepSpeed's order (rank = stage * D + replica) with block placement: node 0 runs stage 0 of both replicas.
    expected = [(0, 0, 0, 0), (1, 0, 0, 1), (2, 1, 1, 0), (3, 1, 1, 1)]
    assert [(p["rank"], p["node"], p["stage"], p["replica"]) for p in record["placement"]] == expected
    assert nodes_of_ranks(run_dir) == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    local = run_sweep(grid, out=tmp_path / "local", name="p2d2", display=quiet())
    assert local.states[0].state == "completed"
    assert losses(run_dir) == pytest.approx(losses(tmp_path / "local" / "p2d2" / "seed=0"), rel=1e-5, abs=1e-5)

    # engine=simulate with 2 data-parallel replicas, one per node.
    sim = ["seed=choice(0)", "pipeline.data_parallel=2", "train.steps=4", "train.eval_every=4"]
    remote = run_sweep([*sim, *slurm], out=tmp_path / "slurm", name="dp", display=quiet())
    run_dir = tmp_path / "slurm" / "dp" / "seed=0"
    assert remote.states[0].state == "completed", (run_dir / "slurm.out").read_text()[-3000:]
    assert nodes_of_ranks(run_dir) == {0: "node1", 1: "node2"}
    local = asyncpipe("train", *sim[1:], "seed=0", f"run.dir={tmp_path / 'dp-local'}")
    assert local.returncode == 0, local.stderr[-3000:]
    assert losses(run_dir) == pytest.approx(losses(tmp_path / "dp-local"), rel=1e-5, abs=1e-5)


def test_requeue_of_multinode_job_resumes_exactly(cluster2: Path, tmp_path: Path, reference: list[float]):
    grid = [*REF_GRID, "launcher=slurm", "launcher.nodes=2"]
    sweep, result = _sweep_in_thread(grid, tmp_path, "rq")
    run_dir = tmp_path / "rq" / "seed=0"
    _wait_for(lambda: _last_step(run_dir) >= 3, 180, "the first steps")
    first = _last_step(run_dir)
    assert first < REF_STEPS, "the run finished before it could be requeued; raise REF_STEPS"
    job_id = json.loads((run_dir / "slurm_job.json").read_text())["job_id"]
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    sweep.join(timeout=300)
    assert not sweep.is_alive(), "the requeued job did not finish in time"
    assert result[0].states[0].state == "completed", (run_dir / "slurm.out").read_text()[-3000:]
    text = (run_dir / "slurm.out").read_text()
    assert text.count("Starting with JobEnvironment") == 2 and "resumed from" in text
    assert "Restarts=1" in subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert losses(run_dir)[-1] == reference[-1]  # exactly
    assert len(losses(run_dir)) == REF_STEPS


def test_killed_node_fails_the_run_cleanly_and_a_rerun_resumes(
    cluster2: Path, tmp_path: Path, reference: list[float], monkeypatch: pytest.MonkeyPatch
):
    # The job's tasks are SlurmRun objects made here and pickled to the nodes: they carry this test's peers wait.
    monkeypatch.setattr(slurm_job, "SlurmRun", functools.partial(slurm_job.SlurmRun, peers_wait_s=PEERS_WAIT_S))
    grid = [*REF_GRID, "launcher=slurm", "launcher.nodes=2"]
    sweep, result = _sweep_in_thread(grid, tmp_path, "kill")
    run_dir = tmp_path / "kill" / "seed=0"
    _wait_for(lambda: (run_dir / "checkpoints" / "step_00000005" / MARKER).exists() and _last_step(run_dir) >= 6,
              240, "a complete checkpoint")  # fmt: skip
    assert _last_step(run_dir) < REF_STEPS, "the run finished before its node could be killed; raise REF_STEPS"
    killed = time.monotonic()
    cluster("kill-node", cluster2, "node2")  # slurmd, its step daemons and rank 1: a crashed host
    # Rank 0 fails as soon as it talks to its lost peer (at the latest after the process-group timeout), then
    # waits PEERS_WAIT_S for the other ranks to report before it records the failure and ends the job.
    _wait_for(lambda: (run_dir / "launch.json").exists(), PG_TIMEOUT_S + PEERS_WAIT_S + 20, "the failure record")
    recorded = time.monotonic() - killed
    sweep.join(timeout=60)
    assert not sweep.is_alive(), "the sweep still waits for the failed job"
    _wait_for(lambda: not processes_of(tmp_path / "kill"), 30, "the job's processes on node1 to end")
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["status"] == "failed" and launch["resumable"]
    assert launch["lost_ranks"] == [{"rank": 1, "node": "node2"}]
    assert "rank 1 on node2 lost" in launch["note"]
    assert result[0].states[0].state == "failed" and "rank 1 on node2" in result[0].states[0].note
    _, states = sweep_states(tmp_path / "kill")
    assert states[0].state == "failed"
    print(f"failure recorded {recorded:.1f} s after the node was killed")

    # The node comes back; re-running the sweep resumes the run from its last complete checkpoint.
    cluster("start-node", cluster2, "node2")
    complete = [d.name for d in (run_dir / "checkpoints").iterdir() if (d / MARKER).exists()
                and (d / "rank0.pt").exists() and (d / "rank1.pt").exists()]  # fmt: skip
    again = run_sweep(grid, out=tmp_path, name="kill", display=quiet())
    assert again.states[0].state == "completed", (run_dir / "slurm.out").read_text()[-3000:]
    job = json.loads((run_dir / "slurm_job.json").read_text())
    log = Path(job["stdout"][0]).read_text()
    last = int(max(complete).split("_")[1])
    assert f"at step {last}" in log and "resumed from" in log
    assert losses(run_dir)[-1] == reference[-1]
    assert len(losses(run_dir)) == REF_STEPS
