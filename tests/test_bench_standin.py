"""Stand-in compute (`asyncpipe bench pipeline --standin F,B`, `pipeline.standin`): the ideal step times
(hand-derived), the option's bad inputs, and one tiny end-to-end run whose measured step must be at least the
schedule's ideal from the configured times (the pad is really waited) and within a loose factor of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from asyncpipe import cli_perf
from asyncpipe.bench.standin import bubble_model_step_s, ideal_step_s, parse_standin
from asyncpipe.errors import UserError


@pytest.mark.parametrize("P,m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 16)])
def test_ideal_step_is_the_flush_or_steady_state_of_the_stream(P: int, m: int) -> None:
    F, B = 0.02, 0.04
    # 1F1B flushes: m + P - 1 slots of F + B; 2BW's steady state: m slots (equal stages, free step and messages).
    assert ideal_step_s("1f1b", P, m, F, B) == pytest.approx((m + P - 1) * (F + B))
    assert ideal_step_s("2bw", P, m, F, B) == pytest.approx(m * (F + B))
    assert bubble_model_step_s("1f1b", P, m, F, B) == pytest.approx((m + P - 1) * (F + B))
    assert bubble_model_step_s("2bw", P, m, F, B) == pytest.approx(m * (F + B))
    # DualPipeV needs m >= 2P; where it runs, its bubble is below 1F1B's.
    v = ideal_step_s("dualpipev", P, m, F, B)
    assert (v is None) == (m < 2 * P)
    assert v is None or m * (F + B) <= v < (m + P - 1) * (F + B)


@pytest.mark.parametrize("text", ["0.02", "a,b", "0.02,0", "0.02,-1", "0.02,0.04,0.01", "nan,0.1", "0.02,61"])
def test_a_bad_standin_is_one_line(text: str) -> None:
    with pytest.raises(UserError, match="--standin"):
        parse_standin(text)
    assert parse_standin(" 0.02, 0.04") == (0.02, 0.04)


def test_standin_run_is_no_faster_than_its_ideal(tmp_path: Path) -> None:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command("pipeline")(cli_perf.bench_pipeline)
    app.command("other")(lambda: None)
    out = tmp_path / "bench.json"
    F, B = 0.02, 0.04
    args = ["pipeline", "model=tiny", "pipeline.stages=2", "train.micro_batches=2", "train.micro_batch_size=1",
            "train.seq_len=16", "--standin", f"{F},{B}", "--variants", "1f1b,2bw", "--rounds", "1", "--steps", "3",
            "--warmup-steps", "1", "--no-simulator", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "stand-in F 20.0 ms, B 40.0 ms" in res.output
    recs = {r["schedule"]: r for r in json.loads(out.read_text())["standin"]["records"]}
    assert set(recs) == {"1f1b", "2bw"}
    for name, r in recs.items():
        ideal = (2 + 1) * (F + B) if name == "1f1b" else 2 * (F + B)
        assert r["ideal_step_s"] == pytest.approx(ideal)
        # Every forward and backward is padded to its configured time: no step beats the ideal (perf_counter
        # steps of a whole train_batch call), and engine overhead under load stays within a loose factor.
        assert ideal * 0.999 <= r["min_step_time_s"] and r["step_time_s"] <= 5 * ideal, r
        assert r["fraction_of_ideal"] == pytest.approx(ideal / r["step_time_s"])
        per = r["per_instruction_s"]
        assert per["ForwardPass"] >= F * 0.999 and per["BackwardPass"] >= B * 0.999
        assert r["instructions_per_step"]["BackwardPass"] == pytest.approx(2.0)  # m backwards per stage and step
        for stage in r["step_breakdown_s"]:  # the partition adds up to the stage's train_batch time
            parts = sum(v for k, v in stage.items() if k not in ("wall", "norm_wait", "cpu"))
            assert parts == pytest.approx(stage["wall"], rel=1e-6)
            # The rank's CPU seconds: the real ops and the engine's work, not the pads (sleeps) it waits in.
            assert 0 < stage["cpu"] < stage["wall"] - 0.5 * stage["standin"], stage
            assert stage["standin"] == pytest.approx(2 * (F + B), rel=0.02)
    assert recs["2bw"]["weight_versions_peak"] == [2.0, 2.0] and recs["1f1b"]["weight_versions_peak"] == [1.0, 1.0]


def test_the_doc_table_is_the_committed_json() -> None:
    """docs/performance.md's stand-in section is `benchmarks/standin_table.py`'s rendering of its committed JSON,
    and every record carries the documented keys with an ideal no faster than the schedule's work allows."""
    import importlib.util

    from asyncpipe.bench.standin import RECORD_KEYS

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("standin_table", repo / "benchmarks" / "standin_table.py")
    table = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(table)
    doc = (repo / "docs" / "performance.md").read_text()
    for section, name in (("standin-x4", "standin-2bw-x4.json"), ("standin-x10", "standin-2bw-x10.json"),
                          ("standin-table", "standin.json")):
        res = json.loads((repo / "benchmarks" / "results" / name).read_text())
        start, end = table.markers(section)
        assert f"{start}\n{table.render(res)}\n{end}" in doc, section
    seen = {(r["schedule"], r["stages"]) for r in res["records"]}
    assert {("1f1b", 8), ("2bw", 8), ("dualpipev", 8)} <= seen
    assert {("paci", 8), ("paci-recompute", 8)} & seen
    for r in res["records"]:
        assert set(RECORD_KEYS) <= set(r)
        work = r["micro_batches"] * (r["forward_s"] + r["backward_s"])  # one stage's stand-in per batch
        assert r["ideal_step_s"] >= work * 0.999 and r["fraction_of_ideal"] == pytest.approx(r["ideal_step_s"] / r["step_time_s"])


