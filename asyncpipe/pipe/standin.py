"""Stand-in compute for the pipeline engine (`pipeline.standin`, `bench pipeline --standin F,B`): each forward or
backward instruction is padded by a sleep to the configured seconds per stage and micro-batch, so a schedule's
timing can be measured at any depth on few cores (sleeping ranks do not compete for them). Torch-free."""

from __future__ import annotations

import time
from typing import Sequence


def sleep_until(deadline: float) -> None:
    """Return at `time.perf_counter` ``deadline`` or just after, sleeping (never spinning: with more ranks than
    cores a spinning rank takes the core a woken one needs; a 0.2 ms spin tripled the pads' overshoot on 2BW's
    critical path at P = 4, docs/performance.md "Where 2BW's time goes")."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


class StandInPad:
    """Per pass kind (forward, backward): seconds the real ops took and seconds they were padded to."""

    def __init__(self, seconds: Sequence[float], chunks: int) -> None:
        self.seconds = tuple(float(s) for s in seconds)  # (forward, backward) per stage and micro-batch
        self.chunks = chunks
        self.real: dict[str, float] = {}
        self.target: dict[str, float] = {}
        self._extra = 0.0  # a recomputed forward's seconds, added to its backward's

    @property
    def on(self) -> bool:
        return any(self.seconds)

    def recomputed_forward(self) -> None:
        """A backward that re-runs its forward first (PACI's straddlers) costs a forward more."""
        self._extra += self.seconds[0] / self.chunks

    def pad(self, which: int, kind: str, began: float) -> None:
        """Pad a forward (0) or backward (1) instruction that began at ``began`` to its share of the stage's seconds
        per micro-batch (plus a recomputed forward's), unless its real op already took longer."""
        target = self.seconds[which] / self.chunks + self._extra
        self._extra = 0.0
        if target <= 0:
            return
        real = time.perf_counter() - began
        self.real[kind] = self.real.get(kind, 0.0) + real
        if real < target:
            sleep_until(began + target)
        self.target[kind] = self.target.get(kind, 0.0) + target
