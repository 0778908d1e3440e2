"""The pipeline cost model (`asyncpipe.timelines.cost`): step times derived by hand on small cases, the calibration
recovering the costs a bench record was written with, the committed check against the real engine re-rendered
from its JSON, and its two users: `plan` naming the fastest schedule that fits, `report` labelling "modelled"."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from asyncpipe.timelines.cost import CostModel, predict

REPO = Path(__file__).resolve().parents[1]


def hand_model(blocks: int = 2, f: float = 1.0, b: float = 2.0, u_per_block: float = 0.25) -> CostModel:
    """[embedding, blocks x (F, B), head]: free embedding and head; the step costs u_per_block per block."""
    return CostModel("hand", False, forward=[0.0] + [f] * blocks + [0.0], backward=[0.0] + [b] * blocks + [0.0],
                     params=[0] + [1] * blocks + [0], tokens_per_micro_batch=1, step_per_param=u_per_block)  # fmt: skip


def test_step_times_derived_by_hand() -> None:
    """P = 2, one block per stage, F = 1, B = 2, step U = 0.25.
    1F1B, m = 2: stage 0 F0 [0,1] F1 [1,2]; stage 1 F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]; stage 0 B0 [4,6] B1 [7,9];
    both step after the norm all-reduce, at 9: a batch is (m+P-1)(F+B) + U = 9.25.
    2BW, m = 2: no flush, every stage busy m(F+B) + U = 6.25 per batch. PACI, m = 2: 2BW's order, nothing more
    (in place: 6.25); paci-recompute: stage 0 recomputes the forward of its one straddling micro-batch
    (w = P-1 = 1): 6 + 1 + 0.25 = 7.25."""
    model = hand_model()
    assert predict(model, "1f1b", 2, 2).step_s == pytest.approx(9.25)
    assert predict(model, "2bw", 2, 2).step_s == pytest.approx(6.25)
    assert predict(model, "paci", 2, 2).step_s == pytest.approx(6.25)
    assert predict(model, "paci-recompute", 2, 2).step_s == pytest.approx(7.25)
    one = predict(model, "1f1b", 2, 4)  # m = 4: (4+1) x 3 + 0.25; the idle share of a stage: 1 - (12.25 / 15.25)
    assert (one.step_s, one.bubble) == (pytest.approx(15.25), pytest.approx(1 - 12.25 / 15.25))
    # EF's extra work and the engine's overhead per instruction land where they should: in every step / instruction.
    ef = CostModel(**{**model.__dict__, "ef_per_param": 0.5})
    assert predict(ef, "2bw", 2, 2, ef=True).step_s == pytest.approx(6.75)
    assert predict(model.with_overhead(0.01), "2bw", 2, 2).step_s > 6.25
    # D replicas: each stage's step adds the ring all-reduce of its gradients, 2 (D-1)/D x 4 bytes x params / bandwidth
    # + latency: D = 2, one parameter per stage at 8 bytes/s and 0.1 s: 0.5 + 0.1 more per step.
    wide = CostModel(**{**model.__dict__, "allreduce_bytes_per_s": 8.0, "allreduce_latency_s": 0.1})
    assert predict(wide, "2bw", 2, 2, data_parallel=2, clip="stage").step_s == pytest.approx(6.25 + 0.6)
    with pytest.raises(Exception, match="no all-reduce bandwidth"):
        predict(model, "2bw", 2, 2, data_parallel=2)


def test_dualpipev_replays_each_chunk_at_its_own_cost() -> None:
    """Four blocks at P = 2: 4 chunks of one block in a V, F = 0.5, B = 1 each, a free step. Its ticks (DeepSpeed's
    commits included) take 14: `tests/test_dualpipev_stream.py` replays this batch by hand at 10 / 20 per chunk
    (280), where the order replayed by data dependencies takes 13.5 (270); a heavier loss chunk (rank 0 holds it)
    makes the batch longer."""
    from asyncpipe.timelines import orders

    model = hand_model(blocks=4, f=0.5, b=1.0, u_per_block=0.0)
    assert orders.replay(orders.plan("dualpipev", 2, 4), forward=1.0, backward=2.0).makespan == pytest.approx(13.5)
    assert predict(model, "dualpipev", 2, 4).step_s == pytest.approx(14.0)
    heavy = CostModel(**{**model.__dict__, "forward": model.forward[:-1] + [0.5], "backward": model.backward[:-1] + [1.0]})
    assert predict(heavy, "dualpipev", 2, 4).step_s > 14.0


def test_predict_runs_the_cut_it_is_given() -> None:
    """`predict(cut=...)` sums each chunk's layers under that cut (`pipeline.cut`). Six blocks of F = 1, B = 2 and a
    head of 3 + 6 at P = 2, free steps and messages: 2BW's steady step is m x the slowest stage's F + B. Even [3, 3]:
    stages 9 and 18 -> 4 x 18 = 72; [4, 2]: 12 and 15 -> 60; [5, 1]: 15 and 12 -> 60. The engine's own work per pass
    (``chunk_s``) is paid once per chunk and pass: 0.5 + 0.25 more per micro-batch on the slowest stage."""
    from dataclasses import replace

    model = replace(
        hand_model(blocks=6, u_per_block=0.0),
        forward=[0.0] + [1.0] * 6 + [3.0],
        backward=[0.0] + [2.0] * 6 + [6.0],
    )
    for cut, step in (([3, 3], 72.0), ([4, 2], 60.0), ([5, 1], 60.0)):
        assert predict(model, "2bw", 2, 4, clip="stage", cut=cut).step_s == pytest.approx(step)
    assert predict(model, "2bw", 2, 4, clip="stage").step_s == pytest.approx(72.0)  # no cut given: even
    extra = replace(model, chunk_s=(0.5, 0.25))
    assert predict(extra, "2bw", 2, 4, clip="stage", cut=[4, 2]).step_s == pytest.approx(4 * (15 + 0.75))


def test_the_replay_imports_neither_torch_nor_deepspeed() -> None:
    """The report models throughput with this (1F1B's stream is DeepSpeed's TrainSchedule order written out,
    `pipe.schedule.flushed_1f1b_stream`), so it must stay torch-free."""
    import subprocess
    import sys

    code = ("import sys; from asyncpipe.timelines.cost import CostModel, ratio; "
            "m = CostModel('hand', False, forward=[0, 1, 1, 0], backward=[0, 2, 2, 0], params=[0, 1, 1, 0], "
            "tokens_per_micro_batch=1, step_per_param=0.25); r = ratio(m, '2bw', '1f1b', 2, 4); assert r > 1, r; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def _record(fwd: list[float], bwd: list[float], upd: list[float], steps: int = 6, m: int = 4) -> dict:
    """A bench record of model small at P = 2 whose 1F1B stages ran these per-micro-batch costs (2 x 1 evaluation
    forwards ride in ForwardPass, as in a job)."""
    ops = [{"ForwardPass": f * (steps * m + 2), "BackwardPass": b * steps * m, "OptimizerStep": u * steps,
            "ReduceGrads": 0.0} for f, b, u in zip(fwd, bwd, upd)]  # fmt: skip
    v = {"seconds_by_op_per_stage": ops, "seconds_blocked_in_per_stage": [{}, {}], "step_time_s": 100.0}
    return {"model": "small", "stages": 2, "micro_batches": m, "steps_per_job": steps, "micro_batch_size": 8,
            "seq_len": 64, "overrides": ["model=small"], "variants": {"1f1b": v}}  # fmt: skip


def test_calibration_recovers_the_costs_and_fits_the_overhead() -> None:
    """Stage 0 = embedding (free) + 4 blocks, stage 1 = 4 blocks + head: a block is stage 0's quarter, the head the
    rest of stage 1; the step per parameter is the steps over all parameters; the overhead is the one figure that
    makes the calibration variant's replayed step its measured one."""
    from asyncpipe.timelines.cost_source import from_bench

    rec = _record([0.04, 0.05], [0.08, 0.09], [0.01, 0.01])
    raw = from_bench(rec, fit=False)
    assert raw.forward[1:9] == pytest.approx([0.01] * 8) and raw.forward[9] == pytest.approx(0.01)
    assert raw.backward[1:9] == pytest.approx([0.02] * 8) and raw.backward[9] == pytest.approx(0.01)
    assert raw.step_per_param * sum(raw.params) == pytest.approx(0.02)
    target = predict(raw, "1f1b", 2, 4).step_s * 1.2
    rec["variants"]["1f1b"]["step_time_s"] = target
    fitted = from_bench(rec)
    assert fitted.overhead_s > 0 and predict(fitted, "1f1b", 2, 4).step_s == pytest.approx(target, rel=1e-6)
    assert fitted.label.startswith("measured:")


