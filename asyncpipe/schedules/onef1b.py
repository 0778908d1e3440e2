"""1F1B with a flush per batch (`pipeline.schedule=1f1b`, delay 0): DeepSpeed's own `TrainSchedule`, run unchanged
by the engine. Stage s runs P-1-s warm-up forwards, then one forward per backward, then drains; the optimizer
steps once per batch on W(b) after every backward of batch b. One weight version."""

from __future__ import annotations

from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight, uniform


def _ideal(m: int, P: int, stage: int, batches: int, start: int = 0, defer_step: bool = False) -> list:
    from asyncpipe.pipe.schedule import flushed_1f1b_stream  # TrainSchedule's order, without DeepSpeed

    return [flushed_1f1b_stream(m, P, stage, batches)]


SPEC = declare_schedule(ScheduleSpec(
    name="1f1b", note="synchronous 1F1B with a flush per batch (DeepSpeed's TrainSchedule)",
    versions=uniform(0), weight_versions=lambda P, s: 1, in_flight=one_f_one_b_in_flight,
    stream=None, ideal=_ideal, delay=0, stage_delay=lambda P, s, delay: 0,
))  # fmt: skip
