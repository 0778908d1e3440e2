"""Performance commands for the `asyncpipe` CLI: `bench pipeline` (1F1B, DualPipeV, 2BW: throughput, memory) and
`schedule` (a schedule's timeline, idealised from the engine's own schedule classes or measured from a trace).

The lead registers them in `asyncpipe/cli.py`; only typer and asyncpipe.errors are imported at module level so
`asyncpipe --help` stays fast. The timeline helpers (`ideal_timeline`, `trace_timeline`, `steady_gaps`) are plain
functions the tests call directly; `asyncpipe.pipe.draw` draws them (text and PNG).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, List, Optional

import typer

from asyncpipe.errors import UserError

SCHEDULES = ("gpipe", "1f1b", "2bw")
SYNC = ("zb-h1", "interleaved-1f1b", "dualpipev")  # drawn from `asyncpipe.pipe.orders`, next to 1F1B and 2BW


# -- timelines ---------------------------------------------------------------------------------------------
def ideal_timeline(kind: str, stages: int, micro_batches: int, batches: int,
                   forward: float = 1.0, backward: float = 2.0, step: float = 1.0) -> Any:  # fmt: skip
    """The `asyncpipe.pipe.timeline.Timeline` of the instruction streams the engine executes for ``kind``,
    replayed against each other with unit costs (F, B and optimizer step durations)."""
    from asyncpipe.pipe.timeline import simulate_schedule

    if kind not in SCHEDULES:
        raise UserError(f"--schedule {kind!r} is unknown; choose one of: {', '.join(SCHEDULES + SYNC)}")
    if stages < 1 or micro_batches < 1 or batches < 1:
        raise UserError("--stages, --micro-batches and --batches must all be >= 1")
    return simulate_schedule(kind, micro_batches, stages, batches, forward=forward, backward=backward, step=step)


def _eval_forwards(config: dict) -> tuple[int, int, int, int]:
    """(eval forwards per evaluation, eval_every, steps, micro_batches) from a run's config.yaml (as a dict)."""
    t, p = config.get("train", {}), config.get("pipeline", {})
    n, d = int(t.get("eval_batches", 8)), int(p.get("data_parallel", 1))
    per_eval = n // d if n % d == 0 else n  # each replica's share (pipe.adapter)
    return per_eval, int(t.get("eval_every", 25)), int(t.get("steps", 100)), int(t.get("micro_batches", 4))


def _label_ops(ops: list[dict], config: dict) -> list[tuple[str, Optional[int], float, float]]:
    """(kind, micro-batch, start, end) of one rank's compute ops; evaluation forwards become ``eval``.

    2BW's training instructions carry their micro-batch, DeepSpeed's (1F1B, evaluation) only a buffer, so
    1F1B ops are numbered by walking the run's known order: one evaluation, then per step m forwards and m
    backwards up to its optimizer step, and an evaluation after every eval_every-th and the last step."""
    per_eval, every, steps, m = _eval_forwards(config)
    by_number = all(o["micro_batch"] is None for o in ops if o["op"] in ("ForwardPass", "BackwardPass"))
    out: list[tuple[str, Optional[int], float, float]] = []
    evals_left, step, nf, nb = per_eval, 0, 0, 0
    for o in ops:
        name, k = o["op"], o["micro_batch"]
        if name == "ForwardPass":
            if (by_number and evals_left > 0) or (not by_number and k is None):
                evals_left -= 1
                out.append(("eval", None, o["start"], o["end"]))
                continue
            out.append(("forward", nf if by_number else k, o["start"], o["end"]))
            nf += 1
        elif name == "BackwardPass":
            out.append(("backward", nb if by_number else k, o["start"], o["end"]))
            nb += 1
        elif name == "OptimizerStep":
            out.append(("step", None, o["start"], o["end"]))
            step += 1
            if by_number and (step % every == 0 or step == steps):
                evals_left = per_eval
    return out


def trace_timeline(run_dir: Path) -> Any:
    """A `Timeline` of a real run from its ``trace-rank{r}.json`` files (replica 0 of every stage), times in
    seconds from the first recorded instruction; waiting on communication shows as idle."""
    from asyncpipe.pipe.timeline import Event, Timeline

    files = sorted(Path(run_dir).glob("trace-rank*.json"))
    if not files:
        raise UserError(f"no trace-rank*.json in {run_dir}; run with pipeline.trace=true to record one")
    from asyncpipe.pipe.trace_load import read_trace_dir

    config, per_stage = read_trace_dir(Path(run_dir), files)  # untrusted files: checked, one line if not a trace
    t0 = min(o["start"] for ops in per_stage.values() for o in ops)
    events, busy = [], [0.0] * (max(per_stage) + 1)
    try:
        labelled = {s: _label_ops(ops, config) for s, ops in per_stage.items()}
    except (TypeError, ValueError, AttributeError) as exc:  # config.yaml settings of the wrong type
        raise UserError(f"{run_dir}/config.yaml cannot label the trace ({exc})") from None
    for s, ops in sorted(per_stage.items()):
        for kind, k, a, e in labelled[s]:
            events.append(Event(s, kind, k, a - t0, e - t0))
            busy[s] += e - a
    makespan = max(ev.end for ev in events) if events else 0.0
    return Timeline(events, makespan, busy)


