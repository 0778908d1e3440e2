"""Multi-node SLURM layout and failure records without a cluster: where each rank goes, what the tasks are
told, and how a run that lost a rank is recorded and resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncpipe.config import compose
from asyncpipe.errors import UserError
from asyncpipe.sweep.slurm import executor_parameters, placement, task_env, task_layout
from asyncpipe.sweep.slurm_job import failed_ranks, failure_note, task_record
from asyncpipe.sweep.state import claim, file_state, run_state, write_launch_record


def cfg_of(*overrides: str):
    return compose(["launcher=slurm", *overrides])


@pytest.mark.parametrize(
    "stages, replicas, nodes", [(2, 1, 2), (2, 2, 2), (4, 1, 2), (2, 4, 4), (4, 2, 2), (3, 2, 3)]
)
def test_pipeline_ranks_follow_deepspeed_topology_one_stage_group_per_node(stages, replicas, nodes):
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    cfg = cfg_of("engine=pipeline", f"pipeline.stages={stages}", f"pipeline.data_parallel={replicas}",
                 f"launcher.nodes={nodes}")  # fmt: skip
    n, per_node = task_layout(cfg)
    assert n * per_node == stages * replicas and n == nodes
    topo = PipeDataParallelTopology(num_pp=stages, num_dp=replicas)
    where = placement(cfg, n, per_node)
    for p in where:  # the stage/replica the launcher reports is the one DeepSpeed gives that rank
        coord = topo.get_coord(p["rank"])
        assert (p["stage"], p["replica"]) == (coord.pipe, coord.data)
    # The stages of one replica run on non-decreasing nodes; with no more nodes than stages, each stage (all its
    # replicas) on one node.
    for r in range(replicas):
        nodes_of_replica = [p["node"] for p in where if p["replica"] == r]
        assert nodes_of_replica == sorted(nodes_of_replica)
    for s in range(stages):
        assert len({p["node"] for p in where if p["stage"] == s}) == 1 or nodes > stages
    if nodes == stages:  # one stage per node
        assert all(p["node"] == p["stage"] for p in where)


def test_simulate_replicas_across_nodes_and_uneven_layouts_refused():
    cfg = cfg_of("pipeline.data_parallel=4", "launcher.nodes=2")
    assert task_layout(cfg) == (2, 2)
    assert [p["node"] for p in placement(cfg, 2, 2)] == [0, 0, 1, 1]
    assert task_layout(cfg_of("launcher.nodes=1")) == (1, 1)  # one task; it starts its replicas itself
    with pytest.raises(UserError, match="spread evenly"):
        task_layout(cfg_of("pipeline.data_parallel=3", "launcher.nodes=2"))
    with pytest.raises(UserError, match="spread evenly"):
        task_layout(cfg_of("engine=pipeline", "pipeline.stages=3", "launcher.nodes=2"))


def test_multinode_jobs_survive_a_node_and_get_the_interface():
    launcher = cfg_of("launcher.nodes=2", "launcher.socket_ifname=ib0").launcher
    assert executor_parameters("x", launcher, 2, 1)["additional_parameters"] == {"no-kill": True}
    assert "additional_parameters" not in executor_parameters("x", launcher, 1, 1)
    assert task_env(launcher) == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert task_env(cfg_of().launcher) == {}


def _task(run_dir: Path, rank: int, node: str, attempt: str, code) -> None:
    path = task_record(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "node": node, "attempt": attempt, "exit_code": code}))


def test_failed_and_lost_ranks_are_named(tmp_path: Path):
    _task(tmp_path, 0, "node1", "7.0", 1)
    _task(tmp_path, 1, "node2", "7.0", None)  # started, never reported an exit
    _task(tmp_path, 2, "node2", "6.0", 0)  # a record of an earlier attempt only
    _task(tmp_path, 3, "node1", "7.0", 0)
    lost, failed = failed_ranks(tmp_path, "7.0", 4)
    assert lost == [{"rank": 1, "node": "node2"}, {"rank": 2, "node": None}]
    assert failed == [{"rank": 0, "node": "node1", "exit_code": 1}]
    assert failure_note(lost, failed) == (
        "rank 1 on node2 lost (no exit status); rank 2 on an unknown node lost (no exit status); "
        "rank 0 on node1 exited with code 1"
    )


@pytest.mark.parametrize("resumable", [True, False])
def test_a_run_that_lost_a_rank_resumes_on_rerun(tmp_path: Path, resumable: bool):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg_of()))
    (run_dir / "summary.json").write_text(json.dumps({"status": "failed"}))
    details = {"note": "rank 1 on node2 lost (no exit status)"}
    write_launch_record(run_dir, 1, "failed", **details, **({"resumable": True} if resumable else {}))
    assert file_state(run_dir) == "failed"
    assert "rank 1 on node2 lost" in run_state(run_dir, "run").note
    c = claim(run_dir, retry_failed=False)
    try:
        assert (c.start, c.resume) == ((True, True) if resumable else (False, False))
        assert (run_dir / "launch.json").exists() != resumable  # set aside: the resumed attempt is a new launch
    finally:
        if c.lock is not None:
            c.lock.release()
