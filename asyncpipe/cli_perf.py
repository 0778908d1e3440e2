"""Performance commands for the `asyncpipe` CLI: `bench pipeline` (1F1B, DualPipeV, 2BW: throughput, memory) and
`schedule` (a schedule's timeline, idealised from the engine's own schedule classes or measured from a trace).

Registered in `asyncpipe/cli.py`; only typer and asyncpipe.errors are imported at module level so `asyncpipe --help`
stays fast. The commands check their arguments and call one function each: timelines, schedule orders and their
drawing live in `asyncpipe.timelines` (timeline, orders, trace_load, draw), the benchmark in `asyncpipe.bench.pipeline`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, List, Optional

import typer

from asyncpipe.errors import UserError


# -- commands ----------------------------------------------------------------------------------------------
def schedule(
    overrides: Optional[List[str]] = typer.Argument(
        None,
        help="Hydra overrides of a run (e.g. model=360m pipeline.stages=8 pipeline.schedule=2bw delay=1): draw the "
        "cost model's timeline of that run, its stages at their own costs under its cut (--profile), instead of "
        "--stages/--micro-batches/--schedule at unit costs.",
    ),
    stages: int = typer.Option(4, "--stages", "-p", help="Pipeline stages P."),
    micro_batches: int = typer.Option(8, "--micro-batches", "-m", help="Micro-batches per batch m."),
    schedule: str = typer.Option(
        "2bw",
        "--schedule",
        help="A declared schedule with a stream (asyncpipe.schedules: "
        "the built-ins or one registered from outside), gpipe, or a synchronous "
        "low-bubble schedule drawn next to 1F1B and 2BW: zb-h1, interleaved-1f1b (2 "
        "chunks per rank), dualpipev (DeepSpeed's).",
    ),
    batches: int = typer.Option(3, "--batches", help="Batches (optimizer steps) to draw."),
    trace: Optional[Path] = typer.Option(
        None, "--trace", help="A run dir recorded with pipeline.trace=true: draw its measured timeline instead."
    ),
    out: Path = typer.Option(Path("runs/schedules"), "--out", help="Directory for the PNG and text files."),
    forward: float = typer.Option(1.0, help="Idealised forward time."),
    backward: float = typer.Option(2.0, help="Idealised backward time (zb-h1 splits it in two halves: B and W)."),
    step: float = typer.Option(1.0, help="Idealised optimizer-step time."),
    profile: str = typer.Option(
        "h100_assumed", "--profile", help="With OVERRIDES: the cost model, as `asyncpipe plan --profile` takes it."
    ),
) -> None:
    """Draw a pipeline schedule as a stages x time timeline (PNG + text), from the engine's schedule classes,
    from a synchronous schedule's own rules, from a traced run, or (OVERRIDES) as the cost model times a run."""
    from asyncpipe.paths import writable_dir
    from asyncpipe.timelines.draw import draw_modelled, draw_schedule

    if overrides and trace is not None:
        raise UserError("give a run's OVERRIDES or --trace, not both")
    if trace is None and not overrides:
        check_schedule_size(stages, micro_batches, batches, forward, backward, step)
    if overrides:  # before anything is written: a mistake in them is one line
        from asyncpipe.plan_speed import modelled

        title, tl = modelled(overrides, profile, batches, MAX_DRAWN)
    writable_dir(out, "--out")
    if overrides:
        text, files = draw_modelled(title, tl, "modelled-" + title.split(":")[0], out)
    else:
        text, files = draw_schedule(schedule, stages, micro_batches, batches, forward, backward, step, trace, out)
    typer.echo(text, nl=False)
    typer.echo("\n".join(f"wrote {path}" for path in files))


MAX_DRAWN = 1024  # stages x micro-batches x batches: about 2 blocks each; a bigger PNG takes minutes to draw


def check_schedule_size(
    stages: int, micro_batches: int, batches: int, forward: float, backward: float, step: float
) -> None:
    """Refuse sizes and costs `schedule` cannot draw: counts below 1, non-positive or infinite times, and
    timelines too big to draw in seconds."""
    for flag, n in (("--stages", stages), ("--micro-batches", micro_batches), ("--batches", batches)):
        if n < 1:
            raise UserError(f"{flag} {n} must be >= 1")
    for flag, t in (("--forward", forward), ("--backward", backward)):
        if not (math.isfinite(t) and t > 0):
            raise UserError(f"{flag} {t:g} must be a finite time > 0")
    if not (math.isfinite(step) and step >= 0):
        raise UserError(f"--step {step:g} must be a finite time >= 0 (0 = a free optimizer step)")
    size = stages * micro_batches * batches
    if size > MAX_DRAWN:
        raise UserError(
            f"--stages x --micro-batches x --batches = {stages}x{micro_batches}x{batches} = {size} exceeds {MAX_DRAWN} "
            "(drawing it would take minutes); draw fewer batches or micro-batches"
        )


