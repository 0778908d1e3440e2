"""Where a stage's time figures come from (`StageClock`): seconds per instruction, split into waiting on
communication and computing, and seconds blocked in each collective (`norm_allreduce`, `dp_grad_allreduce`).

Two modes, named in every figure's record (`mode`: the stage summary's ``timing``, the bench's ``timing``):

- ``host``: `time.perf_counter` around each instruction. Valid where a wait blocks the host: gloo on the CPU,
  or any device when ``pipeline.trace=true`` (the engine synchronises the device around every instruction).
- ``cuda_events``: CUDA events recorded on the stage's stream around each instruction and wait. With NCCL,
  ``req.wait()`` / ``work.wait()`` make the *stream* wait, not the host, so host clocks would read ~0 there and
  charge the wait to the next host sync; the events see the stream stall where it happens. They are read when
  they have completed: `settle()` (called once per optimizer step, where the engine reads its step's numbers
  anyway) waits for the last one.

Figures accumulate in `totals` (``wait``, ``compute`` and one entry per named wait), `by_op` (with
`count_by_op`, instructions per kind) and `by_wait`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional

HOST, CUDA_EVENTS = "host", "cuda_events"


class _Span:
    """One instruction (or one named wait outside any instruction) and the named waits inside it."""

    __slots__ = ("name", "is_wait", "start", "end", "waits")

    def __init__(self, name: str, is_wait: bool, start: Any) -> None:
        self.name, self.is_wait, self.start, self.end = name, is_wait, start, None
        self.waits: list[tuple[str, Any, Any]] = []


class StageClock:
    """Times a stage's instructions in ``host`` or ``cuda_events`` mode (``device.type == "cuda"`` and not
    ``host``: events). ``event`` makes a timing event (tests pass a fake; default `torch.cuda.Event`)."""

    def __init__(self, device: Any, host: bool = False, event: Optional[Callable[[], Any]] = None) -> None:
        self.mode = CUDA_EVENTS if (device.type == "cuda" and not host) or event is not None else HOST
        if self.mode == CUDA_EVENTS and event is None:
            import torch

            event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._event = event
        self.totals: dict[str, float] = {"wait": 0.0, "compute": 0.0}
        self.by_op: dict[str, float] = {}  # seconds per instruction kind, waits included
        self.count_by_op: dict[str, int] = {}  # instructions run per kind (seconds / count: per instruction)
        self.by_wait: dict[str, float] = {}  # seconds blocked inside handlers, per collective
        self._open: Optional[_Span] = None
        self._pending: list[_Span] = []

    def _now(self) -> Any:
        if self.mode == HOST:
            return time.perf_counter()
        ev = self._event()
        ev.record()
        return ev

    def _seconds(self, start: Any, end: Any) -> float:
        return end - start if self.mode == HOST else start.elapsed_time(end) / 1e3

    @contextlib.contextmanager
    def instruction(self, name: str, is_wait: bool) -> Iterator[None]:
        """Time one instruction; ``is_wait``: all of it is waiting (send / receive / commit)."""
        span = _Span(name, is_wait, self._now())
        outer, self._open = self._open, span
        try:
            yield
        finally:
            self._open = outer
            span.end = self._now()
            self._pending.append(span)
            if self.mode == HOST:
                self.settle()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Time a wait for the collective ``what`` inside the open instruction (or on its own)."""
        start = self._now()
        try:
            yield
        finally:
            end = self._now()
            if self._open is not None:
                self._open.waits.append((what, start, end))
            else:  # outside any instruction: counted for the collective only, as no instruction waited
                alone = _Span("", False, start)
                alone.end, alone.waits = end, [(what, start, end)]
                self._pending.append(alone)
                if self.mode == HOST:
                    self.settle()

    def settle(self) -> None:
        """Add every timed span to the totals (``cuda_events``: waits for the last event to complete)."""
        if not self._pending:
            return
        if self.mode == CUDA_EVENTS:
            self._pending[-1].end.synchronize()
        for span in self._pending:
            total = self._seconds(span.start, span.end)
            waited = 0.0
            for what, a, b in span.waits:
                s = self._seconds(a, b)
                waited += s
                self.totals[what] = self.totals.get(what, 0.0) + s
                self.by_wait[what] = self.by_wait.get(what, 0.0) + s
            if not span.name:  # a wait on its own
                continue
            self.by_op[span.name] = self.by_op.get(span.name, 0.0) + total
            self.count_by_op[span.name] = self.count_by_op.get(span.name, 0) + 1
            if span.is_wait:
                self.totals["wait"] += total
            else:
                self.totals["wait"] += waited
                self.totals["compute"] += total - waited
        self._pending = []
