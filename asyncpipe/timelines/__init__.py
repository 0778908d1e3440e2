"""Pipeline schedules on paper: ideal and measured timelines, op orders replayed by data dependencies, bubbles, and
the pictures drawn from them. Pure Python (no torch, no deepspeed at import); the runtime that executes schedules is
`asyncpipe.engines.pipeline`, the schedule declarations `asyncpipe.schedules`."""
