"""The verdict figure (issue 55): each variant's net speed-up over the strongest synchronous schedule per (P, m), read
from the speed-up table's own cells (never recomputed), resolved cells filled, written beside the other plots and
linked from report.md."""

from __future__ import annotations

import json
import math

import matplotlib.colors as mcolors

import pytest

from asyncpipe.report import build_report
from asyncpipe.report.target import speedup_table
from asyncpipe.report.speedups import speedup_cells
from asyncpipe.report.verdict_figure import strongest
from report_runs import line, sweep, write


def _report(tmp_path, bench=None, **kw):
    """sync at L; 1-step reaches L at 1.5x the tokens; 1-step+EF at about 1.1x (seed noise)."""
    main = sweep(tmp_path / "main", "main", ["sync", "1-step", "1-step+EF"])
    longer = sweep(tmp_path / "longer", "longer", ["1-step(x2)", "1-step+EF(x2)"])
    for seed in range(3):
        L = 3.0 + 0.01 * seed
        write(main, "sync", "adamw", seed, line(L))
        write(main, "1-step", "adamw", seed, line(L + 0.2))
        write(main, "1-step+EF", "adamw", seed, line(L + 0.02 + 0.01 * seed))
        write(longer, "1-step(x2)", "adamw", seed, line(L - 0.2, 10000), steps=200)
        write(longer, "1-step+EF(x2)", "adamw", seed, line(L - 0.3, 10000), steps=200)
    return build_report([main, longer], merge=True, bench=bench or [], **kw)


def test_figure_points_are_the_speedup_tables_cells_against_the_strongest_sync(tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    from asyncpipe.report import plots

    figures: list = []
    real_close = plt.close
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: figures.append(fig) or real_close(fig))
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"stages": 2, "micro_batches": 4, "variants": {
        "1f1b": {"ratio_to_1f1b": 1.0}, "dualpipev": {"ratio_to_1f1b": 1.1}, "2bw": {"ratio_to_1f1b": 1.2},
        "2bw_ef": {"ratio_to_1f1b": 1.18}}}))  # fmt: skip
    report = _report(tmp_path, [bench], out_dir=tmp_path / "o")
    table = speedup_table(report.ladders, report.bench)
    drawn = strongest(speedup_cells(report.ladders, report.bench)).set_index(["variant", "P", "m"])
    assert len(drawn) == len(report.ladders) * len(table)
    plain = drawn.loc[("1-step", 2, 4)]
    assert plain["against"] == "dualpipev" and plain["throughput_source"].startswith("measured")  # the faster one
    assert plain["speedup"] == pytest.approx(1.2 / 1.1 / 1.5, abs=0.006)  # 0.73x
    ideal = drawn.loc[("1-step", 4, 4)]
    assert ideal["against"] == "1f1b" and ideal["throughput_source"].startswith("ideal")  # none faster there
    for (variant, P, m), cell in drawn.iterrows():  # every point is the printed table's cell
        column = f"adamw {variant} vs {'1F1B' if cell['against'] == '1f1b' else cell['against']}"
        assert table.loc[(P, m), column].startswith(f"{cell['speedup']:.2f}x")
    (fig,) = [f for f in figures if f._suptitle is not None and f._suptitle.get_text().startswith("Verdict")]
    markers = [ln for ln in fig.axes[0].lines if ln.get_marker() not in ("None", "", None) and len(ln.get_xdata()) == 1]
    values = sorted(round(float(ln.get_ydata()[0]), 6) for ln in markers)
    assert values == sorted(round(float(v), 6) for v in drawn["speedup"])
    filled = sum(ln.get_markerfacecolor() != "none" and mcolors.to_hex(ln.get_markerfacecolor()) == mcolors.to_hex(
        ln.get_color()) for ln in markers)  # fmt: skip
    assert filled == int(drawn["resolved"].sum())
    md = (tmp_path / "o" / "report.md").read_text()
    assert "(verdict.png)" in md and "verdict.png" in report.files and (tmp_path / "o" / "verdict.pdf").exists()


def test_no_timed_column_no_verdict_figure(tmp_path) -> None:
    root = sweep(tmp_path / "s", "s", ["sync", "1-step"])
    for seed in range(2):
        write(root, "sync", "adamw", seed, line(3.0))
        write(root, "1-step", "adamw", seed, line(3.2 + 0.01 * seed))
    report = build_report(root, out_dir=tmp_path / "o")
    assert "verdict.png" not in report.files and "verdict.png" not in (tmp_path / "o" / "report.md").read_text()
