"""The `asyncpipe sweep` commands: thin Typer functions over `asyncpipe.sweep` (registered by asyncpipe/cli.py).

`asyncpipe sweep ARGS` is `asyncpipe sweep run ARGS`; `asyncpipe sweep status DIR/NAME` is its own subcommand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer
from typer.core import TyperGroup

EXIT_FAILED_RUNS = 1


class DefaultRun(TyperGroup):
    """A group whose first argument, when it is not a subcommand (or --help), starts the `run` subcommand."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=DefaultRun,
    no_args_is_help=True,
    help="Run a grid of training runs (locally or on SLURM), or show a sweep's state. "
    "`asyncpipe sweep OVERRIDES` is short for `asyncpipe sweep run OVERRIDES`.",
)

SWEEP_OVERRIDES = typer.Argument(
    None,
    help="Hydra overrides; comma lists, range() and glob() are swept, e.g. optimizer=muon,adamw delay=0,1 "
    "seed=range(0,3). launcher=slurm / launcher.parallel=2 configure the sweep itself. With --file they come "
    "after the file's (seed=0,1,2 replaces its seeds).",
    show_default=False,
)


@app.command("run")
def sweep(
    overrides: Optional[List[str]] = SWEEP_OVERRIDES,
    file: Optional[Path] = typer.Option(
        None, "--file", "-f", help="A sweep file (name, grid, variants, per, overrides), e.g. sweeps/smoke.yaml."
    ),
    name: Optional[str] = typer.Option(
        None,
        "--name",
        help="Sweep name (default: the file's name, else sweep-DATE-TIME). Re-using a name resumes or extends that sweep.",
    ),
    out: Path = typer.Option(Path("runs/sweeps"), "--out", help="Sweeps live in OUT/NAME/."),
    retry_failed: bool = typer.Option(
        False, "--retry-failed", help="Start failed and diverged runs again (old attempts move to .retired/)."
    ),
    detach: bool = typer.Option(
        False, "--detach", help="launcher=slurm: return once submitted instead of watching the jobs."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Print the runs, their tokens and an estimated wall time (from recorded runs under OUT); launch nothing.",
    ),
) -> None:
    """Run a sweep: the grid crossed with the file's variants, one run dir each under OUT/NAME.

    Re-running it skips completed runs and resumes the rest; more seeds or values under the same name add runs
    (the fixed overrides must stay the same)."""
    if dry_run:
        from asyncpipe.sweep import dry_run_sweep

        typer.echo(dry_run_sweep(list(overrides or []), file=file, name=name, out=out))
        return
    from asyncpipe.sweep import run_sweep

    result = run_sweep(list(overrides or []), file=file, name=name, out=out, retry_failed=retry_failed, wait=not detach)
    typer.echo(result.summary())
    if result.failed:
        raise typer.Exit(EXIT_FAILED_RUNS)


@app.command("status")
def status(sweep_dir: Path = typer.Argument(..., help="A sweep directory, e.g. runs/sweeps/NAME.")) -> None:
    """Show each run of a sweep: pending, queued, running, completed, diverged, failed or interrupted."""
    from asyncpipe.sweep import sweep_status

    sweep_status(sweep_dir)