def steady_gaps(timeline: Any, tol: float = 1e-9) -> list[float]:
    """Per stage: idle time between its first backward and its last forward (the 1F1B steady state, which
    2BW keeps across batch boundaries; a flushed schedule idles there at every batch boundary)."""
    out = []
    for s in range(len(timeline.busy)):
        evs = sorted((e for e in timeline.events if e.stage == s and e.kind != "eval"), key=lambda e: e.start)
        lo = min((e.start for e in evs if e.kind == "backward"), default=0.0)
        hi = max((e.end for e in evs if e.kind == "forward"), default=0.0)
        inside = [e for e in evs if e.start >= lo - tol and e.end <= hi + tol]
        gaps = sum(max(0.0, b.start - a.end) for a, b in zip(inside, inside[1:]))
        out.append(gaps if gaps > tol else 0.0)
    return out


def sync_timeline(kind: str, stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0) -> Any:
    """One batch of a synchronous schedule (`asyncpipe.pipe.orders`: 1f1b, zb-h1, interleaved-1f1b, dualpipev),
    replayed by data dependencies."""
    from asyncpipe.pipe.orders import plan, replay

    return replay(plan(kind, stages, micro_batches), forward, backward)


# -- commands ----------------------------------------------------------------------------------------------
def schedule(
    stages: int = typer.Option(4, "--stages", "-p", help="Pipeline stages P."),
    micro_batches: int = typer.Option(8, "--micro-batches", "-m", help="Micro-batches per batch m."),
    schedule: str = typer.Option("2bw", "--schedule", help="gpipe, 1f1b (DeepSpeed's, with flush), 2bw, or a "
                                 "synchronous low-bubble schedule drawn next to 1F1B and 2BW: "
                                 "zb-h1, interleaved-1f1b (2 chunks per rank), dualpipev (DeepSpeed's)."),  # fmt: skip
    batches: int = typer.Option(3, "--batches", help="Batches (optimizer steps) to draw."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="A run dir recorded with pipeline.trace=true: "
                                         "draw its measured timeline instead."),  # fmt: skip
    out: Path = typer.Option(Path("runs/schedules"), "--out", help="Directory for the PNG and text files."),
    forward: float = typer.Option(1.0, help="Idealised forward time."),
    backward: float = typer.Option(2.0, help="Idealised backward time (zb-h1 splits it in two halves: B and W)."),
    step: float = typer.Option(1.0, help="Idealised optimizer-step time."),
) -> None:
    """Draw a pipeline schedule as a stages x time timeline (PNG + text), from the engine's schedule classes,
    from a synchronous schedule's own rules, or from a traced run."""
    from asyncpipe.paths import writable_dir
    from asyncpipe.pipe.draw import label, local_chunks, render_png, render_text, text_legend

    if trace is None:
        check_schedule_size(stages, micro_batches, batches, forward, backward, step)
    writable_dir(out, "--out")
    if trace is not None:
        tl = trace_timeline(trace)
        stem = f"trace-{Path(trace).resolve().name}"
        panels = [(f"measured timeline of {trace} (idle = waiting on communication)", tl)]
    elif schedule in SYNC:
        costs = f"F={forward:g}, B={backward:g}, optimizer step free"
        panels = [(f"{schedule}: P={stages}, m={micro_batches}, one batch ({costs})",
                   sync_timeline(schedule, stages, micro_batches, forward, backward)),
                  (f"1f1b: one batch", sync_timeline("1f1b", stages, micro_batches, forward, backward))]  # fmt: skip
        if micro_batches >= stages:
            panels.append((f"2bw: {batches} batches (no flush)",
                           ideal_timeline("2bw", stages, micro_batches, batches, forward, backward, 0.0)))  # fmt: skip
        stem = f"{schedule}-P{stages}-m{micro_batches}"
        tl = panels[0][1]
    else:
        tl = ideal_timeline(schedule, stages, micro_batches, batches, forward, backward, step)
        stem = f"{schedule}-P{stages}-m{micro_batches}"
        costs = f"F={forward:g}, B={backward:g}, U={step:g}"
        panels = [(f"{schedule}: P={stages}, m={micro_batches}, {batches} batches ({costs})", tl)]
    if trace is not None:  # measured times: a fixed resolution, one letter per cell
        cell, width = (tl.makespan or 1.0) / 300, 1
    else:  # unit costs: one cell per shortest block, every label whole
        cell = min(e.end - e.start for _, t in panels for e in t.events if e.end > e.start)
        width = max(len(label(e, local_chunks(t))) for _, t in panels for e in t.events) + 1
    text = "".join(f"# {title}\n{render_text(t, cell=cell, width=width)}" for title, t in panels)
    text = text_legend([t for _, t in panels], cell, width, unit="s" if trace is not None else "time unit") + text
    out.mkdir(parents=True, exist_ok=True)
    png, txt = out / f"{stem}.png", out / f"{stem}.txt"
    render_png(panels, png, time_label="time (s)" if trace is not None else "time")
    if trace is None and schedule in SYNC:
        from asyncpipe.pipe.orders import bubble_table

        text += format_bubbles(bubble_table(stages, micro_batches, forward, backward, batches), batches)
    txt.write_text(text)
    typer.echo(text, nl=False)
    gaps = steady_gaps(tl) if trace is not None or schedule not in SYNC else []
    if gaps:
        typer.echo("steady-state idle per stage (first backward .. last forward): "
                   + "  ".join(f"S{s} {g:.3g}" for s, g in enumerate(gaps)))  # fmt: skip
    typer.echo(f"wrote {png}\nwrote {txt}")


