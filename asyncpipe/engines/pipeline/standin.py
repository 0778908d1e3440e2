"""Stand-in compute for the pipeline engine (`pipeline.standin`, `bench pipeline --standin F,B`): each forward or
backward instruction is padded by a sleep to the configured seconds per stage and micro-batch (or, with a
per-layer stand-in profile, to the sum of its chunk's layers' seconds: `asyncpipe.standin_costs`), so a schedule's
timing can be measured at any depth on few cores (sleeping ranks do not compete for them). Torch-free."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence


def chunk_seconds(cfg: Any) -> Optional[tuple[list[float], list[float]]]:
    """Per-layer stand-in (`asyncpipe.standin_costs`): forward and backward seconds per micro-batch of every chunk
    of ``cfg``'s cut (P chunks, or 2P in a V, in model order): the sums of their layers'. None when off."""
    from asyncpipe.partition import cut_blocks, partition
    from asyncpipe.standin_costs import layer_costs

    costs = layer_costs(cfg)
    if costs is None:
        return None
    fwd, bwd = costs
    blocks = cut_blocks(cfg)
    parts = partition(len(fwd), len(blocks), blocks)
    spans = [(parts[c], parts[c + 1]) for c in range(len(blocks))]
    return [sum(fwd[a:b]) for a, b in spans], [sum(bwd[a:b]) for a, b in spans]


def stage_standin(cfg: Any, rank: int) -> tuple[float, ...]:
    """The stand-in seconds the engine of pipeline rank ``rank`` pads to (`PipeSettings.standin`): (F, B) per
    stage and micro-batch, shared equally by a V's two chunks; with a per-layer profile, (F, B) of each chunk the
    rank holds under the run's cut (phase 0's, then a V's phase 1's)."""
    node = cfg.pipeline.get("standin") or {}
    per_chunk = chunk_seconds(cfg)
    if per_chunk is None:
        return (float(node.get("forward_s", 0.0)), float(node.get("backward_s", 0.0)))
    fwd, bwd = per_chunk
    P = int(cfg.pipeline.stages)
    mine = [rank] if len(fwd) == P else [rank, 2 * P - 1 - rank]
    return tuple(x for c in mine for x in (fwd[c], bwd[c]))


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
        # (F, B) per stage and micro-batch, each of the ``chunks`` chunks a share; or (F, B) per chunk, 2 x chunks
        # figures in phase order (`stage_standin`)
        self.seconds = tuple(float(s) for s in seconds)
        self.chunks = chunks
        if len(self.seconds) == 2 * chunks and chunks > 1:
            self.per_chunk = [(self.seconds[2 * c], self.seconds[2 * c + 1]) for c in range(chunks)]
        else:
            self.per_chunk = [(self.seconds[0] / chunks, self.seconds[1] / chunks)] * chunks
        self.real: dict[str, float] = {}
        self.target: dict[str, float] = {}
        self._extra = 0.0  # a recomputed forward's seconds, added to its backward's

    @property
    def on(self) -> bool:
        return any(self.seconds)

    def recomputed_forward(self, phase: int = 0) -> None:
        """A backward that re-runs its forward first (PACI's straddlers) costs a forward more."""
        self._extra += self.per_chunk[phase][0]

    def pad(self, which: int, kind: str, began: float, phase: Optional[int] = None) -> None:
        """Pad a forward (0) or backward (1) instruction of chunk ``phase`` (None: the first) that began at
        ``began`` to its chunk's seconds per micro-batch (plus a recomputed forward's), unless its real op already
        took longer."""
        target = self.per_chunk[phase or 0][which] + self._extra
        self._extra = 0.0
        if target <= 0:
            return
        real = time.perf_counter() - began
        self.real[kind] = self.real.get(kind, 0.0) + real
        if real < target:
            sleep_until(began + target)
        self.target[kind] = self.target.get(kind, 0.0) + target
