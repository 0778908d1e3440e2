"""DualPipeV (`pipeline.schedule=dualpipev`, delay 0): DeepSpeed's `DualPipeVSchedule`, the strongest synchronous
baseline. The model is cut into 2P chunks in a V (rank r holds chunk r and chunk 2P-1-r, so rank 0 holds the
embedding and the loss); one weight version, a flush per batch. The engine is `asyncpipe.pipe.dualpipev`'s."""

from __future__ import annotations

from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.schedules import ScheduleSpec, declare_schedule, uniform


def in_flight(P: int, m: int, stage: int) -> list[int]:
    """Peak micro-batches held per chunk of rank ``stage`` (its own chunk, then its mirror), counted on
    DeepSpeed's DualPipeV order (`asyncpipe.timelines.orders.dualpipev`)."""
    from asyncpipe.timelines.orders import dualpipev

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
        raise ConfigError(f"pipeline.schedule=dualpipev needs train.micro_batches and train.eval_batches per replica "
                          f">= 2 x pipeline.stages = {2 * p.stages}, got {t.micro_batches} and {t.eval_batches}")
    if 2 * p.stages > m.n_layer:
        raise ConfigError(f"pipeline.schedule=dualpipev cuts the model into 2 x {p.stages} chunks of at least one "
                          f"block; model '{m.name}' has {m.n_layer} blocks")


SPEC = declare_schedule(ScheduleSpec(
    name="dualpipev", note="synchronous DualPipeV (DeepSpeed's): 2 chunks per rank in a V, a flush per batch",
    versions=uniform(0), weight_versions=lambda P, s: 1, in_flight=in_flight, stream=None, orders="dualpipev",
    delay=0, chunks=2, check=_check, engine_class="asyncpipe.pipe.dualpipev:DualPipeVRunEngine",
    module_class="asyncpipe.pipe.dualpipev:DualPipeVModule", stage_delay=lambda P, s, delay: 0,
))  # fmt: skip
