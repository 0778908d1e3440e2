"""Throughput's own error in the net speed-up's interval (asyncpipe.report.spread, .speedups): a measured cell's
paired bench rounds, a modelled cell's validated band, each combined with the token ratio's interval by hand on
tiny generated sweeps run through the real report; and each column timed by its own optimizer's bench file."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from report_runs import line, sweep, write

from asyncpipe.report import build_report
from asyncpipe.report.speedups import speedup_cells
from asyncpipe.report.spread import model_band, validated_errors
from asyncpipe.report.target import speedup_table
from asyncpipe.report.throughput import load_bench, throughput

REPO = Path(__file__).resolve().parents[1]
T_975_DF2 = 4.302652729911275  # t_{2, 0.975}, the printed-table value


def family(root: Path, opts: tuple[str, ...] = ("adamw",), top: int = 2) -> Path:
    """sync, 1-step at 1x (ends 0.2 above sync) and at `top`x (0.2 below), 3 seeds, P = 2, m = 4: every seed
    crosses sync's loss half-way between the budgets, so the token ratio is (1 + top) / 2 with no spread."""
    root = sweep(root, "s", ["sync", "1-step", f"1-step(x{top})"])
    for opt in opts:
        for seed in range(3):
            L = 3.0 + 0.01 * seed
            write(root, "sync", opt, seed, line(L))
            write(root, "1-step", opt, seed, line(L + 0.2))
            write(root, f"1-step(x{top})", opt, seed, line(L - 0.2, 5000 * top), steps=100 * top)
    return root


