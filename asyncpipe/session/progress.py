"""Progress output for long runs: a rich bar on a terminal, plain periodic lines in logs (CI, SLURM)."""

from __future__ import annotations

import sys


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
