"""PipeDream-2BW (`pipeline.schedule=2bw`, delay 1): 1F1B carried across batch boundaries with no flush, one step
per batch per stage, batch b pinned to W(b-1) on every stage (two weight versions). The stream is
`TwoBWSchedule` below. In the simulator ``delay`` = k >= 1 generalises it to a uniform k-step
delay (k+1 versions, simulator only)."""

from __future__ import annotations

from typing import Any, Iterator

from asyncpipe.errors import ConfigError
from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight, uniform
from asyncpipe.schedules.instructions import (
    BackwardPass,
    CommitP2P,
    ForwardPass,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
    check_stream,
    flatten,
)


WHY = "with fewer, stage 0 would start batch b+2 before step b made its weights"


def min_micro_batches(stages: int) -> int:
    """The fewest micro-batches per batch a stream that carries 1F1B across batches runs with (2BW's and PACI's):
    one per stage, else stage 0 would start batch b+2 before step b made its weights."""
    return stages


class TwoBWSchedule:
    """The whole run of ``batches`` optimizer steps on one stage, as DeepSpeed-style ticks.

    Micro-batches are numbered globally, k = b * micro_batches + j. Stage s first runs P-1-s warm-up forwards,
    then alternates one forward and one backward until every forward is issued, then drains the remaining
    backwards; batch boundaries do not interrupt the 1F1B rhythm. Communication is queued and posted in
    batches by `CommitP2P`, so a send and its matching receive are always posted in the same round on both
    sides (the Megatron pairing: send-activation with receive-grad, send-grad with receive-activation).

    ``steps()`` yields lists of instructions; `ScheduledPipelineEngine.train_batch` runs the stream up to the
    next `ReduceGrads` per call (a cut with no message in flight between stages): warm-up in the first call,
    the drain in the last.

    ``defer_step``: on every stage but the first, each `OptimizerStep(b)` moves from right after `ReduceGrads(b)`
    to just before the first forward of batch b+2, the first use of its output W(b+1) (steps with no such
    forward close the stream). A cross-stage reduction started by `ReduceGrads` then overlaps a batch of work
    instead of stalling. The first stage runs the last backward of every batch, so when it reaches
    `ReduceGrads(b)` every other stage has already started the reduction: it steps at once, which keeps its
    step off the rhythm the other stages wait on (a deferred step there delays the next activation sent).
    With P >= 3 and m >= 1.5 P the steps are **aligned** instead: stage s (the first included) steps just before the
    forward of micro-batch (b+2) m - s, the same beat of the 1F1B rhythm on every stage (forward k reaches
    stage s at beat k + s), so the steady batch stalls for one step, not for one per stage. Replayed with
    F = 1, B = 2, U = 1 under the global norm all-reduce the step is then m(F+B) + U, the no-bubble minimum:
    25 against 27 at P = 4, m = 8; 49 against 55 at P = 8, m = 16; 97 against 103 at P = 8, m = 32 (at P = 2 it
    gains nothing and delays stage 0's sends; at m = P, P + 1 it is slower: those keep the rule above).

    ``start``: the stream begins at batch ``start`` (a resumed run), warming up afresh; micro-batch numbers and
    version pins stay absolute, so batch b still runs on W(max(b-1, 0)).
    """

    def __init__(
        self,
        micro_batches: int,
        stages: int,
        stage_id: int,
        batches: int,
        defer_step: bool = False,
        start: int = 0,
    ) -> None:
        check_stream(micro_batches, stages, stage_id, batches)
        if not 0 <= start < batches:
            raise ValueError(f"start batch {start} is not one of the run's {batches} batches")
        if micro_batches < min_micro_batches(stages):  # config.validate refuses such a config; direct use
            raise ValueError(f"2BW needs micro_batches >= stages (got {micro_batches} < {stages}): {WHY}")
        self.micro_batches, self.stages, self.stage_id, self.batches = micro_batches, stages, stage_id, batches
        self.is_first_stage = stage_id == 0
        self.aligned = defer_step and stages >= 3 and 2 * micro_batches >= 3 * stages
        self.defer_step, self.start = defer_step and (self.aligned or not self.is_first_stage), start
        self.is_last_stage = stage_id == stages - 1

    # -- the rules the engine and the tests rely on ------------------------------------------------------
    def num_pipe_buffers(self) -> int:
        """At most P-s micro-batches are in flight on stage s; one spare slot so a receive never lands on a
        slot whose gradient is still being sent."""
        return self.stages - self.stage_id + 1

    def version_of(self, micro_batch: int) -> int:
        """Weight version used by ``micro_batch``: batch b runs on W(b-1), and W(-1) is W(0)."""
        return max(micro_batch // self.micro_batches - 1, 0)

    def warmup(self) -> int:
        return min(self.stages - 1 - self.stage_id, self.micro_batches * (self.batches - self.start))

    # -- the instruction stream --------------------------------------------------------------------------
    def _buf(self, k: int) -> int:
        return k % self.num_pipe_buffers()

    def _recv_act(self, k: int) -> list[Instruction]:
        return [] if self.is_first_stage else [RecvActivation(buffer_id=self._buf(k), micro_batch=k)]

    def _send_act(self, k: int) -> list[Instruction]:
        return [] if self.is_last_stage else [SendActivation(buffer_id=self._buf(k), micro_batch=k)]

    def _recv_grad(self, k: int) -> list[Instruction]:
        return [] if self.is_last_stage else [RecvGrad(buffer_id=self._buf(k), micro_batch=k)]

    def _send_grad(self, k: int) -> list[Instruction]:
        return [] if self.is_first_stage else [SendGrad(buffer_id=self._buf(k), micro_batch=k)]

    def _forward(self, k: int) -> list[Instruction]:
        load = (
            [LoadMicroBatch(buffer_id=self._buf(k), micro_batch=k)] if self.is_first_stage or self.is_last_stage else []
        )
        return load + [ForwardPass(buffer_id=self._buf(k), micro_batch=k, version=self.version_of(k))]

    def _backward(self, k: int) -> list[Instruction]:
        return [BackwardPass(buffer_id=self._buf(k), micro_batch=k, version=self.version_of(k))]

    def _step_after(self, k: int) -> list[Instruction]:
        if (k + 1) % self.micro_batches:
            return []
        b = k // self.micro_batches
        return [ReduceGrads(batch=b), OptimizerStep(batch=b, src_version=b, dst_version=b + 1)]

    @staticmethod
    def _commit(ops: list[Instruction]) -> list[Instruction]:
        return ops + [CommitP2P()] if ops else []

    def steps(self) -> Iterator[list[Instruction]]:
        """Ticks of the whole run: each is at most one forward and one backward plus their communication."""
        return self._deferred(self._ticks()) if self.defer_step else self._ticks()

    def _deferred(self, ticks: Iterator[list[Instruction]]) -> Iterator[list[Instruction]]:
        waiting: list[Instruction] = []
        lookahead = self.stage_id if self.aligned else 0  # steps are due this many forwards early
        for tick in ticks:
            out: list[Instruction] = []
            for cmd in tick:
                if isinstance(cmd, OptimizerStep):
                    waiting.append(cmd)
                    continue
                if waiting and isinstance(cmd, (LoadMicroBatch, ForwardPass)):
                    # Steps are pending in batch order; each is due when its W(b+1) is first read.
                    while waiting and cmd.micro_batch >= (waiting[0].batch + 2) * self.micro_batches - lookahead:
                        out.append(waiting.pop(0))
                out.append(cmd)
            yield out
        if waiting:
            yield waiting

    def _ticks(self) -> Iterator[list[Instruction]]:
        first, total = self.micro_batches * self.start, self.micro_batches * self.batches
        warm = self.warmup()
        for k in range(first, first + warm):
            yield self._commit(self._recv_act(k)) + self._forward(k) + self._commit(self._send_act(k))
        steady = total - first - warm
        for i in range(steady):
            f, k = first + warm + i, first + i
            cmds = self._commit(self._recv_act(f)) if i == 0 else []
            cmds += self._forward(f) + self._commit(self._send_act(f) + self._recv_grad(k)) + self._backward(k)
            # The next forward's input is received in the same round as this backward's gradient goes out.
            nxt = self._recv_act(f + 1) if i < steady - 1 else []
            yield cmds + self._commit(self._send_grad(k) + nxt) + self._step_after(k)
        for k in range(first + steady, total):
            yield (
                self._commit(self._recv_grad(k))
                + self._backward(k)
                + self._commit(self._send_grad(k))
                + self._step_after(k)
            )

    def __iter__(self) -> Iterator[list[Instruction]]:
        return self.steps()


def two_bw_stream(
    micro_batches: int, stages: int, stage_id: int, batches: int, defer_step: bool = False
) -> list[Instruction]:
    """Stage ``stage_id``'s whole 2BW run, flattened."""
    return flatten(TwoBWSchedule(micro_batches, stages, stage_id, batches, defer_step).steps())


def two_bw_deferred_stream(micro_batches: int, stages: int, stage_id: int, batches: int) -> list[Instruction]:
    """2BW with each optimizer step deferred to the first use of its output (see `TwoBWSchedule`)."""
    return two_bw_stream(micro_batches, stages, stage_id, batches, defer_step=True)


def _stream(m: int, P: int, stage: int, batches: int, start: int = 0, defer_step: bool = False) -> Any:
    return TwoBWSchedule(m, P, stage, batches, defer_step, start).steps()


def _check(cfg: Any) -> None:
    if cfg.delay < 1:
        raise ConfigError(
            f"pipeline.schedule=2bw is one step stale: use delay >= 1 (the simulator's k), got delay={cfg.delay}"
        )
    if cfg.engine == "pipeline" and cfg.delay != 1:
        raise ConfigError(f"engine=pipeline supports delay 0 (1F1B) or 1 (2BW), got delay={cfg.delay}")


SPEC = declare_schedule(
    ScheduleSpec(
        name="2bw",
        note="PipeDream-2BW: no flush, every micro-batch of batch b on W(b-1), two weight versions",
        versions=uniform(1),
        weight_versions=lambda P, s: 2,
        in_flight=one_f_one_b_in_flight,
        stream=_stream,
        check=_check,
        flush=False,
        stage_delay=lambda P, s, delay: delay,
        in_order=True,
        min_micro_batches=min_micro_batches,
        bubble_note="steady state: no flush",
        label="2BW",
    )
)
