"""The verdict figure (verdict.png/.pdf): each variant's net wall-clock speed-up over the strongest synchronous
schedule at every (P, m) of the report's speed-up table, with its interval; one panel per optimizer.

Drawn from the speed-up table's own cells (asyncpipe.report.target.speedup_table, in long form: COLUMNS): they
are read, never computed anew, so the figure says what the table says. Per (P, m) and variant the cell against the
strongest synchronous schedule is the one against a schedule other than 1F1B where the table has one (it names one
only where it is faster, e.g. DualPipeV), else the one against 1F1B. A cell is resolved when its interval excludes 1 (filled marker; hollow
when not); an interval unbounded above is drawn to the top with an arrow; a bound (`≤ X`, some seed never
reached the target) is a downward triangle at X. The y-axis is logarithmic, so 2x and 0.5x sit equally far from 1.
"""

from __future__ import annotations

import math
import re
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

CELL = re.compile(r"^\s*(?P<bound>≤\s*)?(?P<value>\d+(?:\.\d+)?)x(?:\s*\[(?P<lo>\d+(?:\.\d+)?),\s*"
                  r"(?P<hi>\d+(?:\.\d+)?|∞)[\])])?")  # fmt: skip
KIND = re.compile(r"\((?:[\d.]+, )?(measured(?: at m=\d+)?|modelled|ideal)")


COLUMNS = ["P", "m", "optimizer", "variant", "against", "speedup", "lo", "hi", "resolved", "bounded",
           "throughput_source"]  # the long form the figure draws: one row per (P, m, variant, schedule held against)


def parse_cell(text: str) -> tuple[float, float | None, float | None, bool] | None:
    """(value, lo, hi, bound) of a speed-up cell ("1.16x [1.14, 1.18] (...)", "0.83x [0.40, ∞)", "≤ 0.60x"); None
    for "—" or anything else."""
    found = CELL.match(str(text))
    if not found:
        return None
    lo, hi = found.group("lo"), found.group("hi")
    return (float(found.group("value")), float(lo) if lo else None,
            (math.inf if hi == "∞" else float(hi)) if hi else None, bool(found.group("bound")))  # fmt: skip


def _resolved(value: float, lo: float | None, hi: float | None, bound: bool) -> bool:
    if bound:
        return value < 1.0
    return lo is not None and hi is not None and (lo > 1.0 or hi < 1.0)


def cells_of_table(table: pd.DataFrame, ladders: list) -> pd.DataFrame:
    """The speed-up table's cells in long form (COLUMNS), as printed: each ladder's `vs 1F1B` column and its
    `vs SCHEDULE` column where the table has one (a synchronous schedule faster than 1F1B)."""
    rows = []
    for lad in ladders:
        label = f"{lad.optimizer} {lad.columns[0]}"
        for (P, m), row in table.iterrows():
            kind = KIND.search(str(row.get(f"{label} vs 1F1B", "")))
            for column in (c for c in table.columns if str(c).startswith(f"{label} vs ")):
                parsed = parse_cell(row[column])
                if parsed is None:
                    continue
                against = column.removeprefix(f"{label} vs ")
                rows.append(dict(zip(COLUMNS, (int(P), int(m), lad.optimizer, lad.columns[0],
                                               "1f1b" if against == "1F1B" else against, parsed[0], parsed[1],
                                               parsed[2], _resolved(*parsed), parsed[3],
                                               kind.group(1) if kind else ""))))  # fmt: skip
    return pd.DataFrame(rows, columns=COLUMNS)


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
    picked = strongest(frame)
    drawn = [Cell(*(None if isinstance(v, float) and math.isnan(v) else v for v in r))
             for r in picked[COLUMNS].itertuples(index=False)]  # fmt: skip
    if not drawn:
        return []
    palette = Palette(order)
    optimizers = list(dict.fromkeys(c.optimizer for c in drawn))
    points = list(dict.fromkeys((c.P, c.m) for c in sorted(drawn, key=lambda c: (c.P, c.m))))
    fig, axes = plt.subplots(len(optimizers), 1, figsize=(max(10, 1.1 * len(points) + 3), 3.6 * len(optimizers) + 1),
                             dpi=DPI, squeeze=False, layout="constrained")  # fmt: skip
    finite = [float(v) for c in drawn for v in (c.speedup, c.lo, c.hi) if v is not None and math.isfinite(v) and v > 0]
    top, bottom = max(finite + [1.0]) * 1.6, min(finite + [1.0]) / 1.3
    legend: dict[str, Line2D] = {}
    for ax, optimizer in zip(axes[:, 0], optimizers):
        own = [c for c in drawn if c.optimizer == optimizer]
        rank = {v: i for i, v in enumerate(order)}
        variants = sorted(dict.fromkeys(c.variant for c in own), key=lambda v: rank.get(v, len(rank)))
        for c in own:
            x = points.index((c.P, c.m)) + (variants.index(c.variant) - (len(variants) - 1) / 2) * 0.18
            colour, marker = palette.style(c.variant)
            _point(ax, c, x, top, colour, marker)
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
        ax.set_title(f"{optimizer}: time to sync's final val loss, strongest synchronous schedule ÷ this variant",
                     fontsize=10)  # fmt: skip
        ax.grid(axis="y", alpha=0.3, which="both")
    legend["filled: resolved (interval excludes 1x); hollow: not resolved"] = Line2D(
        [], [], color=NEUTRAL["dark"], marker="o", markerfacecolor="none", linestyle="none")
    legend["1x: as fast as the strongest synchronous schedule"] = Line2D([], [], color=NEUTRAL["black"], linewidth=0.9)
    figure_legend(fig, legend)
    fig.suptitle("Verdict: net wall-clock speed-up over the strongest synchronous schedule, 95% interval from the "
                 "speed-up table (throughput ratio ÷ token ratio)", fontsize=11)  # fmt: skip
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


def _point(ax: plt.Axes, c: Cell, x: float, top: float, colour: str, marker: str) -> None:
    face = colour if c.resolved else "none"
    if c.bounded:
        ax.plot([x], [c.speedup], marker="v", color=colour, markerfacecolor=face, markersize=8, linestyle="none")
        return
    if c.lo is not None and c.hi is not None:
        hi = min(c.hi, top)
        ax.plot([x, x], [c.lo, hi], color=colour, linewidth=1.6)
        if math.isinf(c.hi):
            ax.annotate("", (x, top), xytext=(x, top / 1.25), arrowprops={"arrowstyle": "->", "color": colour})
    ax.plot([x], [c.speedup], marker=marker, color=colour, markerfacecolor=face, markersize=7, linestyle="none")
    if c.resolved:
        ax.annotate(f"{c.speedup:.2f}x", (x, c.speedup), textcoords="offset points", xytext=(5, 0), fontsize=7,
                    color=colour, va="center")  # fmt: skip


def _tick(own: list[Cell], P: int, m: int) -> str:
    """`P=4, m=8` over the schedule the cells are measured against and where their throughput came from."""
    here = [c for c in own if (c.P, c.m) == (P, m)]
    versus = ", ".join(dict.fromkeys("1F1B" if c.against == "1f1b" else c.against for c in here))
    kind = ", ".join(dict.fromkeys(c.kind.split(",")[0] for c in here if c.kind))
    return f"P={P}, m={m}\nvs {versus}" + (f"\n{kind}" if kind else "")
