"""Replay per-stage instruction streams against each other: a timeline with idle time, or a deadlock report.

Used by the schedule tests (every send meets its receive in an order that cannot hang) and for drawing
schedules. Communication is rendezvous: an op completes only when its partner is posted, as with NCCL. Ops
queued before a `CommitP2P` are posted together; a stream without commits blocks on every send and receive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from asyncpipe.schedules.instructions import (
    COMM,
    BackwardPass,
    CommitP2P,
    ForwardPass,
    Instruction,
    OptimizerStep,
    RecvActivation,
    ReduceGrads,
    RecvGrad,
    SendActivation,
    SendGrad,
)


class ScheduleError(AssertionError):
    """The streams do not fit together: a deadlock, or a send paired with the wrong receive."""


@dataclass
class Event:
    stage: int
    kind: str  # forward, backward, weight (a split-off weight gradient), step
    micro_batch: Optional[int]
    start: float
    end: float
    version: Optional[int] = None
    batch: Optional[int] = None
    chunk: Optional[int] = None  # model chunk (virtual stage) of a multi-chunk schedule
    straddle: bool = False  # a backward on a newer weight version than its forward's (PACI's straddlers)


@dataclass
class Timeline:
    events: list[Event]
    makespan: float
    busy: list[float]  # compute time per stage

    @property
    def idle_fraction(self) -> list[float]:
        return [1.0 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    def step_times(self, stage: int) -> list[float]:
        """End time of each optimizer step on ``stage``, in batch order."""
        return [e.end for e in self.events if e.stage == stage and e.kind == "step"]


@dataclass
class _Stage:
    stream: Sequence[Instruction]
    batched: bool  # has CommitP2P: queue ops until the commit
    pc: int = 0
    clock: float = 0.0
    queued: list = field(default_factory=list)
    waiting: Optional[list] = None  # posted (channel, side, index) awaiting partners
    collective: Optional[int] = None  # waiting in OptimizerStep for this batch's all-reduce


def _channel(cmd: Instruction, stage: int) -> tuple[tuple[str, int, int], str]:
    """(kind, src, dst) of the link an op uses, and which side of it this stage is."""
    if isinstance(cmd, SendActivation):
        return ("act", stage, stage + 1), "send"
    if isinstance(cmd, RecvActivation):
        return ("act", stage - 1, stage), "recv"
    if isinstance(cmd, SendGrad):
        return ("grad", stage, stage - 1), "send"
    if isinstance(cmd, RecvGrad):
        return ("grad", stage + 1, stage), "recv"
    raise TypeError(cmd)


Cost = Union[float, Sequence[float]]  # one duration for every stage, or one per stage


def simulate(
    streams: Sequence[Sequence[Instruction]],
    forward: Cost = 1.0,
    backward: Cost = 2.0,
    step: Cost = 0.0,
    latency: float = 0.0,
    collective_steps: bool = False,
    overhead: float = 0.0,
    recompute: bool = False,
) -> Timeline:
    """Run the stages' streams against each other with the given durations (per stage where a sequence: a
    measured, unequal pipeline); raises `ScheduleError`.

    ``collective_steps``: a cross-stage all-reduce (global-norm clipping) starts at each stage's
    `ReduceGrads(b)` without blocking, and `OptimizerStep(b)` waits until every stage has started it.
    ``overhead``: seconds the engine spends on every instruction besides its work (the cost model's
    per-instruction term, `asyncpipe.timelines.cost`); ``latency``: seconds each completed exchange adds.
    ``recompute``: a backward on a newer version than its forward's (a straddler) recomputes that forward first
    (paci-recompute); otherwise it costs a backward (paci's in-place recipe).
    """
    n = len(streams)
    fwd, bwd, upd = ([float(c)] * n if isinstance(c, (int, float)) else [float(x) for x in c]
                     for c in (forward, backward, step))  # fmt: skip
    stages = [_Stage(s, any(isinstance(c, CommitP2P) for c in s)) for s in streams]
    # Per link and side: (micro_batch, post time) of every op posted so far, in order.
    posted: dict[tuple, dict[str, list[tuple[int, float]]]] = {}
    events: list[Event] = []
    read: dict[tuple[int, int], Optional[int]] = {}  # (stage, micro-batch) -> the version its forward read
    busy = [0.0] * n
    started: dict[int, list[float]] = {}  # batch -> start times of its all-reduce, one per stage

    def post(i: int, ops: list[Instruction]) -> None:
        st = stages[i]
        st.waiting = []
        for cmd in ops:
            ch, side = _channel(cmd, i)
            if not 0 <= ch[1] < n or not 0 <= ch[2] < n:
                raise ScheduleError(f"stage {i}: {cmd!r} talks to a stage that does not exist")
            lst = posted.setdefault(ch, {"send": [], "recv": []})[side]
            lst.append((cmd.micro_batch, st.clock))
            st.waiting.append((ch, side, len(lst) - 1))

    def try_finish_wait(i: int) -> bool:
        st = stages[i]
        done_at = st.clock
        for ch, side, idx in st.waiting or []:
            other = posted[ch]["recv" if side == "send" else "send"]
            if len(other) <= idx:
                return False
            mine = posted[ch][side][idx]
            if other[idx][0] != mine[0]:
                raise ScheduleError(
                    f"link {ch}: message #{idx} is micro-batch {mine[0]} on one side, {other[idx][0]} on the other"
                )
            done_at = max(done_at, mine[1], other[idx][1])
        st.clock = done_at + (latency if st.waiting else 0.0)
        st.waiting = None
        return True

    def advance(i: int) -> bool:
        """Run stage i until it blocks or ends; True when anything happened."""
        st = stages[i]
        moved = False
        while True:
            if st.collective is not None:
                arrivals = started.get(st.collective, [])
                if len(arrivals) < n:
                    return moved
                begin = st.clock
                st.clock = max([st.clock] + arrivals)
                events.append(Event(i, "step", None, begin, st.clock + upd[i], batch=st.collective))
                st.clock += upd[i]
                busy[i] += upd[i]
                st.collective = None
                moved = True
            if st.waiting is not None:
                if not try_finish_wait(i):
                    return moved
                moved = True
            if st.pc >= len(st.stream):
                return moved
            cmd = st.stream[st.pc]
            st.pc += 1
            st.clock += overhead
            moved = True
            if isinstance(cmd, COMM):
                if st.batched:
                    st.queued.append(cmd)
                else:
                    post(i, [cmd])
            elif isinstance(cmd, CommitP2P):
                post(i, st.queued)
                st.queued = []
            elif isinstance(cmd, (ForwardPass, BackwardPass)):
                dur = fwd[i] if isinstance(cmd, ForwardPass) else bwd[i]
                kind = "forward" if isinstance(cmd, ForwardPass) else "backward"
                version = getattr(cmd, "version", None)
                if kind == "forward":
                    read[(i, cmd.micro_batch)] = version
                straddle = kind == "backward" and read.get((i, cmd.micro_batch), version) != version
                dur += fwd[i] if straddle and recompute else 0.0  # its forward is recomputed first
                events.append(Event(i, kind, cmd.micro_batch, st.clock, st.clock + dur, version, straddle=straddle))
                st.clock += dur
                busy[i] += dur
            elif isinstance(cmd, ReduceGrads):
                if collective_steps:
                    started.setdefault(cmd.batch, []).append(st.clock)
            elif isinstance(cmd, OptimizerStep):
                if collective_steps:
                    st.collective = cmd.batch
                    continue
                events.append(Event(i, "step", None, st.clock, st.clock + upd[i], batch=cmd.batch))
                st.clock += upd[i]
                busy[i] += upd[i]

    while True:
        moved = any([advance(i) for i in range(n)])
        if all(st.pc >= len(st.stream) and st.waiting is None and st.collective is None for st in stages):
            break
        if not moved:
            where = [
                f"stage {i}: at #{st.pc} {st.stream[st.pc - 1] if st.pc else None!r}"
                + (f" waiting on {st.waiting}" if st.waiting else "")
                + (f" in the all-reduce of batch {st.collective}" if st.collective is not None else "")
                for i, st in enumerate(stages)
            ]
            raise ScheduleError("deadlock: " + "; ".join(where))
    for i, st in enumerate(stages):
        if st.queued:
            raise ScheduleError(f"stage {i}: communication queued but never committed: {st.queued}")
    for ch, sides in posted.items():
        if len(sides["send"]) != len(sides["recv"]):
            raise ScheduleError(f"link {ch}: {len(sides['send'])} sends but {len(sides['recv'])} receives")
    makespan = max((st.clock for st in stages), default=0.0)
    return Timeline(events, makespan, busy)


def simulate_schedule(kind: str, micro_batches: int, stages: int, batches: int, **kw: Cost) -> Timeline:
    """`simulate` on every stage's stream of a named schedule (``2bw``, ``1f1b``, ``gpipe``, a declared one)."""
    from asyncpipe.schedules.streams import stream

    streams = [stream(kind, micro_batches, stages, s, batches) for s in range(stages)]
    return simulate(streams, recompute=_recomputes(kind), **kw)  # type: ignore[arg-type]


def _recomputes(kind: str) -> bool:
    from asyncpipe.schedules import get, names

    return kind in names() and get(kind).recompute


def steady_gaps(timeline: Timeline, tol: float = 1e-9) -> list[float]:
    """Per stage: idle time between its first backward and its last forward (the 1F1B steady state, which
    2BW keeps across batch boundaries; a flushed schedule idles there at every batch boundary)."""
    out = []
    for s in range(len(timeline.busy)):
        evs = sorted((e for e in timeline.events if e.stage == s and e.kind != "eval"), key=lambda e: e.start)
        lo = min((e.start for e in evs if e.kind == "backward"), default=0.0)
        hi = max((e.end for e in evs if e.kind == "forward"), default=0.0)
        inside = [e for e in evs if e.start >= lo - tol and e.end <= hi + tol]
        gaps = sum(max(0.0, b.start - a.end) for a, b in zip(inside, inside[1:]))
        out.append(gaps if gaps > tol else 0.0)
    return out
