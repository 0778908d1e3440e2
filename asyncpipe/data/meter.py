"""Progress of a long preparation in input bytes: a rich bar with MB/s and time left on a terminal (stderr), else
a plain line every `EVERY_S` seconds through the preparation's message channel (logs, SLURM)."""

from __future__ import annotations

import sys
import time
from typing import Callable

EVERY_S = 30.0


def _clock(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Meter:
    """`update(done)` with the input bytes done so far (of `total`); `close()` once finished or stopped."""

    def __init__(self, total: int, done: int, label: str, say: Callable[[str], None]) -> None:
        self.total, self.start_done, self.done, self.label, self.say = max(1, total), done, done, label, say
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn(f"[bold]{label}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self.task = self.bar.add_task(label, total=self.total, completed=done)
            self.bar.start()

    def rate(self) -> float:
        """Bytes per second since this meter started (resumed work not counted)."""
        return (self.done - self.start_done) / max(1e-9, time.monotonic() - self.t0)

    def line(self) -> str:
        rate = self.rate()
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = _clock(left) if left == left else "?"
        return (
            f"{self.label}: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB "
            f"({100 * self.done / self.total:.0f}%), {rate / 1e6:.1f} MB/s, {eta} left"
        )

    def update(self, done: int) -> None:
        self.done = min(done, self.total)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
        elif time.monotonic() - self.last >= EVERY_S:
            self.last = time.monotonic()
            self.say(self.line())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
