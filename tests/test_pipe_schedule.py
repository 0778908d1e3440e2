"""The 2BW schedule protocol, in pure Python: order, pairing, deadlock freedom, versions, buffers, cuts."""

from __future__ import annotations

import itertools

import pytest

from asyncpipe.schedules import instructions as sched
from asyncpipe.schedules.onef1b import flushed_1f1b_stream, train_schedule_stream
from asyncpipe.schedules.twobw import TwoBWSchedule, two_bw_stream
from asyncpipe.timelines.timeline import ScheduleError, simulate, simulate_schedule

CASES = [(P, m, N) for P in (2, 3, 4) for m in (P, P + 1, 2 * P) for N in (1, 2, 5)]


def streams(P: int, m: int, N: int, defer: bool) -> list[list[sched.Instruction]]:
    return [two_bw_stream(m, P, s, N, defer_step=defer) for s in range(P)]


def of(stream, kind):
    return [c for c in stream if isinstance(c, kind)]


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("P,m,N", CASES)
def test_every_micro_batch_forward_then_backward_once(P, m, N, defer):
    for stream in streams(P, m, N, defer):
        pos = {}
        for i, cmd in enumerate(stream):
            if isinstance(cmd, (sched.ForwardPass, sched.BackwardPass)):
                key = (type(cmd), cmd.micro_batch)
                assert key not in pos, f"{cmd!r} twice"
                pos[key] = i
        for k in range(N * m):
            assert pos[(sched.ForwardPass, k)] < pos[(sched.BackwardPass, k)]
        assert len(pos) == 2 * N * m
        # 1F1B: forwards and backwards each in micro-batch order
        assert [c.micro_batch for c in of(stream, sched.ForwardPass)] == list(range(N * m))
        assert [c.micro_batch for c in of(stream, sched.BackwardPass)] == list(range(N * m))


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("P,m,N", CASES)
def test_sends_meet_receives_without_deadlock(P, m, N, defer):
    ss = streams(P, m, N, defer)
    for s, stream in enumerate(ss):
        first, last = s == 0, s == P - 1
        assert len(of(stream, sched.SendActivation)) == (0 if last else N * m)
        assert len(of(stream, sched.RecvActivation)) == (0 if first else N * m)
        assert len(of(stream, sched.SendGrad)) == (0 if first else N * m)
        assert len(of(stream, sched.RecvGrad)) == (0 if last else N * m)
    # Rendezvous replay: raises on a deadlock, a message paired with the wrong micro-batch, or a leftover.
    simulate(ss)
    # Also with the cross-stage norm all-reduce (global clipping) between ReduceGrads and OptimizerStep.
    simulate(ss, collective_steps=True)


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("P,m,N", CASES)
def test_one_step_per_batch_after_its_last_backward(P, m, N, defer):
    for stream in streams(P, m, N, defer):
        steps = of(stream, sched.OptimizerStep)
        assert [(c.batch, c.src_version, c.dst_version) for c in steps] == [(b, b, b + 1) for b in range(N)]
        assert [c.batch for c in of(stream, sched.ReduceGrads)] == list(range(N))
        index = {id(c): i for i, c in enumerate(stream)}
        for b in range(N):
            last_bwd = next(c for c in of(stream, sched.BackwardPass) if c.micro_batch == (b + 1) * m - 1)
            reduce = of(stream, sched.ReduceGrads)[b]
            assert index[id(last_bwd)] < index[id(reduce)] < index[id(steps[b])]
            later_bwd = [c for c in of(stream, sched.BackwardPass) if c.micro_batch >= (b + 1) * m]
            # gradients of batch b are taken before any backward of the next batch adds to them
            assert all(index[id(reduce)] < index[id(c)] for c in later_bwd)
            if not defer:
                assert index[id(steps[b])] == index[id(reduce)] + 1


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("P,m,N", CASES)
def test_versions_pinned_to_w_b_minus_1_and_two_alive(P, m, N, defer):
    for s, stream in enumerate(streams(P, m, N, defer)):
        latest, in_flight = 0, {}
        for cmd in stream:
            if isinstance(cmd, sched.ForwardPass):
                b = cmd.micro_batch // m
                assert cmd.version == max(b - 1, 0), f"stage {s}: {cmd!r}"
                assert cmd.version in (latest, latest - 1), f"stage {s}: {cmd!r} but latest is W({latest})"
                in_flight[cmd.micro_batch] = cmd.version
            elif isinstance(cmd, sched.BackwardPass):
                assert cmd.version == in_flight.pop(cmd.micro_batch), "backward on another version than its forward"
            elif isinstance(cmd, sched.OptimizerStep):
                assert cmd.src_version == latest
                # The step writes W(b+1) over W(b-1)'s slot: no in-flight micro-batch may still read it.
                assert set(in_flight.values()) <= {latest}, f"stage {s}: step {cmd.batch} with {in_flight}"
                latest = cmd.dst_version
            alive = {latest} | set(in_flight.values())
            assert len(alive) <= 2, f"stage {s}: versions {alive} alive at {cmd!r}"
        assert not in_flight and latest == N


