"""DualPipeV (`pipeline.schedule=dualpipev`, delay 0): DeepSpeed's `DualPipeVSchedule`, the strongest synchronous
baseline. The model is cut into 2P chunks in a V (rank r holds chunk r and chunk 2P-1-r, so rank 0 holds the
embedding and the loss); one weight version, a flush per batch. The engine is `asyncpipe.pipe.dualpipev`'s.
Its one-batch order is DeepSpeed's `DualPipeVSchedule`'s (which keeps W inside B), written out here without importing
DeepSpeed (`dualpipev_from_deepspeed` reads DeepSpeed's own, for the test)."""

from __future__ import annotations

from typing import Any

from asyncpipe.errors import ConfigError, UserError
from asyncpipe.schedules import ScheduleSpec, declare_schedule, uniform
from asyncpipe.schedules.orders import Op, Plan


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
    ]


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


def in_flight(P: int, m: int, stage: int) -> list[int]:
    """Peak micro-batches held per chunk of rank ``stage`` (its own chunk, then its mirror), counted on
    DeepSpeed's DualPipeV order (`dualpipev` above)."""
    plan = dualpipev(P, m)
    own, mirror = stage, 2 * P - 1 - stage
    held, peak = {own: 0, mirror: 0}, {own: 0, mirror: 0}
    for op in plan.ranks[stage]:
        held[op.chunk] += 1 if op.kind == "F" else -1 if op.kind == "B" else 0
        peak[op.chunk] = max(peak[op.chunk], held[op.chunk])
    return [peak[own], peak[mirror]]


def _check(cfg: Any) -> None:
    t, p, m = cfg.train, cfg.pipeline, cfg.model
    if cfg.engine != "pipeline":
        return
    if t.micro_batches < 2 * p.stages or t.eval_batches // p.data_parallel < 2 * p.stages:
        raise ConfigError(
            f"pipeline.schedule=dualpipev needs train.micro_batches and train.eval_batches per replica "
            f">= 2 x pipeline.stages = {2 * p.stages}, got {t.micro_batches} and {t.eval_batches}"
        )
    if 2 * p.stages > m.n_layer:
        raise ConfigError(
            f"pipeline.schedule=dualpipev cuts the model into 2 x {p.stages} chunks of at least one "
            f"block; model '{m.name}' has {m.n_layer} blocks"
        )


SPEC = declare_schedule(
    ScheduleSpec(
        name="dualpipev",
        note="synchronous DualPipeV (DeepSpeed's): 2 chunks per rank in a V, a flush per batch",
        versions=uniform(0),
        weight_versions=lambda P, s: 1,
        in_flight=in_flight,
        stream=None,
        order=dualpipev,
        bubble_note="2 chunks per rank (V), W inside B",
        label="DualPipeV",
        delay=0,
        chunks=2,
        check=_check,
        engine_class="asyncpipe.pipe.dualpipev:DualPipeVRunEngine",
        module_class="asyncpipe.pipe.dualpipev:DualPipeVModule",
        stage_delay=lambda P, s, delay: 0,
    )
)
