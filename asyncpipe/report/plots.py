"""The report's figures, one column of panels per (table, optimizer), each as PNG and PDF.

- loss_curves: validation loss (markers at the evaluations, line = mean over completed seeds, band = min–max over
  seeds) and train loss (mean over seeds, smoothed, light) per variant; the lower row zooms into the last
  ZOOM_FRAC of training with its own y-range, so a final gap of 0.01 is visible.
- gap_vs_tokens: each variant's val loss minus the reference column's (sync), paired by seed: mean of the per-seed
  differences with error bars of their sample std; the lower row zooms like above. Every panel of a row shares
  one y-range, so a gap 4x another optimizer's looks 4x as large.
One colour per variant, in the table's column order. Token axes in k/M. Figures are 6 inches wide per column
(at least 12) and 8 high, at 100 dpi, so a 2-column figure is exactly 1200x800 px.
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
from matplotlib.ticker import FuncFormatter  # noqa: E402

from asyncpipe.report.load import COMPLETED  # noqa: E402
from asyncpipe.report.tables import GroupTable  # noqa: E402
from asyncpipe.track.files import atomic_write_bytes  # noqa: E402

DPI = 100
ZOOM_FRAC = 0.3  # the zoomed row shows the last 30% of the tokens
SMOOTH_FRAC = 0.05  # train loss: EMA over ~5% of the steps
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
MARKERS = "osD^vP*Xh"
FORMATS = ("png", "pdf")
TITLE_CHARS = 80  # a 6-inch panel holds about 80 characters at font size 9


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
    n = max(n, 1)
    fig, axes = plt.subplots(2, n, figsize=(max(12, 6 * n), 8), dpi=DPI, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})  # fmt: skip
    return fig, axes


def _zoom_limits(ax: plt.Axes, lo_x: float, hi_x: float, ys: list[np.ndarray]) -> None:
    """x from lo_x to the end; y fitted to the data in that range (with a margin)."""
    values = np.concatenate([y for y in ys if len(y)]) if any(len(y) for y in ys) else np.array([])
    if len(values):
        lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
        pad = max((hi - lo) * 0.08, 1e-3)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlim(lo_x, hi_x + (hi_x - lo_x) * 0.03 if hi_x > lo_x else None)


def _decorate(ax: plt.Axes, title: str, ylabel: str, zoom: bool, matched: int | None, legend: str = "upper right") -> None:
    """Axes, titles; the legend on the full panel (the zoomed one below shows the same lines)."""
    if matched is not None:
        ax.axvline(matched, color="grey", linewidth=0.8, linestyle="-.", label="compared here")
    ax.xaxis.set_major_formatter(TOKENS)
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    full = "\n".join(textwrap.wrap(title, TITLE_CHARS))  # a long settings title would run into the next panel's
    ax.set_title(full if not zoom else f"last {ZOOM_FRAC:.0%} of training, zoomed (the lines above)", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        if not zoom:
            ax.legend(fontsize=7, loc=legend)
    else:
        ax.text(0.5, 0.5, "no completed runs with val loss", ha="center", va="center", transform=ax.transAxes)


def plot_loss_curves(runs: pd.DataFrame, curves: pd.DataFrame, groups: list[GroupTable], order: list[str],
                     path: Path) -> list[Path]:  # fmt: skip
    """Val loss (mean, min–max band over seeds, markers at evaluations) and smoothed train loss, full and zoomed."""
    cols = _columns(runs, groups)
    fig, axes = _figure(len(cols))
    for i, (group, optimizer, done) in enumerate(cols):
        top, bottom = axes[0, i], axes[1, i]
        end = max([float(t) for r in done["run"] for t in curves.loc[curves["run"] == r, "tokens"]] or [0.0])
        lo_x, zoom_ys = end * (1 - ZOOM_FRAC), []
        for j, variant in enumerate(v for v in order if v in set(done["variant"])):
            cell = done[done["variant"] == variant]
            colour, marker = COLOURS[j % len(COLOURS)], MARKERS[j % len(MARKERS)]
            wide = seed_matrix(curves, list(cell["run"]))
            train = smoothed_train(cell)
            for ax in (top, bottom):
                if not train.empty:
                    seeds = "mean of seeds" if len(cell) > 1 else "one seed"
                    ax.plot(train.index, train.values, color=colour, alpha=0.35, linewidth=1,
                            label=f"{variant} train (EMA, {seeds})")  # fmt: skip
                if wide.empty:
                    continue
                mean = wide.mean(axis=1)
                n = wide.shape[1]
                ax.plot(mean.index, mean.values, color=colour, marker=marker, markersize=4, linewidth=1.5,
                        label=f"{variant} val (mean of n={n})" if n > 1 else f"{variant} val (one seed)")  # fmt: skip
                if wide.shape[1] > 1:
                    ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1), color=colour, alpha=0.18,
                                    linewidth=0, label=f"{variant} val min–max over seeds")  # fmt: skip
            if not wide.empty:
                zoom_ys += [wide[wide.index >= lo_x].to_numpy().ravel()]
        _zoom_limits(bottom, lo_x, end, zoom_ys)
        title = f"{optimizer} | {group.title}"
        _decorate(top, title, "loss", False, group.matched_tokens)
        _decorate(bottom, title, "loss", True, group.matched_tokens)
    fig.suptitle("Loss vs tokens: val = line with markers at evaluations (band: min–max over seeds); "
                 "train = light line (EMA)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return save_figure(fig, path)


def paired_gap(curves: pd.DataFrame, cell: pd.DataFrame, ref: pd.DataFrame) -> pd.DataFrame:
    """Per token count: mean, sample std and n of (run(seed) - reference run(seed)) over the seeds both have."""
    ref_by_seed = dict(zip(ref["seed"], ref["run"]))
    pairs = [(r, ref_by_seed[s]) for r, s in zip(cell["run"], cell["seed"]) if s in ref_by_seed]
    if not pairs or len(set(cell["seed"])) != len(cell) or len(set(ref["seed"])) != len(ref):
        return pd.DataFrame()  # no pairs, or seeds shared inside a cell (the table shows those apart)
    wide = seed_matrix(curves, [r for p in pairs for r in p])
    if wide.empty:
        return pd.DataFrame()
    diffs = pd.concat([wide[a] - wide[b] for a, b in pairs], axis=1)
    return pd.DataFrame({"mean": diffs.mean(axis=1), "std": diffs.std(axis=1, ddof=1), "n": diffs.shape[1]})


def plot_gap_vs_tokens(runs: pd.DataFrame, curves: pd.DataFrame, groups: list[GroupTable], order: list[str],
                       path: Path) -> list[Path]:  # fmt: skip
    """Val loss minus the reference's, same seed: mean with error bars (sample std of the per-seed differences)."""
    cols = _columns(runs, groups)
    fig, axes = _figure(len(cols))
    for i, (group, optimizer, done) in enumerate(cols):
        top, bottom = axes[0, i], axes[1, i]
        ref = done[done["variant"] == group.reference]
        end = max([float(t) for t in curves.loc[curves["run"].isin(done["run"]), "tokens"]] or [0.0])
        lo_x, zoom_ys = end * (1 - ZOOM_FRAC), []
        for j, variant in enumerate(v for v in order if v in set(done["variant"])):
            if variant == group.reference or ref.empty:
                continue
            gap = paired_gap(curves, done[done["variant"] == variant], ref)
            if gap.empty:
                continue
            colour, marker = COLOURS[j % len(COLOURS)], MARKERS[j % len(MARKERS)]
            n = int(gap["n"].iloc[0])
            err = gap["std"].fillna(0.0) if n > 1 else None
            label = f"{variant} − {group.reference} (same seed, n={n}" + (", bars: ±1 std)" if n > 1 else ")")
            for ax in (top, bottom):
                ax.errorbar(gap.index, gap["mean"], yerr=err, color=colour, marker=marker, markersize=4,
                            capsize=3, linewidth=1.5, label=label)  # fmt: skip
            tail = gap[gap.index >= lo_x]
            zoom_ys += [(tail["mean"] - tail["std"].fillna(0)).to_numpy(), (tail["mean"] + tail["std"].fillna(0)).to_numpy()]
            last = gap.iloc[-1]
            bottom.annotate(f"{last['mean']:+.4f}", (gap.index[-1], last["mean"]), textcoords="offset points",
                            xytext=(-4, 6), ha="right", fontsize=7, color=colour)  # fmt: skip
        for ax in (top, bottom):
            ax.axhline(0.0, color="black", linewidth=0.8, label=f"{group.reference} (reference)")
        _zoom_limits(bottom, lo_x, end, zoom_ys)  # the gaps alone: a 0.01 difference fills part of the panel
        title = f"{optimizer} | {group.title}"
        _decorate(top, title, f"val loss − {group.reference} val loss", False, group.matched_tokens, "upper left")
        _decorate(bottom, title, f"val loss − {group.reference}", True, group.matched_tokens)
    for row in axes:
        share_y(row)
    fig.suptitle("Loss gap to the reference vs tokens, paired by seed (mean; error bars: sample std of the per-seed "
                 "differences); one y-axis per row", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return save_figure(fig, path)


def share_y(axes: np.ndarray) -> None:
    """One y-range for every panel of a row: the union of their own ranges."""
    limits = [ax.get_ylim() for ax in axes]
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
