"""DualPipeV's per-rank instruction stream written out (`asyncpipe.schedules.dualpipev_stream`, torch-free) is DeepSpeed's
own `DualPipeVSchedule` ticks, instruction for instruction with their commits, and the one replay
(`timelines.timeline.simulate`) runs it: phase-1 messages flow towards rank 0, each pass costs its chunk's figure."""

from __future__ import annotations

import pytest

from asyncpipe.errors import UserError
from asyncpipe.schedules import get
from asyncpipe.schedules.dualpipev import dualpipev
from asyncpipe.schedules.dualpipev_stream import dualpipev_stream, dualpipev_stream_from_deepspeed
from asyncpipe.schedules.instructions import BackwardPass, ForwardPass, OptimizerStep, ReduceGrads, flatten
from asyncpipe.timelines.orders import replay
from asyncpipe.timelines.timeline import simulate


@pytest.mark.parametrize("P", range(1, 9))
def test_the_stream_is_deepspeeds_ticks_on_every_rank(P: int) -> None:
    """Every m from 2P (the least DeepSpeed accepts) to 4P + 3, every rank, two batches back to back."""
    for m in range(2 * P, 4 * P + 4):
        for r in range(P):
            ours = flatten(dualpipev_stream(m, P, r, 2))
            assert ours == dualpipev_stream_from_deepspeed(m, P, r, 2), (P, m, r)


def test_a_batch_ends_with_its_reduce_and_step_and_every_pass_names_its_chunk() -> None:
    P, m = 4, 8
    for r in range(P):
        ticks = list(dualpipev_stream(m, P, r, batches=2, start=3))
        assert [t[-2:] for t in ticks] == [
            [ReduceGrads(batch=b), OptimizerStep(batch=b, src_version=b, dst_version=b + 1)] for b in (3, 4)
        ]
        passes = [c for c in flatten(ticks) if isinstance(c, (ForwardPass, BackwardPass))]
        assert {(c.phase, c.chunk) for c in passes} == {(0, r), (1, 2 * P - 1 - r)}
        assert sorted(c.micro_batch for c in passes) == sorted(list(range(3 * m, 5 * m)) * 4)
        assert {c.version for c in passes if c.micro_batch < 4 * m} == {3}


def test_the_spec_gives_the_cost_model_this_stream_and_keeps_its_order() -> None:
    """The order (ideal timeline, drawings, bubbles) is the stream's passes; the stream is the cost model's only."""
    spec = get("dualpipev")
    assert spec.cost_stream is dualpipev_stream and spec.stream is None and spec.ideal is None
    assert spec.orders == "dualpipev"
    P, m = 3, 7
    for r in range(P):
        passes = [c for c in flatten(dualpipev_stream(m, P, r)) if isinstance(c, (ForwardPass, BackwardPass))]
        assert [(type(c) is ForwardPass, c.chunk, c.micro_batch) for c in passes] == [
            (op.kind == "F", op.chunk, op.micro_batch) for op in dualpipev(P, m).ranks[r]
        ]


def _ideal(P: int, m: int, F: float, B: float) -> float:
    """One batch of the streams replayed with a free step, free messages and no overhead; F, B per stage (a V's
    chunk costs half)."""
    streams = [flatten(dualpipev_stream(m, P, r)) for r in range(P)]
    return simulate(streams, [F / 2] * 2 * P, [B / 2] * 2 * P, 0.0).makespan