@pytest.mark.parametrize("P,m,N", CASES)
def test_deferred_step_lands_before_its_weights_are_read(P, m, N):
    for s, stream in enumerate(streams(P, m, N, defer=True)):
        index = {id(c): i for i, c in enumerate(stream)}
        aligned = TwoBWSchedule(m, P, s, N, defer_step=True).aligned  # P >= 3 and m >= 1.5 P
        assert aligned == (P >= 3 and 2 * m >= 3 * P)
        for step in of(stream, sched.OptimizerStep):
            first_use = [c for c in of(stream, sched.ForwardPass) if c.version == step.dst_version]
            assert all(index[id(step)] < index[id(c)] for c in first_use)
            reduced = [i for i, c in enumerate(stream) if c == sched.ReduceGrads(batch=step.batch)]
            assert reduced and reduced[0] < index[id(step)]
            if s == 0 and not aligned:  # the first stage reduces last: it steps at once
                assert stream[index[id(step)] - 1] == sched.ReduceGrads(batch=step.batch)
            # the others (aligned: every stage) at one beat of the rhythm: right before the forward of micro-batch
            # (b+2) m - s (aligned) or of batch b+2's first (not), when there is one and it follows the reduction
            elif (step.batch + 2) * m < N * m:
                nxt = stream[index[id(step)] + 1 :]
                following = next(c for c in nxt if isinstance(c, (sched.LoadMicroBatch, sched.ForwardPass)))
                due = (step.batch + 2) * m - (s if aligned else 0)
                if not aligned:
                    assert following.micro_batch == due
                else:  # due, or right after its reduction when that came later than the due forward
                    last = [i for i in range(index[id(step)]) if isinstance(stream[i], sched.ForwardPass)][-1]
                    assert following.micro_batch >= due
                    assert stream[last].micro_batch < due or last < reduced[0]


