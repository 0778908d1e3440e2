"""Rank 0's account of a run's steps: `Book` (val losses joined to their step, the stop at the first diverged
step, metrics.jsonl through the tracker) and `Progress` output (a rich bar on a terminal, plain periodic lines in
logs: CI, SLURM)."""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional

from asyncpipe.runtime import diverged


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise (logs, CI, SLURM)."""

    def __init__(self, total: int, start: int, every: int, describe: str) -> None:
        self.total, self.every = total, every
        self.bar = None
        print(describe, flush=True)
        if sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress as RichProgress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, metrics: dict) -> None:
        info = (
            f"loss {metrics['train_loss']:.4f}"
            + (f" | val {metrics['val_loss']:.4f}" if "val_loss" in metrics else "")
            + f" | {metrics['tokens_per_s']:.0f} tok/s"
        )
        due = step % self.every == 0 or step == self.total or "val_loss" in metrics
        line = f"step {step}/{self.total} | {info}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
            if due and hasattr(sys.stdout, "log_only"):  # the run's train.log gets the plain line (track.provenance)
                sys.stdout.log_only(line)
        elif due:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


STUCK_STEPS = 3  # a run that ends this many steps at the uniform guess with zero gradients is dead, not a result


class Book:
    """Rank 0's record of the steps: val losses joined to their step, tokens, the stop at the first diverged
    step, metrics.jsonl (through the tracker), progress lines and ``on_step``; and whether the run ended dead
    (`collapsed`): its train loss at the uniform guess ln(vocab) with a gradient norm of exactly zero."""

    def __init__(
        self,
        tracker: Any,
        tokens_per_step: int,
        limit: float,
        progress: Optional[Progress],
        on_step: Optional[Callable[[dict], None]],
        vocab: Optional[int] = None,
    ) -> None:
        self.tracker, self.tokens_per_step, self.limit = tracker, tokens_per_step, limit
        self.progress, self.on_step = progress, on_step
        self.val_at: dict[int, float] = {}
        self.history: list[dict] = []
        self.diverged = False
        self.uniform = math.log(vocab) if vocab else None
        self.stuck = 0  # the latest steps in a row at the uniform guess with zero gradients

    def _at_uniform_guess(self, rec: dict) -> bool:
        loss = rec.get("train_loss")
        return (
            self.uniform is not None
            and rec.get("grad_norm") == 0
            and isinstance(loss, float)
            and abs(loss - self.uniform) < 1e-3
        )

    @property
    def collapsed(self) -> Optional[str]:
        """Why the run is dead (None when it is not): it ended `STUCK_STEPS` or more steps at the uniform guess."""
        if self.uniform is None or self.stuck < STUCK_STEPS:
            return None
        return (
            f"train loss stuck at ln(vocab) = {self.uniform:.4f} (the uniform guess) with a zero gradient "
            f"norm for the last {self.stuck} steps: the model is dead (a learning rate far too large?)"
        )

    def log(self, record: dict) -> None:
        if self.tracker is not None:
            self.tracker.log(record)

    def emit(self, records: list[dict]) -> None:
        for rec in records:
            if self.diverged:
                break  # the record ends at the first diverged step
            step = int(rec["step"])
            out = {"step": step, "tokens": step * self.tokens_per_step}
            out.update((k, v) for k, v in rec.items() if k != "step")
            out["tokens_per_s"] = self.tokens_per_step / max(rec["step_time"], 1e-9)
            if step in self.val_at:
                out["val_loss"] = self.val_at[step]
            self.diverged = diverged(rec["train_loss"], self.limit)
            self.stuck = self.stuck + 1 if self._at_uniform_guess(rec) else 0
            self.history.append(out)
            self.log(out)
            if self.progress is not None:
                self.progress.update(step, out)
            if self.on_step is not None:
                self.on_step(out)
