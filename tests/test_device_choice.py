"""Which GPU each rank uses, under every launcher, on a CPU machine: torch.cuda is stubbed (a node of N GPUs,
`set_device` refusing an ordinal it does not have, as CUDA does with "invalid device ordinal"), and each
launcher's environment is the one it really builds: `SlurmRun` run under SLURM's task variables (submitit's
`JobEnvironment` reads them) with a child that reports its environment, torchrun's variables, and the local
launcher's `rank_environ`. A rank's GPU is named by its CUDA_VISIBLE_DEVICES entry (the physical GPU), so a rank on
another job's GPU, or two ranks on one GPU, fail here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from asyncpipe.errors import UserError
from asyncpipe.runtime.device import cuda_index, pick_device, visible_gpus
from asyncpipe.spawn import rank_environ
from asyncpipe.sweep.slurm_job import SlurmRun

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR",
             "MASTER_PORT", "SLURM_LOCALID", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")  # fmt: skip


class FakeCuda:
    """torch.cuda on a machine whose process sees ``visible`` GPUs."""

    def __init__(self, visible: int) -> None:
        self.visible, self.current = visible, None

    def set_device(self, index: int) -> None:
        if not 0 <= int(index) < self.visible:
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.current = int(index)


def rank_gpu(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], gpus_on_node: int = 8) -> tuple[str, int]:
    """(physical GPU, cuda index) that `pick_device("cuda")` gives a process started with ``env``."""
    for key in RANK_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        if key in RANK_VARS or key.startswith("SLURM_"):
            monkeypatch.setenv(key, value)
    shown = visible_gpus(env) if "CUDA_VISIBLE_DEVICES" in env else [str(i) for i in range(gpus_on_node)]
    cuda = FakeCuda(len(shown))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda.visible)
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    device = pick_device("cuda")
    assert device.type == "cuda" and cuda.current == device.index  # made current
    assert os.environ["LOCAL_RANK"] == str(device.index)  # where DeepSpeed's PipelineModule puts the stage
    return shown[device.index], device.index


# --- SLURM through submitit ---------------------------------------------------------------------------------

REPORT_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def slurm_task_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int, per_node: int, nodes: int,
                   slurm_gpus: str, task_gpus: Optional[str] = None) -> dict[str, str]:  # fmt: skip
    """The environment `SlurmRun` gives its run's process in task ``rank`` of a job of ``nodes`` x ``per_node``
    tasks, when SLURM gave the job GPUs ``slurm_gpus`` on each node (and this task ``task_gpus`` under a per-task
    binding; else every task sees ``slurm_gpus``, SLURM's default)."""
    slurm = {
        "SLURM_JOB_ID": "4242", "SLURM_NTASKS": str(nodes * per_node), "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NODEID": str(rank // per_node), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
        "SLURM_JOB_NODELIST": "gpu[1-2]" if nodes == 2 else "gpu1", "SLURMD_NODENAME": f"gpu{1 + rank // per_node}",
        "SLURM_STEP_GPUS": slurm_gpus, "SLURM_JOB_GPUS": slurm_gpus, "SUBMITIT_EXECUTOR": "slurm",
        "SUBMITIT_FOLDER": str(tmp_path / "submitit"), "CUDA_VISIBLE_DEVICES": task_gpus or slurm_gpus,
    }  # fmt: skip
    for key in RANK_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    out = tmp_path / f"env-{rank}.json"
    SlurmRun([sys.executable, "-c", REPORT_ENV, str(out)], str(run_dir), gpus=len(slurm_gpus.split(",")))()
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "per_node, nodes, slurm_gpus",
    [(1, 2, "3"), (2, 1, "4,5"), (2, 2, "4,5"), (4, 1, "4,5,6,7"), (4, 2, "0,1,2,3")],
)
def test_slurm_tasks_use_their_own_gpu_of_the_jobs(monkeypatch, tmp_path, per_node, nodes, slurm_gpus):
    """submitit with 1, 2 and 4 tasks per node: local rank L uses the L-th GPU SLURM gave the job on its node
    (docs/cluster.md's example is stages=4 on nodes=2 with 2 GPUs per node)."""
    granted = slurm_gpus.split(",")
    for rank in range(nodes * per_node):
        env = slurm_task_env(monkeypatch, tmp_path, rank, per_node, nodes, slurm_gpus)
        assert env["CUDA_VISIBLE_DEVICES"] == slurm_gpus  # SLURM's binding is kept, never the bare local rank
        gpu, index = rank_gpu(monkeypatch, env)
        assert (gpu, index) == (granted[rank % per_node], rank % per_node), f"rank {rank}"


def test_slurm_per_task_binding_gives_each_rank_its_bound_gpu(monkeypatch, tmp_path):
    """`--gpus-per-task=1` / `--gpu-bind`: each task sees only its own GPU, and uses it as cuda:0."""
    for rank, own in enumerate(["4", "5"]):
        env = slurm_task_env(monkeypatch, tmp_path, rank, 2, 1, "4,5", task_gpus=own)
        assert rank_gpu(monkeypatch, env) == (own, 0)


def test_slurm_tasks_beyond_the_nodes_gpus_are_one_clear_error(monkeypatch, tmp_path):
    """4 tasks on a node where the job holds 2 GPUs: the third rank is told, rather than sharing a GPU."""
    env = slurm_task_env(monkeypatch, tmp_path, 2, 4, 1, "4,5")
    with pytest.raises(UserError, match=r"4 ranks run on this node but rank 2's process sees 2 GPU\(s\) "
                                        r"\(CUDA_VISIBLE_DEVICES=4,5\)"):  # fmt: skip
        rank_gpu(monkeypatch, env)


# --- torchrun and the local launcher ------------------------------------------------------------------------


def torchrun_env(rank: int, nproc: int, cuda_visible: Optional[str] = None) -> dict[str, str]:
    env = {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc)}
    return env if cuda_visible is None else {**env, "CUDA_VISIBLE_DEVICES": cuda_visible}


