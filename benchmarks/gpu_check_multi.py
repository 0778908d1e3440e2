"""The parts of the GPU check (`benchmarks/gpu_check.py`) that need two GPUs (in a dry run: two CPU processes):

- pipeline parity, in one launch of 2 ranks: 2BW (fp32 AdamW, eager and compiled), 1F1B and DualPipeV (fp32 AdamW),
  2BW in bf16 with Muon + EF, 2BW on `moe_tiny` with Muon, and the simulator with `pipeline.data_parallel=2` (NCCL all-reduce), each against the one-process
  simulator of the same config (the data-parallel run against one process of 2m micro-batches);
- kill and resume: `asyncpipe train` of the 2BW pipeline with `train.deterministic=true` and a checkpoint every 2
  steps, its process group SIGKILLed mid-run, then `resume=true`: every train loss equal to the uninterrupted run's;
- a SLURM task environment on one node: two `SlurmRun` tasks (the code every SLURM task runs) under SLURM's variables
  (SLURM_PROCID, SLURM_LOCALID, SLURM's CUDA_VISIBLE_DEVICES listing both GPUs), which must pick distinct GPUs and
  reproduce the pipeline's losses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

PIPE_RTOL = 1e-3  # pipeline vs simulator, fp32 (NCCL vs one process: summation order only)
BF16_RTOL = 2e-2  # the same in bf16 with Muon (bf16 rounding differs between the two engines' kernels)
Log = Callable[[str], None]


def _history(result: dict) -> list[float]:
    return [h["train_loss"] for h in result["history"] if "train_loss" in h]


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")


def parity(cfg: Callable[..., Any], dev: str, steps: int, modes: tuple, backend: str, log: Log) -> dict:
    """The 2-rank launch (every job world 2) against in-process simulators on the first device."""
    from omegaconf import OmegaConf

    from asyncpipe.spawn import Job, launch
    from asyncpipe.trainer import Trainer

    tiny = ["model=tiny", f"device={dev}", f"train.steps={steps}", "train.micro_batches=4"]
    pipe = [*tiny, "engine=pipeline", "pipeline.stages=2"]
    cases = {f"2bw fp32 adamw {m}": [*pipe, "precision=fp32", "optimizer=adamw", "delay=1",
                                      f"train.compile={m == 'compiled'}"] for m in modes}  # fmt: skip
    # The kill-and-resume part's uninterrupted run (its own config: deterministic kernels).
    cases["2bw fp32 adamw deterministic"] = [*pipe, "precision=fp32", "optimizer=adamw", "delay=1",
                                            "train.compile=false", "train.deterministic=true"]  # fmt: skip
    cases["1f1b fp32 adamw"] = [*pipe, "precision=fp32", "optimizer=adamw", "delay=0", "train.compile=false"]
    cases["2bw bf16 muon+ef"] = [*pipe, "precision=bf16", "optimizer=muon_ef", "delay=1", "train.compile=false"]
    cases["dualpipev fp32 adamw"] = [*pipe, "precision=fp32", "optimizer=adamw", "delay=0", "train.compile=false",
                                     "pipeline.schedule=dualpipev"]  # fmt: skip
    cases["2bw fp32 moe_tiny muon"] = [*pipe, "model=moe_tiny", "precision=fp32", "optimizer=muon", "delay=1",
                                       "train.compile=false"]  # fmt: skip
    cases["simulate data_parallel=2 fp32"] = [*tiny, "engine=simulate", "pipeline.data_parallel=2", "precision=fp32",
                                             "optimizer=adamw", "delay=1", "train.compile=false"]  # fmt: skip
    cfgs = {name: cfg(over, backend) for name, over in cases.items()}
    started = time.perf_counter()
    results = dict(zip(cfgs, launch([Job(c, None, show_progress=False) for c in cfgs.values()], timeout_s=480)))
    out: dict = {"wall_s": time.perf_counter() - started}
    where = "CPU processes" if dev == "cpu" else "GPUs"
    for name, c in cfgs.items():
        one = {"engine": "simulate", "train": {"compile": "false"}, "pipeline": {"data_parallel": 1}}
        if c.engine == "simulate":  # one process of D x m micro-batches: the same global batch
            one["train"]["micro_batches"] = 2 * c.train.micro_batches
        engine = Trainer(OmegaConf.merge(c, one)).engine
        sim = [engine.train_step().train_loss for _ in range(steps)]
        got, rtol = _history(results[name]), BF16_RTOL if "bf16" in name else PIPE_RTOL
        worst = _worst(got, sim)
        ok = results[name].get("status") == "completed" and len(got) == steps and worst <= rtol
        log(f"{name}, 2 {where}, {steps} steps: worst relative loss difference to the one-process simulator "
            f"{worst:.2e} (tolerance {rtol:g}) {'ok' if ok else 'FAIL'}")  # fmt: skip
        if not ok:
            raise SystemExit(f"FAIL: {name}: {got} vs simulator {sim} (status {results[name].get('status')})")
        out[name] = {"worst_rel": worst, "rtol": rtol}
    out["_reference"] = _history(results[next(iter(cfgs))])  # 2BW fp32 eager: what the SLURM launch must give
    out["_deterministic"] = _history(results["2bw fp32 adamw deterministic"])
    return out


def _train(args: list[str], log_path: Path) -> Any:
    """`asyncpipe train ARGS` in a session of its own (killpg reaches it; its ranks die with it, by the parent-death
    signal), started as the package starts its runs (`asyncpipe.forkserver`: a fork with the imports done on a CPU
    host, a fresh interpreter on a GPU host)."""
    from asyncpipe import forkserver

    with open(log_path, "ab") as out:
        return forkserver.start([sys.executable, "-m", "asyncpipe", "train", *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _train_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return [r["train_loss"] for r in map(json.loads, lines) if "train_loss" in r]


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-1500:] if path.exists() else ""


def kill_and_resume(dev: str, steps: int, reference: list[float], log: Log) -> dict:
    """SIGKILL a deterministic 2BW pipeline run mid-way, resume it, compare with the uninterrupted run (the parity
    launch's "2bw fp32 adamw deterministic" job: the same config)."""
    common = ["model=tiny", "engine=pipeline", "pipeline.stages=2", f"device={dev}", "precision=fp32", "delay=1",
              "optimizer=adamw", f"train.steps={steps}", "train.micro_batches=4", "train.eval_every=100000",
              "checkpoint.every=2", "train.deterministic=true", "train.compile=false", "tracker.wandb.mode=disabled"]
    with tempfile.TemporaryDirectory(prefix="gpu-check-resume-") as tmp:
        run, log_path = Path(tmp) / "killed", Path(tmp) / "train.log"
        proc = _train([*common, f"run.dir={run}"], log_path)
        deadline = time.monotonic() + 300
        while len(_train_losses(run)) < steps // 2 + 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is not None:
            raise SystemExit(f"FAIL: kill-and-resume: the run ended before it was killed: {_tail(log_path)}")
        killed_at = len(_train_losses(run))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(1.0)  # the ranks die with their launcher (parent-death signal)
        again = _train([*common, f"run.dir={run}", "resume=true"], log_path)
        if again.wait(timeout=300) != 0:
            raise SystemExit(f"FAIL: kill-and-resume: the resumed run exited {again.returncode}: {_tail(log_path)}")
        a, b = _train_losses(run), reference
    same = a == b and len(a) == steps
    log(f"kill and resume, 2BW pipeline on 2 {'CPU processes' if dev == 'cpu' else 'GPUs'}, train.deterministic=true: "
        f"SIGKILL after {killed_at} logged steps, resumed: {'bit for bit the uninterrupted losses, ok' if same else 'FAIL'}")
    if not same:
        raise SystemExit(f"FAIL: kill-and-resume: resumed {a} vs uninterrupted {b}")
    return {"killed_after_steps": killed_at, "bit_identical": True}


TASK = "import sys, json; from asyncpipe.sweep.slurm_job import SlurmRun; SlurmRun(json.loads(sys.argv[1]), sys.argv[2], gpus=2)()"


def slurm_env(dev: str, steps: int, visible: list[str], reference: list[float], log: Log) -> dict:
    """Two SLURM tasks of one node, emulated: `SlurmRun` under SLURM's task variables runs the 2BW pipeline."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gpus = ",".join(visible[:2]) if dev == "cuda" else None
    with tempfile.TemporaryDirectory(prefix="gpu-check-slurm-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        argv = [sys.executable, "-m", "asyncpipe", "train", "model=tiny", "engine=pipeline", "pipeline.stages=2",
                f"device={dev}", "precision=fp32", "optimizer=adamw", "delay=1", f"train.steps={steps}",
                "train.micro_batches=4", "train.compile=false", "tracker.wandb.mode=disabled", f"run.dir={run_dir}"]
        base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        procs = []
        for rank in range(2):
            env = dict(base, SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0",
                       SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_JOB_NODELIST="localhost",
                       SUBMITIT_EXECUTOR="slurm", SUBMITIT_FOLDER=str(Path(tmp) / "submitit"), MASTER_PORT=str(port))
            if gpus is not None:
                env.update(CUDA_VISIBLE_DEVICES=gpus, SLURM_STEP_GPUS=gpus, SLURM_JOB_GPUS=gpus)
            log_path = Path(tmp) / f"task{rank}.log"
            with open(log_path, "wb") as out:
                procs.append((subprocess.Popen([sys.executable, "-c", TASK, json.dumps(argv), str(run_dir)], env=env,
                                               stdout=out, stderr=subprocess.STDOUT), log_path))  # fmt: skip
        codes = [p.wait(timeout=300) for p, _ in procs]
        got = _train_losses(run_dir)
        logs = "\n".join(_tail(path) for _, path in procs)
    worst = _worst(got, reference)
    ok = codes == [0, 0] and worst <= PIPE_RTOL
    where = f"GPUs {gpus} (SLURM's CUDA_VISIBLE_DEVICES)" if gpus else "CPU"
    log(f"SLURM task environment, 1 node x 2 tasks on {where}: exit codes {codes}, worst relative loss difference "
        f"to the 2BW pipeline {worst:.2e} {'ok' if ok else 'FAIL'}")  # fmt: skip
    if not ok:
        raise SystemExit(f"FAIL: SLURM task environment: exit codes {codes}, losses {got} vs {reference}\n{logs}")
    return {"exit_codes": codes, "worst_rel": worst}
