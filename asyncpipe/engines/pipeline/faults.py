"""Fault tolerance of `engine=pipeline`: what every rank agrees on at a batch cut (stop requests, divergence),
and the state of a stage at a cut, which the run's trainer checkpoints in the simulator's format
(`asyncpipe.runtime.checkpoint`).

A cut (the end of `train_batch`) has no message between stages in flight. Once its deferred optimizer steps
are applied, a stage's future depends only on its weight versions (2BW: W(b) for batch b+1 and the latest
W(b+1)), its optimizer state (EF buffer included) and the step: a resumed run re-warms the pipeline from
batch b+1 and recomputes, bit for bit, the forwards that were in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as tdist


@dataclass
class CutView:
    """What every rank knows at a cut about the previous one: a stop was asked for, that batch's mean loss."""

    stop: bool = False
    loss: Optional[float] = None


class CutControl:
    """One tiny all-reduce per cut, [stop requests, sum of last-stage losses, their count], posted at cut b
    and read at cut b+1: by then every rank has passed cut b (stage P-1 cannot finish batch b+1 before stage 0
    has passed cut b), so the wait is short and no rank stalls the pipeline for it. Decisions therefore act one
    batch late, identically on every rank."""

    def __init__(self, group: Any, is_last_stage: bool) -> None:
        self.group, self.is_last_stage = group, is_last_stage
        self._posted: Optional[tuple[torch.Tensor, Any]] = None
        self.wait_s = 0.0
        self.cuts = 0

    def exchange(self, stop: bool, loss: float) -> CutView:
        """At a cut: read the previous cut's agreement, then post this one's."""
        seen = self._take()
        vec = torch.tensor(
            [float(stop), loss if self.is_last_stage else 0.0, float(self.is_last_stage)], dtype=torch.float64
        )
        self._posted = (vec, tdist.all_reduce(vec, group=self.group, async_op=True))
        self.cuts += 1
        return seen

    def finish(self) -> CutView:
        """Wait for the last posted agreement (call on every rank before leaving the loop together)."""
        return self._take()

    def _take(self) -> CutView:
        if self._posted is None:
            return CutView()
        vec, work = self._posted
        self._posted = None
        started = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - started
        stops, loss_sum, count = vec.tolist()
        return CutView(stop=stops > 0, loss=loss_sum / count if count else None)


def engine_state(engine: Any) -> dict:
    """This stage's state at a cut whose optimizer steps are all applied."""
    if engine.global_steps != engine.batches_run:
        raise RuntimeError("checkpoint at a cut with a deferred optimizer step pending; apply_pending() first")
    return {
        "step": engine.global_steps,
        "stash": engine.stash.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "previous": engine.previous.state(),  # W(step-1) where the stream's first forwards read it (PACI), else None
        "rng": torch.get_rng_state(),  # nothing in the model draws today; kept so dropout would resume exactly
    }


def load_engine_state(engine: Any, state: dict) -> None:
    engine.stash.load_state_dict(state["stash"])
    engine.previous.load(state.get("previous"))  # older checkpoints have none
    engine.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    engine.restart_at(int(state["step"]))
