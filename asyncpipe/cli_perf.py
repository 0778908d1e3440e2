"""Performance commands for the `asyncpipe` CLI: `bench pipeline` (1F1B, DualPipeV, 2BW: throughput, memory) and
`schedule` (a schedule's timeline, idealised from the engine's own schedule classes or measured from a trace).

The lead registers them in `asyncpipe/cli.py`; only typer and asyncpipe.errors are imported at module level so
`asyncpipe --help` stays fast. The timeline helpers (`ideal_timeline`, `trace_timeline`, `render_text`,
`render_png`, `steady_gaps`) are plain functions the tests call directly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, List, Optional

import typer

from asyncpipe.errors import UserError

SCHEDULES = ("gpipe", "1f1b", "2bw")
SYNC = ("zb-h1", "interleaved-1f1b", "dualpipev")  # drawn from `asyncpipe.pipe.orders`, next to 1F1B and 2BW
_LETTER = {"forward": "F", "backward": "B", "weight": "W", "step": "U", "eval": "E"}
_COLOR = {"forward": "#4c72b0", "backward": "#55a868", "weight": "#8172b3", "step": "#c44e52", "eval": "#999999"}


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
    config: dict = {}
    cfg_path = Path(run_dir) / "config.yaml"
    if cfg_path.exists():
        import yaml

        config = yaml.safe_load(cfg_path.read_text()) or {}
    per_stage: dict[int, list[dict]] = {}
    for f in files:
        ops = json.loads(f.read_text())
        if ops and ops[0].get("replica", 0) == 0:
            per_stage[int(ops[0]["stage"])] = ops
    t0 = min(o["start"] for ops in per_stage.values() for o in ops)
    events, busy = [], [0.0] * (max(per_stage) + 1)
    for s, ops in sorted(per_stage.items()):
        for kind, k, a, e in _label_ops(ops, config):
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


def _local_chunk(timeline: Any) -> dict[tuple[int, int], int]:
    """(stage, chunk) -> the chunk's index among its stage's chunks (a, b, ... in labels)."""
    chunks: dict[int, set] = {}
    for e in timeline.events:
        if e.chunk is not None:
            chunks.setdefault(e.stage, set()).add(e.chunk)
    return {(s, c): i for s, cs in chunks.items() for i, c in enumerate(sorted(cs))}


def _label(e: Any, local: Optional[dict] = None) -> str:
    if e.kind == "step":
        return f"U{e.batch}" if e.batch is not None else "U"
    label = _LETTER[e.kind] + ("" if e.micro_batch is None else str(e.micro_batch))
    if e.chunk is not None and local is not None and len({c for (s, c) in local if s == e.stage}) > 1:
        label += "abcdefgh"[local[(e.stage, e.chunk)] % 8]
    return label


def render_text(timeline: Any, cell: Optional[float] = None, width: Optional[int] = None) -> str:
    """Stages as rows, time as cells: ``S0 |F0  F1  B0------...|``; a block's label fills its first cell and
    ``-`` its remaining cells, ``.`` is idle. ``cell`` is the time per cell (default: the shortest block,
    so unit-cost schedules are exact); ``width`` the characters per cell (default: the longest label + 1)."""
    evs = [e for e in timeline.events if e.end > e.start]
    if not evs:
        return ""
    local = _local_chunk(timeline)
    cell = cell or min(e.end - e.start for e in evs)
    width = width or max(len(_label(e, local)) for e in evs) + 1
    n = int(round(timeline.makespan / cell + 0.4999))
    rows = []
    for s in range(len(timeline.busy)):
        cells = ["." * width] * n
        for e in (e for e in evs if e.stage == s):
            a, b = int(round(e.start / cell)), max(int(round(e.end / cell)), int(round(e.start / cell)) + 1)
            for i in range(a, min(b, n)):
                cells[i] = (_label(e, local)[:width].ljust(width) if i == a else "-" * width) if width > 1 else (
                    _LETTER[e.kind] if i == a else _LETTER[e.kind].lower())  # fmt: skip
        rows.append(f"S{s} |" + "".join(cells) + "|")
    idle = "  ".join(f"S{s} {f:.3f}" for s, f in enumerate(timeline.idle_fraction))
    return "\n".join(rows) + f"\nidle fraction: {idle}\n"


def render_png(timeline: Any, path: Path, title: str) -> None:
    """Stages x time bar chart: forward, backward, optimizer step (and evaluation) blocks; gaps are bubbles."""
    render_pngs([(title, timeline)], path)


def render_pngs(panels: list[tuple[str, Any]], path: Path) -> None:
    """One stages x time bar chart per (title, timeline), stacked on a shared time axis; a rank's second (third,
    ...) model chunk is drawn lighter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(tl.makespan for _, tl in panels) or 1.0
    n_ev = max(len(tl.events) / max(1, len(tl.busy)) for _, tl in panels)
    heights = [0.6 * len(tl.busy) + 0.9 for _, tl in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(min(40, max(8, n_ev * 0.35)), sum(heights) + 0.9),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)  # fmt: skip
    kinds: set = set()
    for ax, (title, timeline) in zip(axes[:, 0], panels):
        P, local = len(timeline.busy), _local_chunk(timeline)
        for e in timeline.events:
            if e.end <= e.start:
                continue
            light = e.chunk is not None and local.get((e.stage, e.chunk), 0) % 2 == 1
            ax.broken_barh([(e.start, e.end - e.start)], (e.stage - 0.4, 0.8), facecolors=_COLOR[e.kind],
                           alpha=0.55 if light else 1.0, edgecolor="white", linewidth=0.5)  # fmt: skip
            if (e.end - e.start) / span > 0.006 and e.kind in ("forward", "backward", "weight"):
                ax.text((e.start + e.end) / 2, e.stage, str(e.micro_batch), ha="center", va="center", fontsize=7,
                        color="white")  # fmt: skip
        kinds |= {e.kind for e in timeline.events}
        ax.set_yticks(range(P), [f"stage {s}  (idle {f:.0%})" for s, f in enumerate(timeline.idle_fraction)])
        ax.set_ylim(P - 0.5, -0.5)
        ax.set_xlim(0, span)
        ax.set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("time")
    ordered = sorted(kinds, key=list(_COLOR).index)
    axes[-1, 0].legend(handles=[Patch(color=_COLOR[k], label=k) for k in ordered], loc="upper center",
                       bbox_to_anchor=(0.5, -0.45), ncol=len(ordered), frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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

    if trace is None:
        check_schedule_size(stages, micro_batches, batches, forward, backward, step)
    writable_dir(out, "--out")
    if trace is not None:
        tl = trace_timeline(trace)
        stem = f"trace-{Path(trace).resolve().name}"
        panels = [(f"measured timeline of {trace} (idle = waiting on communication)", tl)]
        text = render_text(tl, cell=tl.makespan / 160, width=1)
    elif schedule in SYNC:
        costs = f"F={forward:g}, B={backward:g}, optimizer step free"
        panels = [(f"{schedule}: P={stages}, m={micro_batches}, one batch ({costs})",
                   sync_timeline(schedule, stages, micro_batches, forward, backward)),
                  (f"1f1b: one batch", sync_timeline("1f1b", stages, micro_batches, forward, backward))]  # fmt: skip
        if micro_batches >= stages:
            panels.append((f"2bw: {batches} batches (no flush)",
                           ideal_timeline("2bw", stages, micro_batches, batches, forward, backward, 0.0)))  # fmt: skip
        stem = f"{schedule}-P{stages}-m{micro_batches}"
        cell = min(e.end - e.start for _, tl in panels for e in tl.events if e.end > e.start)
        width = max(len(_label(e, _local_chunk(tl))) for _, tl in panels for e in tl.events) + 1
        text = "".join(f"# {t}\n{render_text(tl, cell=cell, width=width)}" for t, tl in panels)
        tl = panels[0][1]
    else:
        tl = ideal_timeline(schedule, stages, micro_batches, batches, forward, backward, step)
        stem = f"{schedule}-P{stages}-m{micro_batches}"
        costs = f"F={forward:g}, B={backward:g}, U={step:g}"
        panels = [(f"{schedule}: P={stages}, m={micro_batches}, {batches} batches ({costs})", tl)]
        text = render_text(tl)
    out.mkdir(parents=True, exist_ok=True)
    png, txt = out / f"{stem}.png", out / f"{stem}.txt"
    render_pngs(panels, png)
    if trace is None and schedule in SYNC:
        from asyncpipe.pipe.orders import bubble_table

        text += format_bubbles(bubble_table(stages, micro_batches, forward, backward, batches), batches)
    txt.write_text(f"# {panels[0][0]}\n{text}")
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
    out: Optional[Path] = typer.Option(None, help="JSON result (default runs/bench/pipeline-{model}-P{P}-m{m}.json)."),
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
                    variants=[v.strip() for v in variants.split(",") if v.strip()])  # fmt: skip
    typer.echo(format_result(res))
    path = out or Path("runs/bench") / f"pipeline-{res['model']}-P{res['stages']}-m{res['micro_batches']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, res)
    typer.echo(f"wrote {path}")
