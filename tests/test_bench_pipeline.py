"""`asyncpipe bench pipeline`: the arithmetic of the result (pure) and one tiny end-to-end run (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from asyncpipe import cli_perf
from asyncpipe.bench.pipeline_summary import ideal_speedup, job_stats, optimizer_state_bytes


def test_ideal_speedup_is_the_flush_bubble() -> None:
    assert ideal_speedup(2, 4) == pytest.approx(1.25)
    assert ideal_speedup(4, 8) == pytest.approx(11 / 8)
    assert ideal_speedup(1, 4) == 1.0


def test_job_stats_times_only_the_steady_steps() -> None:
    hist = [{"step": i + 1, "step_time": t, "stage0_idle_frac": f, "stage1_idle_frac": 0.5}
            for i, (t, f) in enumerate([(9.0, 0.9), (1.0, 0.1), (3.0, 0.3), (2.0, 0.2), (9.0, 0.9)])]  # fmt: skip
    hist.insert(0, {"step": 0, "val_loss": 3.0})  # the start record has no step time
    st = job_stats({"history": hist, "stages": [{"stage": 0}]}, tokens_per_step=100, skip=1)
    assert st["steps_timed"] == 3
    assert st["tokens_per_s"] == pytest.approx(300 / 6.0) and st["step_time_s"] == pytest.approx(2.0)
    assert st["idle_frac"] == [pytest.approx(0.2), pytest.approx(0.5)]
    assert st["min_step_time_s"] == 1.0


def _cfg(optimizer: str):
    from asyncpipe.config import compose

    return compose(["model=tiny", f"optimizer={optimizer}", "engine=pipeline", "pipeline.stages=2"])


def test_optimizer_state_is_two_moments_and_ef_adds_one_buffer() -> None:
    import torch

    from asyncpipe.data import ensure_prepared, load_manifest
    from asyncpipe.model import build_layers, partition

    cfg = _cfg("adamw")
    vocab = load_manifest(ensure_prepared(cfg.data, cfg.tokenizer))["tokenizer"]["vocab_size"]
    parts = partition(cfg.model.n_layer + 2, 2)
    plain, ef = optimizer_state_bytes(cfg), optimizer_state_bytes(_cfg("adamw_ef"))
    for s in range(2):
        layers = build_layers(cfg.model, vocab, indices=range(parts[s], parts[s + 1]))
        params = [p for layer in layers if layer is not None for p in layer.parameters()]
        n_bytes = sum(p.numel() * p.element_size() for p in params)
        step_bytes = plain[s]["optimizer_state_bytes"] - 2 * n_bytes  # AdamW's per-tensor step counters
        assert 0 <= step_bytes <= len(params) * torch.tensor(0.0).element_size() * 2
        assert plain[s]["ef_buffer_bytes"] == 0
        assert ef[s]["ef_buffer_bytes"] == n_bytes
        assert ef[s]["optimizer_state_bytes"] == plain[s]["optimizer_state_bytes"]


@pytest.mark.slow
def test_bench_pipeline_writes_every_field(tmp_path: Path) -> None:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command("pipeline")(cli_perf.bench_pipeline)
    app.command("other")(lambda: None)
    out = tmp_path / "bench.json"
    args = ["pipeline", "model=tiny", "pipeline.stages=2", "train.micro_batches=2", "train.micro_batch_size=2",
            "train.seq_len=16", "--rounds", "1", "--steps", "3", "--warmup-steps", "1", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "fraction of ideal" in res.output and "timed by: host" in res.output
    assert "1 round: too few to judge (--rounds 3+)" in res.output  # issue 41: one round has no spread
    # m = 2 < 2P: DualPipeV cannot run; the bench says why instead of failing.
    assert "dualpipev" in res.output and "2 x pipeline.stages" in res.output
    r = json.loads(out.read_text())
    assert r["stages"] == 2 and r["micro_batches"] == 2 and r["ideal_ratio"] == pytest.approx(1.5)
    # real compute: each layer kind timed alone on the run's micro-batch, for the cost model's stage-0 split
    assert r["layer_profile"]["micro_batch"] == [2, 16] and all(r["layer_profile"][k][0] > 0 for k in ("block", "head"))
    # PyTorch's own schedules run beside ours by default; its DualPipeV refuses m < 2P in its own words.
    torch_names = {"pt_1f1b", "pt_interleaved1f1b", "pt_loopedbfs", "pt_interleavedzb", "pt_zbv"}
    assert set(r["variants"]) == {"1f1b", "2bw", "2bw_ef", "paci", "paci-recompute", *torch_names}
    assert set(r["skipped"]) == {"dualpipev", "pt_dualpipev"} and "ScheduleDualPipeV" in r["skipped"]["pt_dualpipev"]
    assert "pt_zbv = PyTorch ScheduleZBVZeroBubble" in res.output
    v = r["variants"]
    assert r["ratio_2bw_over_1f1b"] == pytest.approx(v["2bw"]["tokens_per_s"] / v["1f1b"]["tokens_per_s"])
    assert r["fraction_of_ideal"] == pytest.approx(r["ratio_2bw_over_1f1b"] / 1.5)
    best = {n: v[n]["tokens_per_s_best_step"] for n in v}
    assert r["ratio_best_step"] == pytest.approx(best["2bw"] / best["1f1b"])
    assert v["2bw"]["tokens_per_s_best_step"] >= v["2bw"]["tokens_per_s"]
    # The schedule model: 1F1B's bubble is (P-1)/(m+P-1) whatever the costs; 2BW's steady state has none.
    assert r["analytic_bubble"]["1f1b"] == pytest.approx(1 / 3) and v["2bw"]["analytic_bubble"] == pytest.approx(0.0)
    assert v["2bw"]["ideal_ratio_to_1f1b"] == pytest.approx(1.5)
    for name, versions, ef in (("1f1b", 1.0, False), ("2bw", 2.0, False), ("2bw_ef", 2.0, True), ("paci", 1.0, False)):
        x = v[name]
        assert x["tokens_per_s"] > 0 and len(x["idle_frac_per_stage"]) == 2 and len(x["norm_wait_ms_per_step"]) == 2
        assert len(x["compute_s_per_micro_batch"]) == 2 and all(y > 0 for y in x["compute_s_per_micro_batch"])
        assert all(0.0 <= f < 1.0 for f in x["idle_frac_per_stage"])
        assert x["timing"] == ["host"]  # CPU: host clocks, and the bench says so
        for mem in x["memory_per_stage"]:
            assert mem["weight_versions_peak"] == pytest.approx(versions)
            assert mem["optimizer_state_mb"] > mem["param_mb"] > 0
            assert (mem["ef_buffer_mb"] == pytest.approx(mem["param_mb"])) if ef else mem["ef_buffer_mb"] == 0
            assert mem["peak_weight_plus_optimizer_mb"] == pytest.approx(
                mem["peak_weight_mb"] + mem["optimizer_state_mb"] + mem["ef_buffer_mb"])
            assert mem["peak_activation_mb"] >= mem["activation_mb_per_micro_batch"] > 0
    for name in torch_names:
        x = v[name]
        assert x["synchronous"] and x["schedule"].startswith("PyTorch Schedule") and x["tokens_per_s"] > 0
        assert all(mem["weight_versions_peak"] == 1.0 and mem["peak_activation_mb"] > 0 for mem in x["memory_per_stage"])
    assert v["pt_1f1b"]["analytic_bubble"] == pytest.approx(1 / 3) and v["pt_zbv"]["analytic_bubble"] < 1 / 3
    assert not v["2bw"]["synchronous"] and v["1f1b"]["synchronous"]
    # 1F1B keeps at most P - s micro-batches in flight on stage s, so stage 0 peaks at two micro-batches' worth.
    m0 = v["1f1b"]["memory_per_stage"][0]
    assert m0["peak_activation_mb"] == pytest.approx(2 * m0["activation_mb_per_micro_batch"], rel=0.01)
    assert set(r["simulator"]["ratio_to_delay0"]) == {"delay0", "delay1", "delay1_ef"}
    assert set(r["targets"]) == {"ratio_ge_0.95_ideal", "fastest_step_ratio_ge_0.95_ideal", "weights_le_two_versions",
                                "simulator_delay1_le_1.10", "paci_weights_equal_1f1b", "paci_tokens_per_s_ge_2bw"}
    # PACI holds one weight version: the same bytes per stage as 1F1B (measured by the engine's stash).
    assert r["targets"]["paci_weights_equal_1f1b"] and v["paci"]["analytic_bubble"] == pytest.approx(0.0)


def test_the_table_flags_ratios_within_their_spread_or_from_too_few_rounds() -> None:
    """Issue 41: a committed 3-round result (benchmarks/results) resolves every ratio; the same result with one
    round, or with a round whose ratio falls below 1, is flagged on its line; the header names its columns."""
    import copy

    from asyncpipe.bench.pipeline import format_result, spread_note

    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / "benchmarks" / "results" / "pipeline-small-P2-m4.json").read_text())
    text = format_result(res)
    assert "norm-wait ms/stage" in text and "x1F1B per round" in text and "too few" not in text
    assert "not a difference" not in text
    assert "EF's cost: 2bw_ef / 2bw tokens/s 0.958 (4.2% slower), per round 0.951, 0.966, 0.958" in text
    wide = copy.deepcopy(res)
    wide["variants"]["dualpipev"]["ratio_to_1f1b_per_round"] = [0.98, 1.05, 1.09]
    row = next(ln for ln in format_result(wide).splitlines() if ln.startswith("dualpipev "))
    assert row.endswith("1 within the rounds' spread 0.980-1.090: not a difference")
    one = copy.deepcopy(res)
    one["ratio_per_round"] = one["ratio_per_round"][:1]
    line = next(ln for ln in format_result(one).splitlines() if ln.startswith("2bw/1f1b"))
    assert line.endswith("[1 round: too few to judge (--rounds 3+)]")
    assert spread_note([1.2, 1.3]) == "2 rounds: too few to judge (--rounds 3+)"
