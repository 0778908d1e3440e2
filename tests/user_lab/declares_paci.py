"""A schedule declared under a built-in schedule's name."""

from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight, uniform

declare_schedule(
    ScheduleSpec(
        name="paci",
        note="my own PACI",
        versions=uniform(0),
        weight_versions=lambda P, s: 1,
        in_flight=one_f_one_b_in_flight,
        stage_delay=lambda P, s, delay: 0,
    )
)
