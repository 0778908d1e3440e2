"""Timelines drawn for a person: text rows wrapped to a line width under a time ruler, with a legend, and a stages x
time PNG whose blocks carry their micro-batch numbers and, where the schedule has them, the weight version each block
reads and the batch boundaries (what makes 2BW 2BW: batch b+1 enters before batch b's backwards are done, on the
weights of two steps ago). Pure Python and matplotlib: no torch, no deepspeed.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from asyncpipe.timelines.timeline import Event, Timeline, steady_gaps

LINE_WIDTH = 100  # characters per text line: a terminal, an editor, a diff
LETTER = {"forward": "F", "backward": "B", "weight": "W", "step": "U", "eval": "E"}
COLOR = {"forward": "#4c72b0", "backward": "#55a868", "weight": "#8172b3", "step": "#c44e52", "eval": "#999999"}
MEANING = {
    "forward": "forward",
    "backward": "backward",
    "weight": "weight-gradient pass (W)",
    "step": "optimizer step",
    "eval": "evaluation forward",
}
VERSION_COLOR = ["#f0a35e", "#9467bd", "#e377c2", "#17becf", "#bcbd22", "#8c564b"]  # W0, W1, ... (cycled)
LIGHT = 0.5  # alpha of a rank's second model chunk
ROW_IN = 0.5  # inches per stage in the PNG


# -- what the blocks are -----------------------------------------------------------------------------------
def local_chunks(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(stage, chunk) -> the chunk's index among its stage's chunks (a, b, ... in labels)."""
    chunks: dict[int, set] = {}
    for e in timeline.events:
        if e.chunk is not None:
            chunks.setdefault(e.stage, set()).add(e.chunk)
    return {(s, c): i for s, cs in chunks.items() for i, c in enumerate(sorted(cs))}


def label(e: Event, local: Optional[dict] = None) -> str:
    """``F3``, ``B3b`` (micro-batch 3 on the rank's second chunk), ``U0`` (the step of batch 0), ``E``."""
    if e.kind == "step":
        return f"U{e.batch}" if e.batch is not None else "U"
    text = LETTER[e.kind] + ("" if e.micro_batch is None else str(e.micro_batch))
    if e.chunk is not None and local is not None and len({c for (s, c) in local if s == e.stage}) > 1:
        text += "abcdefgh"[local[(e.stage, e.chunk)] % 8]
    return text + ("*" if e.straddle else "")


