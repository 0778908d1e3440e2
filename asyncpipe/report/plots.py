"""The report's figures, one column of panels per (table, optimizer), each as PNG and PDF.

- loss_curves: validation loss (markers at the evaluations, line = mean over completed seeds, band = min–max over
  seeds) and train loss (mean over seeds, smoothed, light) per variant; the lower row zooms into the last
  ZOOM_FRAC of training with a y-range that holds every line drawn there, so a final gap of 0.01 is visible.
- gap_vs_tokens: each variant's val loss minus the reference column's (sync), paired by seed: mean of the per-seed
  differences with error bars of their 95% t-interval (the intervals the report's text uses); the lower row zooms
  like above and always shows 0.
Panels of one kind (full, zoomed) share one y-range, so a gap 4x another optimizer's looks 4x as large. One
colour per variant family in every figure (asyncpipe.report.palette); the legend sits below the panels, never over data. Token axes in k/M.
Figures are 6 inches wide per column (at least 12) and 8 high, at 100 dpi, so a 2-column figure is exactly
1200x800 px; more than MAX_COLUMNS columns wrap onto further rows of panel pairs.
The at-a-glance figure (asyncpipe.report.glance) is drawn from the report's claims.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: reports are made on clusters and in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from asyncpipe.report.load import COMPLETED  # noqa: E402
from asyncpipe.report.palette import NEUTRAL, Palette, family, is_rung  # noqa: E402
from asyncpipe.report.stats import t_quantile  # noqa: E402
from asyncpipe.report.tables import GroupTable  # noqa: E402
from asyncpipe.track.files import atomic_write_bytes  # noqa: E402

DPI = 100
ZOOM_FRAC = 0.3  # the zoomed row shows the last 30% of the tokens
SMOOTH_FRAC = 0.05  # train loss: EMA over ~5% of the steps
RUNG_MARKERS = "v^<>PX*hpd"  # a budget rung: its family's colour, its own marker
FORMATS = ("png", "pdf")
TITLE_CHARS = 80  # a 6-inch panel holds about 80 characters at font size 9
MAX_COLUMNS = 4  # panel columns per row; more (a study with many tables or optimizers) wrap onto new rows
LEGEND_SIZE = 9  # legend text, points (readable at 100 dpi)


def fmt_tokens(value: float, _pos: object = None) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


TOKENS = FuncFormatter(lambda v, pos: fmt_tokens(round(v, 6)))


def seed_matrix(curves: pd.DataFrame, runs: list[str]) -> pd.DataFrame:
    """Val loss: index tokens, one column per run, linearly interpolated between a run's evaluations, only at token
    counts every run covers."""
    own = curves[curves["run"].isin(runs)]
    if own.empty:
        return pd.DataFrame()
    wide = own.pivot_table(index="tokens", columns="run", values="val_loss", aggfunc="last").sort_index()
    return wide.interpolate(method="index", limit_area="inside").dropna(how="any")


def smoothed_train(runs: pd.DataFrame) -> pd.Series:
    """Mean train loss over the runs at each token count, exponentially smoothed (span ~5% of the steps)."""
    series = [pd.Series(dict(points)) for points in runs["train"] if len(points)]
    if not series:
        return pd.Series(dtype="float64")
    mean = pd.concat(series, axis=1).sort_index().mean(axis=1)
    return mean.ewm(span=max(2, int(len(mean) * SMOOTH_FRAC)), adjust=False).mean()


def _columns(runs: pd.DataFrame, groups: list[GroupTable]) -> list[tuple[GroupTable, str, pd.DataFrame]]:
    out = []
    for group in groups:
        done = runs[(runs["status"] == COMPLETED) & runs["run"].isin(group.runs)]
        for optimizer in group.table.index:
            out.append((group, str(optimizer), done[done["optimizer"] == optimizer]))
    return out


def _figure(n: int) -> tuple[plt.Figure, np.ndarray]:
    """Axes [2, n]: row 0 the full panels, row 1 the zoomed ones, one column per (table, optimizer); beyond
    MAX_COLUMNS the columns wrap onto further pairs of rows (8 inches high each)."""
    n = max(n, 1)
    cols, bands = min(n, MAX_COLUMNS), -(-n // MAX_COLUMNS)
    fig, grid = plt.subplots(
        2 * bands,
        cols,
        figsize=(max(12, 6 * cols), 8 * bands),
        dpi=DPI,
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2] * bands},
        layout="constrained",
    )
    axes = np.empty((2, n), dtype=object)
    for i in range(n):
        band, col = divmod(i, MAX_COLUMNS)
        axes[0, i], axes[1, i] = grid[2 * band, col], grid[2 * band + 1, col]
    for ax in grid.ravel()[::-1]:  # cells of the last band that no column uses
        if ax not in set(axes.ravel()):
            ax.set_visible(False)
    return fig, axes


def _limits(values: list[np.ndarray], include: tuple[float, ...] = ()) -> tuple[float, float] | None:
    """The range of every finite value (and `include`), with an 8% margin; None when there is none."""
    finite = [v[np.isfinite(v)] for v in values if len(v)]
    flat = np.concatenate(finite + [np.asarray(include, dtype=float)]) if finite or include else np.array([])
    if not len(flat):
        return None
    lo, hi = float(flat.min()), float(flat.max())
    pad = max((hi - lo) * 0.08, 1e-3)
    return lo - pad, hi + pad


def _zoom_limits(ax: plt.Axes, lo_x: float, hi_x: float, ys: list[np.ndarray], include: tuple[float, ...] = ()) -> None:
    """x from lo_x to the end; y holding every value drawn in that range (and `include`, e.g. 0), with a margin."""
    limits = _limits(ys, include)
    if limits is not None:
        ax.set_ylim(*limits)
    ax.set_xlim(lo_x, hi_x + (hi_x - lo_x) * 0.03 if hi_x > lo_x else None)


def _decorate(ax: plt.Axes, title: str, ylabel: str, zoom: bool, matched: int | None) -> None:
    """Axes and titles; the legend is the figure's, below the panels (`figure_legend`)."""
    if matched is not None:
        ax.axvline(matched, color=NEUTRAL["grey"], linewidth=0.8, linestyle="-.")
    ax.xaxis.set_major_formatter(TOKENS)
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    full = "\n".join(textwrap.wrap(title, TITLE_CHARS))  # a long settings title would run into the next panel's
    ax.set_title(full if not zoom else f"last {ZOOM_FRAC:.0%} of training, zoomed (the lines above)", fontsize=9)
    ax.grid(alpha=0.3)
    if not ax.lines and not ax.collections:
        ax.text(0.5, 0.5, "no completed runs with val loss", ha="center", va="center", transform=ax.transAxes)


