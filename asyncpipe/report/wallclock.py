"""Val loss against modelled wall-clock: a run's tokens divided by its schedule's throughput relative to 1F1B (sync
= 1, a 2BW column = the measured or ideal ratio at the run's own P and m), one panel per (table, optimizer) that
has a delayed column, mean over seeds; the dashed line is sync's final val loss (the target). A budget family's
rungs share its colour (fainter the shorter), each rung's end marked. Each panel's legend sits below it, never over
data."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from asyncpipe.report.load import COMPLETED
from asyncpipe.report.plots import COLOURS, DPI, LEGEND_SIZE, MARKERS, TOKENS, save_figure, seed_matrix
from asyncpipe.report.target import Ladder
from asyncpipe.report.throughput import throughput

VIEW_FRAC = 0.4  # the x-axis starts at 40% of the longest run: the approach to the target is what matters


def plot_wallclock(runs: pd.DataFrame, curves: pd.DataFrame, groups: list, ladders: list[Ladder], bench: list[dict],
                   path: Path, at: tuple[int, int] | None = None) -> list[Path]:  # fmt: skip
    """``at`` (P, m): every column's throughput at that depth and micro-batch count (the verdict's figure), else each
    ladder's own (the number its takeaway uses)."""
    panels = list(dict.fromkeys((lad.table, lad.optimizer) for lad in ladders))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(12, 6 * len(panels)), 7), dpi=DPI, squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax, (table, optimizer) in zip(axes[0], panels):
        group = next(g for g in groups if g.title == table)
        done = runs[(runs["status"] == COMPLETED) & runs["run"].isin(group.runs) & (runs["optimizer"] == optimizer)]
        own = [lad for lad in ladders if (lad.table, lad.optimizer) == (table, optimizer)]
        # One colour per family: sync, then each ladder, whose budget rungs share it (fainter the shorter), each
        # rung's end marked; one legend entry per family.
        families = [(group.reference, [group.reference], 1.0, "sync (1F1B)")]
        for lad in own:
            thr = lad.throughput(bench) if at is None else throughput(*at, bench, lad.ef, lad.schedule)
            P, m = at or (lad.stages, lad.micro_batches)
            rungs = f", budgets {lad.multiples[0]:.2f}x-{lad.multiples[-1]:.2f}x" if len(lad.columns) > 1 else ""
            families.append((lad.columns[0], list(lad.columns), thr.vs_1f1b,
                             f"{lad.columns[0]}{rungs} (÷{thr.vs_1f1b:.3f}, {thr.kind} at P={P}, m={m})"))
        ys, xmax = [], 0.0
        for j, (_, columns, ratio, label) in enumerate(families):
            colour, marker, seeds = COLOURS[j % len(COLOURS)], MARKERS[j % len(MARKERS)], 0
            for i, column in enumerate(columns):
                wide = seed_matrix(curves, list(done.loc[done["variant"] == column, "run"]))
                if wide.empty:
                    continue
                seeds = max(seeds, wide.shape[1])
                mean = wide.mean(axis=1)
                x = mean.index.to_numpy(dtype=float) / ratio
                alpha = 1.0 if len(columns) == 1 else 0.35 + 0.65 * i / (len(columns) - 1)
                ax.plot(x, mean.values, color=colour, alpha=alpha, linewidth=1.2)
                ax.plot(x[-1:], mean.values[-1:], color=colour, marker=marker, markersize=5, linestyle="none")
                ys.append((x, mean.to_numpy()))
                xmax = max(xmax, float(x.max()))
            if seeds:
                ax.plot([], [], color=colour, marker=marker, markersize=5, linewidth=1.2,
                        label=f"{label}, mean of {seeds}")  # fmt: skip
        ref = done[done["variant"] == group.reference]
        finals = [curves.loc[curves["run"] == r].sort_values("tokens")["val_loss"].iloc[-1] for r in ref["run"]
                  if (curves["run"] == r).any()]  # fmt: skip
        if finals:
            ax.axhline(float(np.mean(finals)), color="black", linestyle="--", linewidth=0.9,
                       label=f"target: sync's final val loss (mean {np.mean(finals):.4f})")  # fmt: skip
        lo_x = xmax * VIEW_FRAC
        tail = np.concatenate([y[x >= lo_x] for x, y in ys]) if ys else np.array([])
        if len(tail):
            pad = max((tail.max() - tail.min()) * 0.08, 1e-3)
            ax.set_ylim(tail.min() - pad, tail.max() + pad)
            ax.set_xlim(lo_x, xmax * 1.02)
        ax.xaxis.set_major_formatter(TOKENS)
        ax.set_xlabel("modelled wall-clock: tokens ÷ throughput ratio to 1F1B")
        ax.set_ylabel("val loss")
        ax.set_title(f"{optimizer} | {table}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=LEGEND_SIZE - 1, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    where = f" (every schedule at P={at[0]}, m={at[1]})" if at else ""
    fig.suptitle("Val loss vs modelled wall-clock" + where + ": a curve that crosses the dashed line further left "
                 "reaches sync's final loss sooner", fontsize=10)  # fmt: skip
    return save_figure(fig, path)
