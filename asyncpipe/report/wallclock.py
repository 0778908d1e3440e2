"""Val loss against modelled wall-clock: a run's tokens divided by its schedule's throughput relative to 1F1B (sync
= 1, a 2BW column = the measured or ideal ratio at the run's own P and m), one panel per (table, optimizer) that
has a delayed column, mean over seeds; the dashed line is sync's final val loss (the target).

A budget family (a ladder: one variant at several token budgets) is ONE curve, its longest budget's, in its
variant's colour (asyncpipe.report.palette; dash-dotted for a rule's older revision, `PACI@r1`), plus a marker at
each budget's end (its final val loss), the ends joined by a dotted line: where that dotted line crosses the target
is the family's time to target. Each panel's legend sits below it, never over data."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from asyncpipe.report.load import COMPLETED
from asyncpipe.report.palette import NEUTRAL, Palette, older_revision
from asyncpipe.report.plots import DPI, LEGEND_SIZE, TOKENS, save_figure, seed_matrix
from asyncpipe.report.target import Ladder
from asyncpipe.report.throughput import throughput

VIEW_FRAC = 0.4  # the x-axis starts at 40% of the longest run: the approach to the target is what matters


def _families(group, own: list[Ladder], bench: list[dict], at: tuple[int, int] | None) -> list[tuple]:
    """(colour key, columns smallest budget first, throughput ratio to 1F1B, legend label) per family."""
    families = [(group.reference, [group.reference], 1.0, "sync (1F1B)")]
    for lad in own:
        thr = lad.throughput(bench) if at is None else throughput(*at, bench, lad.ef, lad.schedule, lad.optimizer)
        P, m = at or (lad.stages, lad.micro_batches)
        rungs = (
            f", {len(lad.columns)} budgets {lad.multiples[0]:.2f}x-{lad.multiples[-1]:.2f}x"
            if len(lad.columns) > 1
            else ""
        )
        families.append(
            (
                lad.columns[0],
                list(lad.columns),
                thr.vs_1f1b,
                f"{lad.columns[0]}{rungs} (÷{thr.vs_1f1b:.3f}, {thr.kind} at P={P}, m={m})",
            )
        )
    return families


def _draw_family(
    ax: plt.Axes, done: pd.DataFrame, curves: pd.DataFrame, columns: list[str], ratio: float, style: tuple[str, ...]
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """The longest budget's mean curve (`style`: colour, marker, line style) and every budget's end point; returns
    what was drawn and the seeds."""
    colour, marker, line = style
    means = []
    for column in columns:
        wide = seed_matrix(curves, list(done.loc[done["variant"] == column, "run"]))
        if not wide.empty:
            mean = wide.mean(axis=1)
            means.append((mean.index.to_numpy(dtype=float) / ratio, mean.to_numpy(), wide.shape[1]))
    if not means:
        return [], 0
    x, y, _ = means[-1]
    ax.plot(x, y, color=colour, linewidth=1.4, linestyle=line)
    ends = np.array([(m[0][-1], m[1][-1]) for m in means])
    ax.plot(
        ends[:, 0],
        ends[:, 1],
        color=colour,
        marker=marker,
        markersize=6,
        linestyle=":" if len(ends) > 1 else "none",
        linewidth=1.0,
    )
    return [(m[0], m[1]) for m in means], max(m[2] for m in means)


def plot_wallclock(
    runs: pd.DataFrame,
    curves: pd.DataFrame,
    groups: list,
    ladders: list[Ladder],
    bench: list[dict],
    path: Path,
    at: tuple[int, int] | None = None,
    order: list[str] | None = None,
) -> list[Path]:
    """``at`` (P, m): every column's throughput at that depth and micro-batch count (the verdict's figure), else each
    ladder's own (the number its takeaway uses). ``order``: the report's column order (the palette's)."""
    palette = Palette(order or [])
    panels = list(dict.fromkeys((lad.table, lad.optimizer) for lad in ladders))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(max(12, 6 * len(panels)), 7), dpi=DPI, squeeze=False, layout="constrained"
    )
    for ax, (table, optimizer) in zip(axes[0], panels):
        group = next(g for g in groups if g.title == table)
        done = runs[(runs["status"] == COMPLETED) & runs["run"].isin(group.runs) & (runs["optimizer"] == optimizer)]
        own = [lad for lad in ladders if (lad.table, lad.optimizer) == (table, optimizer)]
        ys = []
        for key, columns, ratio, label in _families(group, own, bench, at):
            colour, marker = palette.style(key)
            line = "-." if older_revision(key) else "-"
            drawn, seeds = _draw_family(ax, done, curves, columns, ratio, (colour, marker, line))
            ys += drawn
            if seeds:
                ax.plot(
                    [],
                    [],
                    color=colour,
                    marker=marker,
                    markersize=6,
                    linewidth=1.4,
                    linestyle=line,
                    label=f"{label}, mean of {seeds}",
                )
        _target(ax, done, curves, group.reference)
        _frame(ax, ys, f"{optimizer} | {table}")
    where = f" (every schedule at P={at[0]}, m={at[1]})" if at else ""
    fig.suptitle(
        "Val loss vs modelled wall-clock" + where + "\nline: a family's longest budget; markers: each budget's "
        "end; markers crossing the dashed target further left reach sync's final loss sooner",
        fontsize=10,
    )
    return save_figure(fig, path)


def _target(ax: plt.Axes, done: pd.DataFrame, curves: pd.DataFrame, reference: str) -> None:
    """The dashed line at sync's mean final val loss."""
    ref = done[done["variant"] == reference]
    finals = [
        curves.loc[curves["run"] == r].sort_values("tokens")["val_loss"].iloc[-1]
        for r in ref["run"]
        if (curves["run"] == r).any()
    ]
    if finals:
        ax.axhline(
            float(np.mean(finals)),
            color=NEUTRAL["black"],
            linestyle="--",
            linewidth=0.9,
            label=f"target: sync's final val loss (mean {np.mean(finals):.4f})",
        )
    ax.plot(
        [],
        [],
        color=NEUTRAL["dark"],
        marker="o",
        linestyle=":",
        linewidth=1.0,
        label="markers: each budget's end (final val loss), joined dotted",
    )


def _frame(ax: plt.Axes, ys: list[tuple[np.ndarray, np.ndarray]], title: str) -> None:
    """Axes from VIEW_FRAC of the longest run on, y holding everything drawn there; labels and legend below."""
    xmax = max((float(x.max()) for x, _ in ys), default=0.0)
    lo_x = xmax * VIEW_FRAC
    tail = np.concatenate([y[x >= lo_x] for x, y in ys]) if ys else np.array([])
    if len(tail):
        pad = max((tail.max() - tail.min()) * 0.08, 1e-3)
        ax.set_ylim(tail.min() - pad, tail.max() + pad)
        ax.set_xlim(lo_x, xmax * 1.02)
    ax.xaxis.set_major_formatter(TOKENS)
    ax.set_xlabel("modelled wall-clock: tokens ÷ throughput ratio to 1F1B")
    ax.set_ylabel("val loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=LEGEND_SIZE - 1, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
