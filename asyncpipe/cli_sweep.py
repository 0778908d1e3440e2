"""The `asyncpipe sweep` command: thin Typer functions over `asyncpipe.launch` (registered by asyncpipe/cli.py).

`asyncpipe sweep status DIR/NAME` is dispatched from the same command: `status` is never a valid override.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from asyncpipe.errors import UserError

EXIT_FAILED_RUNS = 1

SWEEP_OVERRIDES = typer.Argument(
    None,
    help="Hydra overrides; comma lists, range() and glob() are swept, e.g. optimizer=muon,adamw delay=0,1 "
    "seed=range(0,3). launcher=slurm / launcher.parallel=2 configure the sweep itself. "
    "`asyncpipe sweep status DIR/NAME` shows a sweep's runs.",
    show_default=False,
)


def sweep(
    overrides: Optional[List[str]] = SWEEP_OVERRIDES,
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="A named sweep YAML (name, grid, overrides), e.g. sweeps/smoke.yaml."),
    name: Optional[str] = typer.Option(None, "--name", help="Sweep name (default: the file's name, else sweep-DATE-TIME)."),
    out: Path = typer.Option(Path("runs/sweeps"), "--out", help="Sweeps live in OUT/NAME/."),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Start failed and diverged runs again (old attempts move to .retired/)."),
    detach: bool = typer.Option(False, "--detach", help="launcher=slurm: return once submitted instead of watching the jobs."),
) -> None:
    """Run a grid of training runs (locally or on SLURM); re-running skips completed runs and resumes the rest."""
    args = list(overrides or [])
    if args and args[0] == "status":
        if len(args) != 2 or file is not None:
            raise UserError("usage: asyncpipe sweep status DIR/NAME")
        status(Path(args[1]))
        return
    from asyncpipe.launch import run_sweep

    result = run_sweep(args, file=file, name=name, out=out, retry_failed=retry_failed, wait=not detach)
    typer.echo(result.summary())
    if result.failed:
        raise typer.Exit(EXIT_FAILED_RUNS)


def status(sweep_dir: Path = typer.Argument(..., help="A sweep directory, e.g. runs/sweeps/NAME.")) -> None:
    """Show each run of a sweep: pending, queued, running, completed, diverged, failed or interrupted."""
    from asyncpipe.launch import sweep_status

    sweep_status(sweep_dir)

