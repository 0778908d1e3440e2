"""Synchronous schedules that shrink the flush bubble, as per-rank compute orders replayed by data dependencies.

A schedule here is, per pipeline rank, the order in which it runs forwards (F), backwards (B) and, for
zero-bubble schedules, deferred weight-gradient passes (W) of one batch, on model chunks (virtual stages).
`replay` starts every op as soon as its rank is free and its inputs exist (communication is free and eager):
the idealised timeline, its bubble, and a deadlock check. Pure Python: no torch.

- ``1f1b``: one chunk per rank, P-1-r warm-up forwards, then one forward and one backward (DeepSpeed's flushed
  1F1B; the same order as `asyncpipe.pipe.schedule.train_schedule_stream`, here without instructions).
- ``zb-h1``: 1F1B with the backward split into B (input gradient, on the critical path) and W (weight
  gradient); rank r holds back its W's by r backwards and runs them after the last B (Qi et al. 2023).
- ``interleaved-1f1b``: v chunks per rank, chunk c on rank c mod P; forwards go round the chunks in groups of
  P micro-batches, depth first (Narayanan et al. 2021).
- ``dualpipev``: two chunks per rank in a V: rank r holds chunk r and chunk 2P-1-r, so rank 0 runs both the
  embedding and the loss. The order is DeepSpeed's `DualPipeVSchedule`'s (which keeps W inside B), written out
  here without importing DeepSpeed (`dualpipev_from_deepspeed` reads DeepSpeed's own, for the test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from asyncpipe.errors import UserError

if TYPE_CHECKING:
    from asyncpipe.timelines.timeline import Timeline



@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" (whole backward, or input gradient when the plan splits it), "W" (weight gradient)
    chunk: int  # virtual stage: 0 holds the embedding, n_chunks - 1 the loss
    micro_batch: int


@dataclass
class Plan:
    """One batch of a synchronous schedule: each rank's op order and which rank holds each chunk."""

    name: str
    stages: int  # pipeline ranks P
    micro_batches: int
    chunk_rank: list[int]  # chunk -> rank
    ranks: list[list[Op]]
    split_backward: bool = False  # B is the input gradient only and a W op follows

    @property
    def chunks_per_rank(self) -> int:
        return len(self.chunk_rank) // self.stages


def one_f_one_b(stages: int, micro_batches: int) -> Plan:
    ranks = []
    for r in range(stages):
        warm = min(stages - 1 - r, micro_batches)
        ops = [Op("F", r, k) for k in range(warm)]
        for i in range(micro_batches - warm):
            ops += [Op("F", r, warm + i), Op("B", r, i)]
        ops += [Op("B", r, k) for k in range(micro_batches - warm, micro_batches)]
        ranks.append(ops)
    return Plan("1f1b", stages, micro_batches, list(range(stages)), ranks)


def zb_h1(stages: int, micro_batches: int) -> Plan:
    """1F1B order of F and B (input gradient); each W follows a later B so that rank r lags r W's behind,
    and the lagging W's run after the rank's last B, where 1F1B would wait for the drain."""
    ranks = []
    for r in range(stages):
        warm = min(stages - 1 - r, micro_batches)
        ops, done_b, done_w = [Op("F", r, k) for k in range(warm)], 0, 0

        def backward(k: int) -> list[Op]:
            nonlocal done_b, done_w
            out = [Op("B", r, k)]
            done_b += 1
            if done_b > r:  # W of the oldest backward whose W is still pending
                out.append(Op("W", r, done_w))
                done_w += 1
            return out

        for i in range(micro_batches - warm):
            ops += [Op("F", r, warm + i)] + backward(i)
        for k in range(micro_batches - warm, micro_batches):
            ops += backward(k)
        ops += [Op("W", r, k) for k in range(done_w, micro_batches)]
        ranks.append(ops)
    return Plan("zb-h1", stages, micro_batches, list(range(stages)), ranks, split_backward=True)


def interleaved_1f1b(stages: int, micro_batches: int, chunks: int = 2) -> Plan:
    """Megatron's interleaved 1F1B with ``chunks`` model chunks per rank; needs m a multiple of P."""
    P, m, v = stages, micro_batches, chunks
    if m % P:
        raise UserError(f"interleaved-1f1b needs micro-batches divisible by stages (got m={m}, P={P})")
    total = m * v

    def unit(i: int, backward: bool) -> tuple[int, int]:
        """The i-th forward (or backward) unit of a rank: (local chunk, micro-batch), P micro-batches per group."""
        group, j = divmod(i, P * v)
        local = j // P
        return (v - 1 - local if backward else local), group * P + j % P

    ranks = []
    for r in range(P):
        warm = min((P - 1 - r) * 2 + (v - 1) * P, total)
        ops = []
        for i in range(warm):
            c, k = unit(i, False)
            ops.append(Op("F", c * P + r, k))
        for i in range(total - warm):
            c, k = unit(warm + i, False)
            cb, kb = unit(i, True)
            ops += [Op("F", c * P + r, k), Op("B", cb * P + r, kb)]
        for i in range(total - warm, total):
            cb, kb = unit(i, True)
            ops.append(Op("B", cb * P + r, kb))
        ranks.append(ops)
    chunk_rank = [c % P for c in range(P * v)]
    return Plan("interleaved-1f1b", P, m, chunk_rank, ranks)


