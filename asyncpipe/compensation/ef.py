"""``compensation=ef``: EF (Zmushko et al. 2026), x(t+1) = x(t) - u(t) - lam(t) (u(t) - u(t-1)), lambda constant or
warmed up; its settings, value checks and memory (u(t-1) plus the step's snapshot). The rule:
`asyncpipe.optim.compensation.ef`.

Also declared here, all that names EF outside this module: its run label and run-dir tag (``muon + EF(lam=1)``,
``muon_ef``); the *_ef presets' switch ``optimizer.ef.enabled`` (and ``optimizer.ef.lam``), an alias of this method
with a constant lambda that `asyncpipe.config.alias` resolves at composition (so lambda is checked here only); and
the fingerprint key ``ef`` its checkpoints have always carried (`asyncpipe.runtime.checkpoint`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.registry import Switch, declare_method

SCHEDULES = ("constant", "warmup")


@dataclass
class EFCompensation:
    lam: float = 1.0  # EF strength lambda (>= 0): x -= u(t-1) + lam * (u(t-1) - u(t-2))
    schedule: str = "constant"  # constant, or warmup: lam * min(1, (t+1) / warmup_steps)
    warmup_steps: int = 0  # steps of the linear lambda warm-up (schedule=warmup)


@dataclass
class EFSwitch:
    """``optimizer.ef``: the ``adamw_ef`` / ``muon_ef`` presets' switch, as sweep files and run records write it."""

    enabled: bool = False  # error feedback on: compensation=ef
    lam: float = 1.0  # EF strength lambda: compensation.ef.lam


def switch_settings(node: Any) -> dict:
    """What ``optimizer.ef.enabled=true`` sets in ``compensation.ef``: its lambda, constant."""
    return {"lam": node.get("lam", 1.0), "schedule": "constant", "warmup_steps": 0}


def check_ef(c: Any, cfg: Any) -> None:
    """EF's value checks (the one check of lambda; ``optimizer.ef.lam`` arrives here through the alias)."""
    if c.lam < 0:
        raise ConfigError(f"compensation.ef.lam={c.lam} must be >= 0 (optimizer.ef.lam is its alias)")
    if c.schedule not in SCHEDULES:
        raise ConfigError(
            f"compensation.ef.schedule={c.schedule} is not allowed; choose one of: {', '.join(SCHEDULES)}"
        )
    if c.warmup_steps < 0 or (c.schedule == "warmup" and c.warmup_steps < 1):
        raise ConfigError(
            f"compensation.ef.warmup_steps={c.warmup_steps} must be >= 1 with schedule=warmup (>= 0 always)"
        )


declare_method(
    "ef",
    build="asyncpipe.optim.compensation.ef:build_ef",
    fits_2bw=True,
    note="one parameter-sized buffer u(t-1) (optimizer state, no weight version)",
    buffers=2,
    key="ef",
    config=EFCompensation,
    check=check_ef,
    label=lambda c: f"EF(lam={c.ef.lam:g})",
    tag="_ef",
    switch=Switch("ef", EFSwitch, switch_settings, origin="the *_ef presets"),
    fingerprint_key="ef",
)