def batch_size(timeline: Timeline) -> Optional[int]:
    """Micro-batches per batch when every stage runs the same whole number of numbered forwards per optimizer step
    (the engine's 2BW / 1F1B / GPipe streams, a traced run); None for a one-batch drawing without steps."""
    sizes = set()
    for s in range(len(timeline.busy)):
        evs = [e for e in timeline.events if e.stage == s]
        n_f = sum(e.kind == "forward" and e.micro_batch is not None for e in evs)
        n_u = sum(e.kind == "step" for e in evs)
        if n_u == 0 or n_f % n_u:
            return None
        sizes.add(n_f // n_u)
    return sizes.pop() if len(sizes) == 1 and 0 not in sizes else None


def batch_starts(timeline: Timeline) -> list[tuple[int, int, float]]:
    """(stage, batch, time) of the first forward of every batch after the first, on every stage."""
    m = batch_size(timeline)
    if m is None:
        return []
    first: dict[tuple[int, int], float] = {}
    for e in timeline.events:
        if e.kind == "forward" and e.micro_batch is not None and e.micro_batch >= m:
            key = (e.stage, e.micro_batch // m)
            first[key] = min(first.get(key, math.inf), e.start)
    return sorted((s, b, t) for (s, b), t in first.items())


def version_rule(timeline: Timeline) -> Optional[str]:
    """How a batch's blocks pick their weights, read off the events: 2BW's W(b-1) or a flushed schedule's W(b)."""
    m = batch_size(timeline)
    blocks = [e for e in timeline.events if e.kind in ("forward", "backward") and e.version is not None]
    pairs = [(e.micro_batch // m, e.version) for e in blocks if m and e.micro_batch is not None]
    if not pairs:
        return None
    if all(v == max(b - 1, 0) for b, v in pairs):
        return "2bw: batch b reads weight version W(b-1) (batch 0: W0), one step stale, two versions per stage"
    if all(v == b for b, v in pairs):
        return "flushed: batch b reads weight version W(b), so it waits for step b-1"
    if any(e.straddle for e in blocks):
        return (
            "paci: one weight version stepped in place; a stage's backward reads the version after its last "
            "step, a forward the one it holds then (the small bar: the version read)"
        )
    return None


# -- text --------------------------------------------------------------------------------------------------
def _ruler(first: int, cells: int, cell: float, width: int) -> str:
    """Time at every `tick`-th cell, the tick a round number of cells at least ~10 characters apart."""
    tick = next(t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if t * width >= 10 or t == 1000)
    line = [" "] * (cells * width)
    for i in range(cells):
        if (first + i) % tick == 0:
            mark = f"{(first + i) * cell:.4g}"
            at = i * width
            if at + len(mark) <= len(line):
                line[at : at + len(mark)] = mark
    return "".join(line).rstrip()


def render_text(
    timeline: Timeline, cell: Optional[float] = None, width: Optional[int] = None, line_width: int = LINE_WIDTH
) -> str:
    """Stages as rows, time as cells (``S0 |F0  F1  B0------...|``): a block's label fills its first cell and ``-``
    its remaining cells, ``.`` is idle; with ``width`` 1 a block is its letter, lower case where it continues.
    Rows longer than ``line_width`` characters wrap into consecutive time windows, each under a time ruler.
    ``cell`` is the time per cell (default: the shortest block, so unit-cost schedules are exact); ``width`` the
    characters per cell (default: the longest label + 1)."""
    evs = [e for e in timeline.events if e.end > e.start]
    if not evs:
        return ""
    local = local_chunks(timeline)
    cell = cell or min(e.end - e.start for e in evs)
    width = width or max(len(label(e, local)) for e in evs) + 1
    n = int(round(timeline.makespan / cell + 0.4999))
    P = len(timeline.busy)
    rows = []
    for s in range(P):
        cells = ["." * width] * n
        for e in (e for e in evs if e.stage == s):
            a, b = int(round(e.start / cell)), max(int(round(e.end / cell)), int(round(e.start / cell)) + 1)
            for i in range(a, min(b, n)):
                if width > 1:
                    cells[i] = label(e, local)[:width].ljust(width) if i == a else "-" * width
                else:
                    cells[i] = LETTER[e.kind] if i == a else LETTER[e.kind].lower()
        rows.append(cells)
    names = [f"S{s}".ljust(len(f"S{P - 1}")) + " |" for s in range(P)]
    per_line = max(1, (line_width - len(names[0]) - 1) // width)
    out = []
    for first in range(0, n, per_line):
        last = min(n, first + per_line)
        out.append("t".ljust(len(names[0]) - 1) + "|" + _ruler(first, last - first, cell, width))
        out += [names[s] + "".join(rows[s][first:last]) + "|" for s in range(P)]
    idle = "  ".join(f"S{s} {f:.3f}" for s, f in enumerate(timeline.idle_fraction))
    return "\n".join(out) + "\n" + textwrap.fill(f"idle fraction: {idle}", line_width) + "\n"


def text_legend(
    timelines: Sequence[Timeline], cell: float, width: int, line_width: int = LINE_WIDTH, unit: str = "time unit"
) -> str:
    """What the letters, marks and cells of `render_text` mean, for the kinds of block these timelines hold; ``unit``
    names the time (``s`` for a measured trace)."""
    kinds = [k for k in LETTER if any(e.kind == k and e.end > e.start for tl in timelines for e in tl.events)]
    if width > 1:
        say = {
            "forward": "F3 forward of micro-batch 3",
            "backward": "B3 its backward",
            "weight": "W3 its weight-gradient pass (B3 then computes only the input gradient)",
            "step": "U0 the optimizer step of batch 0 (writes W1)",
            "eval": "E an evaluation forward",
        }
        parts = [say[k] for k in kinds] + ["'-' the block goes on", "'.' idle"]
    else:
        parts = [f"{LETTER[k]} {MEANING[k]}" for k in kinds] + ["lower case: the block goes on", "'.' idle"]
    if any(len(local_chunks(tl)) > len(tl.busy) for tl in timelines):
        parts.append("a / b after the number: the rank's first / second model chunk")
    m = next((batch_size(tl) for tl in timelines if batch_size(tl)), None)
    if m and width > 1:
        parts.append(f"batch b is micro-batches {m}b .. {m}b+{m - 1}")
    rules = {r for r in (version_rule(tl) for tl in timelines) if r}
    parts += sorted(rules)
    if any(e.straddle for tl in timelines for e in tl.events):
        parts.append(
            "* a backward on a newer weight version than its forward read (the micro-batch straddles "
            "the stage's step: paci back-propagates through its forward's graph on the stepped weights, "
            "paci-recompute re-runs its forward first)"
        )
    plural = "" if cell == 1 or unit == "s" else "s"
    parts.append(f"one cell = {cell:.4g} {unit}{plural}; t = time at the start of a cell")
    return textwrap.fill("legend: " + "; ".join(parts) + ".", line_width) + "\n"


# -- PNG ---------------------------------------------------------------------------------------------------
def _put_label(ax, e: Event, text: str, px_per_unit: float, y: float, height_px: float, color: str, dpi: int) -> None:
    """The block's label across it when it fits, up it (rotated) when only that fits, else none."""
    char = 7 * 0.62 * dpi / 72  # px of one character at fontsize 7
    w = (e.end - e.start) * px_per_unit
    if w >= len(text) * char + 3:
        ax.text((e.start + e.end) / 2, y, text, ha="center", va="center", fontsize=7, color=color)
    elif w >= 8 and height_px >= len(text) * char + 2:
        ax.text((e.start + e.end) / 2, y, text, ha="center", va="center", fontsize=6.5, color=color, rotation=90)


def render_png(panels: list[tuple[str, Timeline]], path: Path, dpi: int = 110, time_label: str = "time") -> None:
    """`figure` written to ``path`` as a PNG."""
    fig = figure(panels, dpi, time_label)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def figure(panels: list[tuple[str, Timeline]], dpi: int = 110, time_label: str = "time"):  # noqa: ANN201 (a Figure)
    """One stages x time bar chart per (title, timeline), stacked on a shared time axis, the legend above them: each
    forward / backward block numbered by its micro-batch (a rank's second model chunk drawn lighter), optimizer steps
    as U<batch>, the weight version a block reads as a bar under it, and a dashed line where the next batch starts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = max(tl.makespan for _, tl in panels) or 1.0
    n_ev = max(len(tl.events) / max(1, len(tl.busy)) for _, tl in panels)
    fig_w = min(40.0, max(9.0, n_ev * 0.35))
    heights = [ROW_IN * len(tl.busy) + 0.75 for _, tl in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(fig_w, sum(heights) + 0.7),
        dpi=dpi,
        squeeze=False,
        layout="constrained",
        gridspec_kw={"height_ratios": heights},
    )
    px_per_unit = (fig_w - 1.9) * dpi / span  # 1.9 in: the stage names and margins
    drawn = _Drawn()
    for ax, (title, tl) in zip(axes[:, 0], panels):
        _draw_panel(ax, title, tl, span, px_per_unit, dpi, drawn)
    axes[-1, 0].set_xlabel(time_label)
    handles = drawn.legend_handles()
    one_row = sum(len(h.get_label()) * 8 * 0.55 * dpi / 72 + 45 for h in handles) <= fig_w * dpi  # fontsize 8
    ncol = len(handles) if one_row else math.ceil(len(handles) / 2)
    fig.legend(handles=handles, loc="outside upper center", ncol=ncol, frameon=False, fontsize=8)
    return fig


@dataclass
class _Drawn:
    """What the panels drew, so the legend names exactly that."""

    kinds: set = field(default_factory=set)
    versions: set = field(default_factory=set)
    light: bool = False  # a rank's second model chunk
    straddle: bool = False  # a hatched block: its backward on a newer version than its forward read
    bounds: bool = False  # a batch boundary's dashed line

    def legend_handles(self) -> list:
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        say = {**MEANING, "forward": "forward (number: micro-batch)", "step": "optimizer step U<b>: writes W(b+1)"}
        handles = [Patch(color=COLOR[k], label=say[k]) for k in LETTER if k in self.kinds]
        if self.light:
            handles.append(Patch(color=COLOR["forward"], alpha=LIGHT, label="lighter: the rank's 2nd model chunk (b)"))
        handles += [
            Patch(color=VERSION_COLOR[v % len(VERSION_COLOR)], label=f"bar below: weights read, W{v}")
            for v in sorted(self.versions)
        ]
        if self.straddle:
            hatched = Patch(
                facecolor=COLOR["backward"], hatch="///", edgecolor="white", label="hatched *: straddles a step"
            )
            handles.append(hatched)
        if self.bounds:
            handles.append(Line2D([], [], color="black", linestyle=(0, (3, 2)), label="next batch's first forward"))
        return handles


def _draw_panel(ax, title: str, tl: Timeline, span: float, px_per_unit: float, dpi: int, drawn: _Drawn) -> None:
    """One timeline on ``ax``: its labelled blocks (with the weight-version bar under each where the schedule has
    versions), its batch boundaries, stage names with their idle fraction; what it drew is noted in ``drawn``."""
    P, local = len(tl.busy), local_chunks(tl)
    versioned = any(e.version is not None for e in tl.events if e.kind in ("forward", "backward"))
    top, h = -0.42, (0.6 if versioned else 0.84)
    # One bar collection per row, colour and shade (a collection per block took 12 s of a 12-stage picture).
    bars: dict[tuple, list] = {}
    for e in tl.events:
        if e.end <= e.start:
            continue
        light = e.chunk is not None and local.get((e.stage, e.chunk), 0) % 2 == 1
        drawn.light |= light
        drawn.kinds.add(e.kind)
        span_ = (e.start, e.end - e.start)
        bars.setdefault((e.stage + top, h, COLOR[e.kind], LIGHT if light else 1.0, e.straddle), []).append(span_)
        if versioned and e.version is not None:
            drawn.versions.add(e.version)
            version_color = VERSION_COLOR[e.version % len(VERSION_COLOR)]
            bars.setdefault((e.stage + top + h + 0.03, 0.2, version_color, 1.0, False), []).append(span_)
        if e.kind != "eval":
            text = label(e, local) if e.kind == "step" else label(e, local)[1:]
            color = "#222222" if light else "white"
            _put_label(ax, e, text, px_per_unit, e.stage + top + h / 2, h * ROW_IN * dpi, color, dpi)
    for (y, height, color, alpha, hatched), spans in bars.items():
        hatch = "///" if hatched else None
        ax.broken_barh(spans, (y, height), facecolors=color, alpha=alpha, edgecolor="white", linewidth=0.6, hatch=hatch)
        drawn.straddle |= hatched
    for s, b, t in batch_starts(tl):
        drawn.bounds = True
        ax.plot([t, t], [s - 0.5, s + 0.5], color="black", linewidth=1.3, linestyle=(0, (3, 2)))
        if s == 0:
            ax.annotate(
                f"batch {b} \u2192",
                (t, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, 2),
                textcoords="offset points",
                fontsize=7,
                va="bottom",
            )
    ax.set_yticks(range(P), [f"stage {s}  (idle {f:.0%})" for s, f in enumerate(tl.idle_fraction)])
    ax.set_ylim(P - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_title(title, fontsize=10, pad=14 if batch_starts(tl) else 6)


def draw_schedule(
    schedule: str,
    stages: int,
    micro_batches: int,
    batches: int,
    forward: float,
    backward: float,
    step: float,
    trace: Optional[Path],
    out: Path,
) -> tuple[str, list[Path]]:
    """`asyncpipe schedule`: the timeline of ``schedule`` (the engine's streams, or a synchronous schedule drawn
    next to 1F1B and 2BW with its bubble table), or of a ``trace``d run, written to ``out`` as a PNG and a text
    file. Returns what to print (the text, then the steady-state idle per stage) and the files written."""
    from asyncpipe.schedules import get
    from asyncpipe.schedules.streams import streamed
    from asyncpipe.schedules.orders import sync_schedules
    from asyncpipe.timelines.orders import bubble_table, format_bubbles, ideal_timeline, sync_timeline
    from asyncpipe.timelines.trace_load import trace_timeline

    sync = schedule in sync_schedules() and schedule not in streamed()  # a stream: the engine's, several batches
    if trace is not None:
        tl = trace_timeline(trace)
        stem = f"trace-{Path(trace).resolve().name}"
        panels = [(f"measured timeline of {trace} (idle = waiting on communication)", tl)]
    elif sync:
        costs = f"F={forward:g}, B={backward:g}, optimizer step free"
        panels = [
            (
                f"{schedule}: P={stages}, m={micro_batches}, one batch ({costs})",
                sync_timeline(schedule, stages, micro_batches, forward, backward),
            ),
            ("1f1b: one batch", sync_timeline("1f1b", stages, micro_batches, forward, backward)),
        ]
        if get("2bw").fits(stages, micro_batches):
            panels.append(
                (
                    f"2bw: {batches} batches (no flush)",
                    ideal_timeline("2bw", stages, micro_batches, batches, forward, backward, 0.0),
                )
            )
        stem = f"{schedule}-P{stages}-m{micro_batches}"
        tl = panels[0][1]
    else:
        tl = ideal_timeline(schedule, stages, micro_batches, batches, forward, backward, step)
        stem = f"{schedule}-P{stages}-m{micro_batches}"
        costs = f"F={forward:g}, B={backward:g}, U={step:g}"
        panels = [(f"{schedule}: P={stages}, m={micro_batches}, {batches} batches ({costs})", tl)]
    bubbles = format_bubbles(bubble_table(stages, micro_batches, forward, backward, batches), batches) if sync else ""
    text, files = _write(panels, stem, out, seconds=trace is not None, extra=bubbles if trace is None else "")
    return text + (_gaps(tl) if trace is not None or not sync else ""), files


def draw_modelled(title: str, tl: Timeline, stem: str, out: Path) -> tuple[str, list[Path]]:
    """`asyncpipe schedule OVERRIDES`: a cost model's timeline of a run (`plan_speed.modelled`: seconds, stages as
    its cut makes them) as a PNG and a text file; returns what to print and the files written."""
    text, files = _write([(title, tl)], stem, out, seconds=True)
    return text + _gaps(tl), files


def _write(panels: list, stem: str, out: Path, seconds: bool, extra: str = "") -> tuple[str, list[Path]]:
    """The panels as ``out/stem.png`` and ``.txt`` (+ ``extra``); seconds (measured or modelled): a fixed resolution,
    one letter per cell; unit costs: one cell per shortest block, every label whole."""
    tl = panels[0][1]
    if seconds:
        cell, width = (tl.makespan or 1.0) / 300, 1
    else:
        cell = min(e.end - e.start for _, t in panels for e in t.events if e.end > e.start)
        width = max(len(label(e, local_chunks(t))) for _, t in panels for e in t.events) + 1
    text = "".join(f"# {title}\n{render_text(t, cell=cell, width=width)}" for title, t in panels)
    text = text_legend([t for _, t in panels], cell, width, unit="s" if seconds else "time unit") + text + extra
    out.mkdir(parents=True, exist_ok=True)
    png, txt = out / f"{stem}.png", out / f"{stem}.txt"
    render_png(panels, png, time_label="time (s)" if seconds else "time")
    txt.write_text(text)
    return text, [png, txt]


def _gaps(tl: Timeline) -> str:
    """The steady-state idle per stage (first backward .. last forward), one line; '' where there is none."""
    gaps = "  ".join(f"S{s} {g:.3g}" for s, g in enumerate(steady_gaps(tl)))
    return f"steady-state idle per stage (first backward .. last forward): {gaps}\n" if gaps else ""