MAX_DRAWN = 1024  # stages x micro-batches x batches: about 2 blocks each; a bigger PNG takes minutes to draw


def check_schedule_size(stages: int, micro_batches: int, batches: int, forward: float, backward: float,
                        step: float) -> None:  # fmt: skip
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


def format_bubbles(table: dict[str, Optional[float]], batches: int) -> str:
    """The bubble table as text lines (n/a where a schedule cannot run)."""
    notes = {"1f1b": "(P-1)/(m+P-1)", "zb-h1": "B and W split in halves", "interleaved-1f1b": "2 chunks per rank",
             "dualpipev": "2 chunks per rank (V), W inside B", "2bw": "steady state: no flush",
             "2bw-run": f"{batches} batches: one fill and drain"}  # fmt: skip
    lines = ["bubble (idle fraction of the most idle stage per batch, optimizer step free):"]
    for k, v in table.items():
        lines.append(f"  {k:17s} {'n/a' if v is None else f'{v:.3f}':>6s}  {notes.get(k, '')}")
    return "\n".join(lines) + "\n"


def bench_pipeline(
    overrides: Optional[List[str]] = typer.Argument(None, help="Hydra overrides, e.g. model=small "
                                                    "pipeline.stages=2 train.micro_batches=4"),  # fmt: skip
    rounds: int = typer.Option(3, help="Alternating rounds of every schedule after the warm-up."),
    steps: int = typer.Option(6, help="Optimizer steps per job (the first and last are not timed)."),
    warmup_steps: int = typer.Option(3, help="Steps of the untimed warm-up job."),
    variants: str = typer.Option("1f1b,dualpipev,2bw,2bw_ef", help="Schedules to run (1f1b is the reference)."),
    simulator: bool = typer.Option(True, "--simulator/--no-simulator", help="Also bench the simulator "
                                   "(delay=1 vs delay=0 step time)."),  # fmt: skip
    out: Optional[Path] = typer.Option(None, help="JSON result. Default: a file in runs/bench/ named after the model, "
                                       "P and m, e.g. pipeline-small-P2-m4.json."),  # fmt: skip
    compile_: str = typer.Option("eager", "--compile", help="eager, compiled or both (train.compile rows)."),
) -> None:
    """Throughput of DeepSpeed's 1F1B and DualPipeV against our 2BW (and 2BW + EF) on the same model, stages and
    micro-batches, alternating in one launch: tokens/s, ratio to 1F1B against the schedule model's ideal, idle
    fraction, and weight + optimizer + activation memory per stage."""
    from asyncpipe.bench.pipeline import bench_pipeline as run_bench
    from asyncpipe.bench.pipeline import format_result
    from asyncpipe.paths import writable_file
    from asyncpipe.track import atomic_write_json

    if out is not None:
        writable_file(out, "--out")  # before minutes of measuring, not after

    res = run_bench(overrides or [], rounds=rounds, steps=steps, warmup_steps=warmup_steps, simulator=simulator,
                    log=lambda msg: typer.echo(msg, err=True),
                    variants=[v.strip() for v in variants.split(",") if v.strip()],
                    modes=("eager", "compiled") if compile_ == "both" else (compile_,))  # fmt: skip
    typer.echo(format_result(res))
    path = out or Path("runs/bench") / f"pipeline-{res['model']}-P{res['stages']}-m{res['micro_batches']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, res)
    typer.echo(f"wrote {path}")
