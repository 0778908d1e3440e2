"""Pipeline schedules as generators of small instruction objects, in the spirit of DeepSpeed's `TrainSchedule`.

`TwoBWSchedule` is PipeDream-2BW: 1F1B carried across batch boundaries with no flush, one optimizer step per
batch per stage right after the batch's last backward, every micro-batch pinned to one weight version
(batch b runs on W(b-1), W(-1) = W(0)), at most two versions alive per stage. Pure Python: no torch, no deepspeed.
`gpipe_stream` and `flushed_1f1b_stream` (DeepSpeed's own 1F1B with flush, its order without importing it) give the
baselines for timelines.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from asyncpipe.errors import UserError


class Instruction:
    """One thing a stage does; keyword arguments become attributes and are passed to the engine's handler."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class LoadMicroBatch(Instruction):
    """First stage: load inputs of ``micro_batch`` into ``buffer_id``; last stage: its labels."""


class ForwardPass(Instruction):
    """Forward of ``micro_batch`` (in ``buffer_id``) on weight ``version``."""


class BackwardPass(Instruction):
    """Backward of ``micro_batch``; gradients accumulate on the same weight ``version`` its forward used."""


class SendActivation(Instruction):
    """Queue the output of ``micro_batch`` for the next stage (sent at the next `CommitP2P`)."""


class RecvActivation(Instruction):
    """Queue the receipt of ``micro_batch``'s input from the previous stage."""


class SendGrad(Instruction):
    """Queue the input gradient of ``micro_batch`` for the previous stage."""


class RecvGrad(Instruction):
    """Queue the receipt of ``micro_batch``'s output gradient from the next stage."""


class CommitP2P(Instruction):
    """Post every queued send and receive at once and wait for all of them (batched isend/irecv)."""


class ReduceGrads(Instruction):
    """Average batch ``batch``'s gradients over the stage's data-parallel replicas."""


class OptimizerStep(Instruction):
    """W(dst_version) = W(src_version) - U(grad of ``batch``): clipping, lr schedule and the optimizer step."""


COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)


def _check(micro_batches: int, stages: int, stage_id: int, batches: int) -> None:
    if stages < 1 or not 0 <= stage_id < stages:
        raise ValueError(f"stage_id {stage_id} is not a stage of a {stages}-stage pipeline")
    if micro_batches < 1 or batches < 1:
        raise ValueError(f"need micro_batches >= 1 and batches >= 1, got {micro_batches}, {batches}")


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
        self, micro_batches: int, stages: int, stage_id: int, batches: int, defer_step: bool = False,
        start: int = 0,
    ) -> None:
        _check(micro_batches, stages, stage_id, batches)
        if not 0 <= start < batches:
            raise ValueError(f"start batch {start} is not one of the run's {batches} batches")
        if micro_batches < stages:
            raise ValueError(  # config.validate refuses such a config; this guards direct use
                f"2BW needs micro_batches >= stages (got {micro_batches} < {stages}): with fewer, "
                "stage 0 would start batch b+2 before step b made its weights"
            )
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
        load = [LoadMicroBatch(buffer_id=self._buf(k), micro_batch=k)] if self.is_first_stage or self.is_last_stage else []
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
            yield self._commit(self._recv_grad(k)) + self._backward(k) + self._commit(self._send_grad(k)) + self._step_after(k)

    def __iter__(self) -> Iterator[list[Instruction]]:
        return self.steps()


def flatten(ticks: Any) -> list[Instruction]:
    """One flat instruction list from ticks (lists of instructions)."""
    return [cmd for tick in ticks for cmd in tick]


def two_bw_stream(
    micro_batches: int, stages: int, stage_id: int, batches: int, defer_step: bool = False
) -> list[Instruction]:
    """Stage ``stage_id``'s whole 2BW run, flattened."""
    return flatten(TwoBWSchedule(micro_batches, stages, stage_id, batches, defer_step).steps())