@pytest.mark.parametrize("nproc, cuda_visible, expected", [
    (4, None, ["0", "1", "2", "3"]),  # an 8-GPU node, nothing restricted
    (2, "2,3", ["2", "3"]),  # the user's CUDA_VISIBLE_DEVICES is respected
    (1, "6", ["6"]),
])  # fmt: skip
def test_torchrun_rank_l_uses_visible_gpu_l(monkeypatch, nproc, cuda_visible, expected):
    assert [rank_gpu(monkeypatch, torchrun_env(r, nproc, cuda_visible))[0] for r in range(nproc)] == expected


def test_torchrun_world_larger_than_visible_gpus_is_one_clear_error(monkeypatch):
    with pytest.raises(UserError, match="each rank needs its own GPU"):
        rank_gpu(monkeypatch, torchrun_env(2, 4, "0,1"))


def test_local_launcher_ranks_spread_over_the_visible_gpus(monkeypatch):
    """`asyncpipe.spawn.launch` gives rank r torchrun's variables: 4 ranks on GPUs 4-7 of CUDA_VISIBLE_DEVICES."""
    gpus = [rank_gpu(monkeypatch, {**rank_environ(r, 4, 29500), "CUDA_VISIBLE_DEVICES": "4,5,6,7"})[0]
            for r in range(4)]  # fmt: skip
    assert gpus == ["4", "5", "6", "7"]
    with pytest.raises(UserError, match="3 ranks run on this node but rank 2's process sees 2 GPU"):
        rank_gpu(monkeypatch, {**rank_environ(2, 3, 29500), "CUDA_VISIBLE_DEVICES": "0,1"})


