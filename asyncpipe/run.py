"""The entry point of one training run: make the run dir, pick the engine, drive it, write the summary.

`engine=simulate` trains here in one process; `engine=pipeline` starts its stage processes (or, under SLURM /
torchrun, is one of them). Local files are the record: `config.yaml`, `metrics.jsonl`, `summary.json`.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe.config import to_yaml
from asyncpipe.errors import UserError

EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 4  # a signal arrived; a checkpoint was written and resume=true continues


def prepare_run_dir(cfg: DictConfig) -> Path:
    """Create the run dir and write `config.yaml`; refuse to overwrite a finished run unless resuming."""
    from asyncpipe.track import RunDir

    path = Path(cfg.run.dir)
    summary = path / "summary.json"
    if summary.exists() and not cfg.resume:
        raise UserError(f"run dir {path} already holds a run; choose another run.dir or pass resume=true")
    if summary.exists() and json.loads(summary.read_text()).get("status") == "completed":
        raise UserError(f"run dir {path} holds a completed run; nothing to resume")
    run_dir = RunDir(path)
    run_dir.write_config(to_yaml(cfg))
    return path


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise (logs, CI, SLURM)."""

    def __init__(self, total: int, start: int, every: int, describe: str) -> None:
        self.total, self.every = total, every
        self.bar = None
        print(describe, flush=True)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            self.bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, metrics: dict) -> None:
        info = f"loss {metrics['train_loss']:.4f}" + (
            f" | val {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
        ) + f" | {metrics['tokens_per_s']:.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif step % self.every == 0 or step == self.total or "val_loss" in metrics:
            print(f"step {step}/{self.total} | {info}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _resume(trainer, cfg: DictConfig, run_path: Path, run_dir, log: Callable[[str], None]) -> None:
    """Load the latest complete checkpoint into `trainer` (resume=true) and drop metrics logged after it."""
    from asyncpipe.train import checkpoint

    path = checkpoint.latest_complete(run_path, world=1, log=log) if cfg.resume else None
    if path is not None:
        trainer.load_state_dict(checkpoint.load(path, checkpoint.fingerprint_of(cfg)))
        log(f"resumed from {path} at step {trainer.step}")
    elif cfg.resume:
        log("resume=true but no complete checkpoint: starting from step 0")
    run_dir.truncate_metrics(after_step=trainer.step if path is not None else -1)


def _save(trainer, cfg: DictConfig, run_path: Path) -> Path:
    from asyncpipe.train import checkpoint

    return checkpoint.save(
        run_path, trainer.step, trainer.state_dict(), checkpoint.fingerprint_of(cfg), keep=cfg.checkpoint.keep
    )


def _step_metrics(result, step_tokens: int) -> dict:
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


def run_simulated(cfg: DictConfig, run_path: Path, log: Callable[[str], None] = print) -> dict:
    """Train `engine=simulate` in this process; returns the summary (also written to summary.json)."""
    from asyncpipe.track import RunDir, Tracker
    from asyncpipe.train.loop import Trainer, describe, diverged
    from asyncpipe.train.signals import StopRequest

    started = time.perf_counter()
    # Set-up errors (bad data, a foreign checkpoint) surface before anything is logged.
    trainer = Trainer(cfg, log=log)
    _resume(trainer, cfg, run_path, RunDir(run_path), log)
    tracker = Tracker(cfg, run_path, rank=0)
    status, final_val = "failed", None
    try:
        t = cfg.train
        progress = Progress(t.steps, trainer.step, t.log_every, describe(trainer))
        with StopRequest() as stop:
            try:
                if trainer.step == 0:
                    final_val = trainer.evaluate()
                    tracker.log({"step": 0, "tokens": 0, "val_loss": final_val})
                status = "completed"
                while trainer.step < t.steps:
                    metrics = _step_metrics(trainer.train_step(), trainer.tokens_per_step)
                    step = metrics["step"]
                    if diverged(metrics["train_loss"], t.diverge_loss):
                        status = "diverged"
                        tracker.log(metrics)
                        log(f"diverged at step {step}: train loss {metrics['train_loss']}")
                        break
                    if step % t.eval_every == 0 or step == t.steps:
                        final_val = metrics["val_loss"] = trainer.evaluate()
                    tracker.log(metrics)
                    progress.update(step, metrics)
                    every = cfg.checkpoint.every
                    if stop.requested or (every and step % every == 0 and step < t.steps):
                        path = _save(trainer, cfg, run_path)
                        if stop.requested:
                            status = "interrupted"
                            log(f"{stop.signal_name}: checkpoint {path} written; resume=true continues")
                            break
            finally:
                progress.close()
    except BaseException:
        tracker.finish({"status": "failed", "wall_time": time.perf_counter() - started})
        raise
    exit_code = {"completed": 0, "diverged": EXIT_DIVERGED, "interrupted": EXIT_INTERRUPTED}[status]
    summary = {
        "status": status,
        "final_val_loss": final_val if final_val is None or math.isfinite(final_val) else None,
        "tokens": trainer.step * trainer.tokens_per_step,
        "steps": trainer.step,
        "wall_time": time.perf_counter() - started,
        "exit_code": exit_code,
    }
    tracker.finish(summary)
    log(f"{status}: final val loss {summary['final_val_loss']} | run dir {run_path}")
    return summary


def run_training(cfg: DictConfig, overrides: Sequence[str] = (), log: Optional[Callable[[str], None]] = None) -> dict:
    """Run one training job as configured; the CLI's `train` command."""
    log = log or print
    if cfg.engine == "pipeline":
        from asyncpipe.pipe.runner import launch_local

        return launch_local(cfg, overrides, log=log)
    existed = Path(cfg.run.dir).exists()
    run_path = prepare_run_dir(cfg)
    try:
        return run_simulated(cfg, run_path, log=log)
    except UserError:
        if not existed:  # a user mistake leaves no run dir behind that could pass for a run
            shutil.rmtree(run_path, ignore_errors=True)
        raise
