"""How a sweep shows its runs: a rich table (`sweep status`, and a live one on a terminal) or plain lines.

Off a terminal (logs, CI, SLURM) every change of a run's state is one line, so the output stays greppable; runs
not started yet are one summary line, never a line each. Both say the sweep's elapsed time and an estimate of the
time left (`sweep_clock`).
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Optional, TextIO

from asyncpipe.sweep.state import COMPLETED, DIVERGED, FAILED, INTERRUPTED, PENDING, QUEUED, RUNNING, RunState

_STYLE = {
    COMPLETED: "green",
    DIVERGED: "yellow",
    FAILED: "red",
    RUNNING: "cyan",
    QUEUED: "blue",
    INTERRUPTED: "magenta",
}


PROGRESS_LINE_S = 30.0  # off a terminal: a running run's step, val loss and ETA at most this often
WAITING = (PENDING, QUEUED)  # not started yet: summarised as one line / one row


def _fmt_loss(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4f}"


def _fmt_val(state: RunState) -> str:
    """A finished run's final val loss; a running or interrupted run's latest, with its step when that is not the
    step shown (a val loss is never paired with a later step silently)."""
    if state.final_val_loss is not None:
        return _fmt_loss(state.final_val_loss)
    if state.val_loss is None:
        return ""
    at = f" (step {state.val_step})" if state.val_step is not None and state.val_step != state.step else ""
    return f"{state.val_loss:.4f}{at}"


def _fmt_step(state: RunState) -> str:
    if state.step is None:
        return ""
    return f"{state.step}" + (f"/{state.steps}" if state.steps is not None and state.steps != state.step else "")


def state_table(
    title: str,
    states: Iterable[RunState],
    elapsed: Optional[dict[str, float]] = None,
    eta: Optional[dict[str, float]] = None,
    fold_waiting: bool = False,
):
    """A rich Table of runs: name, state, step, val loss, (time and ETA,) SLURM job and state, note.
    `fold_waiting`: runs not started yet are one row ("N runs") instead of a row each (the live view)."""
    from rich.table import Table

    states = list(states)
    waiting = [s for s in states if s.state in WAITING] if fold_waiting else []
    states = [s for s in states if s not in waiting]
    table = Table(title=title, title_justify="left")
    table.add_column("run", overflow="fold")
    table.add_column("state")
    table.add_column("step", justify="right")
    table.add_column("val loss", justify="right")
    if elapsed is not None:
        table.add_column("time", justify="right")
        table.add_column("ETA", justify="right")
    slurm = any(s.job_id for s in states)
    if slurm:
        table.add_column("job")
        table.add_column("slurm")
    branches = any(s.branch_of for s in states)
    if branches:
        table.add_column("branch of", overflow="fold")
    table.add_column("note", overflow="fold")
    for s in states:
        style = _STYLE.get(s.state, "")
        row = [s.name, f"[{style}]{s.state}[/]" if style else s.state, _fmt_step(s), _fmt_val(s)]
        if elapsed is not None:
            row.append(f"{elapsed[s.name]:.0f}s" if s.name in elapsed else "")
            row.append(fmt_eta((eta or {}).get(s.name)) if s.state == RUNNING else "")
        if slurm:
            row += [s.job_id or "", s.slurm_state or ""]
        if branches:
            row.append(s.branch_of or "")
        row.append(s.note)
        table.add_row(*row)
    if waiting:
        blank = [""] * (len(table.columns) - 3)
        table.add_row(f"{len(waiting)} run(s) not started yet", f"[{_STYLE[QUEUED]}]pending[/]", *blank, "waiting")
    return table


def fmt_eta(seconds: Optional[float]) -> str:
    if seconds is None:
        return ""
    from asyncpipe.sweep.estimate import fmt_seconds

    return fmt_seconds(max(0.0, seconds))


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
        self._first: dict[str, tuple[float, int]] = {}  # (time, step) a running run was first seen at a step
        self._said: dict[str, float] = {}  # when a progress line was last printed per run
        self.expected: dict[str, Optional[float]] = {}  # the dry-run's estimated seconds per run (when known)
        self._t0: Optional[float] = None  # when the sweep was first shown
        self._slots = 1  # the most runs seen running at once (how many share the time left)
        self._waiting_said: set[str] = set()  # runs already counted in a "not started yet" line

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

    def etas(self, states: list[RunState]) -> dict[str, float]:
        """Seconds left per running run: from its own steps per second since first seen at a step, else from the
        dry-run's estimate minus the time it has run."""
        now, out = time.monotonic(), {}
        elapsed = self._elapsed()
        for s in states:
            if s.state != RUNNING:
                continue
            first = self._first.get(s.name)
            if first and s.step is not None and s.steps and s.step > first[1] and now > first[0]:
                out[s.name] = (s.steps - s.step) * (now - first[0]) / (s.step - first[1])
            elif self.expected.get(s.name) and s.name in elapsed:
                out[s.name] = max(0.0, float(self.expected[s.name] or 0.0) - elapsed[s.name])
        return out

    def sweep_clock(self, states: list[RunState], etas: dict[str, float]) -> str:
        """ "12s elapsed, ~1.5 min left": the time left is the running runs' ETAs plus the runs not started at the
        mean time of the runs finished so far (else the running runs' projected times, else the dry-run's
        estimate), shared by the runs seen at once."""
        now = time.monotonic()
        elapsed = now - (self._t0 if self._t0 is not None else now)
        took = [self._ended[k] - self._started[k] for k in self._ended if k in self._started]
        running = [s for s in states if s.state == RUNNING]
        ran = self._elapsed()
        so_far = [ran[s.name] + etas[s.name] for s in running if s.name in etas and s.name in ran]  # projected
        guess = [float(v) for v in self.expected.values() if v]
        per_run = next((sum(x) / len(x) for x in (took, so_far, guess) if x), None)
        waiting = sum(1 for s in states if s.state in WAITING)
        text = f"{fmt_eta(elapsed)} elapsed"
        if not running and not waiting:
            return text
        if per_run is None and (waiting or any(s.name not in etas for s in running)):
            return text + ", time left not known yet"
        work = sum(etas.get(s.name, per_run or 0.0) for s in running) + waiting * (per_run or 0.0)
        return text + f", ~{fmt_eta(work / max(1, self._slots))} left"

    def update(self, states: list[RunState]) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        self._slots = max(self._slots, sum(1 for s in states if s.state == RUNNING))
        for s in states:
            if s.state == RUNNING and s.name not in self._started:
                self._started[s.name] = now
            if s.state != RUNNING and s.name in self._started and s.name not in self._ended:
                self._ended[s.name] = now
            if s.state == RUNNING and s.step is not None and s.name not in self._first:
                self._first[s.name] = (now, s.step)
        etas = self.etas(states)
        if self._live is not None:
            title = f"{self.title}  ({counts(states)}; {self.sweep_clock(states, etas)})"
            self._live.update(state_table(title, states, self._elapsed(), etas, fold_waiting=True))
            return
        done = sum(1 for s in states if s.state in (COMPLETED, DIVERGED, FAILED))
        waiting = [s.name for s in states if s.state in WAITING]
        if set(waiting) - self._waiting_said:
            self._waiting_said |= set(waiting)
            print(
                f"[{done}/{len(states)}] {len(waiting)} run(s) not started yet (pending)", file=self.stream, flush=True
            )
        for s in states:
            if s.state in WAITING:
                continue
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
            if s.state == COMPLETED and s.final_val_loss is not None:
                extra += f", val loss {s.final_val_loss:.4f}"
            if s.state in (COMPLETED, DIVERGED, FAILED) and took is not None:  # ran here, not found finished
                extra += f" | sweep: {self.sweep_clock(states, etas)}"
            print(f"[{done}/{len(states)}] {s.name}: {s.state}{extra}", file=self.stream, flush=True)
        self._progress_lines(states, etas, now)

    def _progress_lines(self, states: list[RunState], etas: dict[str, float], now: float) -> None:
        """Off a terminal: a running run's step/total, latest val loss and ETA, at most every PROGRESS_LINE_S."""
        done = sum(1 for s in states if s.state in (COMPLETED, DIVERGED, FAILED))
        for s in states:
            last = self._said.get(s.name, self._started.get(s.name, now))
            if s.state != RUNNING or s.step is None or now - last < PROGRESS_LINE_S:
                continue
            self._said[s.name] = now
            val = _fmt_val(s)
            text = f"step {_fmt_step(s)}" + (f", val loss {val}" if val else "")
            text += f", ETA {fmt_eta(etas[s.name])}" if s.name in etas else ""
            text += f" | sweep: {self.sweep_clock(states, etas)}"
            print(f"[{done}/{len(states)}] {s.name}: running, {text}", file=self.stream, flush=True)


def print_table(title: str, states: list[RunState], stream: Optional[TextIO] = None) -> None:
    from rich.console import Console

    stream = stream or sys.stdout
    # Off a terminal rich assumes 80 columns and folds run names; logs read better unfolded.
    width = None if stream.isatty() else 200
    Console(file=stream, width=width).print(state_table(f"{title}  ({counts(states)})", states))
