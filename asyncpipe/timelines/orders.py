"""Replay of one-batch compute orders (`asyncpipe.schedules.orders`) by data dependencies: `replay` starts every op
as soon as its rank is free and its inputs exist (communication is free and eager): the idealised timeline, its
bubble, and a deadlock check; the bubble table of every schedule and the ideal timelines of the engine's streams.
Every one goes through the one replay, `asyncpipe.timelines.timeline.simulate`. Pure Python: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from asyncpipe.errors import UserError
from asyncpipe.schedules import get, schedules
from asyncpipe.schedules.orders import Op, Plan, drawn_orders, plan, plan_streams, sync_schedules

if TYPE_CHECKING:
    from asyncpipe.timelines.timeline import Timeline


def replay(
    p: Plan,
    forward: float = 1.0,
    backward: float = 2.0,
    weight_share: float = 0.5,
    chunk_costs: Optional[dict[str, Sequence[float]]] = None,
    latency: float = 0.0,
) -> "Timeline":
    """Run every rank's order against the others: an op starts when its rank is free and its dependencies
    are done. ``forward``/``backward`` are the costs of a whole stage's worth of layers (a chunk costs 1/chunks
    per rank of it); with a split backward, B costs (1 - weight_share) of it and W the rest. Raises
    `ScheduleError` on a deadlock, a dependency on an op no rank runs, or an op run twice or on the wrong rank.
    ``chunk_costs`` ({"F": [...], "B": [...]}, one cost per chunk) replaces the uniform costs (the cost model's
    measured, unequal chunks); ``latency`` delays a result read on another rank. The order runs as instruction
    streams (`schedules.orders.plan_streams`) through the one replay, `timelines.timeline.simulate` (the cost model
    prices the engine's per-instruction overhead there, `simulate(..., overhead=)`, on the declared streams)."""
    from asyncpipe.timelines.timeline import simulate

    n_chunks, v = len(p.chunk_rank), p.chunks_per_rank
    cost = {"F": forward / v, "B": backward / v, "W": 0.0}
    if p.split_backward:
        cost["B"], cost["W"] = backward * (1 - weight_share) / v, backward * weight_share / v
    _check_ranks(p)

    def per_chunk(kind: str) -> list[float]:
        if chunk_costs is None or kind not in chunk_costs:
            return [cost[kind]] * n_chunks
        return [float(chunk_costs[kind][c]) for c in range(n_chunks)]

    fwd, bwd, wgt = per_chunk("F"), per_chunk("B"), per_chunk("W")
    return simulate(plan_streams(p), fwd, bwd, latency=latency, weight=wgt, name=p.name)


def _check_ranks(p: Plan) -> None:
    """Every op once, on the rank that holds its chunk."""
    from asyncpipe.timelines.timeline import ScheduleError

    owner: dict[Op, int] = {}
    for r, ops in enumerate(p.ranks):
        for op in ops:
            if op in owner:
                raise ScheduleError(f"{op} runs twice (ranks {owner[op]} and {r})")
            if p.chunk_rank[op.chunk] != r:
                raise ScheduleError(f"rank {r} runs {op}, but chunk {op.chunk} lives on rank {p.chunk_rank[op.chunk]}")
            owner[op] = r


def bubble(name: str, stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0) -> Optional[float]:
    """Idle fraction of the busiest-idle rank over one batch of ``name`` (None where it cannot run)."""
    try:
        tl = replay(plan(name, stages, micro_batches), forward, backward)
    except UserError:
        return None
    return max(tl.idle_fraction)


def bubble_table(
    stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0, batches: int = 3
) -> dict[str, Optional[float]]:
    """Per schedule, the bubble of one batch with a free optimizer step (None where it cannot run this P and m).
    A synchronous schedule flushes every batch, so that is its idle fraction over one batch; ``2bw`` is the
    idle share of the time one more batch adds to a run (its steady state; 0 with equal stages) and ``2bw-run``
    the idle fraction of a ``batches``-batch run, which pays one fill and drain."""
    from asyncpipe.timelines.timeline import simulate_schedule

    out: dict[str, Optional[float]] = {k: bubble(k, stages, micro_batches, forward, backward) for k in sync_schedules()}
    out["2bw"] = out["2bw-run"] = None
    if get("2bw").fits(stages, micro_batches):
        runs = [
            simulate_schedule("2bw", micro_batches, stages, n, forward=forward, backward=backward, step=0.0)
            for n in (batches, batches + 1)
        ]
        extra = runs[1].makespan - runs[0].makespan
        out["2bw"] = max(0.0, 1.0 - micro_batches * (forward + backward) / extra)
        out["2bw-run"] = max(runs[0].idle_fraction)
    return out


def ideal_timeline(
    kind: str,
    stages: int,
    micro_batches: int,
    batches: int,
    forward: float = 1.0,
    backward: float = 2.0,
    step: float = 1.0,
) -> "Timeline":
    """The timeline of the instruction streams the engine executes for ``kind`` (a declared schedule with a stream:
    1f1b, 2bw, paci, ...; or gpipe), replayed against each other with unit costs (F, B and optimizer step
    durations); an unknown kind is one line."""
    from asyncpipe.schedules.streams import drawn_only, streamed
    from asyncpipe.timelines.timeline import simulate_schedule

    if kind not in streamed(kind) and "." not in kind:
        known = list(dict.fromkeys(streamed() + list(sync_schedules())))
        raise UserError(f"--schedule {kind!r} is unknown; choose one of: {', '.join(known)}")
    if stages < 1 or micro_batches < 1 or batches < 1:
        raise UserError("--stages, --micro-batches and --batches must all be >= 1")
    spec = get(kind) if kind in streamed(kind) and kind not in drawn_only() else None
    if spec is not None and not spec.fits(stages, micro_batches):
        need = spec.min_micro_batches(stages) if spec.min_micro_batches else 1
        raise UserError(
            f"--schedule {kind} needs --micro-batches >= {'--stages' if need == stages else need}, got "
            f"{micro_batches} < {need} (too few to carry its order across batches)"
        )
    return simulate_schedule(kind, micro_batches, stages, batches, forward=forward, backward=backward, step=step)


def sync_timeline(
    kind: str, stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0
) -> "Timeline":
    """One batch of the synchronous schedule ``kind`` (1f1b, zb-h1, interleaved-1f1b, dualpipev), replayed by
    data dependencies."""
    return replay(plan(kind, stages, micro_batches), forward, backward)


def format_bubbles(table: dict[str, Optional[float]], batches: int) -> str:
    """`bubble_table` as text lines (n/a where a schedule cannot run)."""
    notes = {s.name: s.bubble_note for s in schedules()}
    notes.update({name: note for name, (_, note) in drawn_orders().items()})
    notes["2bw-run"] = f"{batches} batches: one fill and drain"
    lines = ["bubble (idle fraction of the most idle stage per batch, optimizer step free):"]
    for k, v in table.items():
        lines.append(f"  {k:17s} {'n/a' if v is None else f'{v:.3f}':>6s}  {notes.get(k, '')}")
    return "\n".join(lines) + "\n"
