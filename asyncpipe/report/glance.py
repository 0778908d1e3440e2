"""The at-a-glance figure (glance.png/.pdf): each optimizer's final gap to the reference column with the same 95%
interval the report's text gives (asyncpipe.report.claims), one row per optimizer and one colour per variant; and,
when the report has budgets (asyncpipe.report.target), the tokens each delayed column needs to reach sync's final
val loss, as a ratio to sync's tokens with its interval.

Columns measured over several seeds are drawn when any exist (their intervals are what the text judges); a report of
one seed draws its point values, said to have no interval.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from asyncpipe.report.claims import Claim  # noqa: E402
from asyncpipe.report.headline import headline_variant  # noqa: E402
from asyncpipe.report.palette import NEUTRAL, Palette  # noqa: E402
from asyncpipe.report.plots import DPI, figure_legend, save_figure, variant_key  # noqa: E402
from asyncpipe.report.target import Ladder  # noqa: E402

ROW_IN = 0.55  # inches per optimizer row


def glance_claims(claims: list[Claim]) -> list[Claim]:
    """The gap claims drawn: those over several seeds when any exist, else all (a one-seed report)."""
    gaps = [c for c in claims if c.kind == "gap"]
    several = [c for c in gaps if c.interval.n >= 2]
    return several or gaps


def _rows(claims: list[Claim]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((c.table, c.optimizer) for c in claims))


def _label(row: tuple[str, str], tables: int) -> str:
    return row[1] if tables < 2 else f"{row[1]}\n{row[0]}"


def plot_glance(claims: list[Claim], ladders: list[Ladder], order: list[str], path: Path) -> list[Path]:
    """Gap per optimizer (95% intervals) and, with budgets, the token ratio to reach sync's loss."""
    drawn = glance_claims(claims)
    rows = _rows(drawn)
    timed = [lad for lad in ladders if lad.ratio is not None or lad.bound is not None]
    tables = len({t for t, _ in rows})
    ncols = 2 if timed else 1
    height = max(3.5, 1.8 + ROW_IN * max(len(rows), 1) * (1 + 0.15 * len({c.variant for c in drawn})))
    fig, axes = plt.subplots(1, ncols, figsize=(12, height), dpi=DPI, squeeze=False, layout="constrained")
    ax = axes[0, 0]
    variants = [v for v in order if v in {c.variant for c in drawn}] + sorted({c.variant for c in drawn} - set(order))
    legend: dict[str, Line2D] = {}
    step = 0.8 / max(len(variants), 1)
    for c in drawn:
        y = rows.index((c.table, c.optimizer)) + (variants.index(c.variant) - (len(variants) - 1) / 2) * step
        colour, marker = variant_key(order, c.variant)
        iv = c.interval
        err = [[iv.value - iv.lo], [iv.hi - iv.value]] if iv.known else None
        ax.errorbar(
            [iv.value],
            [y],
            xerr=err,
            color=colour,
            marker=marker,
            markersize=6,
            capsize=4,
            linewidth=1.6,
            linestyle="none",
        )
        text = c.shown() if iv.n >= 2 else f"{iv.value:+.4f} (one seed)"
        ax.annotate(
            text + ("" if iv.n < 2 or not c.note else "  not resolved"),
            (iv.hi if iv.known else iv.value, y),
            textcoords="offset points",
            xytext=(6, -3),
            fontsize=8,
            color=colour,
        )
        legend.setdefault(c.variant, Line2D([], [], color=colour, marker=marker, linestyle="none", markersize=6))
    ax.axvline(0.0, color=NEUTRAL["black"], linewidth=0.8)
    ax.set_yticks(range(len(rows)), [_label(r, tables) for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    lo = min([c.interval.lo if c.interval.known else c.interval.value for c in drawn] + [0.0])
    hi = max([c.interval.hi if c.interval.known else c.interval.value for c in drawn] + [0.0])
    ax.set_xlim(lo - 0.05 * (hi - lo or 1), hi + 0.45 * (hi - lo or 1))  # room for the interval's text
    reference = next((c.label.split(" − ", 1)[1] for c in drawn if " − " in c.label), "the reference")
    ax.set_xlabel(f"final val loss − {reference} val loss (same seed)")
    n = sorted({c.interval.n for c in drawn})
    seeds = f"{n[0]} seed{'s' if n[0] != 1 else ''}" if len(n) == 1 else f"{n[0]}-{n[-1]} seeds"
    plain = headline_variant(claims)
    ratios = [c for c in claims if c.kind == "gap ratio" and c.variant == plain]
    said = "; ".join(f"{c.label} {c.shown()}" for c in ratios[:3])
    title = f"Gap to {reference} per optimizer: mean and 95% interval ({seeds})" + (f". {said}" if said else "")
    ax.set_title("\n".join(textwrap.wrap(title, 120 // ncols)), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    if timed:
        _plot_time_to_target(axes[0, 1], timed, tables, Palette(order))
    legend[f"0: {reference}"] = Line2D([], [], color=NEUTRAL["black"], linewidth=0.8)
    figure_legend(fig, legend)
    fig.suptitle("At a glance: error bars are the 95% intervals the report's text gives", fontsize=11)
    return save_figure(fig, path)


def _plot_time_to_target(ax: plt.Axes, ladders: list[Ladder], tables: int, palette: Palette) -> None:
    """Tokens to reach sync's final val loss over sync's tokens (1 = as many), per delayed column, in its
    variant's colour."""
    labels = []
    for i, lad in enumerate(ladders):
        colour, marker = palette.point_style(lad.columns[0])
        if lad.ratio is not None:
            iv = lad.ratio
            known = math.isfinite(iv.lo) and math.isfinite(iv.hi)
            err = [[iv.value - iv.lo], [iv.hi - iv.value]] if known else None
            ax.errorbar([iv.value], [i], xerr=err, color=colour, marker=marker, capsize=4, linestyle="none")
            ax.annotate(
                lad.tokens_text(),
                (iv.hi if known else iv.value, i),
                textcoords="offset points",
                xytext=(6, -3),
                fontsize=8,
            )
        else:
            ax.plot([lad.bound], [i], marker=">", color=colour, linestyle="none")  # a lower bound: open to the right
            ax.annotate(
                f"≥ {lad.bound:.2f}x (not reached)",
                (lad.bound, i),
                textcoords="offset points",
                xytext=(6, -3),
                fontsize=8,
            )
        labels.append(f"{lad.optimizer} {lad.columns[0]}" + (f"\n{lad.table}" if tables > 1 else ""))
    ax.axvline(1.0, color=NEUTRAL["black"], linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    xs = [
        v
        for lad in ladders
        for v in ((lad.ratio.lo, lad.ratio.hi, lad.ratio.value) if lad.ratio else (lad.bound,))
        if v is not None and math.isfinite(v)
    ]
    if xs:
        lo, hi = min(xs + [1.0]), max(xs + [1.0])
        ax.set_xlim(lo - 0.05 * (hi - lo or 1), hi + 0.6 * (hi - lo or 1))
    ax.set_xlabel("tokens to reach sync's final val loss ÷ sync's tokens")
    ax.set_title("Time to target: token ratio and 95% interval", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