def test_a_hand_replayed_batch_pays_the_commits() -> None:
    """P = 2, m = 4, F = 20, B = 40 per stage (10 and 20 per chunk), replayed by hand:
    rank 0: F0 0-10, 10-20, 20-30 (each send posted at the next commit, rank 1's receive already there);
    rank 1 meanwhile F0(0) 10-20, F1(0) 20-30, F0(1) 30-40; rank 0's F1(0) 30-40, its B1(0) 40-60; rank 1's
    F1(1) 40-50, F0(2) 50-60 then the commit with B1(0)'s gradient at 60: B1(0) 60-80, F1(2) 80-90, B0(0) 90-110.
    Rank 0 ran F0(3) 70-80 and B1(1) 80-100 (its F1(1) 60-70), but its commit after them needs rank 1's, posted
    only after B0(0) at 110: the overlapped pair's results wait for the pair. From there each side waits on the
    other's pair: rank 0's F1(2)+B0(0) 110-140, B1(2) 140-160; rank 1's F0(3)+B1(1)+F1(3)+B0(1) 110-170;
    rank 0 F1(3)+B0(1) 170-200, B1(3) 200-220; rank 1 B1(2)+B0(2) 170-210, commit with rank 0 at 220,
    B1(3)+B0(3) 220-260; rank 0's B0(2) 220-240, then B0(3) after rank 1's last gradient at 260: 280.
    The same order replayed by data dependencies (each op's inputs the moment they are done) takes 270."""
    assert _ideal(2, 4, 20.0, 40.0) == pytest.approx(280.0)
    assert replay(dualpipev(2, 4), 20.0, 40.0).makespan == pytest.approx(270.0)


@pytest.mark.parametrize("P,m,order_ms,ticks_ms", [(4, 8, 590.0, 620.0), (8, 16, 1230.0, 1300.0)])
def test_the_ticks_ideal_is_slower_than_the_orders_at_depth(P: int, m: int, order_ms: float, ticks_ms: float) -> None:
    """The commits cost a chunk's forward per overlapped pair over the order's replay (docs/performance.md,
    "DualPipeV's miss at depth")."""
    assert replay(dualpipev(P, m), 20.0, 40.0).makespan == pytest.approx(order_ms)
    assert _ideal(P, m, 20.0, 40.0) == pytest.approx(ticks_ms)


def test_fewer_than_2p_micro_batches_is_refused() -> None:
    with pytest.raises(UserError, match=r"dualpipev needs micro-batches >= 2 x stages \(got m=7, P=4\)"):
        list(dualpipev_stream(7, 4, 0))


def test_the_cost_model_predicts_the_committed_standin_records_within_5_percent() -> None:
    """DualPipeV's stand-in records (benchmarks/results/cost-standin.json: P = 2, 4, 8, F = 20 ms, B = 40 ms per
    stage) against the cost model calibrated on that file's 1F1B and 2BW at P = 2 (`cost_source.from_standin`):
    every P within 5 %, where the order's replay ran -4.3 % at P = 8, m = 16. The replay is the streams' own: the
    prediction minus the step is one batch of `simulate` on `dualpipev_stream` at those costs."""
    import json
    from pathlib import Path

    from asyncpipe.timelines.cost import predict, stage_costs
    from asyncpipe.timelines.cost_source import from_standin, model_at, standin_calibration

    run = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/cost-standin.json").read_text())
    fitted = from_standin(standin_calibration(run["records"]), 2, "cost-standin.json")
    rows = [r for r in run["records"] if r["schedule"] == "dualpipev"]
    assert {r["stages"] for r in rows} == {2, 4, 8}
    for r in rows:
        P, m = r["stages"], r["micro_batches"]
        model = model_at(fitted, P)
        step = predict(model, "dualpipev", P, m).step_s
        assert abs(step / r["step_time_s"] - 1) <= 0.05, (P, m, step, r["step_time_s"])
        fwd, bwd, upd, _ = stage_costs(model, P, 2)
        streams = [flatten(dualpipev_stream(m, P, s)) for s in range(P)]
        upd = [u + model.allreduce_latency_s for u in upd]  # global clipping: the norm all-reduce in every step
        one = simulate(streams, fwd, bwd, upd, model.p2p_s, collective_steps=True, overhead=model.overhead_s)
        assert step == pytest.approx(one.makespan, rel=1e-9)