def legend_columns(labels: list[str], width_px: float) -> int:
    """The most legend columns whose labels fit `width_px` at LEGEND_SIZE (matplotlib fills column by column)."""
    for ncol in range(min(len(labels), 6), 1, -1):
        rows = -(-len(labels) // ncol)
        cols = [labels[i * rows : (i + 1) * rows] for i in range(ncol)]
        need = sum(max(map(len, c)) * LEGEND_SIZE * DPI / 72 * 0.6 + 50 for c in cols if c)  # ~0.6 em a character
        if need <= 0.95 * width_px:
            return ncol
    return 1


def figure_legend(fig: plt.Figure, entries: dict[str, Line2D]) -> None:
    """One legend for the whole figure, below the panels (never over data), one entry per label."""
    if entries:
        ncol = legend_columns(list(entries), fig.get_figwidth() * DPI)
        fig.legend(
            list(entries.values()),
            list(entries),
            loc="outside lower center",
            ncol=ncol,
            fontsize=LEGEND_SIZE,
            frameon=False,
        )


def variant_key(order: list[str], variant: str) -> tuple[str, str]:
    """A variant's colour and marker, the same in every panel and every figure (asyncpipe.report.palette); a budget
    rung has its family's colour and a marker of its own (by its place among the family's rungs in `order`)."""
    colour, marker = Palette(order).point_style(variant)  # an older revision: its own marker too
    if is_rung(variant):
        rungs = [v for v in order if is_rung(v) and family(v) == family(variant)]
        marker = RUNG_MARKERS[(rungs.index(variant) if variant in rungs else 0) % len(RUNG_MARKERS)]
    return colour, marker


def plot_loss_curves(
    runs: pd.DataFrame, curves: pd.DataFrame, groups: list[GroupTable], order: list[str], path: Path
) -> list[Path]:
    """Val loss (mean, min–max band over seeds, markers at evaluations) and smoothed train loss, full and zoomed."""
    cols = _columns(runs, groups)
    fig, axes = _figure(len(cols))
    legend: dict[str, Line2D] = {}
    for i, (group, optimizer, done) in enumerate(cols):
        top, bottom = axes[0, i], axes[1, i]
        end = max([float(t) for r in done["run"] for t in curves.loc[curves["run"] == r, "tokens"]] or [0.0])
        lo_x, zoom_ys, seeds = end * (1 - ZOOM_FRAC), [], []
        for variant in (v for v in order if v in set(done["variant"])):
            cell = done[done["variant"] == variant]
            colour, marker = variant_key(order, variant)
            wide = seed_matrix(curves, list(cell["run"]))
            train = smoothed_train(cell)
            for ax in (top, bottom):
                if not train.empty:
                    ax.plot(train.index, train.values, color=colour, alpha=0.35, linewidth=1)
                if wide.empty:
                    continue
                mean = wide.mean(axis=1)
                ax.plot(mean.index, mean.values, color=colour, marker=marker, markersize=4, linewidth=1.5)
                if wide.shape[1] > 1:
                    ax.fill_between(
                        wide.index, wide.min(axis=1), wide.max(axis=1), color=colour, alpha=0.18, linewidth=0
                    )
            if not train.empty:
                zoom_ys.append(train[train.index >= lo_x].to_numpy())
            if not wide.empty:
                zoom_ys.append(wide[wide.index >= lo_x].to_numpy().ravel())
                seeds.append(wide.shape[1])
                legend.setdefault(variant, Line2D([], [], color=colour, marker=marker, markersize=5, linewidth=1.5))
        _zoom_limits(bottom, lo_x, end, zoom_ys)
        title = f"{optimizer} | {group.title}" + seed_note(seeds)
        _decorate(top, title, "loss", False, group.matched_tokens)
        _decorate(bottom, title, "loss", True, group.matched_tokens)
    share_y(axes[0])
    share_y(axes[1])
    grey = NEUTRAL["dark"]
    legend["val: mean over seeds, markers at evaluations (band: min–max)"] = Line2D(
        [], [], color=grey, marker="o", markersize=4, linewidth=1.5
    )
    legend["train: mean over seeds, EMA (light)"] = Line2D([], [], color=grey, alpha=0.35, linewidth=1)
    legend["compared here"] = Line2D([], [], color=NEUTRAL["grey"], linewidth=0.8, linestyle="-.")
    figure_legend(fig, legend)
    fig.suptitle(
        "Loss vs tokens, one colour per variant (a longer budget: its own marker); each row of panels "
        "shares one y-range",
        fontsize=10,
    )
    return save_figure(fig, path)


def seed_note(seeds: list[int]) -> str:
    """ " | 3 seeds" (or " | 1-8 seeds per column") for a panel's title."""
    if not seeds:
        return ""
    lo, hi = min(seeds), max(seeds)
    return f" | {hi} seed{'s' if hi > 1 else ''}" if lo == hi else f" | {lo}-{hi} seeds per column"


def paired_gap(curves: pd.DataFrame, cell: pd.DataFrame, ref: pd.DataFrame) -> pd.DataFrame:
    """Per token count: mean, sample std, n and the 95% t-interval's half-width of (run(seed) - reference run(seed))
    over the seeds both have (the same interval as the report's text: asyncpipe.report.stats.t_interval)."""
    ref_by_seed = dict(zip(ref["seed"], ref["run"]))
    pairs = [(r, ref_by_seed[s]) for r, s in zip(cell["run"], cell["seed"]) if s in ref_by_seed]
    if not pairs or len(set(cell["seed"])) != len(cell) or len(set(ref["seed"])) != len(ref):
        return pd.DataFrame()  # no pairs, or seeds shared inside a cell (the table shows those apart)
    wide = seed_matrix(curves, [r for p in pairs for r in p])
    if wide.empty:
        return pd.DataFrame()
    diffs = pd.concat([wide[a] - wide[b] for a, b in pairs], axis=1)
    n = diffs.shape[1]
    std = diffs.std(axis=1, ddof=1)
    half = std * t_quantile(n) / np.sqrt(n) if n > 1 else std * np.nan
    return pd.DataFrame({"mean": diffs.mean(axis=1), "std": std, "n": n, "half95": half})


def plot_gap_vs_tokens(
    runs: pd.DataFrame, curves: pd.DataFrame, groups: list[GroupTable], order: list[str], path: Path
) -> list[Path]:
    """Val loss minus the reference's, same seed: the mean with error bars of its 95% t-interval (the text's)."""
    cols = [
        (g, o, done)
        for g, o, done in _columns(runs, groups)  # a panel needs its reference and another column
        if (done["variant"] == g.reference).any() and (done["variant"] != g.reference).any()
    ]
    if not cols:
        return []
    fig, axes = _figure(len(cols))
    legend: dict[str, Line2D] = {}
    references, single = set(), False
    for i, (group, optimizer, done) in enumerate(cols):
        top, bottom = axes[0, i], axes[1, i]
        ref = done[done["variant"] == group.reference]
        references.add(group.reference)
        drawn = [
            (v, paired_gap(curves, done[done["variant"] == v], ref))
            for v in order
            if v in set(done["variant"]) and v != group.reference and not ref.empty
        ]
        drawn = [(v, gap) for v, gap in drawn if not gap.empty]
        # the gaps end where the reference does (a longer budget's curve beyond it has no gap): zoom on their end
        end = max([float(gap.index.max()) for _, gap in drawn] or [0.0])
        lo_x, zoom_ys, seeds = end * (1 - ZOOM_FRAC), [], []
        several = any(int(gap["n"].iloc[0]) > 1 for _, gap in drawn)  # then one-seed lines get no end label
        for variant, gap in drawn:
            colour, marker = variant_key(order, variant)
            n = int(gap["n"].iloc[0])
            err = gap["half95"].fillna(0.0) if n > 1 else None
            for ax in (top, bottom):
                ax.errorbar(
                    gap.index,
                    gap["mean"],
                    yerr=err,
                    color=colour,
                    marker=marker,
                    markersize=4,
                    capsize=3,
                    linewidth=1.5 if n > 1 else 1.0,
                    linestyle="-" if n > 1 else ":",
                )
            tail = gap[gap.index >= lo_x]
            half = tail["half95"].fillna(0.0)
            zoom_ys += [(tail["mean"] - half).to_numpy(), (tail["mean"] + half).to_numpy()]
            seeds.append(n)
            single = single or n < 2
            legend.setdefault(variant, Line2D([], [], color=colour, marker=marker, markersize=5, linewidth=1.5))
            last = gap.iloc[-1]
            if several and n < 2:
                continue
            bottom.annotate(
                f"{last['mean']:+.4f}",
                (gap.index[-1], last["mean"]),
                textcoords="offset points",
                xytext=(-4, 6),
                ha="right",
                fontsize=8,
                color=colour,
            )
        for ax in (top, bottom):
            ax.axhline(0.0, color=NEUTRAL["black"], linewidth=0.8)
        _zoom_limits(bottom, lo_x, end, zoom_ys, include=(0.0,))  # every bar and 0 stay in view
        title = f"{optimizer} | {group.title}" + seed_note(seeds)
        _decorate(top, title, f"val loss − {group.reference} val loss", False, group.matched_tokens)
        _decorate(bottom, title, f"val loss − {group.reference}", True, group.matched_tokens)
    share_y(axes[0])
    share_y(axes[1])
    zero = Line2D([], [], color=NEUTRAL["black"], linewidth=0.8)
    legend[f"0: the reference ({', '.join(sorted(references))}), same seed"] = zero
    if single:
        legend["one seed: dotted, no error bar"] = Line2D([], [], color=NEUTRAL["dark"], linewidth=1.0, linestyle=":")
    legend["compared here"] = Line2D([], [], color=NEUTRAL["grey"], linewidth=0.8, linestyle="-.")
    figure_legend(fig, legend)
    fig.suptitle(GAP_CAPTION, fontsize=10)
    return save_figure(fig, path)


GAP_CAPTION = (
    "Loss gap to the reference vs tokens, paired by seed: mean over seeds, error bars = the 95% t-interval "
    "the report's text uses; each row of panels shares one y-range"
)


def share_y(axes: np.ndarray) -> None:
    """One y-range for every panel of a row: the union of their own ranges."""
    limits = [ax.get_ylim() for ax in axes if ax.lines or ax.collections]
    if not limits:
        return
    lo, hi = min(a for a, _ in limits), max(b for _, b in limits)
    for ax in axes:
        ax.set_ylim(lo, hi)


def save_figure(fig: plt.Figure, path: Path) -> list[Path]:
    """PNG at `path` and the same figure beside it in the other FORMATS (no bbox_inches: sizes stay fixed)."""
    written = []
    for fmt in FORMATS:
        target = Path(path).with_suffix(f".{fmt}")
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, dpi=DPI)
        atomic_write_bytes(target, buf.getvalue())
        written.append(target)
    plt.close(fig)
    return written