@pytest.mark.slow
def test_bench_pipeline_runs_even_against_balanced_side_by_side(tmp_path: Path) -> None:
    """`bench pipeline --cuts even,balanced` under a per-layer stand-in (`pipeline.standin.profile`: 360m's layers,
    the head about four blocks): each schedule at both cuts in the same rounds, the balanced cut giving the head's
    stage fewer blocks, its stand-in ideal faster, and the measured ratio per round beside the cost model's."""
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command("pipeline")(cli_perf.bench_pipeline)
    app.command("other")(lambda: None)
    out = tmp_path / "bench.json"
    model = ["model=tiny", "model.n_layer=8", "pipeline.stages=2", "train.micro_batches=2", "train.micro_batch_size=1"]
    standin = ["train.seq_len=16", "pipeline.standin.profile=360m_h100", "pipeline.standin.scale=4"]
    flags = ["--variants", "1f1b,2bw", "--rounds", "2", "--steps", "3", "--warmup-steps", "1", "--no-simulator"]
    res = CliRunner().invoke(app, ["pipeline", *model, *standin, "--cuts", "even,balanced", *flags, "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert set(data["variants"]) == {"1f1b+even", "1f1b+balanced", "2bw+even", "2bw+balanced"}
    assert data["variants"]["2bw+even"]["cut"] == [4, 4] and data["variants"]["2bw+balanced"]["cut"][-1] < 4
    recs = {r["variant"]: r for r in data["standin"]["records"]}
    for name, r in recs.items():  # every stage waited for the layers its cut gave it: m x (F + B) of its chunk
        per_stage = [f + b for f, b in zip(r["forward_s_per_chunk"], r["backward_s_per_chunk"])]
        waited = [st["standin"] for st in r["step_breakdown_s"]]
        assert waited == pytest.approx([2 * x for x in per_stage], rel=0.02), name
        assert r["cut"] == data["variants"][name]["cut"]
    ideal = recs["2bw+even"]["ideal_step_s"] / recs["2bw+balanced"]["ideal_step_s"]
    assert ideal > 1.2  # the waits alone: the head's stage is the bottleneck at the even cut
    ratio = data["cuts"]["ratios"]["2bw balanced/even"]
    v = data["variants"]
    assert ratio["measured"] == pytest.approx(v["2bw+balanced"]["tokens_per_s"] / v["2bw+even"]["tokens_per_s"])
    # paired per round; what they measure is the machine's (on a loaded machine real ops outgrow short waits)
    assert len(ratio["per_round"]) == 2 and ratio["per_round"][0] > 0
    assert ratio["predicted"] == pytest.approx(
        data["cuts"]["variants"]["2bw+even"]["predicted_step_s"] / data["cuts"]["variants"]["2bw+balanced"]["predicted_step_s"]
    )
    assert "stage cuts (cost model: measured: this run (per-layer stand-in 360m_h100 x 4" in res.output
    assert "2bw        balanced/even:" in res.output
