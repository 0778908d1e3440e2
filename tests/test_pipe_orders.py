"""Synchronous low-bubble schedules (`asyncpipe.timelines.orders`): each rule runs every op once on its own rank,
respects the data dependencies, and idles exactly what the hand-derived bubble formulas say."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from asyncpipe import cli_perf
from asyncpipe.errors import UserError
from asyncpipe.schedules.orders import Op, Plan, deps, plan, sync_schedules
from asyncpipe.timelines.orders import bubble, replay
from asyncpipe.timelines.timeline import ScheduleError

CASES = [(P, m) for P in (2, 3, 4) for m in (P, 2 * P, 2 * P + 1, 4 * P)]


def _runnable(name: str, P: int, m: int) -> bool:
    return not ((name == "dualpipev" and m < 2 * P) or (name == "interleaved-1f1b" and m % P))


@pytest.mark.parametrize("name", sync_schedules())
@pytest.mark.parametrize("P,m", CASES)
def test_every_op_once_on_its_rank_after_its_inputs(name: str, P: int, m: int) -> None:
    if not _runnable(name, P, m):
        with pytest.raises(UserError):
            plan(name, P, m)
        assert bubble(name, P, m) is None
        return
    p = plan(name, P, m)
    kinds = "FBW" if p.split_backward else "FB"
    expected = {Op(k, c, j) for k in kinds for c in range(len(p.chunk_rank)) for j in range(m)}
    ran = [op for ops in p.ranks for op in ops]
    assert len(ran) == len(set(ran)) and set(ran) == expected
    assert all(p.chunk_rank[op.chunk] == r for r, ops in enumerate(p.ranks) for op in ops)
    for fb in ((1.0, 2.0), (1.0, 1.0), (2.0, 3.0)):
        tl = replay(p, *fb)
        end = {(e.kind[0].upper(), e.chunk, e.micro_batch): e.end for e in tl.events}
        for e in tl.events:
            op = Op(e.kind[0].upper(), e.chunk, e.micro_batch)
            assert all(end[(d.kind, d.chunk, d.micro_batch)] <= e.start + 1e-12 for d in deps(op, len(p.chunk_rank), True))
        for r in range(P):  # one op at a time per rank, in the rank's order
            mine = [e for e in tl.events if e.stage == r]
            assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
        assert tl.busy == pytest.approx([m * (fb[0] + fb[1])] * P)  # every rank does one stage's worth of work


@pytest.mark.parametrize("P,m", [(2, 2), (2, 4), (3, 5), (4, 8), (4, 16)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0)])
def test_1f1b_and_interleaved_bubbles(P: int, m: int, f: float, b: float) -> None:
    assert bubble("1f1b", P, m, f, b) == pytest.approx((P - 1) / (m + P - 1))
    if m % P == 0:  # v = 2 chunks: the fill and drain shrink to (P-1) half-stage slots
        assert bubble("interleaved-1f1b", P, m, f, b) == pytest.approx((P - 1) / (2 * m + P - 1))


@pytest.mark.parametrize("P,m", [(1, 1), (2, 2), (3, 5), (4, 8), (8, 16)])
def test_1f1b_one_batch_by_hand(P: int, m: int) -> None:
    # F = 1, B = 2: the fill and the drain each take P - 1 slots of F + B around m of them, and every rank works
    # 3m; whole numbers, so the replay must hit them exactly.
    tl = replay(plan("1f1b", P, m), forward=1.0, backward=2.0)
    assert tl.makespan == 3.0 * (m + P - 1)
    assert tl.busy == [3.0 * m] * P
    assert bubble("1f1b", P, m) == pytest.approx((P - 1) / (m + P - 1), rel=1e-15)


def test_latency_and_chunk_costs_by_hand() -> None:
    # 1F1B, P = 2, m = 1; each result read on the other rank 0.5 later (one on the same rank at once). Uniform:
    # F = 1, B = 2. Per chunk: chunk 1 (rank 1) takes F = 1.5 and B = 2.5, chunk 0 the uniform costs.
    tl = replay(plan("1f1b", 2, 1), forward=1.0, backward=2.0, latency=0.5)
    spans = [(e.stage, e.kind, e.start, e.end) for e in tl.events]
    by_hand = [(0, "forward", 0.0, 1.0), (1, "forward", 1.5, 2.5), (1, "backward", 2.5, 4.5), (0, "backward", 5.0, 7.0)]
    assert spans == by_hand
    assert tl.makespan == 7.0 and tl.busy == [3.0, 3.0]
    tl = replay(plan("1f1b", 2, 1), chunk_costs={"F": [1.0, 1.5], "B": [2.0, 2.5]}, latency=0.5)
    spans = [(e.stage, e.kind, e.start, e.end) for e in tl.events]
    by_hand = [(0, "forward", 0.0, 1.0), (1, "forward", 1.5, 3.0), (1, "backward", 3.0, 5.5), (0, "backward", 6.0, 8.0)]
    assert spans == by_hand
    assert tl.makespan == 8.0 and tl.busy == [3.0, 4.0]


def test_broken_orders_say_where() -> None:
    good = plan("1f1b", 2, 2)
    cases = {
        "bad: deadlock: rank 0 at Op(kind='B', chunk=0, micro_batch=1); rank 1 at Op(kind='F', chunk=1, micro_batch=0)":
            [list(reversed(good.ranks[0])), good.ranks[1]],
        "rank 0 runs Op(kind='F', chunk=1, micro_batch=5), but chunk 1 lives on rank 1":
            [good.ranks[0] + [Op("F", 1, 5)], good.ranks[1]],
        "Op(kind='F', chunk=0, micro_batch=0) runs twice (ranks 0 and 0)": [good.ranks[0] + [Op("F", 0, 0)], good.ranks[1]],
        "Op(kind='B', chunk=1, micro_batch=1) on rank 1 needs Op(kind='F', chunk=1, micro_batch=1), which no rank runs":
            [good.ranks[0], [op for op in good.ranks[1] if op != Op("F", 1, 1)]],
    }  # fmt: skip
    for message, ranks in cases.items():
        with pytest.raises(ScheduleError) as err:
            replay(Plan("bad", 2, 2, good.chunk_rank, ranks))
        assert str(err.value) == message


@pytest.mark.parametrize("P,m", [(2, 2), (2, 4), (3, 5), (4, 8)])
def test_zb_h1_bubble_is_the_papers(P: int, m: int) -> None:
    # F = B = W = 1 (backward 2 split in halves): ZB-H1 idles (P-1)(F + B - W) = P-1 per rank and batch,
    # a third of 1F1B's (P-1)(F + B + W).
    tl = replay(plan("zb-h1", P, m), forward=1.0, backward=2.0)
    assert tl.makespan == pytest.approx(3 * m + P - 1)
    assert tl.idle_fraction == pytest.approx([(P - 1) / (3 * m + P - 1)] * P)


def test_dualpipev_small_case_by_hand() -> None:
    # P=2, m=4, F=B=1: each chunk op takes 0.5. Rank 1 waits 0.5 for rank 0's first chunk forward; rank 0
    # then waits 0.5 for F3 to come back from rank 1 (5.5-6.0) and 0.5 for B3 of chunk 1 (8.0-8.5); rank 1
    # ends at 8.5 and rank 0 at 9.0: 8 units of work in 9 on both ranks.
    tl = replay(plan("dualpipev", 2, 4), forward=1.0, backward=1.0)
    assert tl.makespan == pytest.approx(9.0)
    assert tl.idle_fraction == pytest.approx([1 / 9, 1 / 9])
    first = [(e.kind, e.chunk, e.micro_batch) for e in sorted(tl.events, key=lambda e: e.start) if e.stage == 0][:5]
    assert first == [("forward", 0, 0), ("forward", 0, 1), ("forward", 0, 2), ("forward", 3, 0), ("backward", 3, 0)]


def test_a_broken_order_is_reported() -> None:
    good = plan("1f1b", 2, 2)
    swapped = Plan("bad", 2, 2, good.chunk_rank, [list(reversed(good.ranks[0])), good.ranks[1]])
    with pytest.raises(ScheduleError, match="deadlock"):
        replay(swapped)
    twice = Plan("bad", 2, 2, good.chunk_rank, [good.ranks[0] + [Op("F", 0, 0)], good.ranks[1]])
    with pytest.raises(ScheduleError, match="twice"):
        replay(twice)


def test_schedule_command_draws_dualpipev_next_to_1f1b_and_2bw(tmp_path: Path) -> None:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command("schedule")(cli_perf.schedule)
    app.command("other")(lambda: None)
    args = ["schedule", "--stages", "2", "--micro-batches", "4", "--schedule", "dualpipev", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "dualpipev-P2-m4.png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "dualpipev-P2-m4.txt").read_text()
    assert "# 1f1b: one batch" in text and "# 2bw: 3 batches" in text
    rows = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("  ") and line.split()[1] != "n/a"}  # fmt: skip
    assert rows["1f1b"] == pytest.approx(0.2) and rows["dualpipev"] == pytest.approx(1 / 9, abs=1e-3)
    assert rows["2bw"] == 0.0
    res = CliRunner().invoke(app, ["schedule", "-p", "2", "-m", "2", "--schedule", "dualpipev", "--out", str(tmp_path)])
    assert isinstance(res.exception, UserError) and "2 x stages" in str(res.exception)
