"""DualPipeV (`pipeline.schedule=dualpipev`, delay 0): DeepSpeed's `DualPipeVSchedule`, the strongest synchronous
baseline. The model is cut into 2P chunks in a V (rank r holds chunk r and chunk 2P-1-r, so rank 0 holds the
embedding and the loss); one weight version, a flush per batch. The engine is `asyncpipe.engines.pipeline.dualpipev`'s.
Its one-batch order is DeepSpeed's `DualPipeVSchedule`'s (which keeps W inside B), written out here without importing
DeepSpeed (`dualpipev_from_deepspeed` reads DeepSpeed's own, for the test); its per-rank instruction stream, with
DeepSpeed's commits, is `dualpipev_stream`'s (the cost model replays it)."""

from __future__ import annotations

from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.schedules import ScheduleSpec, declare_schedule, uniform
from asyncpipe.schedules.dualpipev_stream import dualpipev_stream
from asyncpipe.schedules.instructions import BackwardPass, ForwardPass, flatten
from asyncpipe.schedules.orders import Op, Plan


def dualpipev(stages: int, micro_batches: int) -> Plan:
    """DualPipeV's one-batch order as DeepSpeed's `DualPipeVSchedule` runs it (W inside B), without importing it:
    each rank's passes in its stream's order (`dualpipev_stream`): phase 0 of rank r is chunk r, phase 1 is chunk
    2P-1-r; the n-th forward (backward) of a phase on a rank is micro-batch n. Needs m >= 2P (DeepSpeed's own
    check; the stream refuses fewer in one line). `tests/test_orders_dualpipev.py` holds it equal to
    `dualpipev_from_deepspeed` for P <= 8, 2P <= m <= 4P + 3."""
    P, m = stages, micro_batches
    ranks = []
    for r in range(P):
        passes = [c for c in flatten(dualpipev_stream(m, P, r)) if isinstance(c, (ForwardPass, BackwardPass))]
        ranks.append([Op("F" if isinstance(c, ForwardPass) else "B", c.chunk, c.micro_batch) for c in passes])
    chunk_rank = list(range(P)) + list(reversed(range(P)))
    return Plan("dualpipev", P, m, chunk_rank, ranks)


def dualpipev_instructions(stages: int, micro_batches: int, rank: int) -> int:
    """How many engine instructions DeepSpeed's `DualPipeVSchedule` gives rank ``rank`` for one batch: its stream
    written out (`dualpipev_stream`) and the `ReduceTiedGrads` our vocabulary leaves out."""
    return len(flatten(dualpipev_stream(micro_batches, stages, rank))) + 1


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
        cost_stream=dualpipev_stream,
        bubble_note="2 chunks per rank (V), W inside B",
        label="DualPipeV",
        delay=0,
        chunks=2,
        check=_check,
        engine_class="asyncpipe.engines.pipeline.dualpipev:DualPipeVRunEngine",
        module_class="asyncpipe.engines.pipeline.dualpipev:DualPipeVModule",
        stage_delay=lambda P, s, delay: 0,
    )
)
