"""One simulated run from start to summary: resume, the step loop, evaluation, divergence, checkpoints, signals.

Runs as a single process or as one of D data-parallel ranks (rank 0 writes the run dir; every rank takes the
same decisions because loss and stop requests are agreed collectively).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig

from asyncpipe.errors import EXIT_DIVERGED, EXIT_INTERRUPTED
from asyncpipe.train import checkpoint
from asyncpipe.train.loop import StepResult, Trainer, describe, diverged
from asyncpipe.train.progress import Progress
from asyncpipe.train.signals import StopRequest

EXIT_CODES = {"completed": 0, "diverged": EXIT_DIVERGED, "interrupted": EXIT_INTERRUPTED}


def _agree(flag: bool, world: int) -> bool:
    """True on every rank when any rank says so (a signal may reach the ranks at different steps)."""
    if world == 1:
        return flag
    import torch.distributed as tdist

    t = torch.tensor([int(flag)])
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item())


def _barrier(world: int) -> Callable[[], None] | None:
    if world == 1:
        return None
    import torch.distributed as tdist

    return tdist.barrier


def resume_trainer(trainer: Trainer, cfg: DictConfig, run_path: Path, log: Callable[[str], None]) -> None:
    """Load the latest complete checkpoint (resume=true); rank 0 drops metrics logged after it."""
    from asyncpipe.track import RunDir

    path = checkpoint.latest_complete(run_path, world=trainer.world, log=log) if cfg.resume else None
    if path is not None:
        trainer.load_state_dict(checkpoint.load(path, checkpoint.fingerprint_of(cfg), rank=trainer.rank))
        log(f"resumed from {path} at step {trainer.step}")
    elif cfg.resume:
        log("resume=true but no complete checkpoint: starting from step 0")
    if trainer.rank == 0:
        RunDir(run_path).truncate_metrics(after_step=trainer.step if path is not None else -1)


def save_checkpoint(trainer: Trainer, cfg: DictConfig, run_path: Path) -> Path:
    return checkpoint.save(
        run_path, trainer.step, trainer.state_dict(), checkpoint.fingerprint_of(cfg),
        rank=trainer.rank, world=trainer.world, barrier=_barrier(trainer.world), keep=cfg.checkpoint.keep,
    )  # fmt: skip


def step_metrics(result: StepResult, step_tokens: int) -> dict:
    return {
        "step": result.step,
        "tokens": result.step * step_tokens,
        "train_loss": result.train_loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "step_time": result.step_time,
        "tokens_per_s": step_tokens / max(result.step_time, 1e-9),
        **result.extras,
    }


def run_simulated(
    cfg: DictConfig, run_path: Path, log: Callable[[str], None] = print, rank: int = 0, world: int = 1
) -> dict:
    """Train `engine=simulate`; returns the summary (rank 0 also writes it to summary.json)."""
    from asyncpipe.track import Tracker

    started = time.perf_counter()
    # Set-up errors (bad data, a foreign checkpoint) surface before anything is logged.
    trainer = Trainer(cfg, log=log, rank=rank, world=world)
    resume_trainer(trainer, cfg, run_path, log)
    tracker = Tracker(cfg, run_path, rank=rank)
    t = cfg.train
    status, final_val = "failed", None
    try:
        progress = Progress(t.steps, trainer.step, t.log_every, describe(trainer)) if rank == 0 else None
        with StopRequest() as stop:
            try:
                if trainer.step == 0 and rank == 0:
                    final_val = trainer.evaluate()
                    tracker.log({"step": 0, "tokens": 0, "val_loss": final_val})
                status = "completed"
                while trainer.step < t.steps:
                    metrics = step_metrics(trainer.train_step(), trainer.tokens_per_step)
                    step = metrics["step"]
                    if diverged(metrics["train_loss"], t.diverge_loss):  # the loss is agreed across replicas
                        status = "diverged"
                        tracker.log(metrics)
                        log(f"diverged at step {step}: train loss {metrics['train_loss']}")
                        break
                    if rank == 0 and (step % t.eval_every == 0 or step == t.steps):
                        final_val = metrics["val_loss"] = trainer.evaluate()
                    tracker.log(metrics)
                    if progress is not None:
                        progress.update(step, metrics)
                    stopping = _agree(stop.requested, world)
                    every = cfg.checkpoint.every
                    if stopping or (every and step % every == 0 and step < t.steps):
                        path = save_checkpoint(trainer, cfg, run_path)
                        if stopping:
                            status = "interrupted"
                            log(f"{stop.signal_name or 'stop'}: checkpoint {path} written; resume=true continues")
                            break
            finally:
                if progress is not None:
                    progress.close()
    except BaseException:
        tracker.finish({"status": "failed", "wall_time": time.perf_counter() - started})
        raise
    summary = {
        "status": status,
        "final_val_loss": final_val if final_val is None or math.isfinite(final_val) else None,
        "tokens": trainer.step * trainer.tokens_per_step,
        "steps": trainer.step,
        "wall_time": time.perf_counter() - started,
        "exit_code": EXIT_CODES[status],
    }
    tracker.finish(summary)
    if rank == 0:
        log(f"{status}: final val loss {summary['final_val_loss']} | run dir {run_path}")
    return summary