def dualpipev(stages: int, micro_batches: int) -> Plan:
    """DualPipeV's one-batch order as DeepSpeed's `DualPipeVSchedule` runs it (W inside B), without importing it:
    phase 0 of rank r is chunk r, phase 1 is chunk 2P-1-r; the n-th forward (backward) of a phase on a rank is
    micro-batch n; rank r runs `_dualpipev_rounds` in turn. Needs m >= 2P (DeepSpeed's own check).
    `tests/test_orders_dualpipev.py` holds it equal to `dualpipev_from_deepspeed` for P <= 8, 2P <= m <= 4P + 3."""
    P, m = stages, micro_batches
    if m < 2 * P:
        raise UserError(f"dualpipev needs micro-batches >= 2 x stages (got m={m}, P={P})")
    ranks = []
    for r in range(P):
        chunk = (r, 2 * P - 1 - r)
        seen = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        ops = []
        for repeats, pattern, _ in _dualpipev_rounds(P, m, r):
            for _ in range(repeats):
                for kind, phase in ((w[0], int(w[1])) for w in pattern.split()):
                    ops.append(Op(kind, chunk[phase], seen[(kind, phase)]))
                    seen[(kind, phase)] += 1
        ranks.append(ops)
    chunk_rank = list(range(P)) + list(reversed(range(P)))
    return Plan("dualpipev", P, m, chunk_rank, ranks)


def _dualpipev_rounds(P: int, m: int, r: int) -> list[tuple[int, str, int]]:
    """Rank r's batch of DualPipeV as (repeats, ops of one round, CommitP2P's per round), the eight steps of the
    DualPipe paper (DeepSeek-V3 report) folded into a V: F0/B0 run the rank's phase-0 chunk (towards the last rank),
    F1/B1 its phase-1 chunk (back towards rank 0). A rank further from the end (a = P-1-r) fills more of the warm-up
    with phase-0 forwards; the main rounds overlap a forward of one phase with a backward of the other."""
    a, b = P - 1 - r, r + 1
    return [
        (2 * a, "F0", 1),  # warm-up: phase-0 forwards until phase-1 inputs can arrive
        (b, "F0 F1", 2),
        (a, "B1 F1", 3),  # the third commit stands where the reference runs a deferred W
        (m - 2 * P + b, "F0 B1 F1 B0", 2),  # steady state: two overlapped forward-backward pairs
        (a, "B1 F1 B0", 2),
        (b, "B1 B0", 2),
        (a, "B0", 2),
        (b, "", 1),  # the reference's deferred W's: only their commits here
    ]  # fmt: skip


def dualpipev_instructions(stages: int, micro_batches: int, rank: int) -> int:
    """How many engine instructions DeepSpeed's `DualPipeVSchedule` gives rank ``rank`` for one batch: its passes,
    rank 0's micro-batch loads, a send and a receive each way across every chunk boundary to another rank, the
    CommitP2P's of `_dualpipev_rounds` (+ one where the last rank sends its first phase-1 activation apart, + the
    batch's closing one) and ReduceTiedGrads, ReduceGrads, OptimizerStep."""
    P, m, r = stages, micro_batches, rank
    chunk_rank = list(range(P)) + list(reversed(range(P)))
    mine = [c for c in range(2 * P) if chunk_rank[c] == r]
    crossings = sum((c > 0 and chunk_rank[c - 1] != r) + (c < 2 * P - 1 and chunk_rank[c + 1] != r) for c in mine)
    commits = sum(n * k for n, _, k in _dualpipev_rounds(P, m, r)) + (r == P - 1) + 1
    return 4 * m + (m if r == 0 else 0) + 2 * m * crossings + commits + 3


