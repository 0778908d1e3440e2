"""docs/performance.md's compile figures are the committed benchmark JSONs' numbers (no figure typed by hand)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "performance.md").read_text()
RESULTS = REPO / "benchmarks" / "results"


def _row(schedule: str) -> list[str]:
    rows = [line for line in DOC.splitlines() if line.startswith(f"| {schedule} | ") and "compiled" in line]
    assert len(rows) == 1, rows
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_the_compiled_pipeline_table_is_the_benchmarks_json() -> None:
    bench = json.loads((RESULTS / "pipeline-small-P2-m4-compile.json").read_text())
    v = bench["variants"]
    for schedule in ("1f1b", "2bw"):
        eager, compiled = v[schedule], v[f"{schedule}+compiled"]
        cells = _row(schedule)
        assert cells[1] == f"{eager['tokens_per_s']:.0f}" and cells[2] == f"{compiled['tokens_per_s']:.0f}"
        rounds = ", ".join(f"{r:.3f}" for r in compiled["compile_speedup_per_round"])
        assert cells[3] == f"{compiled['compile_speedup']:.3f}x ({rounds})"
        peaks = (eager["memory_per_stage"][0]["peak_activation_mb"], compiled["memory_per_stage"][0]["peak_activation_mb"])
        assert cells[5] == f"{peaks[0]:.1f} eager, {peaks[1]:.1f} compiled"
    assert _row("2bw")[4] == f"{v['2bw']['ratio_to_1f1b']:.3f} eager, {v['2bw+compiled']['ratio_to_1f1b']:.3f} compiled"
    assert f"ideal {bench['ideal_ratio']:.2f}" in DOC


def test_the_compiled_simulator_sentence_is_the_benchmarks_json() -> None:
    bench = json.loads((RESULTS / "simulator-tiny-study-compile.json").read_text())
    speedups = bench["compile_speedup"].values()
    assert f"compiled {min(speedups):.2f}x-{max(speedups):.2f}x faster per step" in DOC
    eager, compiled = bench["median_step_s"], bench["compiled_median_step_s"]
    for variant, name in (("delay0", "delay 0"), ("delay1_ef", "delay 1 + EF")):
        expected = rf"{re.escape(name)}:\s+{eager[variant] * 1e3:.1f} against {compiled[variant] * 1e3:.1f} ms"
        assert re.search(expected, DOC), expected
