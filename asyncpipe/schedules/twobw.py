"""PipeDream-2BW (`pipeline.schedule=2bw`, delay 1): 1F1B carried across batch boundaries with no flush, one step
per batch per stage, batch b pinned to W(b-1) on every stage (two weight versions). The stream is
`asyncpipe.pipe.schedule.TwoBWSchedule`. In the simulator ``delay`` = k >= 1 generalises it to a uniform k-step
delay (k+1 versions, simulator only)."""

from __future__ import annotations

from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight, uniform


def _stream(m: int, P: int, stage: int, batches: int, start: int = 0, defer_step: bool = False) -> Any:
    from asyncpipe.pipe.schedule import TwoBWSchedule

    return TwoBWSchedule(m, P, stage, batches, defer_step, start).steps()


def _check(cfg: Any) -> None:
    if cfg.delay < 1:
        raise ConfigError(f"pipeline.schedule=2bw is one step stale: use delay >= 1 (the simulator's k), got delay={cfg.delay}")
    if cfg.engine == "pipeline":
        if cfg.delay != 1:
            raise ConfigError(f"engine=pipeline supports delay 0 (1F1B) or 1 (2BW), got delay={cfg.delay}")
        t, p = cfg.train, cfg.pipeline
        if t.micro_batches < p.stages:
            raise ConfigError(f"2BW needs train.micro_batches >= pipeline.stages, got {t.micro_batches} < {p.stages}")


SPEC = declare_schedule(ScheduleSpec(
    name="2bw", note="PipeDream-2BW: no flush, every micro-batch of batch b on W(b-1), two weight versions",
    versions=uniform(1), weight_versions=lambda P, s: 2, in_flight=one_f_one_b_in_flight,
    stream=_stream, check=_check, flush=False, stage_delay=lambda P, s, delay: delay, in_order=True,
))  # fmt: skip
