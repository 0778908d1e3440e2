"""The `asyncpipe` command line: thin Typer commands over library functions.

Heavy imports (torch, deepspeed, wandb, pandas) happen inside the commands so `asyncpipe --help` stays instant.
A `UserError` anywhere becomes one line on stderr and exit code 2; never a traceback for a user mistake.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from asyncpipe import cli_perf, cli_sweep  # typer and asyncpipe.errors only: --help stays fast
from asyncpipe.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, Stopped, UserError, WriteFailed
from asyncpipe.paths import data_root, writable_dir, writable_file
from asyncpipe.terminal import check_cwd, guarded_streams

try:
    from typer import TyperException as CliError  # typer >= 0.20 vendors click: its errors derive from this
except ImportError:  # older typer raises click's own
    from click import ClickException as CliError


def _untag_flags() -> None:
    """Rich help (typer >= 0.2x) types every option, flags too: `--help <bool>`, `--plots/--no-plots <bool>`. A flag
    takes no value, so it shows no type; options that take one keep theirs (`<int>`, `<path>`)."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "untagged_flags", False):
        return

    def display_type_rich(self, ctx):  # noqa: ANN001, ANN202 (typer's signature)
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich.untagged_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_untag_flags()

app = typer.Typer(
    help="Asynchronous (PipeDream-2BW) pipeline-parallel pretraining: train, sweep, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect composed configs.", no_args_is_help=True)
data_app = typer.Typer(help="Prepare token files.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
app.add_typer(bench_app, name="bench")
app.add_typer(cli_sweep.app, name="sweep")
app.command("schedule")(cli_perf.schedule)
bench_app.command("pipeline")(cli_perf.bench_pipeline)

OVERRIDES = typer.Argument(None, help="Hydra overrides, e.g. model=tiny optimizer=muon_ef delay=1 train.steps=50")


@app.command()
def train(overrides: Optional[List[str]] = OVERRIDES) -> None:
    """Train one run (engine=simulate in this process; engine=pipeline starts its stage processes)."""
    from asyncpipe.run import compose_run, run_training

    cfg = compose_run(overrides or [])  # composed, validated, delay and paths checked: one call
    summary = run_training(cfg, overrides=overrides or [])  # overrides: as typed, for provenance.json only
    raise typer.Exit(summary.get("exit_code", 0))


MAX_GPU_MEM_GIB = 1e5  # per device; above any accelerator (H200: 141 GiB) by far, below float overflow in the plan


@app.command("plan")
def plan_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    gpu_mem: Optional[float] = typer.Option(
        None,
        "--gpu-mem",
        help="Memory budget per device, GiB: sets pipeline.memory_gib, so each balanced cut is chosen within it "
        "as such a run chooses it (default: pipeline.memory_gib, else 80 GiB with cuts unconstrained).",
    ),
    profile: str = typer.Option(
        "h100_assumed",
        "--profile",
        help="Cost model for the speed table: a device profile "
        "(conf/device_profile/NAME or a YAML path; stated figures) or a `bench pipeline` JSON "
        "of the same model (measured here).",
    ),
    speed: bool = typer.Option(
        True,
        "--speed/--no-speed",
        help="Also predict every schedule's step time and tokens/s and name the fastest within --gpu-mem.",
    ),
) -> None:
    """Memory per pipeline stage before launching: weights (2 versions under 2BW), gradients, optimizer state,
    EF, activations in flight, in GiB against --gpu-mem, and the largest micro-batch that fits; then, per
    schedule, memory beside predicted step time and tokens/s (`asyncpipe.plan_speed`), its bubble (the least busy
    stage's idle share of a step: the flush plus overhead, p2p waits and uneven stages) and the fastest that fits.
    Ends with a one-line verdict; exits 1 when a stage does not fit or the schedule cannot run the batch."""
    if gpu_mem is not None and not 0 < gpu_mem <= MAX_GPU_MEM_GIB:  # also refuses nan (no comparison is true)
        raise UserError(f"--gpu-mem {gpu_mem:g} must be a memory budget in GiB, > 0 and at most {MAX_GPU_MEM_GIB:g}")
    from asyncpipe.config import compose
    from asyncpipe.plan import plan
    from asyncpipe.plan_table import BUBBLE_LEGEND, render

    cfg = compose(overrides or [])
    key = cfg.pipeline.memory_gib  # one budget: --gpu-mem is the run's pipeline.memory_gib (plan refuses two)
    if gpu_mem is None:
        gpu_mem = 80.0 if key is None else float(key)
    elif key is None:
        overrides = [*(overrides or []), f"pipeline.memory_gib={gpu_mem!r}"]
        cfg = compose(overrides)
    result = plan(cfg, gpu_mem)
    table, verdict = render(result, cfg).rsplit("\n", 1)
    speeds = ""
    if speed:  # between the memory table and the verdict, which stays the last line
        from asyncpipe import plan_speed

        rows, label = plan_speed.speeds(overrides or [], gpu_mem, profile)
        speeds = plan_speed.render(rows, gpu_mem, label) + "\n" + BUBBLE_LEGEND + "\n"
    from asyncpipe.data.dataset import run_data_line

    typer.echo(table + "\n" + speeds + run_data_line(cfg) + "\n" + verdict)  # the run's tokens and epochs
    raise typer.Exit(0 if result.ok else 1)


