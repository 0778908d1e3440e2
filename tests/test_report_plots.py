"""The report's figures tell what its text tells (issue 41): error bars are the text's 95% intervals, legends sit
below the panels (never over data), zoomed rows hold every line drawn there (the gap's also 0), panels that
compare optimizers share a y-range, many columns wrap, and glance.png draws each gap with its interval."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from asyncpipe.report import build_report
from test_report_verdict import T_975, line, sweep, write


def _figures(monkeypatch: pytest.MonkeyPatch) -> list:
    import matplotlib.pyplot as plt

    from asyncpipe.report import plots

    figures: list = []
    real_close = plt.close
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: figures.append(fig) or real_close(fig))
    return figures


def _two_optimizers(root, seeds: int = 3):
    """AdamW's 1-step gap 0.4 with seed noise, Muon's 0.1; EF halves AdamW's."""
    noise = [0.0, 0.05, -0.03, 0.02][:seeds]
    for seed, e in enumerate(noise):
        for opt, gap in (("adamw", 0.4), ("muon", 0.1)):
            write(root, "sync", opt, seed, line(3.0 + seed * 0.01))
            write(root, "1-step", opt, seed, line(3.0 + seed * 0.01 + gap + e))
            write(root, "1-step+EF", opt, seed, line(3.0 + seed * 0.01 + gap / 2 + e / 2))
    return [0.4 + e for e in noise]


def _by_title(figures: list, words: str):
    return next(f for f in figures if f._suptitle is not None and words in f._suptitle.get_text())


def test_error_bars_are_the_texts_95_intervals_and_legends_sit_below(tmp_path, monkeypatch) -> None:
    figures = _figures(monkeypatch)
    root = sweep(tmp_path / "s", "s", ["sync", "1-step", "1-step+EF"])
    gaps = _two_optimizers(root)
    report = build_report(root, out_dir=tmp_path / "o")
    half = T_975[2] * statistics.stdev(gaps) / np.sqrt(3)
    fig = _by_title(figures, "Loss gap")
    assert "95% t-interval" in fig._suptitle.get_text()
    top_adamw = fig.axes[0]
    bars = [c for c in top_adamw.collections if c.__class__.__name__ == "LineCollection"]
    segments = [seg for c in bars for seg in c.get_segments()]
    last = max(segments, key=lambda s: s[0][0])  # the bar at the compared token count
    assert last[1][1] - last[0][1] == pytest.approx(2 * half, rel=1e-6)
    claim = next(c for c in report.claims if c.kind == "gap" and c.optimizer == "adamw" and c.variant == "1-step")
    assert (last[0][1], last[1][1]) == pytest.approx((claim.interval.lo, claim.interval.hi), rel=1e-6)
    for fig in (_by_title(figures, "Loss gap"), _by_title(figures, "Loss vs tokens")):
        fig.canvas.draw()
        assert not any(ax.get_legend() for ax in fig.axes) and len(fig.legends) == 1
        legend = fig.legends[0].get_window_extent()
        lowest = min(ax.get_tightbbox().y0 for ax in fig.axes if ax.get_visible())
        assert legend.y1 <= lowest + 1 and legend.y0 >= 0 and legend.x0 >= 0 and legend.x1 <= fig.bbox.x1
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert len(labels) <= 8 and fig.legends[0].get_texts()[0].get_fontsize() >= 9
    md = (tmp_path / "o" / "report.md").read_text()
    assert "error bars = the 95% t-interval" in md and "![each optimizer's gap at a glance](glance.png)" in md


def test_zoomed_rows_keep_every_line_and_zero_and_panels_share_y(tmp_path, monkeypatch) -> None:
    figures = _figures(monkeypatch)
    root = sweep(tmp_path / "s", "s", ["sync", "1-step", "1-step+EF"])
    _two_optimizers(root)
    build_report(root, out_dir=tmp_path / "o")
    for fig in (_by_title(figures, "Loss gap"), _by_title(figures, "Loss vs tokens")):
        top, bottom = fig.axes[:2], fig.axes[2:4]
        assert top[0].get_ylim() == top[1].get_ylim() and bottom[0].get_ylim() == bottom[1].get_ylim()
        for ax in bottom:
            lo_x, hi_x = ax.get_xlim()
            lo_y, hi_y = ax.get_ylim()
            for drawn in ax.lines:
                x, y = np.asarray(drawn.get_xdata(), float), np.asarray(drawn.get_ydata(), float)
                if len(set(x)) == 1:  # the "compared here" line (a vertical in axes coordinates)
                    continue
                inside = y[(x >= lo_x) & (x <= hi_x)]
                assert ((inside >= lo_y) & (inside <= hi_y)).all(), drawn.get_label()
            if "gap" in fig._suptitle.get_text():
                assert lo_y < 0 < hi_y


def test_many_columns_wrap_and_glance_draws_each_gap_with_its_interval(tmp_path, monkeypatch) -> None:
    from asyncpipe.report import glance

    drawn = []
    real = glance.plt.Axes.errorbar
    monkeypatch.setattr(glance.plt.Axes, "errorbar", lambda self, x, y, **k: (
        drawn.append((x, k["xerr"])) if "xerr" in k else None) or real(self, x, y, **k))  # fmt: skip
    figures = _figures(monkeypatch)
    root = sweep(tmp_path / "s", "s", ["sync", "1-step"])
    for i, opt in enumerate(("adamw", "muon", "nadam", "soap", "nag")):
        for seed in range(2):
            write(root, "sync", opt, seed, line(3.0 + seed * 0.01))
            write(root, "1-step", opt, seed, line(3.0 + 0.1 * (i + 1) + seed * 0.02))
    report = build_report(root, out_dir=tmp_path / "o")
    fig = _by_title(figures, "Loss gap")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 10 and fig.get_figwidth() == 24 and fig.get_figheight() == 16  # 4 + 1 columns, 2 bands
    gaps = [c for c in report.claims if c.kind == "gap"]
    assert len(drawn) == len(gaps) == 5
    for (x, err), c in zip(drawn, gaps):
        assert x[0] == pytest.approx(c.interval.value)
        assert (x[0] - err[0][0], x[0] + err[1][0]) == pytest.approx((c.interval.lo, c.interval.hi))
    assert (tmp_path / "o" / "glance.png").exists()
