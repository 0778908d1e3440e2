"""The verdict figure (verdict.png/.pdf): each variant's net wall-clock speed-up over the strongest synchronous
schedule at every (P, m) of the report's speed-up table, with its interval; one panel per optimizer.

Drawn from the speed-up table's own cells in columns (asyncpipe.report.speedups.speedup_cells, also written to
speedups.csv): speed-up, interval (token ratio's and throughput's error combined), resolved, the schedule it is held
against and where its throughput came from are read, never computed anew, so the figure says what the table says.
Per (P, m) and variant the cell against the strongest synchronous schedule is the one against a schedule other
than 1F1B where the table has one (it has one only where that schedule is faster, e.g. DualPipeV), else the one
against 1F1B. Resolved cells (the interval excludes 1) are filled markers, the others hollow; an interval unbounded
above is drawn to the top with an arrow; a bound (some seed never reached the target: the speed-up is at most X)
is a downward triangle at X. The y-axis is logarithmic, so 2x and 0.5x sit equally far from 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter  # noqa: E402

from asyncpipe.report.palette import NEUTRAL, Palette  # noqa: E402
from asyncpipe.report.plots import DPI, figure_legend, save_figure  # noqa: E402

COLUMNS = [
    "P",
    "m",
    "optimizer",
    "variant",
    "against",
    "speedup",
    "lo",
    "hi",
    "resolved",
    "bounded",
    "throughput_source",
]  # what the figure reads of speedup_cells: one row per (P, m, variant, schedule)


def strongest(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (optimizer, variant, P, m) the row against the strongest synchronous schedule: the one against a schedule
    other than 1F1B where there is one (the table names it only where it is faster), else against 1F1B."""
    if frame.empty:
        return frame
    ranked = frame.assign(_other=frame["against"] != "1f1b").sort_values("_other", kind="stable")
    keep = ranked.groupby(["optimizer", "variant", "P", "m"], sort=False).tail(1)
    return keep.drop(columns="_other").sort_values(["P", "m"], kind="stable").reset_index(drop=True)