@config_app.command("show")
def config_show(overrides: Optional[List[str]] = OVERRIDES) -> None:
    """Print the composed, validated config as YAML."""
    from asyncpipe.config import compose, to_yaml

    typer.echo(to_yaml(compose(overrides or [])), nl=False)


@data_app.command("prepare")
def data_prepare(overrides: Optional[List[str]] = OVERRIDES) -> None:
    """Tokenize a corpus into memory-mapped train/val files with a manifest (data=NAME tokenizer=NAME)."""
    from asyncpipe.config import compose
    from asyncpipe.data import describe, prepare

    cfg = compose(overrides or [])
    data_root(cfg.data.root)
    path = prepare(cfg.data, cfg.tokenizer, progress=lambda msg: typer.echo(msg, err=True))
    typer.echo(f"prepared {path}\n{describe(path)}")


# `report`'s arguments and options, declared apart so its signature reads one line per option.
SWEEP_DIRS = typer.Argument(
    None,
    help="Sweep directories DIR/NAME holding run dirs; "
    "several are compared in one table, columns labelled NAME:variant.",
)
BASELINE = typer.Option(
    None,
    "--baseline",
    help="A sweep directory whose first column (sync) every gap is measured against, paired by seed.",
)
REFERENCE = typer.Option(
    None,
    "--reference",
    help="Measure the gaps against this column instead (e.g. cpu_study:1-step), paired by seed.",
)
WANDB_PROJECT = typer.Option(None, "--wandb", help="Read runs from W&B: ENTITY/PROJECT.")
GROUP = typer.Option(None, "--group", help="With --wandb: the run group (sweep name).")
REPORT_OUT = typer.Option(None, "--out", help="Where report files go (default DIR/NAME/report).")
LOG_WANDB = typer.Option(
    True,
    "--wandb-log/--no-wandb-log",
    help="Also log table and plots to a W&B report run of the group (when the runs' W&B mode is not disabled).",
)
PLOTS = typer.Option(True, "--plots/--no-plots", help="Also draw the loss and gap plots (the slow part).")
MERGE = typer.Option(
    False,
    "--merge",
    help="Pool the sweeps' runs that share a column name and every "
    "compared setting into one cell (seeds unioned; a seed twice in a cell is refused).",
)
TARGET = typer.Option(
    None,
    "--target",
    help="The % of a gap a mitigation should close (e.g. 85), "
    "or 'paper': each optimizer's closure in the paper's table (and its gap "
    "ratios); the takeaways judge each closure against it by its interval.",
)
BEST_OF = typer.Option(
    None,
    "--best-of",
    help="A swept key (e.g. optimizer.lr): every column at "
    "its own best value, chosen on --select-seeds, measured on the other seeds.",
)
SELECT_SEEDS = typer.Option(
    None,
    "--select-seeds",
    help="With --best-of: the seeds the value is chosen on, comma-separated (default: the lower half of the seeds).",
)
BENCH = typer.Option(
    None,
    "--bench",
    help="A `bench pipeline` result file (repeatable): "
    "2BW's measured throughput ratio for the net speed-up (else the ideal).",
)
OTHER_LENGTH = typer.Option(
    False,
    "--other-length",
    help="Accept a --baseline that trains another train.steps than every compared run (refused otherwise).",
)
WALLCLOCK_AT = typer.Option(
    None,
    "--wallclock-at",
    help="P,m: draw the wall-clock figure with every schedule's throughput at that depth (else each run's own).",
)


