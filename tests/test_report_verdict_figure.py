"""The verdict figure (issue 55): each variant's net speed-up over the strongest synchronous schedule per (P, m), read
from the speed-up table's own cells (never recomputed), resolved cells filled, written beside the other plots and
linked from report.md."""

from __future__ import annotations

import json
import math

import pytest

from asyncpipe.report import build_report
from asyncpipe.report.target import speedup_table
from asyncpipe.report.verdict_figure import cells_of_table, parse_cell, strongest
from report_runs import line, sweep, write


def test_cells_parse_as_the_table_prints_them() -> None:
    assert parse_cell("1.16x [1.14, 1.18] (1.234, measured)") == (1.16, 1.14, 1.18, False)
    assert parse_cell("0.83x [0.40, ∞) (1.190, measured)") == (0.83, 0.40, math.inf, False)
    assert parse_cell("≤ 0.60x") == (0.60, None, None, True)
    assert parse_cell("1.02x (n=1)") == (1.02, None, None, False)
    assert parse_cell("—") is None


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


def test_figure_points_are_the_speedup_tables_cells_against_the_strongest_sync(tmp_path) -> None:
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"stages": 2, "micro_batches": 4, "variants": {
        "1f1b": {"ratio_to_1f1b": 1.0}, "dualpipev": {"ratio_to_1f1b": 1.1}, "2bw": {"ratio_to_1f1b": 1.2},
        "2bw_ef": {"ratio_to_1f1b": 1.18}}}))  # fmt: skip
    report = _report(tmp_path, [bench], out_dir=tmp_path / "o")
    table = speedup_table(report.ladders, report.bench)
    drawn = strongest(cells_of_table(table, report.ladders)).set_index(["variant", "P", "m"])
    assert len(drawn) == len(report.ladders) * len(table)
    plain = drawn.loc[("1-step", 2, 4)]
    assert plain["against"] == "dualpipev" and plain["throughput_source"].startswith("measured")  # the faster one
    shown = table.loc[(2, 4), "adamw 1-step vs dualpipev"]
    assert plain["speedup"] == pytest.approx(1.2 / 1.1 / 1.5, abs=0.006)  # 0.73x
    if math.isnan(plain["lo"]):  # the table gives no interval here (a throughput without a spread): unresolved
        assert shown.startswith(f"{plain['speedup']:.2f}x (") and not plain["resolved"]
    else:
        assert shown.startswith(f"{plain['speedup']:.2f}x [{plain['lo']:.2f}, {plain['hi']:.2f}]")
        assert plain["resolved"] == (plain["hi"] < 1 or plain["lo"] > 1)
    ideal = drawn.loc[("1-step", 4, 4)]
    assert ideal["against"] == "1f1b" and ideal["throughput_source"].startswith("ideal")  # none faster there
    md = (tmp_path / "o" / "report.md").read_text()
    assert "(verdict.png)" in md and "verdict.png" in report.files and (tmp_path / "o" / "verdict.pdf").exists()


def test_no_timed_column_no_verdict_figure(tmp_path) -> None:
    root = sweep(tmp_path / "s", "s", ["sync", "1-step"])
    for seed in range(2):
        write(root, "sync", "adamw", seed, line(3.0))
        write(root, "1-step", "adamw", seed, line(3.2 + 0.01 * seed))
    report = build_report(root, out_dir=tmp_path / "o")
    assert "verdict.png" not in report.files and "verdict.png" not in (tmp_path / "o" / "report.md").read_text()