def bench_pipeline(
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Hydra overrides, e.g. model=small pipeline.stages=2 train.micro_batches=4"
    ),
    rounds: int = typer.Option(3, help="Alternating rounds of every schedule after the warm-up."),
    steps: int = typer.Option(6, help="Optimizer steps per job (the first and last are not timed)."),
    warmup_steps: int = typer.Option(3, help="Steps of the untimed warm-up job."),
    variants: str = typer.Option(
        "all",
        help="Schedules to run (1f1b is the reference): all (every schedule the "
        "pipeline engine runs, 2bw_ef, and PyTorch's own torch.distributed.pipelining "
        "schedules on the same model, pt_*), or names / import paths of declared schedules.",
    ),
    simulator: bool = typer.Option(
        True, "--simulator/--no-simulator", help="Also bench the simulator (delay=1 vs delay=0 step time)."
    ),
    out: Optional[Path] = typer.Option(
        None,
        help="JSON result. Default: a file in runs/bench/ named after the model, "
        "P and m, e.g. pipeline-small-P2-m4.json.",
    ),
    compile_: str = typer.Option("eager", "--compile", help="eager, compiled or both (train.compile rows)."),
    standin: Optional[str] = typer.Option(
        None,
        "--standin",
        help="F,B: stand-in compute, each stage's forward and "
        "backward per micro-batch also waits F and B seconds (e.g. 0.02,0.04; "
        "asyncpipe.bench.standin): a schedule's ideal is known, P = 8 fits 2 cores.",
    ),
    cuts: str = typer.Option(
        "",
        "--cuts",
        help="e.g. even,balanced: every variant at each pipeline.cut side by side in the same rounds, with the "
        "balanced/even ratio per schedule and the cost model's prediction (asyncpipe.bench.pipeline_cuts).",
    ),
) -> None:
    """Throughput of every declared pipeline schedule (DeepSpeed's 1F1B and DualPipeV, 2BW and 2BW + EF, PACI) and
    PyTorch's own schedules (pt_*) on the same model, stages and micro-batches, alternating in one launch: tokens/s,
    ratio to 1F1B against the schedule model's ideal, idle fraction, and weight + optimizer + activation memory per
    stage."""
    from asyncpipe.runtime.signals import StopRequest

    check_bench_flags(rounds, steps, warmup_steps, compile_)
    with StopRequest() as stop:  # from here a stop signal is one line and exit 4 (`errors.Stopped`), at any moment
        _bench_pipeline(
            overrides or [], rounds, steps, warmup_steps, variants, simulator, out, compile_, standin, stop, cuts
        )


def _bench_pipeline(
    overrides: list[str],
    rounds: int,
    steps: int,
    warmup_steps: int,
    variants: str,
    simulator: bool,
    out: Optional[Path],
    compile_: str,
    standin: Optional[str],
    stop: Any,
    cuts: str = "",
) -> None:
    from asyncpipe.bench.pipeline import bench_pipeline as run_bench
    from asyncpipe.bench.pipeline import format_result
    from asyncpipe.bench.standin import parse_standin
    from asyncpipe.errors import Stopped
    from asyncpipe.paths import writable_file
    from asyncpipe.track import atomic_write_json

    if out is not None:
        writable_file(out, "--out")  # before minutes of measuring, not after
    fb = parse_standin(standin) if standin is not None else None
    res = run_bench(
        overrides,
        rounds=rounds,
        steps=steps,
        warmup_steps=warmup_steps,
        simulator=simulator,
        log=lambda msg: typer.echo(msg, err=True),
        variants=[v.strip() for v in variants.split(",") if v.strip()],
        stop=stop,
        modes=("eager", "compiled") if compile_ == "both" else (compile_,),
        standin=fb,
        cuts=[c.strip() for c in cuts.split(",") if c.strip()],
    )
    if stop.requested:  # after the ranks' last step: the result is whole, but the user asked to stop
        raise Stopped(f"bench pipeline stopped by {stop.signal_name} after its last job; nothing written")
    typer.echo(format_result(res))
    path = out or Path("runs/bench") / f"pipeline-{res['model']}-P{res['stages']}-m{res['micro_batches']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, res)
    typer.echo(f"wrote {path}")


def check_bench_flags(rounds: int, steps: int, warmup_steps: int, compile_: str) -> None:
    """`bench pipeline`'s numbers and modes, refused in one line before torch is imported."""
    if rounds < 1:
        raise UserError(f"--rounds {rounds} must be >= 1 (alternating rounds of every schedule)")
    if steps < 3:
        raise UserError(f"--steps {steps} leaves no timed step after dropping 1 at each end; use >= 3")
    if warmup_steps < 1:
        raise UserError(f"--warmup-steps {warmup_steps} must be >= 1 (the untimed warm-up job trains that many steps)")
    if compile_ not in ("eager", "compiled", "both"):
        raise UserError(f"--compile {compile_}: give eager, compiled or both")