def test_two_records_separate_the_overhead_from_the_exchange_latency() -> None:
    """Steps replayed with a known overhead per instruction and latency per exchange, for 1F1B (a flush) and 2BW
    (none) at P = 2, m = 8: the fit recovers both; one overhead alone cannot reproduce both steps. Where 2BW's
    measured step needs a negative latency, the latency is 0 and the overhead fits 1F1B alone."""
    from dataclasses import replace

    from asyncpipe.timelines.cost_source import fit_overhead_latency

    base = hand_model(blocks=4, f=0.01, b=0.02, u_per_block=0.001)
    truth = replace(base, overhead_s=3e-4, p2p_s=2e-3)
    cal = [(s, 2, 8, predict(truth, s, 2, 8).step_s) for s in ("1f1b", "2bw")]
    fitted = fit_overhead_latency(base, cal)
    assert fitted.overhead_s == pytest.approx(3e-4, rel=1e-4) and fitted.p2p_s == pytest.approx(2e-3, rel=1e-4)
    assert predict(fitted, "1f1b", 4, 16).step_s == pytest.approx(predict(truth, "1f1b", 4, 16).step_s, rel=1e-5)
    one = fit_overhead_latency(base, cal[:1] + [("1f1b", 2, 8, cal[0][3])])  # the same record twice: singular
    assert one.p2p_s == 0 and predict(one, "1f1b", 2, 8).step_s == pytest.approx(cal[0][3], rel=1e-6)
    assert predict(one, "2bw", 2, 8).step_s != pytest.approx(cal[1][3], rel=1e-3)
    fast = fit_overhead_latency(base, [cal[0], ("2bw", 2, 8, predict(base, "2bw", 2, 8).step_s * 0.9)])
    assert fast.p2p_s == 0 and predict(fast, "1f1b", 2, 8).step_s == pytest.approx(cal[0][3], rel=1e-6)