def gpipe_stream(micro_batches: int, stages: int, stage_id: int, batches: int = 1) -> list[Instruction]:
    """GPipe with a flush per batch: all forwards, then all backwards (last first), then the step.

    Blocking communication (no `CommitP2P`), like DeepSpeed's engine; delay 0, so batch b runs on W(b).
    """
    _check(micro_batches, stages, stage_id, batches)
    first, last = stage_id == 0, stage_id == stages - 1
    cmds: list[Instruction] = []
    for b in range(batches):
        ks = range(b * micro_batches, (b + 1) * micro_batches)
        for k in ks:
            j = k - b * micro_batches
            if not first:
                cmds.append(RecvActivation(buffer_id=j, micro_batch=k))
            if first or last:
                cmds.append(LoadMicroBatch(buffer_id=j, micro_batch=k))
            cmds.append(ForwardPass(buffer_id=j, micro_batch=k, version=b))
            if not last:
                cmds.append(SendActivation(buffer_id=j, micro_batch=k))
        for k in reversed(ks):
            j = k - b * micro_batches
            if not last:
                cmds.append(RecvGrad(buffer_id=j, micro_batch=k))
            cmds.append(BackwardPass(buffer_id=j, micro_batch=k, version=b))
            if not first:
                cmds.append(SendGrad(buffer_id=j, micro_batch=k))
        cmds += [ReduceGrads(batch=b), OptimizerStep(batch=b, src_version=b, dst_version=b + 1)]
    return cmds


_DS_NAMES = {
    "LoadMicroBatch": LoadMicroBatch,
    "ForwardPass": ForwardPass,
    "BackwardPass": BackwardPass,
    "SendActivation": SendActivation,
    "RecvActivation": RecvActivation,
    "SendGrad": SendGrad,
    "RecvGrad": RecvGrad,
}


def from_deepspeed(ds_ticks: Any, micro_batches: int, batch: int = 0) -> list[Instruction]:
    """Translate one batch of a DeepSpeed schedule (e.g. `TrainSchedule`) into our instructions.

    DeepSpeed names only buffers; each kind of instruction visits micro-batches in order on a stage, so the
    n-th instruction of a kind is micro-batch n of the batch. `ReduceTiedGrads` is dropped (no tied layers).
    """
    seen: dict[str, int] = {}
    out: list[Instruction] = []
    for tick in ds_ticks:
        for cmd in tick:
            name = type(cmd).__name__
            if name in _DS_NAMES:
                n = seen.get(name, 0)
                seen[name] = n + 1
                k = batch * micro_batches + n
                extra = {"version": batch} if name in ("ForwardPass", "BackwardPass") else {}
                out.append(_DS_NAMES[name](buffer_id=cmd.buffer_id, micro_batch=k, **extra))
            elif name == "ReduceGrads":
                out.append(ReduceGrads(batch=batch))
            elif name == "OptimizerStep":
                out.append(OptimizerStep(batch=batch, src_version=batch, dst_version=batch + 1))
            elif name != "ReduceTiedGrads":
                raise ValueError(f"no translation for DeepSpeed instruction {cmd!r}")
    return out


