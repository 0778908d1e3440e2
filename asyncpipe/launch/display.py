"""How a sweep shows its runs: a rich table (`sweep status`, and a live one on a terminal) or plain lines.

Off a terminal (logs, CI, SLURM) every change of a run's state is one line, so the output stays greppable.
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Optional, TextIO

from asyncpipe.launch.state import COMPLETED, DIVERGED, FAILED, INTERRUPTED, QUEUED, RUNNING, RunState

_STYLE = {COMPLETED: "green", DIVERGED: "yellow", FAILED: "red", RUNNING: "cyan", QUEUED: "blue", INTERRUPTED: "magenta"}


def _fmt_loss(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4f}"


def _fmt_step(state: RunState) -> str:
    if state.step is None:
        return ""
    return f"{state.step}" + (f"/{state.steps}" if state.steps is not None and state.steps != state.step else "")


def state_table(title: str, states: Iterable[RunState], elapsed: Optional[dict[str, float]] = None):
    """A rich Table of runs: name, state, step, final val loss, SLURM job and state, note."""
    from rich.table import Table

    states = list(states)
    table = Table(title=title, title_justify="left")
    table.add_column("run", overflow="fold")
    table.add_column("state")
    table.add_column("step", justify="right")
    table.add_column("val loss", justify="right")
    if elapsed is not None:
        table.add_column("time", justify="right")
    slurm = any(s.job_id for s in states)
    if slurm:
        table.add_column("job")
        table.add_column("slurm")
    table.add_column("note", overflow="fold")
    for s in states:
        style = _STYLE.get(s.state, "")
        row = [s.name, f"[{style}]{s.state}[/]" if style else s.state, _fmt_step(s), _fmt_loss(s.final_val_loss)]
        if elapsed is not None:
            row.append(f"{elapsed[s.name]:.0f}s" if s.name in elapsed else "")
        if slurm:
            row += [s.job_id or "", s.slurm_state or ""]
        row.append(s.note)
        table.add_row(*row)
    return table


def counts(states: Iterable[RunState]) -> str:
    tally: dict[str, int] = {}
    for s in states:
        tally[s.state] = tally.get(s.state, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in tally.items())


class SweepDisplay:
    """Live view of a sweep in progress: `update()` with fresh states; rich Live on a TTY, lines otherwise."""

    def __init__(self, title: str, stream: Optional[TextIO] = None, live: Optional[bool] = None) -> None:
        self.title = title
        self.stream = stream or sys.stdout
        self.live_enabled = self.stream.isatty() if live is None else live
        self._live = None
        self._last: dict[str, tuple[str, str]] = {}
        self._started: dict[str, float] = {}
        self._ended: dict[str, float] = {}

    def __enter__(self) -> "SweepDisplay":
        if self.live_enabled:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(file=self.stream), refresh_per_second=2, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _elapsed(self) -> dict[str, float]:
        now = time.monotonic()
        return {k: self._ended.get(k, now) - t for k, t in self._started.items()}

    def update(self, states: list[RunState]) -> None:
        now = time.monotonic()
        for s in states:
            if s.state == RUNNING and s.name not in self._started:
                self._started[s.name] = now
            if s.state != RUNNING and s.name in self._started and s.name not in self._ended:
                self._ended[s.name] = now
        if self._live is not None:
            self._live.update(state_table(f"{self.title}  ({counts(states)})", states, self._elapsed()))
            return
        done = sum(1 for s in states if s.state in (COMPLETED, DIVERGED, FAILED))
        for s in states:
            key = (s.state, s.note)
            if self._last.get(s.name) == key:
                continue
            self._last[s.name] = key
            extra = f" ({s.note})" if s.note else ""
            if s.job_id:
                extra += f" [job {s.job_id}{' ' + s.slurm_state if s.slurm_state else ''}]"
            took = self._elapsed().get(s.name)
            if s.state in (COMPLETED, DIVERGED, FAILED) and took is not None:
                extra += f" in {took:.0f}s"
            print(f"[{done}/{len(states)}] {s.name}: {s.state}{extra}", file=self.stream, flush=True)


def print_table(title: str, states: list[RunState], stream: Optional[TextIO] = None) -> None:
    from rich.console import Console

    stream = stream or sys.stdout
    # Off a terminal rich assumes 80 columns and folds run names; logs read better unfolded.
    width = None if stream.isatty() else 200
    Console(file=stream, width=width).print(state_table(f"{title}  ({counts(states)})", states))
