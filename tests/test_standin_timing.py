"""Issue 39 item 5: the stand-in pad hits its target (a sleep to a deadline from the instruction's start), and the
critical-path walk of a traced stand-in run (`asyncpipe.bench.critical_path`) splits a window exactly, on
hand-built traces whose path is known."""

from __future__ import annotations

import statistics
import time

import pytest

from asyncpipe.bench import critical_path as cp
from asyncpipe.engines.pipeline.standin import StandInPad, sleep_until


def test_sleep_until_never_returns_early_and_lands_close() -> None:
    over = []
    for _ in range(15):
        deadline = time.perf_counter() + 0.01
        sleep_until(deadline)
        over.append(time.perf_counter() - deadline)
    assert min(over) >= 0.0
    assert statistics.median(over) < 0.002  # a wake-up's latency; a loaded machine may preempt now and then


def test_pad_counts_from_the_instruction_start_and_hits_its_target() -> None:
    pad = StandInPad((0.02, 0.04), chunks=1)
    walls = []
    for _ in range(6):
        began = time.perf_counter()
        time.sleep(0.003)  # the real op: part of the padded time, not added to it
        pad.pad(0, "forward", began)
        walls.append(time.perf_counter() - began)
    assert min(walls) >= 0.02
    assert statistics.median(walls) < 0.02 + 0.002
    assert pad.target["forward"] == pytest.approx(6 * 0.02)
    assert 6 * 0.003 <= pad.real["forward"] < 6 * 0.02
    began = time.perf_counter() - 0.05  # a real op longer than its target is not padded
    pad.pad(1, "backward", began)
    assert time.perf_counter() - began < 0.05 + 0.002


def test_a_per_chunk_pad_waits_its_own_chunks_seconds() -> None:
    """A per-layer stand-in gives each chunk a rank holds its own (F, B) (`engines.pipeline.standin.stage_standin`): a
    V's phase-1 forward waits its chunk's seconds, not half the rank's; a per-stage (F, B) is shared equally."""
    pad = StandInPad((0.004, 0.008, 0.02, 0.03), chunks=2)
    walls = {}
    for phase in (1, 0):
        began = time.perf_counter()
        pad.pad(0, "forward", began, phase)
        walls[phase] = time.perf_counter() - began
    assert walls[1] >= 0.02 and 0.004 <= walls[0] < 0.02
    assert pad.target["forward"] == pytest.approx(0.024)
    assert StandInPad((0.02, 0.04), chunks=2).per_chunk == [(0.01, 0.02), (0.01, 0.02)]
    assert StandInPad((0.02, 0.04), chunks=1).per_chunk == [(0.02, 0.04)]


def ev(op: str, start: float, end: float, mb: int | None = None) -> dict:
    return {"op": op, "start": start, "end": end, "micro_batch": mb}


def two_stage_traces() -> dict[int, list[dict]]:
    """Stage 0 sends activation 0 in a commit posted at 10 that ends at 13; stage 1 posted its receive at 2 and
    waited until 12.5. Stage 1's backward then sends the gradient back: stage 0's commit posted at 14, stage 1's
    at 40 (its forward and backward first), so stage 0 waits and the message lands at 41."""
    return {
        0: [ev("ForwardPass", 0, 10, 0), ev("SendActivation", 10, 10, 0), ev("CommitP2P", 10, 13),
            ev("RecvGrad", 14, 14, 0), ev("CommitP2P", 14, 41), ev("BackwardPass", 41, 61, 0),
            ev("ReduceGrads", 61, 62)],
        1: [ev("RecvActivation", 2, 2, 0), ev("CommitP2P", 2, 12.5), ev("ForwardPass", 13, 23, 0),
            ev("BackwardPass", 23, 39, 0), ev("SendGrad", 40, 40, 0), ev("CommitP2P", 40, 40.5),
            ev("ReduceGrads", 41, 42)],
    }  # fmt: skip


def test_messages_match_in_order_per_direction() -> None:
    peers = cp.match_messages(two_stage_traces())
    assert peers[(0, 2)] == [(1, 1)]  # activation 0: stage 0's commit <-> stage 1's commit
    assert peers[(0, 4)] == [(1, 5)]  # gradient 0
    assert peers[(1, 5)] == [(0, 4)]


def test_the_walk_splits_the_window_along_the_path() -> None:
    """Back from 62 on stage 0: ReduceGrads 1, backward 20 (its stand-in), then the commit whose peer posted
    later (40 > 14): 1 ms of message (40 -> 41) and on to stage 1 at 40: the gap 39-40 (between), its backward
    16 (target 20: all wait) and forward 10, the gap 12.5-13, then its commit that waited for stage 0's post
    (10 > 2): message 10 -> 12.5, and on stage 0 at 10: its forward, 10."""
    path = cp.critical_path(two_stage_traces(), 0.0, 62.0, (10.0, 20.0))
    p = path["parts"]
    assert p["reduce"] == 1 and p["message"] == pytest.approx(1 + 2.5) and path["hops"] == 2
    assert p["wait"] == 20 + 16 + 10 + 10 and p["between"] == pytest.approx(1 + 0.5)
    assert sum(p.values()) == pytest.approx(62.0)


def test_overshoot_and_the_cut_gap_are_their_own_parts() -> None:
    traces = {0: [ev("ForwardPass", 0, 10.4, 0), ev("CommitP2P", 10.4, 10.6), ev("ReduceGrads", 10.6, 11),
                  ev("OptimizerStep", 14, 15), ev("LoadMicroBatch", 15, 15.5, 1), ev("ForwardPass", 15.5, 25.5, 1)]}  # fmt: skip
    p = cp.critical_path(traces, 0.0, 25.5, (10.0, 20.0))["parts"]
    assert p["overshoot"] == pytest.approx(0.4) and p["cut"] == pytest.approx(3.0)
    assert p["commit"] == pytest.approx(0.2) and p["load"] == 0.5 and p["optimizer_step"] == 1
    stage = cp.per_stage(traces, 0.0, 25.5, (10.0, 20.0))[0]
    assert stage["cut"] == pytest.approx(3.0) and sum(stage.values()) == pytest.approx(25.5)


def test_the_doc_breakdown_is_the_committed_json() -> None:
    """docs/performance.md's critical-path table is `benchmarks/standin_breakdown.py`'s rendering of its committed
    JSON, and each record's path splits its window exactly: the parts add up to the step."""
    import importlib.util
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("standin_breakdown", repo / "benchmarks" / "standin_breakdown.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    res = json.loads(mod.JSON.read_text())
    start, end = mod.MARKS
    assert f"{start}\n{mod.render(res)}\n{end}" in mod.DOC.read_text()
    assert {(r["schedule"], r["stages"], r["micro_batches"]) for r in res["records"]} == {
        (s, P, k * P) for s in ("2bw", "1f1b") for P in (2, 4) for k in (1, 2)}  # fmt: skip
    for r in res["records"]:
        assert sum(r["critical_path_s_per_step"].values()) == pytest.approx(r["step_s"])
        assert r["fraction_of_ideal"] == pytest.approx(r["ideal_step_s"] / r["step_s"])
