"""docs/performance.md's compile figures are the committed benchmark JSONs' numbers (no figure typed by hand)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "performance.md").read_text()
RESULTS = REPO / "benchmarks" / "results"


def _span(values: list[float], fmt: str) -> str:
    """A figure range as the docs write it: "74-76" (or "75" when both ends print alike)."""
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


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


def test_the_compile_ceiling_sentence_is_the_profiles_json() -> None:
    bench = json.loads((RESULTS / "compile-profile-tiny.json").read_text())
    rounds = bench["rounds"]
    assert bench["git"] is not None and not bench["git"]["dirty"]
    assert f"`benchmarks/compile_profile.py` at {bench['git']['commit'][:7]}" in DOC
    assert "compiled / eager step time " + ", ".join(f"{r['speedup']:.2f}x" for r in rounds) in DOC
    assert "could not beat " + ", ".join(f"{r['ceiling']:.2f}x" for r in rounds) in DOC
    assert _span([100 * r["aten_share_compiled"] for r in rounds], "{:.0f}") + "% of a compiled step" in DOC


def test_the_fast_host_end_to_end_table_is_the_benchmarks_json() -> None:
    bench = json.loads((RESULTS / "compile_speed-tiny-1100-avx2-fast.json").read_text())
    labels = {"eager A": "eager A", "compiled cold": "compiled, cold cache", "compiled warm": "compiled, warm cache",
              "eager B": "eager B"}  # fmt: skip
    for run in bench["runs"]:
        row = (f"| {labels[run['run']]} | {run['wall_s']:.1f} s | {run['tokens_per_s'] / 1e3:.1f}k | "
               f"{run['steady_step_s'] * 1e3:.1f} ms |")  # fmt: skip
        assert row in DOC, row
    sp = bench["speedup"]
    assert (f"**{sp['eager first (A / warm)']:.2f}x** eager first, **{sp['compiled first (B / warm)']:.2f}x** compiled "
            f"first; cold **{sp['cold, eager first (A / cold)']:.2f}x**") in DOC.replace("\n", " ")


def test_the_bare_loop_sentence_is_the_profiles_json() -> None:
    rounds = json.loads((RESULTS / "compile-profile-tiny.json").read_text())["rounds"]

    def listed(key: str) -> str:
        return ", ".join(f"{r[key]:.2f}x" for r in rounds)

    assert f"the bare loop's compiled speed-up {listed('bare_speedup')}" in DOC
    assert f"simulator / bare loop step time {listed('over_bare_eager')} eager" in DOC
    assert f"and {listed('over_bare_compiled')} compiled" in DOC


def test_the_compile_profile_table_is_the_committed_profiles() -> None:
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from compile_profile import table

    assert table() in DOC
    small = json.loads((RESULTS / "compile-profile-small.json").read_text())
    assert not small["git"]["dirty"] and f"at {small['git']['commit'][:7]}, same host" in DOC
    shares = _span([100 * r["aten_share_compiled"] for r in small["rounds"]], "{:.0f}")
    assert f"matmul and attention are {shares}% of a compiled step" in DOC


def test_the_readme_compile_line_is_the_committed_profiles() -> None:
    readme = " ".join((REPO / "docs" / "usage.md").read_text().split())  # README's reference part (issue 41)

    rounds = {m: json.loads((RESULTS / f"compile-profile-{m}.json").read_text())["rounds"] for m in ("tiny", "small")}
    speed = {m: _span([r["speedup"] for r in rs], "{:.2f}") + "x" for m, rs in rounds.items()}
    share = {m: _span([100 * r["aten_share_compiled"] for r in rs], "{:.0f}") + "%" for m, rs in rounds.items()}
    assert f"{speed['tiny']} per step for tiny and {speed['small']} for small" in readme
    assert f"matmul and attention are {share['tiny']} and {share['small']} of a compiled step" in readme


def test_the_pytorch_schedules_table_is_the_committed_json() -> None:
    """The side-by-side table of PyTorch's schedules and ours is `pipeline_table.py --torch` rendered from the
    committed JSONs; every PyTorch schedule is in it, run or with the reason it could not; the prose's figures."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from pipeline_table import TORCH_END, TORCH_ORDER, TORCH_START, table

    block = DOC.split(TORCH_START + "\n")[1].split("\n" + TORCH_END)[0]
    model = re.search(r"Model `(\w+)`", block).group(1)
    results = [json.loads((RESULTS / f"pipeline-torch-{model}-P2-m{m}.json").read_text()) for m in (2, 4, 8)]
    assert block == table(results, TORCH_ORDER)
    assert f"pipeline_table.py --torch --model {model} --rounds {results[0]['rounds']} --steps " \
           f"{results[0]['steps_per_job']} --update-doc" in DOC
    for r in results:
        assert all(n in r["variants"] or n in r["skipped"] for n in TORCH_ORDER), r["micro_batches"]
        assert r["variants"]["pt_1f1b"]["schedule"] == "PyTorch Schedule1F1B"
    assert "ScheduleDualPipeV refuses P=2, m=2" in results[0]["skipped"]["pt_dualpipev"]
    assert {"pt_1f1b", "pt_interleaved1f1b", "pt_zbv", "pt_dualpipev", "dualpipev", "2bw"} <= set(results[1]["variants"])
    ideals = [x["ideal_ratio_to_1f1b"] for r in results for x in r["variants"].values()]
    assert f"the schedules' ideals do ({min(ideals):.2f}-{max(ideals):.2f}x 1F1B)" in DOC