@pytest.mark.parametrize("P,m,N", CASES)
def test_buffers_never_reused_while_live(P, m, N):
    for s in range(P):
        schedule = TwoBWSchedule(m, P, s, N)
        owner: dict[int, int] = {}
        for cmd in sched.flatten(schedule.steps()):
            if not hasattr(cmd, "buffer_id"):
                continue
            assert 0 <= cmd.buffer_id < schedule.num_pipe_buffers()
            k = cmd.micro_batch
            if isinstance(cmd, (sched.RecvActivation, sched.LoadMicroBatch, sched.ForwardPass)):
                assert owner.get(cmd.buffer_id, k) == k, f"stage {s}: buffer {cmd.buffer_id} still holds {owner}"
                owner[cmd.buffer_id] = k
            else:
                assert owner.get(cmd.buffer_id) == k
            if isinstance(cmd, sched.BackwardPass if s == 0 else sched.SendGrad):
                del owner[cmd.buffer_id]  # freed: stage 0 after its backward, others once the gradient left
        assert not owner


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("P,m,N", CASES)
def test_batch_boundaries_are_consistent_cuts(P, m, N, defer):
    """Cutting every stage right after its ReduceGrads(b) leaves no message half-delivered: what the engine
    relies on to return from train_batch and evaluate without a flush."""
    ss = streams(P, m, N, defer)
    for b in range(N):
        counts = {}
        for s, stream in enumerate(ss):
            cut = next(i for i, c in enumerate(stream) if isinstance(c, sched.ReduceGrads) and c.batch == b)
            prefix = stream[: cut + 1]
            counts[s] = {kind: len(of(prefix, kind)) for kind in sched.COMM}
            last_commit = max((i for i, c in enumerate(prefix) if isinstance(c, sched.CommitP2P)), default=-1)
            assert not of(prefix[last_commit + 1 :], sched.COMM), f"stage {s}: queued but uncommitted at the cut"
        for s in range(P - 1):
            assert counts[s][sched.SendActivation] == counts[s + 1][sched.RecvActivation]
            assert counts[s + 1][sched.SendGrad] == counts[s][sched.RecvGrad]


def test_fewer_micro_batches_than_stages_refused():
    # A user's config is refused by config.validate (test_config); the schedule guards direct use.
    with pytest.raises(ValueError, match="micro_batches >= stages"):
        TwoBWSchedule(micro_batches=3, stages=4, stage_id=0, batches=2)


def test_simulator_catches_deadlock_and_mismatch():
    # Both stages receive first with blocking p2p: each waits for the other forever.
    a = [sched.RecvGrad(buffer_id=0, micro_batch=0), sched.SendActivation(buffer_id=0, micro_batch=0)]
    b = [sched.SendGrad(buffer_id=0, micro_batch=0)]
    b = [sched.RecvActivation(buffer_id=0, micro_batch=0)] + b
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([a, b])
    # Queued and committed together, the same ops pair up fine.
    commit = [sched.CommitP2P()]
    simulate([a + commit, b + commit])
    bad = [sched.SendActivation(buffer_id=0, micro_batch=1)]
    with pytest.raises(ScheduleError, match="micro-batch"):
        simulate([bad, [sched.RecvActivation(buffer_id=0, micro_batch=0)]])


@pytest.mark.parametrize("P,m", [(2, 2), (3, 4), (4, 4), (4, 8)])
def test_baseline_streams_replay(P, m):
    for kind in ("gpipe", "1f1b"):
        tl = simulate_schedule(kind, m, P, 3)
        done = [e for e in tl.events if e.kind == "backward"]
        assert len(done) == 3 * m * P


@pytest.mark.parametrize("P,m", [(2, 2), (4, 4), (4, 8)])
def test_2bw_removes_the_flush_bubble_and_deferral_hides_the_norm_allreduce(P, m):
    N = 6
    flush = simulate_schedule("1f1b", m, P, N).makespan
    free = simulate_schedule("2bw", m, P, N).makespan
    blocking = simulate_schedule("2bw", m, P, N, collective_steps=True).makespan
    deferred = simulate_schedule("2bw-deferred", m, P, N, collective_steps=True).makespan
    # F=1, B=2: one fill and drain for the whole run instead of one per batch
    assert free == pytest.approx(3 * N * m + 3 * (P - 1))
    assert flush == pytest.approx(N * (3 * m + 3 * (P - 1)))
    assert blocking > free  # a blocking all-reduce at every step puts part of the bubble back
    assert deferred == pytest.approx(free)