def dualpipev_from_deepspeed(stages: int, micro_batches: int) -> tuple[Plan, list[int]]:
    """The same order read from DeepSpeed's own `DualPipeVSchedule` (imported here: for the tests that hold
    `dualpipev` and `dualpipev_instructions` to it), and each rank's instruction count."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, DualPipeVSchedule, ForwardPass

    P, m = stages, micro_batches
    ranks, counts = [], []
    for r in range(P):
        seen = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        ops, n = [], 0
        for tick in DualPipeVSchedule(micro_batches=m, stages=P, stage_id=r):
            for cmd in tick:
                n += 1
                kind = "F" if isinstance(cmd, ForwardPass) else "B" if isinstance(cmd, BackwardPass) else None
                if kind is None:
                    continue
                k = seen[(kind, cmd.phase)]
                seen[(kind, cmd.phase)] = k + 1
                ops.append(Op(kind, r if cmd.phase == 0 else 2 * P - 1 - r, k))
        ranks.append(ops)
        counts.append(n)
    return Plan("dualpipev", P, m, list(range(P)) + list(reversed(range(P))), ranks), counts


PLANS: dict[str, Callable[[int, int], Plan]] = {
    "1f1b": one_f_one_b, "zb-h1": zb_h1, "interleaved-1f1b": interleaved_1f1b, "dualpipev": dualpipev,
}  # fmt: skip
SYNC_SCHEDULES = tuple(PLANS)  # the one-batch orders drawn by data dependencies


def plan(name: str, stages: int, micro_batches: int) -> Plan:
    if name not in PLANS:
        raise UserError(f"unknown synchronous schedule {name!r}; choose one of: {', '.join(PLANS)}")
    if stages < 1 or micro_batches < 1:
        raise UserError("stages and micro-batches must be >= 1")
    return PLANS[name](stages, micro_batches)


def deps(op: Op, n_chunks: int, split_backward: bool) -> list[Op]:
    """The ops whose results ``op`` reads."""
    if op.kind == "F":
        return [Op("F", op.chunk - 1, op.micro_batch)] if op.chunk > 0 else []
    if op.kind == "B":
        own = [Op("F", op.chunk, op.micro_batch)]
        return own + ([Op("B", op.chunk + 1, op.micro_batch)] if op.chunk < n_chunks - 1 else [])
    return [Op("B", op.chunk, op.micro_batch)]


def replay(p: Plan, forward: float = 1.0, backward: float = 2.0, weight_share: float = 0.5,
           chunk_costs: Optional[dict[str, Sequence[float]]] = None, latency: float = 0.0,
           op_overhead: float = 0.0) -> "Timeline":  # fmt: skip
    """Run every rank's order against the others: an op starts when its rank is free and its dependencies
    are done. ``forward``/``backward`` are the costs of a whole stage's worth of layers (a chunk costs 1/chunks
    per rank of it); with a split backward, B costs (1 - weight_share) of it and W the rest. Raises
    `ScheduleError` on a deadlock, a dependency on an op no rank runs, or an op run twice or on the wrong rank.
    ``chunk_costs`` ({"F": [...], "B": [...]}, one cost per chunk) replaces the uniform costs (the cost model's
    measured, unequal chunks); ``latency`` delays a result read on another rank; ``op_overhead`` is added to
    every op (the engine's instructions around it)."""
    from asyncpipe.timelines.timeline import Event, ScheduleError, Timeline

    n_chunks, v = len(p.chunk_rank), p.chunks_per_rank
    cost = {"F": forward / v, "B": backward / v, "W": 0.0}
    if p.split_backward:
        cost["B"], cost["W"] = backward * (1 - weight_share) / v, backward * weight_share / v

    def duration(op: Op) -> float:
        if chunk_costs is None or op.kind not in chunk_costs:
            return cost[op.kind] + op_overhead
        return float(chunk_costs[op.kind][op.chunk]) + op_overhead
    owner: dict[Op, int] = {}
    for r, ops in enumerate(p.ranks):
        for op in ops:
            if op in owner:
                raise ScheduleError(f"{op} runs twice (ranks {owner[op]} and {r})")
            if p.chunk_rank[op.chunk] != r:
                raise ScheduleError(f"rank {r} runs {op}, but chunk {op.chunk} lives on rank {p.chunk_rank[op.chunk]}")
            owner[op] = r
    end: dict[Op, float] = {}
    pc, clock = [0] * p.stages, [0.0] * p.stages
    events, busy = [], [0.0] * p.stages
    while any(pc[r] < len(p.ranks[r]) for r in range(p.stages)):
        moved = False
        for r in range(p.stages):
            while pc[r] < len(p.ranks[r]):
                op = p.ranks[r][pc[r]]
                need = deps(op, n_chunks, p.split_backward)
                missing = [d for d in need if d not in owner]
                if missing:
                    raise ScheduleError(f"{op} on rank {r} needs {missing[0]}, which no rank runs")
                if any(d not in end for d in need):
                    break
                start = max([clock[r]] + [end[d] + (latency if owner[d] != r else 0.0) for d in need])
                dur = duration(op)
                kind = {"F": "forward", "B": "backward", "W": "weight"}[op.kind]
                events.append(Event(r, kind, op.micro_batch, start, start + dur, chunk=op.chunk))
                end[op] = clock[r] = start + dur
                busy[r] += dur
                pc[r] += 1
                moved = True
        if not moved:
            stuck = "; ".join(f"rank {r} at {p.ranks[r][pc[r]]}" for r in range(p.stages) if pc[r] < len(p.ranks[r]))
            raise ScheduleError(f"{p.name}: deadlock: {stuck}")
    return Timeline(events, max(clock, default=0.0), busy)


def bubble(name: str, stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0) -> Optional[float]:
    """Idle fraction of the busiest-idle rank over one batch of ``name`` (None where it cannot run)."""
    try:
        tl = replay(plan(name, stages, micro_batches), forward, backward)
    except UserError:
        return None
    return max(tl.idle_fraction)


def bubble_table(stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0,
                 batches: int = 3) -> dict[str, Optional[float]]:  # fmt: skip
    """Per schedule, the bubble of one batch with a free optimizer step (None where it cannot run this P and m).
    A synchronous schedule flushes every batch, so that is its idle fraction over one batch; ``2bw`` is the
    idle share of the time one more batch adds to a run (its steady state; 0 with equal stages) and ``2bw-run``
    the idle fraction of a ``batches``-batch run, which pays one fill and drain."""
    from asyncpipe.timelines.timeline import simulate_schedule

    out: dict[str, Optional[float]] = {k: bubble(k, stages, micro_batches, forward, backward) for k in SYNC_SCHEDULES}
    out["2bw"] = out["2bw-run"] = None
    if micro_batches >= stages:
        runs = [simulate_schedule("2bw", micro_batches, stages, n, forward=forward, backward=backward, step=0.0)
                for n in (batches, batches + 1)]  # fmt: skip
        extra = runs[1].makespan - runs[0].makespan
        out["2bw"] = max(0.0, 1.0 - micro_batches * (forward + backward) / extra)
        out["2bw-run"] = max(runs[0].idle_fraction)
    return out


def ideal_timeline(kind: str, stages: int, micro_batches: int, batches: int,
                   forward: float = 1.0, backward: float = 2.0, step: float = 1.0) -> "Timeline":  # fmt: skip
    """The timeline of the instruction streams the engine executes for ``kind`` (a declared schedule with a stream:
    1f1b, 2bw, paci, ...; or gpipe), replayed against each other with unit costs (F, B and optimizer step
    durations); an unknown kind is one line."""
    from asyncpipe.pipe.schedule import streamed
    from asyncpipe.timelines.timeline import simulate_schedule

    if kind not in streamed(kind) and "." not in kind:
        known = list(dict.fromkeys(streamed() + list(SYNC_SCHEDULES)))
        raise UserError(f"--schedule {kind!r} is unknown; choose one of: {', '.join(known)}")
    if stages < 1 or micro_batches < 1 or batches < 1:
        raise UserError("--stages, --micro-batches and --batches must all be >= 1")
    if kind == "2bw" and micro_batches < stages:
        raise UserError(f"--schedule 2bw needs --micro-batches >= --stages, got {micro_batches} < {stages} (with fewer, "
                        "stage 0 would start batch b+2 before step b made its weights)")  # fmt: skip
    return simulate_schedule(kind, micro_batches, stages, batches, forward=forward, backward=backward, step=step)


def sync_timeline(kind: str, stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0) -> "Timeline":
    """One batch of the synchronous schedule ``kind`` (1f1b, zb-h1, interleaved-1f1b, dualpipev), replayed by
    data dependencies."""
    return replay(plan(kind, stages, micro_batches), forward, backward)


def format_bubbles(table: dict[str, Optional[float]], batches: int) -> str:
    """`bubble_table` as text lines (n/a where a schedule cannot run)."""
    notes = {"1f1b": "(P-1)/(m+P-1)", "zb-h1": "B and W split in halves", "interleaved-1f1b": "2 chunks per rank",
             "dualpipev": "2 chunks per rank (V), W inside B", "2bw": "steady state: no flush",
             "2bw-run": f"{batches} batches: one fill and drain"}  # fmt: skip
    lines = ["bubble (idle fraction of the most idle stage per batch, optimizer step free):"]
    for k, v in table.items():
        lines.append(f"  {k:17s} {'n/a' if v is None else f'{v:.3f}':>6s}  {notes.get(k, '')}")
    return "\n".join(lines) + "\n"