def test_one_process_uses_cuda_0_and_cpu_is_left_alone(monkeypatch):
    assert rank_gpu(monkeypatch, {}, gpus_on_node=2) == ("0", 0)
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("local, world, visible, env, expected", [
    (0, 1, 1, {}, 0), (3, 4, 8, {}, 3), (1, 2, 1, {"SLURM_LOCALID": "1", "SLURM_STEP_GPUS": "0,1"}, 0),
    (1, 2, 1, {}, None), (1, 2, 1, {"SLURM_LOCALID": "1", "SLURM_STEP_GPUS": "0"}, None), (0, 1, 0, {}, None),
])  # fmt: skip
def test_cuda_index_table(local, world, visible, env, expected):
    if expected is None:
        with pytest.raises(UserError):
            cuda_index(local, world, visible, env)
    else:
        assert cuda_index(local, world, visible, env) == expected


def test_visible_gpus_reads_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 5"}) == ["4", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}) == ["GPU-1a2b", "GPU-3c4d"]


# --- a local sweep with launcher.parallel > 1 -----------------------------------------------------------------

RECORD_GPUS = """
import json, os, sys, time
from pathlib import Path
run_dir = Path(dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)["run.dir"].strip("'"))
began = time.time()
time.sleep(0.4)
(run_dir / "gpus.json").write_text(json.dumps([os.environ.get("CUDA_VISIBLE_DEVICES"), began, time.time()]))
(run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 1}))
"""


def test_parallel_local_sweep_gives_each_running_run_its_own_gpus(monkeypatch, tmp_path):
    """4 pipeline runs of 2 ranks, parallel=3, on GPUs 4-7: each run sees 2 GPUs no running run holds (so at
    most 2 run at once), instead of every run's rank 0 on cuda:0; a CPU sweep is left alone."""
    from asyncpipe.sweep import run_sweep
    from asyncpipe.sweep.display import SweepDisplay

    script = tmp_path / "fake_train.py"
    script.write_text(RECORD_GPUS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")

    def sweep(name: str, *extra: str) -> list[tuple]:
        run_sweep(["seed=0,3,4,5", "engine=pipeline", "pipeline.stages=2", "launcher.parallel=3", *extra],
                  out=tmp_path, name=name, command=lambda o: [sys.executable, str(script), *o],
                  display=SweepDisplay("t", stream=open(os.devnull, "w"), live=False))  # fmt: skip
        return [tuple(json.loads(p.read_text())) for p in sorted((tmp_path / name).glob("*/gpus.json"))]

    runs = sweep("gpu")
    assert len(runs) == 4 and {r[0] for r in runs} <= {"4,5", "6,7"}
    assert any(a[1] < b[2] and b[1] < a[2] for a, b in zip(runs, runs[1:]))  # some did run at once
    for i, (gpus, start, end) in enumerate(runs):
        for other, o_start, o_end in runs[i + 1:]:
            if start < o_end and o_start < end:  # ran at the same time: never on the same GPU
                assert set(gpus.split(",")).isdisjoint(other.split(","))
    assert {r[0] for r in sweep("cpu", "device=cpu")} == {"4,5,6,7"}  # no split: the runs see what the sweep sees


# --- train.deterministic --------------------------------------------------------------------------------------


def test_train_deterministic_sets_torchs_flags_and_changes_no_cpu_result(monkeypatch):
    from asyncpipe.config import compose
    from asyncpipe.trainer import Trainer

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    base = ["model=tiny", "device=cpu", "precision=fp32", "train.micro_batch_size=2", "train.seq_len=16",
            "train.micro_batches=2", "train.steps=3", "tracker.wandb.mode=disabled"]  # fmt: skip
    losses = {}
    try:
        for flag in ("true", "false"):
            engine = Trainer(compose([*base, f"train.deterministic={flag}"])).engine
            assert torch.are_deterministic_algorithms_enabled() == (flag == "true")
            assert torch.backends.cudnn.deterministic == (flag == "true")
            if flag == "true":
                assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
            losses[flag] = [engine.train_step().train_loss for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
    assert losses["true"] == losses["false"]