def bench_file(path: Path, rounds: list[float], optimizer: str = "adamw", ratio: float | None = None) -> Path:
    point = ratio if ratio is not None else sorted(rounds)[len(rounds) // 2]
    path.write_text(json.dumps({"stages": 2, "micro_batches": 4, "optimizer": optimizer, "variants": {
        "1f1b": {"ratio_to_1f1b": 1.0, "ratio_to_1f1b_per_round": [1.0] * len(rounds)},
        "2bw": {"ratio_to_1f1b": point, "ratio_to_1f1b_per_round": rounds}}}))  # fmt: skip
    return path


def by_hand(rounds: list[float]) -> tuple[float, float]:
    """exp(mean log ± t_{n-1} sd / sqrt(n)) of the per-round ratios (n = 3)."""
    logs = [math.log(r) for r in rounds]
    mean = sum(logs) / 3
    half = T_975_DF2 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
    return math.exp(mean - half), math.exp(mean + half)


def own_cell(report, against: str = "1f1b"):
    cells = speedup_cells(report.ladders, report.bench)
    (row,) = cells[cells["own"] & (cells["against"] == against)].to_dict("records")
    return row


def test_a_measured_cell_whose_rounds_spread_alone_leaves_it_unresolved(tmp_path):
    """Token ratio 1.5 [1.5, 1.5]; 2BW measured 1.8 over 1F1B in rounds of 1.5, 1.8, 2.4: on the token ratio alone
    1.20x [1.20, 1.20] (resolved faster), with the rounds' t-interval (on logs, t_2 = 4.303) [1.035, 3.359] the
    speed-up is [0.69, 2.24]: not resolved. The same file with rounds 1.79, 1.80, 1.81 resolves it."""
    root = family(tmp_path / "s")
    noisy = bench_file(tmp_path / "noisy.json", [1.5, 1.8, 2.4])
    report = build_report(root, out_dir=tmp_path / "o", plots=False, bench=[noisy])
    row = own_cell(report)
    lo, hi = by_hand([1.5, 1.8, 2.4])
    assert (row["token_ratio"], row["token_lo"], row["token_hi"]) == pytest.approx((1.5, 1.5, 1.5))
    assert (row["throughput"], row["throughput_lo"], row["throughput_hi"]) == pytest.approx((1.8, lo, hi))
    assert (row["speedup"], row["lo"], row["hi"]) == pytest.approx((1.8 / 1.5, lo / 1.5, hi / 1.5))
    assert row["lo"] < 1 < row["hi"] and not row["resolved"] and row["direction"] == ""
    assert (row["throughput_source"], row["rounds"]) == ("measured, 3 rounds", 3)
    said = next(t for t in report.takeaways if "1-step" in t and "P=2, m=4" in t)
    assert "is not resolved" in said and "(1.80x throughput, measured, 3 rounds)" in said
    cell = speedup_table(report.ladders, report.bench).loc[(2, 4), "adamw 1-step vs 1F1B"]
    assert cell == f"1.20x [{lo / 1.5:.2f}, {hi / 1.5:.2f}] (1.800, measured, 3 rounds)"

    tight = bench_file(tmp_path / "tight.json", [1.79, 1.80, 1.81])
    again = own_cell(build_report(root, out_dir=tmp_path / "o2", plots=False, bench=[tight]))
    lo, hi = by_hand([1.79, 1.80, 1.81])
    assert (again["lo"], again["hi"]) == pytest.approx((lo / 1.5, hi / 1.5))
    assert again["resolved"] and again["direction"] == "faster" and again["lo"] > 1


def test_one_round_resolves_nothing(tmp_path):
    """A bench file of one round (or one that kept no rounds) has no spread: the cell shows the point only."""
    root = family(tmp_path / "s")
    report = build_report(root, out_dir=tmp_path / "o", plots=False,
                          bench=[bench_file(tmp_path / "one.json", [1.79])])  # fmt: skip
    row = own_cell(report)
    assert row["speedup"] == pytest.approx(1.79 / 1.5) and math.isnan(row["lo"]) and not row["resolved"]
    assert row["throughput_source"] == "measured, 1 round: no spread"
    assert speedup_table(report.ladders, report.bench).loc[(2, 4), "adamw 1-step vs 1F1B"] == (
        "1.19x (1.790, measured, 1 round: no spread)")


def test_a_modelled_cell_carries_the_validated_band_and_stays_resolved(tmp_path):
    """At P = 4, m = 8 no file measured: the cost model calibrated on the committed P = 2, m = 4 bench file gives 2BW's
    ratio v over 1F1B, within the worst validated error b of a modelled ratio over 1F1B; token ratio 2.0 [2.0, 2.0]
    (budgets 1x and 3x): the speed-up is v / 2 in [v / (1 + b) / 2, v / (1 - b) / 2], below 1 even at its top."""
    root = family(tmp_path / "s", top=3)
    committed = REPO / "benchmarks" / "results" / "pipeline-small-P2-m4.json"
    report = build_report(root, out_dir=tmp_path / "o", plots=False, bench=[committed])
    cells = speedup_cells(report.ladders, report.bench)
    (row,) = cells[(cells["P"] == 4) & (cells["m"] == 8) & (cells["against"] == "1f1b")].to_dict("records")
    v, b = row["throughput"], row["band"]
    assert "modelled" in row["throughput_detail"] and b == pytest.approx(worst_over("1f1b"), abs=2e-3)  # as printed
    assert row["throughput_source"] == f"modelled, ±{b:.1%}"
    assert row["token_ratio"] == pytest.approx(2.0)
    assert (row["lo"], row["hi"]) == pytest.approx((v / (1 + b) / 2.0, v / (1 - b) / 2.0))
    assert row["hi"] < 1 and row["resolved"] and row["direction"] == "slower"


def worst_over(reference: str) -> float:
    """The worst |error| of a modelled throughput ratio over `reference`, by hand from the doc's two cost tables
    (markdown, rounded as printed): real compute's 'x1F1B' columns (over DualPipeV: their quotient), and the stand-in
    table's step times (a ratio over 1F1B is the inverse ratio of step times)."""
    doc = (REPO / "docs" / "performance.md").read_text()
    real = doc.split("<!-- cost-table:start -->")[1].split("<!-- cost-table:end -->")[0]
    standin = doc.split("<!-- cost-standin-table:start -->")[1].split("<!-- cost-standin-table:end -->")[0]
    errors = []
    at: dict = {}
    for cells in (r.split("|")[1:-1] for r in real.splitlines() if re.match(r"\| \d", r)):
        at.setdefault(("real", 2, int(cells[0])), {})[cells[1].strip()] = (float(cells[5]), float(cells[6]))
    for cells in (r.split("|")[1:-1] for r in standin.splitlines() if re.match(r"\| \d", r)):
        step = (float(cells[3]), float(cells[5]))
        at.setdefault(("standin", int(cells[0]), int(cells[1])), {})[cells[2].strip()] = (1 / step[0], 1 / step[1])
    for rows in at.values():
        if reference not in rows:
            continue
        ref_meas, ref_pred = rows[reference]
        for name, (meas, pred) in rows.items():
            if name not in ("1f1b", "dualpipev"):
                errors.append(abs((pred / ref_pred) / (meas / ref_meas) - 1))
    return max(errors)


@pytest.mark.parametrize("reference", ["1f1b", "dualpipev"])
def test_the_band_is_the_validation_tables_worst_error(reference):
    """The band the report reads from cost-table.json is the doc tables' worst error over the same schedule (the
    doc prints 3-4 digits: equal within its rounding), and covers every validated ratio."""
    band, where = model_band(reference)
    assert band == pytest.approx(worst_over(reference), abs=2e-3)
    assert all(abs(e) <= band for e, ref, _ in validated_errors() if ref == reference) and reference in where
    assert 0 < band < 0.10  # the doc's claim: the model is within a few % of every validated record


def test_each_column_is_timed_by_its_own_optimizers_bench_file(tmp_path):
    """AdamW's file measures 2BW at 1.25x, Muon's at 1.10x (Muon's costlier step): each optimizer's column uses its
    own; a column whose optimizer no file timed falls back, and its source says whose step it is."""
    adamw = bench_file(tmp_path / "adamw.json", [1.24, 1.25, 1.26], "adamw")
    muon = bench_file(tmp_path / "muon.json", [1.09, 1.10, 1.11], "muon")
    root = family(tmp_path / "s", opts=("adamw", "muon"))
    report = build_report(root, out_dir=tmp_path / "o", plots=False, bench=[adamw, muon])
    cells = speedup_cells(report.ladders, report.bench)
    own = cells[cells["own"] & (cells["against"] == "1f1b")].set_index("optimizer")
    assert own.loc["adamw", "throughput"] == 1.25 and own.loc["muon", "throughput"] == 1.10
    detail = own.loc["muon", "throughput_detail"]
    assert "(muon.json)" in detail and "no bench file" not in detail
    table = speedup_table(report.ladders, report.bench)
    assert {"2BW / 1F1B throughput (adamw's step)", "2BW / 1F1B throughput (muon's step)"} <= set(table.columns)
    nadam = throughput(2, 4, load_bench([adamw, muon]), optimizer="nadam")
    assert nadam.note == "nadam: no bench file timed it, adamw / muon's step" and nadam.note in nadam.source
    assert throughput(2, 4, load_bench([adamw, muon]), optimizer="muon@r1").vs_1f1b == 1.10  # a revision is muon's


def test_the_report_writes_the_speed_ups_in_columns(tmp_path):
    """speedups.csv beside report.md holds the long table, the figure's and the write-up's source."""
    import pandas as pd

    root = family(tmp_path / "s")
    bench = bench_file(tmp_path / "b.json", [1.5, 1.8, 2.4])
    report = build_report(root, out_dir=tmp_path / "o", plots=False, bench=[bench])
    written = pd.read_csv(tmp_path / "o" / "speedups.csv")
    expected = speedup_cells(report.ladders, report.bench)
    assert list(written.columns) == list(expected.columns) and len(written) == len(expected)
    assert {"speedup", "lo", "hi", "resolved", "throughput_source"} <= set(written.columns)
    assert written["resolved"].tolist() == expected["resolved"].tolist()


def test_a_file_measured_under_load_says_so_in_every_cell_it_times(tmp_path):
    """A bench file whose 1-minute load before the run exceeded its CPUs: its measured cells' source names the load;
    a quiet one's does not."""
    path = bench_file(tmp_path / "busy.json", [1.2, 1.25, 1.3])
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "load_avg": [21.25, 18.0, 14.1], "cpu_count": 2}))
    busy = throughput(2, 4, load_bench([path]))
    assert busy.source == "measured, 2bw (busy.json); measured at load 21.2 on 2 CPUs"
    path.write_text(json.dumps({**record, "load_avg": [1.2, 1.5, 1.7], "cpu_count": 2}))
    assert throughput(2, 4, load_bench([path])).source == "measured, 2bw (busy.json)"


def test_a_model_calibrated_under_load_has_no_validated_band(tmp_path):
    """The band was validated on calibrations measured on a quiet machine: a cost model calibrated on a file measured
    at a load above its CPUs carries none (its cells resolve nothing); beside a quiet file, the quiet one calibrates."""
    record = json.loads((REPO / "benchmarks" / "results" / "pipeline-small-P2-m8.json").read_text())
    busy = tmp_path / "busy-small-P2-m8.json"
    busy.write_text(json.dumps({**record, "load_avg": [20.0, 18.0, 14.0], "cpu_count": 2}))
    alone = throughput(4, 8, load_bench([busy]))
    assert alone.kind == "modelled" and "busy-small-P2-m8.json" in alone.source
    assert alone.error().how == "modelled, no validated band (calibrated at load 20.0 on 2 CPUs)"
    assert not alone.error().known and not alone.error(best=True).known
    quiet = REPO / "benchmarks" / "results" / "pipeline-small-P2-m4.json"
    both = throughput(4, 8, load_bench([busy, quiet]))
    assert "calibrated on pipeline-small-P2-m4.json" in both.source and both.error().how.startswith("modelled, ±")