@pytest.mark.parametrize("P,m", [(2, 2), (2, 4), (3, 3), (4, 8)])
def test_deferral_costs_nothing_with_unequal_stages_and_a_priced_step(P, m):
    # Measured-like costs: the last stage (head + loss) is heavier and every step costs something. The blocking
    # norm all-reduce costs the deferred schedule nothing; deferring the first stage's step too would delay the
    # activations the others wait for, once per batch.
    costs = dict(forward=[1.0] * (P - 1) + [1.1], backward=[2.0] * (P - 1) + [2.1], step=0.4)
    N = 5
    free = simulate_schedule("2bw-deferred", m, P, N, **costs).makespan
    deferred = simulate_schedule("2bw-deferred", m, P, N, collective_steps=True, **costs).makespan
    assert deferred == pytest.approx(free)
    if TwoBWSchedule(m, P, 0, N, defer_step=True).aligned:
        # aligned steps (P >= 3, m >= 1.5 P) against the rule below: faster
        unaligned = []
        for s in range(P):
            t = TwoBWSchedule(m, P, s, N, defer_step=True)
            t.aligned, t.defer_step = False, s > 0
            unaligned.append(sched.flatten(t.steps()))
        assert simulate(unaligned, collective_steps=True, **costs).makespan > deferred
        return
    all_deferred = [sched.flatten(TwoBWSchedule(m, P, s, N, defer_step=True).steps()) for s in range(P)]
    first = TwoBWSchedule(m, P, 0, N, defer_step=True)
    first.defer_step = True  # the old rule: the first stage deferred too
    all_deferred[0] = sched.flatten(first.steps())
    assert simulate(all_deferred, collective_steps=True, **costs).makespan > deferred


def test_our_flushed_1f1b_is_deepspeeds_train_schedule_instruction_for_instruction():
    """`flushed_1f1b_stream` (torch-free, what timelines and the cost model replay) against DeepSpeed's own
    `TrainSchedule` translated: the same instructions in the same order (buffers aside), every stage, P <= 8,
    m <= 12, two batches."""
    pytest.importorskip("deepspeed")

    def key(c):
        return c.name, tuple(sorted((k, v) for k, v in c.kwargs.items() if k != "buffer_id"))

    for P in range(1, 9):
        for m in range(1, 13):
            for s in range(P):
                ours = [key(c) for c in flushed_1f1b_stream(m, P, s, 2)]
                assert ours == [key(c) for c in train_schedule_stream(m, P, s, 2)], (P, m, s)


def test_deepspeed_translation_keeps_micro_batch_order():
    pytest.importorskip("deepspeed")
    for P, m, s in itertools.product((2, 4), (4, 5), (0, 1)):
        stream = train_schedule_stream(m, P, s, batches=2)
        assert [c.micro_batch for c in of(stream, sched.ForwardPass)] == list(range(2 * m))
        assert [c.batch for c in of(stream, sched.OptimizerStep)] == [0, 1]


@pytest.mark.parametrize("kind", ["2bw", "2bw-deferred", "1f1b"])
@pytest.mark.parametrize("P,m", [(2, 2), (3, 3), (4, 4), (4, 6)])
def test_stage_0_steps_after_everyone_finished_the_previous_step(kind, P, m):
    """What the metrics path relies on: rank 0 collects, at the cut after batch b, the steps before the one it
    applied last (applied: b without deferral, b-1 with it, where its step b follows the cut), so everyone must
    have sent those; and a rank finishes its step b-2 send when it applies step b (rank 0 has posted that
    receive). Causal order, so it must hold for any compute times: checked for random ones."""
    import random

    rng = random.Random(P * 100 + m)
    N = 5
    for _ in range(20):
        tl = simulate_schedule(
            kind, m, P, N, forward=rng.uniform(0.1, 3), backward=rng.uniform(0.1, 6), step=rng.uniform(0, 3),
            collective_steps=rng.random() < 0.5,
        )  # fmt: skip
        ends = {(e.stage, e.batch): e.end for e in tl.events if e.kind == "step"}
        starts = {(e.stage, e.batch): e.start for e in tl.events if e.kind == "step"}
        lag = 2 if kind == "2bw-deferred" else 1
        for b in range(lag, N):
            assert all(starts[(0, b)] >= ends[(s, b - lag)] - 1e-9 for s in range(P)), (b, ends, starts)
            if b >= 2:
                assert all(starts[(s, b)] >= ends[(0, b - 2)] - 1e-9 for s in range(P)), (b, ends, starts)
