"""PipeDream (`pipeline.schedule=pipedream`, or the old ``delay_profile=pipedream``): weight stashing with one
update per batch, stage s of P reading weights P-1-s steps old (P-s versions on stage s). Simulator only: the
pipeline engine holds at most two versions."""

from __future__ import annotations

from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.schedules import ScheduleSpec, declare_schedule


def _versions(P: int, m: int, stage: int, k: int) -> tuple[int, int]:
    v = max(k // m - (P - 1 - stage), 0)
    return v, v


def _check(cfg: Any) -> None:
    if cfg.delay_profile != "pipedream" or cfg.delay != 1:
        raise ConfigError(
            "delay_profile=pipedream (the pipedream schedule) delays stage s by P-1-s steps; use it with "
            f"delay=1 and delay_profile=pipedream, got delay={cfg.delay}, delay_profile={cfg.delay_profile}"
        )


SPEC = declare_schedule(
    ScheduleSpec(
        name="pipedream",
        note="PipeDream: stage s reads weights P-1-s steps old",
        versions=_versions,
        weight_versions=lambda P, s: P - s,
        in_flight=lambda P, m, s: [P - s],
        engines=("simulate",),
        check=_check,
        flush=False,
        stage_delay=lambda P, s, delay: P - 1 - s,
    )
)