def test_the_cost_table_in_the_doc_is_its_json() -> None:
    """docs/performance.md's cost table is `benchmarks/cost_table.py` rendered from the committed JSON, and that JSON
    is what the committed raw bench files give (re-computed here, no bench run)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from cost_table import END, STANDIN, STANDIN_END, STANDIN_START, START, TABLE, render, render_standin, rows
    from cost_table import standin_rows

    table = json.loads(TABLE.read_text())
    doc = (REPO / "docs" / "performance.md").read_text()
    assert doc.split(START, 1)[1].split(END, 1)[0].strip() == render(table).strip()
    assert doc.split(STANDIN_START, 1)[1].split(STANDIN_END, 1)[0].strip() == render_standin(table["standin"]).strip()
    st = standin_rows(json.loads(STANDIN.read_text()), STANDIN.name)
    assert [r["error"] for r in st["rows"]] == pytest.approx([r["error"] for r in table["standin"]["rows"]], abs=1e-6)
    again = rows(table["model"], table["stages"])
    assert [(r["m"], r["variant"]) for r in again["rows"]] == [(r["m"], r["variant"]) for r in table["rows"]]
    for a, b in zip(again["rows"], table["rows"]):
        assert a["predicted_step_s"] == pytest.approx(b["predicted_step_s"], rel=1e-6)
        assert a["error"] == pytest.approx(b["error"], abs=1e-6)


def test_plan_names_the_fastest_schedule_that_fits() -> None:
    """moe_10b at 8 stages under the stated H100 profile: every schedule's memory beside its predicted speed; the
    named one is the fastest of those that fit, at a budget that 2BW's second version exceeds at its unconstrained
    cut too (--gpu-mem is pipeline.memory_gib: each balanced cut within it, `plan.cut_within`)."""
    from asyncpipe.cli import app
    from asyncpipe.plan_speed import fastest, speeds

    over = ["model=moe_10b", "pipeline.stages=8", "delay=1", "optimizer=muon_ef", "train.micro_batch_size=1",
            "train.seq_len=2048", "train.micro_batches=16"]  # fmt: skip
    rows, label = speeds(over, 80.0)
    assert "h100_assumed" in label and "stated, not measured" in label
    runnable = {r.schedule: r for r in rows if not r.reason}
    assert {"1f1b", "2bw", "dualpipev"} <= set(runnable) and "paci" not in runnable  # PACI refuses MoE
    best = fastest(rows)
    assert best is not None and best.tokens_per_s == max(r.tokens_per_s for r in runnable.values() if r.fits)
    tight = (runnable["1f1b"].peak_gib + runnable["2bw"].peak_gib) / 2  # 1F1B fits, 2BW not at its free cut
    out = CliRunner().invoke(app, ["plan", *over, "--gpu-mem", f"{tight:.2f}"])
    at_tight, _ = speeds([*over, f"pipeline.memory_gib={tight:.2f}"], float(f"{tight:.2f}"))
    winner = fastest(at_tight)
    assert winner is not None and all(r.peak_gib <= tight for r in at_tight if r.fits)
    assert f"fastest within {float(f'{tight:.2f}'):g} GiB: {winner.schedule}, {winner.tokens_per_s:,.0f} tokens/s" in out.output
    assert "device profile h100_assumed (stated, not measured" in out.output


def test_report_labels_modelled_throughput_with_its_calibration(tmp_path: Path) -> None:
    """A depth no bench file covers: the cost model calibrated on the P = 2 file's 1F1B, labelled "modelled" with
    that file; the file's own depth stays measured; a file without stage timings leaves the ideal."""
    from asyncpipe.report.target import speedup_table
    from asyncpipe.report.throughput import load_bench, throughput

    rec = _record([0.04, 0.05], [0.08, 0.09], [0.01, 0.01])
    rec["variants"]["1f1b"]["step_time_s"] = 1.0
    rec["variants"]["1f1b"]["ratio_to_1f1b"] = 1.0
    rec["variants"]["2bw"] = {"ratio_to_1f1b": 1.2}
    path = tmp_path / "cost-small-P2-m4.json"
    path.write_text(json.dumps(rec))
    bench = load_bench([path])
    thr = throughput(4, 8, bench)
    assert thr.kind == "modelled" and "cost-small-P2-m4.json" in thr.source
    assert 1.0 < thr.vs_1f1b < (8 + 4 - 1) / 8  # below the ideal: the step and the uneven head cost something
    assert throughput(2, 4, bench).kind == "measured"
    table = speedup_table([], bench)
    assert "modelled, 2bw (cost model calibrated on cost-small-P2-m4.json" in table.loc[(8, 16), "2BW / 1F1B throughput"]
    del rec["variants"]["1f1b"]["seconds_by_op_per_stage"]
    path.write_text(json.dumps(rec))
    assert throughput(4, 8, load_bench([path])).source == "ideal (m+P-1)/m"