def plot_verdict(frame: pd.DataFrame, order: list[str], path: Path) -> list[Path]:
    """One panel per optimizer: x = the (P, m) points, y = net speed-up (log), one colour per variant; `frame` is
    the speed-up cells in long form (COLUMNS), every schedule held against: the strongest is picked here."""
    picked = strongest(frame[frame["speedup"].notna()] if len(frame) else frame)
    drawn = [
        Cell(*(None if isinstance(v, float) and math.isnan(v) else v for v in r))
        for r in picked[COLUMNS].itertuples(index=False)
    ]
    if not drawn:
        return []
    palette = Palette(order)
    optimizers = list(dict.fromkeys(c.optimizer for c in drawn))
    points = list(dict.fromkeys((c.P, c.m) for c in sorted(drawn, key=lambda c: (c.P, c.m))))
    fig, axes = plt.subplots(
        len(optimizers),
        1,
        figsize=(max(10, 1.1 * len(points) + 3), 3.6 * len(optimizers) + 1),
        dpi=DPI,
        squeeze=False,
        layout="constrained",
    )
    finite = [float(v) for c in drawn for v in (c.speedup, c.lo, c.hi) if v is not None and math.isfinite(v) and v > 0]
    top, bottom = max(finite + [1.0]) * 1.6, min(finite + [1.0]) / 1.3
    legend: dict[str, Line2D] = {}
    for ax, optimizer in zip(axes[:, 0], optimizers):
        own = [c for c in drawn if c.optimizer == optimizer]
        rank = {v: i for i, v in enumerate(order)}
        variants = sorted(dict.fromkeys(c.variant for c in own), key=lambda v: rank.get(v, len(rank)))
        for c in own:
            x = points.index((c.P, c.m)) + (variants.index(c.variant) - (len(variants) - 1) / 2) * 0.18
            colour, marker = palette.point_style(c.variant)
            _point(ax, c, x, (bottom, top), colour, marker)
            legend.setdefault(c.variant, Line2D([], [], color=colour, marker=marker, linestyle="none", markersize=7))
        ax.axhline(1.0, color=NEUTRAL["black"], linewidth=0.9)
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.yaxis.set_major_locator(FixedLocator([0.125, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4, 8, 16]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(range(len(points)), [_tick(own, P, m) for P, m in points], fontsize=8)
        for i in range(1, len(points)):
            if points[i][0] != points[i - 1][0]:
                ax.axvline(i - 0.5, color=NEUTRAL["grey"], linewidth=0.6)
        ax.set_ylabel("net speed-up (x)")
        ax.set_title(
            f"{optimizer}: time to sync's final val loss, strongest synchronous schedule ÷ this variant", fontsize=10
        )
        ax.grid(axis="y", alpha=0.3, which="both")
    legend["filled: resolved (interval excludes 1x); hollow: not resolved"] = Line2D(
        [], [], color=NEUTRAL["dark"], marker="o", markerfacecolor="none", linestyle="none"
    )
    legend["1x: as fast as the strongest synchronous schedule"] = Line2D([], [], color=NEUTRAL["black"], linewidth=0.9)
    figure_legend(fig, legend)
    fig.suptitle(
        "Verdict: net wall-clock speed-up over the strongest synchronous schedule, 95% interval from the "
        "speed-up table (throughput ratio ÷ token ratio)",
        fontsize=11,
    )
    return save_figure(fig, path)


@dataclass(frozen=True)
class Cell:
    """One drawn point: a variant's net speed-up at (P, m) against `against`, as the speed-up cells give it."""

    P: int
    m: int
    optimizer: str
    variant: str
    against: str  # the synchronous schedule it is held against ("1f1b", "dualpipev", ...)
    speedup: float
    lo: float | None  # None: a point value with no interval (one seed) or a bound
    hi: float | None  # math.inf: unbounded above
    resolved: bool  # its interval excludes 1 (a bound: it is below 1)
    bounded: bool  # `≤ X`: an upper bound (the target was not reached by some seed)
    kind: str  # where the throughput came from: measured, modelled, ideal


def _point(ax: plt.Axes, c: Cell, x: float, ylim: tuple[float, float], colour: str, marker: str) -> None:
    """One cell: its interval as a bar (clipped to the axis; an arrow where unbounded), its value as a marker."""
    bottom, top = ylim
    face = colour if c.resolved else "none"
    if c.bounded:
        ax.plot([x], [c.speedup], marker="v", color=colour, markerfacecolor=face, markersize=8, linestyle="none")
        return
    if c.lo is not None and c.hi is not None:
        ax.plot([x, x], [max(c.lo, bottom), min(c.hi, top)], color=colour, linewidth=1.6)
        if math.isinf(c.hi):
            ax.annotate("", (x, top), xytext=(x, top / 1.25), arrowprops={"arrowstyle": "->", "color": colour})
    ax.plot([x], [c.speedup], marker=marker, color=colour, markerfacecolor=face, markersize=7, linestyle="none")
    if c.resolved:
        ax.annotate(
            f"{c.speedup:.2f}x",
            (x, c.speedup),
            textcoords="offset points",
            xytext=(5, 0),
            fontsize=7,
            color=colour,
            va="center",
        )


def _tick(own: list[Cell], P: int, m: int) -> str:
    """`P=4, m=8` over the schedule the cells are measured against and where their throughput came from."""
    here = [c for c in own if (c.P, c.m) == (P, m)]
    versus = ", ".join(dict.fromkeys("1F1B" if c.against == "1f1b" else c.against for c in here))
    kind = ", ".join(dict.fromkeys(c.kind.split(",")[0] for c in here if c.kind))
    return f"P={P}, m={m}\nvs {versus}" + (f"\n{kind}" if kind else "")
