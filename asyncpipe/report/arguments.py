"""`asyncpipe report`'s arguments as typed: --target and --wallclock-at read from their text, --out checked, and
the report command called with them (the Typer command in `asyncpipe/cli.py` only declares its options)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from asyncpipe.errors import UserError
from asyncpipe.paths import writable_dir
from asyncpipe.report.build import Report
from asyncpipe.report.command import report_command
from asyncpipe.report.paper import PAPER


def parse_target(text: str | None) -> float | str | None:
    """`--target 85` (a percentage, as a fraction) or `--target paper`; anything else is one line."""
    if text is None:
        return None
    if text.strip().lower() == PAPER:
        return PAPER
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 100:
        raise UserError(
            f"--target {text}: give a percentage in (0, 100] (e.g. 85) or 'paper' (each optimizer's "
            "closure in the paper's table)"
        )
    return value / 100


def parse_depth(text: str | None) -> tuple[int, int] | None:
    """`--wallclock-at 4,8` as (P, m); anything but two positive integers with m >= P is one line."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[1]) < int(parts[0]):
        raise UserError(f"--wallclock-at {text}: give P,m (pipeline stages and micro-batches, m >= P), e.g. 4,8")
    return int(parts[0]), int(parts[1])


def report_from_arguments(
    sweep_dirs: Optional[Sequence[Path]],
    out: Optional[Path],
    *,
    target: Optional[str] = None,
    select_seeds: Optional[str] = None,
    wallclock_at: Optional[str] = None,
    bench: Optional[Sequence[Path]] = None,
    say: Callable[[str], Any] = print,
    **options: Any,
) -> Report:
    """`report_command` with the command line's values: ``out`` must be a writable dir, ``target`` a percentage or
    `paper`, ``select_seeds`` comma-separated seeds, ``wallclock_at`` `P,m`; the other ``options`` pass through."""
    if out is not None:
        writable_dir(out, "--out")
    return report_command(
        sweep_dirs or [],
        out,
        say=say,
        target=parse_target(target),
        bench=bench or [],
        select_seeds=select_seeds.split(",") if select_seeds else None,
        wallclock_at=parse_depth(wallclock_at),
        **options,
    )