def test_report_models_the_strongest_sync_schedule_at_depth(tmp_path: Path) -> None:
    """At a modelled depth the strongest sync schedule is the model's faster of 1F1B and DualPipeV: with a small
    engine overhead (the file's 1F1B step no longer than its compute) DualPipeV wins at P = 4, m = 8 and 2BW's ratio
    over it is the cost model's own; where DualPipeV cannot run (m < 2P; P = 8 needs 16 blocks, small has 8) or
    where the fitted overhead of its many instructions makes it slower, it is 1F1B."""
    from asyncpipe.report.stats import Interval
    from asyncpipe.report.target import Ladder, net_speedup, phrase, speedup_table
    from asyncpipe.report.throughput import load_bench, throughput
    from asyncpipe.timelines.cost import ratio
    from asyncpipe.timelines.cost_source import from_bench

    rec = _record([0.04, 0.05], [0.08, 0.09], [0.01, 0.01])
    rec["variants"]["1f1b"].update(step_time_s=0.01, ratio_to_1f1b=1.0)  # below the replayed compute: no overhead
    rec["variants"]["2bw"] = {"ratio_to_1f1b": 1.2}
    path = tmp_path / "lean-small-P2-m4.json"
    path.write_text(json.dumps(rec))
    bench = load_bench([path])
    model = from_bench(rec, str(path))
    thr = throughput(4, 8, bench)
    assert ratio(model, "dualpipev", "1f1b", 4, 8) > 1.0
    assert (thr.kind, thr.best_sync, thr.best_sync_label) == ("modelled", "dualpipev", "DualPipeV (modelled)")
    assert thr.vs_1f1b == pytest.approx(ratio(model, "2bw", "1f1b", 4, 8))
    assert thr.vs_best_sync == pytest.approx(ratio(model, "2bw", "dualpipev", 4, 8)) and thr.vs_best_sync < thr.vs_1f1b
    ef = throughput(4, 8, bench, ef=True)
    assert ef.vs_best_sync == pytest.approx(ratio(model, "2bw", "dualpipev", 4, 8, ef=True))
    for P, m in ((4, 4), (8, 16)):  # m < 2P; 2P = 16 chunks > 8 blocks
        short = throughput(P, m, bench)
        assert (short.best_sync, short.best_sync_label, short.vs_best_sync) == ("1f1b", "1F1B (modelled)", short.vs_1f1b)
    cell = speedup_table([], bench).loc[(4, 8), "strongest sync schedule (x1F1B)"]
    assert cell == f"dualpipev = DualPipeV (modelled), {thr.vs_1f1b / thr.vs_best_sync:.3f}"
    iv = Interval(1.5, 1.2, 1.8, 3, "fieller")
    lad = Ladder("t", "adamw", ["1-step"], [1.0], False, 4, 8, ratio=iv,
                 per_seed={s: (1.0, True, 1.0) for s in range(3)})  # fmt: skip
    said = phrase(lad, bench)
    best = net_speedup(iv, None, thr.vs_best_sync, thr.error(best=True))  # within the model's band over DualPipeV
    assert said.endswith(f"; against the cost model's strongest synchronous schedule, DualPipeV (modelled): {best}"
                         + " (not resolved)" * (thr.error(best=True).lo / iv.hi <= 1 <= thr.error(best=True).hi / iv.lo))
    table = speedup_table([lad], bench)
    band = thr.error(best=True).band
    assert table.loc[(4, 8), "adamw 1-step vs dualpipev"] == f"{best} ({thr.vs_best_sync:.3f}, modelled, ±{band:.1%})"
    rec["variants"]["1f1b"]["step_time_s"] = 1.0  # the fitted overhead per instruction outweighs a one-block chunk
    heavy = tmp_path / "heavy-small-P2-m4.json"  # another file: the report keeps each file's calibration
    heavy.write_text(json.dumps(rec))
    slow = throughput(4, 8, load_bench([heavy]))
    assert ratio(from_bench(rec, str(heavy)), "dualpipev", "1f1b", 4, 8) < 1.0
    assert (slow.best_sync, slow.vs_best_sync) == ("1f1b", slow.vs_1f1b)