@app.command()
def report(
    sweep_dirs: Optional[List[Path]] = SWEEP_DIRS,
    baseline: Optional[Path] = BASELINE,
    reference: Optional[str] = REFERENCE,
    wandb_project: Optional[str] = WANDB_PROJECT,
    group: Optional[str] = GROUP,
    out: Optional[Path] = REPORT_OUT,
    log_wandb: bool = LOG_WANDB,
    plots: bool = PLOTS,
    merge: bool = MERGE,
    target: Optional[str] = TARGET,
    best_of: Optional[str] = BEST_OF,
    select_seeds: Optional[str] = SELECT_SEEDS,
    bench: Optional[List[Path]] = BENCH,
    other_length: bool = OTHER_LENGTH,
    wallclock_at: Optional[str] = WALLCLOCK_AT,
) -> None:
    """Takeaways, loss-gap tables with 95% intervals (sync / 1-step / 1-step+EF per optimizer, or a sweep file's
    variants), time to sync's loss and net wall-clock speed-up, plots."""
    from asyncpipe.report.arguments import report_from_arguments

    report_from_arguments(
        sweep_dirs,
        out,
        wandb_project=wandb_project,
        group=group,
        log_wandb=log_wandb,
        say=typer.echo,
        baseline=baseline,
        reference=reference,
        plots=plots,
        merge=merge,
        target=target,
        bench=bench,
        best_of=best_of,
        select_seeds=select_seeds,
        other_length=other_length,
        wallclock_at=wallclock_at,
    )


@app.command()
def sync(
    path: Path = typer.Argument(..., help="A run or sweep directory whose offline W&B runs to upload."),
    timeout: float = typer.Option(120.0, help="Seconds one run's upload may take before sync gives up."),
) -> None:
    """Upload offline W&B runs (`wandb sync`) under a run or sweep directory, one at a time, each time-bounded."""
    from asyncpipe.track import sync as wandb_sync

    typer.echo(f"synced {wandb_sync(path, timeout_s=timeout, progress=typer.echo)} offline run(s)")


@bench_app.command("simulator")
def bench_simulator_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    rounds: int = typer.Option(5, help="Interleaved measurement rounds."),
    out: Optional[Path] = typer.Option(None, help="Also write the result as JSON here."),
    compile_: str = typer.Option("both", "--compile", help="eager, compiled or both (train.compile columns)."),
) -> None:
    """Simulator step time and extra memory: delay=k (delay=K sets k, default 1) plain and with every staleness
    mitigation vs delay=0, eager and compiled, interleaved in one run; ratios within the noise are marked ~."""
    import json

    if rounds < 1:
        raise UserError(f"--rounds {rounds} must be >= 1 (interleaved measurement rounds)")
    if out:
        writable_file(out, "--out")
    from asyncpipe.bench.simulator import MODES, bench_simulator, format_result
    from asyncpipe.track import atomic_write_json

    modes = MODES if compile_ == "both" else (compile_,)
    result = bench_simulator(overrides or [], rounds=rounds, log=lambda m: typer.echo(m, err=True), modes=modes)
    typer.echo(format_result(result))
    if out:
        atomic_write_json(out, result)
        typer.echo(f"wrote {out}")
    else:
        typer.echo(json.dumps(result))


def _version(value: bool) -> None:
    if value:
        from asyncpipe import __version__

        typer.echo(f"asyncpipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_version
    ),
) -> None:
    """Asynchronous (PipeDream-2BW) pipeline-parallel pretraining: train, sweep, report."""


def _config_help(argv: List[str]) -> None:
    """`train --help` and `config show --help` end with the config groups, their options and the main keys; built
    only when help is asked for (it reads conf/ and the schema, which `asyncpipe --help` need not)."""
    if not {"--help", "-h"} & set(argv):
        return
    from asyncpipe.config.describe import help_epilog

    text = help_epilog()
    for info in [*app.registered_commands, *config_app.registered_commands]:
        if info.callback in (train, config_show):
            info.epilog = text


def main(argv: Optional[List[str]] = None) -> None:
    """The `asyncpipe` entry point: every user mistake, usage errors included, is one line on stderr and exit 2.
    Closed or ASCII-only standard streams never end a command (`asyncpipe.terminal`)."""
    with guarded_streams():
        code = _run(argv)
    sys.exit(code if isinstance(code, int) else 0)


def _run(argv: Optional[List[str]]) -> object:
    try:
        check_cwd()  # before anything resolves a path or imports torch (whose import dies of a deleted cwd)
        _config_help(list(sys.argv[1:] if argv is None else argv))
        code = app(args=argv, prog_name="asyncpipe", standalone_mode=False)
    except CliError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `asyncpipe config` alone: its help, as click does
            exc.show()
        else:  # a usage error (unknown command or option, bad option value): one line like every other error
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            typer.echo(f"error: {exc.format_message()}{hint}", err=True)
        code = exc.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        code = 1
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        code = EXIT_USER_ERROR
    except WriteFailed as exc:  # a full disk or a size limit: the file, why, and what to do (not a user mistake)
        typer.echo(f"error: {exc}", err=True)
        code = 1
    except Stopped as exc:  # a bench stopped by a signal: it said so, wrote nothing
        typer.echo(f"stopped: {exc}", err=True)
        code = EXIT_INTERRUPTED
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        code = 130
    return code


if __name__ == "__main__":
    main()
