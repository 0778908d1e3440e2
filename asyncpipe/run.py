"""The entry point of one training run: check the run dir, pick the engine and the process layout, drive it.

- `engine=simulate`, one process: trains here.
- `engine=simulate` with `pipeline.data_parallel=D`: spawns D local ranks (or, when RANK/WORLD_SIZE are set by
  torchrun or SLURM, is one of them).
- `engine=pipeline`: starts its P x D stage processes (or is one rank of them under torchrun / SLURM).
Local files are the record: `config.yaml`, `metrics.jsonl`, `summary.json`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe.config import to_yaml
from asyncpipe.dist import rank_env
from asyncpipe.errors import UserError


def check_run_dir(cfg: DictConfig) -> Path:
    """Refuse to overwrite a run (unless resuming) and to resume a completed one."""
    from asyncpipe.track.files import read_summary

    path = Path(cfg.run.dir)
    summary = path / "summary.json"
    if summary.exists() and not cfg.resume:
        raise UserError(f"run dir {path} already holds a run; choose another run.dir or pass resume=true")
    if summary.exists() and (read_summary(path) or {}).get("status") == "completed":
        raise UserError(f"run dir {path} holds a completed run; nothing to resume")
    return path


def prepare_run_dir(cfg: DictConfig) -> Path:
    """Create the run dir and write the resolved `config.yaml`."""
    from asyncpipe.track import RunDir

    path = check_run_dir(cfg)
    RunDir(path).write_config(to_yaml(cfg))
    return path


def _world_of(cfg: DictConfig) -> int:
    replicas = cfg.pipeline.data_parallel
    return replicas * (cfg.pipeline.stages if cfg.engine == "pipeline" else 1)


def _spawn(cfg: DictConfig, overrides: Sequence[str], log: Callable[[str], None]) -> dict:
    """This process is the launcher: start the ranks locally and report rank 0's summary."""
    from asyncpipe.data import ensure_prepared
    from asyncpipe.dist import spawn_local

    path = check_run_dir(cfg)
    ensure_prepared(cfg.data, cfg.tokenizer, progress=log)  # once, before the ranks start
    argv = ["train", *overrides, f"run.dir={path}", f"resume={str(bool(cfg.resume)).lower()}"]
    code = spawn_local(_world_of(cfg), argv, threads=cfg.pipeline.threads)
    summary_path = path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "failed"}
    if code == 2 and not summary_path.exists():
        raise UserError("a rank stopped on a configuration or data error (see above)")
    return {**summary, "exit_code": code}


def _run_rank(cfg: DictConfig, rank: int, world: int, log: Callable[[str], None]) -> dict:
    """This process is one rank of a multi-process job."""
    if world != _world_of(cfg):
        raise UserError(
            f"launched as {world} processes but the config needs {_world_of(cfg)} "
            f"(pipeline.stages x pipeline.data_parallel for engine=pipeline, pipeline.data_parallel for simulate)"
        )
    from asyncpipe.dist import destroy_process_group, init_process_group

    if cfg.engine == "pipeline":  # sets up its own groups, with pipeline.backend
        from asyncpipe.pipe.runner import run_rank

        summary = run_rank(cfg, log=log)
    else:
        from asyncpipe.train.runtime import pick_device

        init_process_group(pick_device(cfg.device).type)
        summary = _run_simulated(cfg, log, rank, world)
    destroy_process_group()  # after a success only: with a rank gone, the teardown's barrier would wait forever
    return summary


def _run_simulated(cfg: DictConfig, log: Callable[[str], None], rank: int = 0, world: int = 1) -> dict:
    from asyncpipe.train.session import run_simulated

    existed = Path(cfg.run.dir).exists()
    run_path = prepare_run_dir(cfg) if rank == 0 else Path(cfg.run.dir)
    try:
        return run_simulated(cfg, run_path, log=log if rank == 0 else (lambda _: None), rank=rank, world=world)
    except UserError:
        if rank == 0 and not existed:  # a user mistake leaves no run dir behind that could pass for a run
            shutil.rmtree(run_path, ignore_errors=True)
        raise


def run_training(cfg: DictConfig, overrides: Sequence[str] = (), log: Optional[Callable[[str], None]] = None) -> dict:
    """Run one training job as configured; the CLI's `train` command."""
    log = log or print
    env = rank_env()
    if env is not None and env[1] > 1:
        return _run_rank(cfg, env[0], env[1], log)
    if cfg.engine == "pipeline":
        from asyncpipe.pipe.runner import launch_local

        return launch_local(cfg, overrides, log=log)
    if cfg.pipeline.data_parallel > 1:
        return _spawn(cfg, overrides, log)
    return _run_simulated(cfg, log)