def test_deferred_steps_cost_p_minus_2_steps_at_depth() -> None:
    """The doc's figure: equal stages, F = 1, B = 2, a step of 1 per stage, P = 8. At m = P = 8 2BW under global
    clipping (deferred steps, at different beats of the rhythm) takes m(F+B) + U + (P-2)U = 31, per-stage clipping
    m(F+B) + U = 25; from m = 1.5 P the deferred steps are aligned to one beat (`TwoBWSchedule`): 37 = 37 at m = 12,
    49 = 49 at m = 16 (55 before they were). At P = 2 the two agree (13)."""
    model = hand_model(blocks=8, u_per_block=1.0)
    assert predict(model, "2bw", 8, 8, clip="global").step_s == pytest.approx(31.0)
    assert predict(model, "2bw", 8, 8, clip="stage").step_s == pytest.approx(25.0)
    for m, step in ((12, 37.0), (16, 49.0)):
        assert predict(model, "2bw", 8, m, clip="global").step_s == pytest.approx(step)
        assert predict(model, "2bw", 8, m, clip="stage").step_s == pytest.approx(step)
    two = hand_model(blocks=2, u_per_block=1.0)
    assert predict(two, "2bw", 2, 4, clip="global").step_s == pytest.approx(predict(two, "2bw", 2, 4, clip="stage").step_s)


def test_the_docs_plan_speed_block_is_what_plan_prints() -> None:
    import re
    import shlex

    from asyncpipe.plan_speed import render, speeds

    doc = (REPO / "docs" / "performance.md").read_text()
    cmd = re.search(r"^    asyncpipe plan --gpu-mem (\S+) (model=moe_10b .*)$", doc, re.M)
    assert cmd is not None
    block = re.search(r"```\n(schedules under the cost model.*?)\n```", doc, re.S)
    assert block is not None
    rows, label = speeds(shlex.split(cmd.group(2)), float(cmd.group(1)))
    assert block.group(1) == render(rows, float(cmd.group(1)), label)
    # The prose under it: the head-heavy last stage and EF's step, per stage, under the same profile.
    from asyncpipe.config import compose
    from asyncpipe.timelines.cost import stage_costs
    from asyncpipe.timelines.cost_source import from_profile, load_profile

    cfg = compose([*shlex.split(cmd.group(2)), "engine=pipeline"])
    fwd, _, upd, _ = stage_costs(from_profile(load_profile("h100_assumed"), cfg), 8, ef=True)
    said = re.sub(r"\s+", " ", doc)
    assert f"{fwd[-1] * 1e3:.2f} ms forward per micro-batch against {fwd[0] * 1e3:.2f} on the other stages" in said
    assert f"({min(upd) * 1e3:.1f}-{max(upd) * 1e3:.1f} ms per stage at 48 bytes per parameter" in said


@pytest.mark.parametrize("profile,said", [
    ("nope", "--profile nope: no such device profile; give a YAML path or one of: h100_assumed"),
    ("benchmarks/results/cost-small-P2-m8.json", "calibrated on model small, not model=tiny"),
])  # fmt: skip
def test_a_bad_profile_is_one_line(profile: str, said: str) -> None:
    from helpers import asyncpipe

    proc = asyncpipe("plan", "model=tiny", "--profile", str(REPO / profile) if profile.endswith(".json") else profile)
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and said in proc.stderr