def flushed_1f1b_stream(micro_batches: int, stages: int, stage_id: int, batches: int = 1) -> list[Instruction]:
    """DeepSpeed's `TrainSchedule` instruction order without importing DeepSpeed (`train_schedule_stream` is the
    same order translated from DeepSpeed itself; `tests/test_pipe_schedule.py` holds them equal for P <= 8, m <= 12).

    A batch is 2 (m + P - 1) ticks. On stage s, tick t runs the forward of micro-batch (t - s) / 2 when t - s is
    even, the backward of micro-batch (t - 2P + 1 + s) / 2 when it is odd (none outside 0 .. m-1). A tick first
    sends what the previous tick produced (an activation forward, a gradient backward) and receives what its own op
    needs, the receive first when its op is a backward, the send first otherwise; then the first and last stages
    load their micro-batch for a forward; then the op. Blocking communication (no `CommitP2P`); the step follows
    the batch's last tick, on W(b)."""
    _check(micro_batches, stages, stage_id, batches)
    m, P, s = micro_batches, stages, stage_id
    first, last = s == 0, s == P - 1

    def op_at(t: int) -> Optional[tuple[bool, int]]:  # (forward?, micro-batch of the batch)
        forward = (t - s) % 2 == 0
        j = (t - s) // 2 if forward else (t - 2 * P + 1 + s) // 2
        return (forward, j) if 0 <= j < m else None

    cmds: list[Instruction] = []
    for b in range(batches):
        for t in range(2 * (m + P - 1)):
            prev, cur = op_at(t - 1) if t else None, op_at(t)
            send: list[Instruction] = []
            if prev is not None and prev[0] and not last:
                send = [SendActivation(buffer_id=prev[1], micro_batch=b * m + prev[1])]
            elif prev is not None and not prev[0] and not first:
                send = [SendGrad(buffer_id=prev[1], micro_batch=b * m + prev[1])]
            if cur is None:
                cmds += send
                continue
            forward, j = cur
            k = b * m + j
            recv: list[Instruction] = []
            if forward and not first:
                recv = [RecvActivation(buffer_id=j, micro_batch=k)]
            elif not forward and not last:
                recv = [RecvGrad(buffer_id=j, micro_batch=k)]
            cmds += send + recv if forward else recv + send
            if forward:
                cmds += [LoadMicroBatch(buffer_id=j, micro_batch=k)] if first or last else []
                cmds.append(ForwardPass(buffer_id=j, micro_batch=k, version=b))
            else:
                cmds.append(BackwardPass(buffer_id=j, micro_batch=k, version=b))
        cmds += [ReduceGrads(batch=b), OptimizerStep(batch=b, src_version=b, dst_version=b + 1)]
    return cmds


def train_schedule_stream(micro_batches: int, stages: int, stage_id: int, batches: int = 1) -> list[Instruction]:
    """DeepSpeed's own `TrainSchedule` (1F1B with a flush per batch, blocking p2p), ``batches`` times over."""
    _check(micro_batches, stages, stage_id, batches)
    from deepspeed.runtime.pipe.schedule import TrainSchedule  # heavy import, only when asked for

    out: list[Instruction] = []
    for b in range(batches):
        out += from_deepspeed(TrainSchedule(micro_batches, stages, stage_id), micro_batches, batch=b)
    return out


def two_bw_deferred_stream(micro_batches: int, stages: int, stage_id: int, batches: int) -> list[Instruction]:
    """2BW with each optimizer step deferred to the first use of its output (see `TwoBWSchedule`)."""
    return two_bw_stream(micro_batches, stages, stage_id, batches, defer_step=True)


DRAWN_ONLY = {"2bw-deferred": two_bw_deferred_stream, "gpipe": gpipe_stream}  # streams no config runs


def streamed(kind: str = "") -> list[str]:
    """Names `stream` knows: every declared schedule with a stream of its own (`asyncpipe.schedules`), and the
    drawn-only ones; ``kind``, an import path (``pkg.module``), is imported first so its schedule is among them."""
    from asyncpipe.schedules import get, schedules

    if "." in kind:
        get(kind)
    return [s.name for s in schedules() if s.stream or s.ideal] + list(DRAWN_ONLY)


def stream(kind: str, micro_batches: int, stages: int, stage_id: int, batches: int = 1) -> list[Instruction]:
    """A stage's instruction stream by schedule name: a declared schedule's (``2bw``, ``paci``, ``1f1b`` as
    DeepSpeed's, a registered one), ``2bw-deferred`` or ``gpipe``."""
    from asyncpipe.schedules import get

    maker: Optional[Any] = DRAWN_ONLY.get(kind)
    if maker is not None:
        return maker(micro_batches, stages, stage_id, batches)
    if kind not in streamed(kind) and get(kind).name not in streamed():
        raise UserError(f"unknown schedule {kind!r}; choose one of: {', '.join(streamed())}")
    spec = get(kind)
    return flatten((spec.ideal or spec.stream)(micro_batches, stages, stage_id, batches, 0, False))
