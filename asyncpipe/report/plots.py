"""The report's figures: val loss vs tokens, and (async - sync) val loss vs tokens, one panel per group.

One colour per optimizer; line style per variant (solid = sync, dashed = k-step, dotted = k-step+EF).
Curves are means over completed seeds. Every figure is exactly 1200x800 px (figsize 12x8 at 100 dpi).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: reports are made on clusters and in CI
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from asyncpipe.report.load import COMPLETED  # noqa: E402
from asyncpipe.report.tables import CANONICAL, GroupTable, variant_order  # noqa: E402
from asyncpipe.track.files import atomic_write_bytes  # noqa: E402

FIGSIZE = (12, 8)
DPI = 100


def line_style(variant: str) -> str:
    if variant.startswith("sync"):
        return "-"
    return ":" if "+EF" in variant else "--"


MARKERS = "osD^vP*X"


def _line_kwargs(variant: str, variants: list[str]) -> dict:
    """Sync / 1-step / 1-step+EF differ by line style; any other variant (pipedream(P=4), 2-step, …) also gets
    its own marker, so several of them of one optimizer stay apart in one colour."""
    kwargs: dict = {"linestyle": line_style(variant)}
    others = [v for v in variants if v not in CANONICAL]
    if variant in others:
        kwargs["marker"] = MARKERS[others.index(variant) % len(MARKERS)]
        kwargs["markersize"] = 4
    return kwargs


def mean_curve(curves: pd.DataFrame, runs: list[str]) -> pd.Series:
    """Mean val loss over `runs` at each token count all of them cover (linear interpolation between evals)."""
    own = curves[curves["run"].isin(runs)]
    if own.empty:
        return pd.Series(dtype="float64")
    wide = own.pivot_table(index="tokens", columns="run", values="val_loss", aggfunc="last").sort_index()
    wide = wide.interpolate(method="index", limit_area="inside")
    return wide.dropna(how="any").mean(axis=1)


def _panels(n: int) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = math.ceil(math.sqrt(max(n, 1)))
    rows = math.ceil(max(n, 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=FIGSIZE, dpi=DPI, squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat


def _group_runs(runs: pd.DataFrame, group: GroupTable) -> pd.DataFrame:
    return runs[(runs["status"] == COMPLETED) & runs["run"].isin(group.runs)]


def _save(fig: plt.Figure, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)  # no bbox_inches="tight": the size must stay fixed
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _colours(runs: pd.DataFrame) -> dict[str, str]:
    names = sorted(str(o) for o in runs["optimizer"].dropna().unique())
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


def plot_loss_curves(runs: pd.DataFrame, curves: pd.DataFrame, groups: list[GroupTable], path: Path) -> None:
    fig, axes = _panels(len(groups))
    colours = _colours(runs)
    for ax, group in zip(axes, groups):
        done = _group_runs(runs, group)
        for opt, opt_runs in done.groupby("optimizer", sort=True):
            variants = variant_order(list(opt_runs["variant"]))
            for variant in variants:
                cell = opt_runs[opt_runs["variant"] == variant]
                curve = mean_curve(curves, list(cell["run"]))
                if not curve.empty:
                    label = f"{opt} {variant} (n={len(cell)})"
                    ax.plot(curve.index, curve.values, color=colours[str(opt)], label=label,
                            **_line_kwargs(variant, variants))
        _decorate(ax, group, "val loss")
    fig.suptitle("Validation loss vs tokens (mean over completed seeds)")
    fig.tight_layout()
    _save(fig, path)


def plot_gap_vs_tokens(runs: pd.DataFrame, curves: pd.DataFrame, groups: list[GroupTable], path: Path) -> None:
    fig, axes = _panels(len(groups))
    colours = _colours(runs)
    for ax, group in zip(axes, groups):
        done = _group_runs(runs, group)
        for opt, opt_runs in done.groupby("optimizer", sort=True):
            sync = mean_curve(curves, list(opt_runs.loc[opt_runs["variant"] == "sync", "run"]))
            variants = variant_order(list(opt_runs["variant"]))
            for variant in variants:
                cell = opt_runs[opt_runs["variant"] == variant]
                if variant == "sync" or cell.empty or sync.empty:
                    continue
                gap = (mean_curve(curves, list(cell["run"])) - sync).dropna()
                if not gap.empty:
                    label = f"{opt} {variant} − sync"
                    ax.plot(gap.index, gap.values, color=colours[str(opt)], label=label,
                            **_line_kwargs(variant, variants))
        ax.axhline(0.0, color="grey", linewidth=0.8)
        _decorate(ax, group, "val loss − sync val loss")
    fig.suptitle("Loss gap to synchronous training vs tokens (means over completed seeds)")
    fig.tight_layout()
    _save(fig, path)


def _decorate(ax: plt.Axes, group: GroupTable, ylabel: str) -> None:
    if group.matched_tokens is not None:
        ax.axvline(group.matched_tokens, color="grey", linewidth=0.8, linestyle="-.")
    ax.set_title(group.title, fontsize=10)
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no completed runs with val loss", ha="center", va="center", transform=ax.transAxes)
