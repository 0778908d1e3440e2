"""The one replay of pipeline orders: per-stage instruction streams run against each other, giving a timeline with
idle time, or a deadlock report. Every timeline goes through it: the engine's streams (ideal, modelled by the cost
model, drawn), and the one-batch orders of `asyncpipe.schedules.orders` (`asyncpipe.timelines.orders.replay`).

Used by the schedule tests (every send meets its receive in an order that cannot hang) and for drawing
schedules. Communication is rendezvous: an op completes only when its partner is posted, as with NCCL. Ops
queued before a `CommitP2P` are posted together; a stream without commits blocks on every send and receive.
A pass of a one-batch order (on a model ``chunk``, naming the ops it ``needs``) has no sends or receives: it starts
once those ops are done (communication free and eager, ``latency`` after an op on another stage). A pass of a
stream that names its ``chunk`` (a V's two chunks per stage, DualPipeV's) costs that chunk's figure; its sends and
receives name their ``phase`` (1: towards stage 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

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
    WeightPass,
)
from asyncpipe.schedules.orders import Op, op_of


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
    pending: Optional[Instruction] = None  # a pass of an order waiting for the ops it reads

    @property
    def finished(self) -> bool:
        """At the end of its stream, waiting for nothing."""
        return self.pc >= len(self.stream) and self.waiting is None and self.collective is None and self.pending is None


def _channel(cmd: Instruction, stage: int) -> tuple[tuple[str, int, int], str]:
    """(kind, src, dst) of the link an op uses, and which side of it this stage is. Phase 0 (the default) flows
    towards the last stage; phase 1 (a V's second chunk) back towards stage 0: its activation goes to the stage
    before, its gradient to the stage after."""
    step = -1 if getattr(cmd, "phase", 0) == 1 else 1
    if isinstance(cmd, SendActivation):
        return ("act", stage, stage + step), "send"
    if isinstance(cmd, RecvActivation):
        return ("act", stage - step, stage), "recv"
    if isinstance(cmd, SendGrad):
        return ("grad", stage, stage - step), "send"
    if isinstance(cmd, RecvGrad):
        return ("grad", stage + step, stage), "recv"
    raise TypeError(cmd)


Cost = Union[float, Sequence[float]]  # one duration for every stage, or one per stage (per chunk: an order's passes)


def simulate(
    streams: Sequence[Sequence[Instruction]],
    forward: Cost = 1.0,
    backward: Cost = 2.0,
    step: Cost = 0.0,
    latency: float = 0.0,
    collective_steps: Union[bool, Sequence[Sequence[int]]] = False,
    overhead: float = 0.0,
    recompute: bool = False,
    weight: Cost = 0.0,
    name: Optional[str] = None,
) -> Timeline:
    """Run the stages' streams against each other with the given durations (per stage where a sequence: a
    measured, unequal pipeline; per chunk for the passes of a one-batch order); raises `ScheduleError`.

    ``collective_steps``: a cross-stage all-reduce (global-norm clipping) starts at each stage's
    `ReduceGrads(b)` without blocking, and `OptimizerStep(b)` waits until every stage has started it; given as
    groups of stages (e.g. [[0, P-1]]: a tied matrix's two copies summed), only within each group, a stage in none
    stepping at once.
    ``overhead``: seconds the engine spends on every instruction besides its work (the cost model's
    per-instruction term, `asyncpipe.timelines.cost`); ``latency``: seconds each completed exchange adds (for an
    order's pass, each op it reads from another stage).
    ``recompute``: a backward on a newer version than its forward's (a straddler) recomputes that forward first
    (paci-recompute); otherwise it costs a backward (paci's in-place recipe).
    ``weight``: a split-off weight gradient (`WeightPass`); ``name``: the one-batch order the streams are, whose
    deadlock report names the op each rank waits at.
    """
    costs = {
        kind: float(c) if isinstance(c, (int, float)) else [float(x) for x in c]
        for kind, c in (("F", forward), ("B", backward), ("W", weight), ("U", step))
    }
    return _Replay(streams, costs, latency, collective_steps, overhead, recompute, name).run()


class _Replay:
    """The state of one `simulate` run: every stage's place in its stream and clock, what each link has posted,
    and one handler per instruction."""

    def __init__(
        self,
        streams: Sequence[Sequence[Instruction]],
        costs: dict[str, Union[float, list[float]]],
        latency: float,
        collective_steps: Union[bool, Sequence[Sequence[int]]],
        overhead: float,
        recompute: bool,
        name: Optional[str],
    ) -> None:
        self.n, self.costs, self.name = len(streams), costs, name
        self.latency, self.overhead, self.recompute = latency, overhead, recompute
        groups = [range(len(streams))] if collective_steps is True else collective_steps or []
        self.group_of = {i: tuple(g) for g in groups for i in g}  # stage -> the stages its step waits for
        self.stages = [_Stage(s, any(isinstance(c, CommitP2P) for c in s)) for s in streams]
        # Per link and side: (micro_batch, post time) of every op posted so far, in order.
        self.posted: dict[tuple, dict[str, list[tuple[int, float]]]] = {}
        self.events: list[Event] = []
        self.read: dict[tuple[int, int], Optional[int]] = {}  # (stage, micro-batch) -> the version its forward read
        self.busy = [0.0] * self.n
        self.started: dict[int, dict[int, float]] = {}  # batch -> stage -> when it started its all-reduce
        # An order's ops: the stage that runs each, and when each finished.
        self.owner = {op_of(c): i for i, s in enumerate(streams) for c in s if getattr(c, "needs", None) is not None}
        self.done: dict[Op, float] = {}
        self.handlers: list[tuple[Any, Callable[[int, Any], None]]] = [
            (COMM, self._comm),
            (CommitP2P, self._commit),
            ((ForwardPass, BackwardPass, WeightPass), self._pass),
            (ReduceGrads, self._reduce),
            (OptimizerStep, self._step),
        ]  # the rest (loading a micro-batch) takes no time here

    def run(self) -> Timeline:
        while True:
            moved = any([self.advance(i) for i in range(self.n)])
            if all(st.finished for st in self.stages):
                break
            if not moved:
                raise ScheduleError(self._deadlock())
        for i, st in enumerate(self.stages):
            if st.queued:
                raise ScheduleError(f"stage {i}: communication queued but never committed: {st.queued}")
        for ch, sides in self.posted.items():
            if len(sides["send"]) != len(sides["recv"]):
                raise ScheduleError(f"link {ch}: {len(sides['send'])} sends but {len(sides['recv'])} receives")
        makespan = max((st.clock for st in self.stages), default=0.0)
        return Timeline(self.events, makespan, self.busy)

    def _deadlock(self) -> str:
        """Where every stage is stuck; for a one-batch order, the op each unfinished rank waits at."""
        if self.name is None:
            return "deadlock: " + "; ".join(self._where(i) for i in range(self.n))
        stuck = [f"rank {i} at {op_of(st.pending)}" for i, st in enumerate(self.stages) if st.pending is not None]
        return f"{self.name}: deadlock: " + "; ".join(stuck)

    def _where(self, i: int) -> str:
        st = self.stages[i]
        return (
            f"stage {i}: at #{st.pc} {st.stream[st.pc - 1] if st.pc else None!r}"
            + (f" waiting on {st.waiting}" if st.waiting else "")
            + (f" in the all-reduce of batch {st.collective}" if st.collective is not None else "")
            + (f" waiting for the inputs of {op_of(st.pending)}" if st.pending is not None else "")
        )

    def advance(self, i: int) -> bool:
        """Run stage i until it blocks or ends; True when anything happened."""
        st = self.stages[i]
        moved = False
        while True:
            if st.collective is not None:
                if not self._finish_collective(i):
                    return moved
                moved = True
            if st.waiting is not None:
                if not self._finish_wait(i):
                    return moved
                moved = True
            if st.pending is not None:
                if not self._finish_pending(i):
                    return moved
                moved = True
            if st.pc >= len(st.stream):
                return moved
            cmd = st.stream[st.pc]
            st.pc += 1
            st.clock += self.overhead
            moved = True
            for kind, handler in self.handlers:
                if isinstance(cmd, kind):
                    handler(i, cmd)
                    break

    # -- one handler per instruction ------------------------------------------------------------------------
    def _comm(self, i: int, cmd: Instruction) -> None:
        """A send or receive: queued until the commit of a batched stream, else posted (and waited for) at once."""
        if self.stages[i].batched:
            self.stages[i].queued.append(cmd)
        else:
            self._post(i, [cmd])

    def _commit(self, i: int, cmd: Instruction) -> None:
        st = self.stages[i]
        self._post(i, st.queued)
        st.queued = []

    def _pass(self, i: int, cmd: Instruction) -> None:
        """A forward, backward or weight gradient; a pass of an order first waits for the ops it ``needs``."""
        needs = getattr(cmd, "needs", None)
        if needs is None:
            self._compute(i, cmd)
            return
        missing = [d for d in needs if d not in self.owner]
        if missing:
            raise ScheduleError(f"{op_of(cmd)} on rank {i} needs {missing[0]}, which no rank runs")
        self.stages[i].pending = cmd  # run by `_finish_pending` once they are done

    def _compute(self, i: int, cmd: Instruction) -> None:
        """A pass's duration on the stage (on its chunk, for an order's); a straddler's backward recomputes its
        forward first under ``recompute``."""
        st, forward = self.stages[i], isinstance(cmd, ForwardPass)
        chunk = getattr(cmd, "chunk", None)
        at = i if chunk is None else chunk
        kind = "forward" if forward else "backward" if isinstance(cmd, BackwardPass) else "weight"
        dur = self._cost(kind[0].upper(), at)
        version = getattr(cmd, "version", None)
        if forward:
            self.read[(i, cmd.micro_batch)] = version
        straddle = kind == "backward" and self.read.get((i, cmd.micro_batch), version) != version
        dur += self._cost("F", at) if straddle and self.recompute else 0.0
        event = Event(i, kind, cmd.micro_batch, st.clock, st.clock + dur, version, chunk=chunk, straddle=straddle)
        self.events.append(event)
        st.clock += dur
        self.busy[i] += dur
        if getattr(cmd, "needs", None) is not None:
            self.done[op_of(cmd)] = st.clock

    def _cost(self, kind: str, at: int) -> float:
        """Seconds of one ``kind`` (F, B, W, U) on stage or chunk ``at``."""
        c = self.costs[kind]
        return c if isinstance(c, float) else c[at]

    def _reduce(self, i: int, cmd: Instruction) -> None:
        if i in self.group_of:
            self.started.setdefault(cmd.batch, {})[i] = self.stages[i].clock

    def _step(self, i: int, cmd: Instruction) -> None:
        """An optimizer step; in a collective group it first waits for its group's all-reduce to start."""
        if i in self.group_of:
            self.stages[i].collective = cmd.batch
            return
        self._run_step(i, self.stages[i].clock, cmd.batch)

    def _run_step(self, i: int, begin: float, batch: int) -> None:
        st = self.stages[i]
        upd = self._cost("U", i)
        self.events.append(Event(i, "step", None, begin, st.clock + upd, batch=batch))
        st.clock += upd
        self.busy[i] += upd

    # -- waiting ---------------------------------------------------------------------------------------------
    def _finish_collective(self, i: int) -> bool:
        st = self.stages[i]
        started = self.started.get(st.collective, {})  # type: ignore[arg-type]
        if any(j not in started for j in self.group_of[i]):
            return False
        arrivals = [started[j] for j in self.group_of[i]]
        begin = st.clock
        st.clock = max([st.clock] + arrivals)
        batch, st.collective = st.collective, None
        self._run_step(i, begin, batch)  # type: ignore[arg-type]
        return True

    def _finish_pending(self, i: int) -> bool:
        """Run the waiting pass once every op it reads is done: at the latest of their ends, ``latency`` later for
        one on another stage."""
        st, done = self.stages[i], self.done
        needs = st.pending.needs  # type: ignore[union-attr]
        if not all(d in done for d in needs):
            return False
        st.clock = max([st.clock] + [done[d] + (self.latency if self.owner[d] != i else 0.0) for d in needs])
        cmd, st.pending = st.pending, None
        self._compute(i, cmd)  # type: ignore[arg-type]
        return True

    def _post(self, i: int, ops: list[Instruction]) -> None:
        st = self.stages[i]
        st.waiting = []
        for cmd in ops:
            ch, side = _channel(cmd, i)
            if not 0 <= ch[1] < self.n or not 0 <= ch[2] < self.n:
                raise ScheduleError(f"stage {i}: {cmd!r} talks to a stage that does not exist")
            lst = self.posted.setdefault(ch, {"send": [], "recv": []})[side]
            lst.append((cmd.micro_batch, st.clock))
            st.waiting.append((ch, side, len(lst) - 1))

    def _finish_wait(self, i: int) -> bool:
        st = self.stages[i]
        done_at = st.clock
        for ch, side, idx in st.waiting or []:
            other = self.posted[ch]["recv" if side == "send" else "send"]
            if len(other) <= idx:
                return False
            mine = self.posted[ch][side][idx]
            if other[idx][0] != mine[0]:
                raise ScheduleError(
                    f"link {ch}: message #{idx} is micro-batch {mine[0]} on one side, {other[idx][0]} on the other"
                )
            done_at = max(done_at, mine[1], other[idx][1])
        st.clock = done_at + (self.latency if st.waiting else 0.0)
        st.waiting = None
        return True


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
