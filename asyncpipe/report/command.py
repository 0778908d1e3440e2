"""`asyncpipe report` behind its arguments: the report of sweep dirs or of a W&B group, printed, its files listed,
and mirrored to a W&B report run of the group."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from asyncpipe.errors import UserError
from asyncpipe.report.build import Report, build_report
from asyncpipe.report.render import print_report
from asyncpipe.report.wandb_log import log_report_to_wandb
from asyncpipe.report.wandb_source import build_report_from_wandb


def report_command(
    sweep_dirs: Sequence[Path],
    out: Optional[Path],
    *,
    wandb_project: Optional[str] = None,
    group: Optional[str] = None,
    log_wandb: bool = True,
    say: Callable[[str], Any] = print,
    **options: Any,
) -> Report:
    """Build the report (from W&B with ``wandb_project`` and ``group``, else from ``sweep_dirs`` with the
    `build_report` ``options``), print it, `say` each file written and, with ``log_wandb``, where its W&B copy went."""
    if wandb_project:
        if not group:
            raise UserError("--wandb needs --group (the sweep name the runs were grouped under)")
        rep = build_report_from_wandb(wandb_project, group, out or Path("reports") / group)
    elif sweep_dirs:
        rep = build_report(list(sweep_dirs), out, **options)
    else:
        raise UserError("give a sweep directory (asyncpipe report DIR/NAME) or --wandb ENTITY/PROJECT --group G")
    print_report(rep)
    for path in rep.files.values():
        say(f"wrote {path}")
    if log_wandb and sweep_dirs and log_report_to_wandb(rep):
        say(rep.wandb_message)
    return rep
