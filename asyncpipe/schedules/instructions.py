"""The instruction vocabulary every schedule's stream is written in, in the spirit of DeepSpeed's
`runtime/pipe/schedule.py`: tiny instruction classes, one list per tick. Pure Python: no torch, no deepspeed.
`from_deepspeed` translates a DeepSpeed schedule's ticks into them (the tests hold our orders to DeepSpeed's)."""

from __future__ import annotations

from typing import Any


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
    """Forward of ``micro_batch`` (in ``buffer_id``) on weight ``version``.

    A pass of a one-batch order (`asyncpipe.schedules.orders.plan_streams`) names its model ``chunk`` and ``needs``, the
    ops whose results it reads (`orders.Op`): it starts once they are done, with no send or receive between."""


class BackwardPass(Instruction):
    """Backward of ``micro_batch``; gradients accumulate on the same weight ``version`` its forward used. In a
    one-batch order that splits the backward, the input gradient only (a `WeightPass` follows)."""


class WeightPass(Instruction):
    """The weight gradient of ``micro_batch`` on ``chunk``, split off its backward (zero-bubble orders)."""


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


def check_stream(micro_batches: int, stages: int, stage_id: int, batches: int) -> None:
    """A stream's arguments: a stage of the pipeline, at least one micro-batch and one batch."""
    if stages < 1 or not 0 <= stage_id < stages:
        raise ValueError(f"stage_id {stage_id} is not a stage of a {stages}-stage pipeline")
    if micro_batches < 1 or batches < 1:
        raise ValueError(f"need micro_batches >= 1 and batches >= 1, got {micro_batches}, {batches}")


def flatten(ticks: Any) -> list[Instruction]:
    """One flat instruction list from ticks (lists of instructions)."""
    return [cmd for tick in ticks for cmd in tick]


DEEPSPEED_NAMES = {  # DeepSpeed's instruction names with one of ours (the translators)
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
            if name in DEEPSPEED_NAMES:
                n = seen.get(name, 0)
                seen[name] = n + 1
                k = batch * micro_batches + n
                extra = {"version": batch} if name in ("ForwardPass", "BackwardPass") else {}
                out.append(DEEPSPEED_NAMES[name](buffer_id=cmd.buffer_id, micro_batch=k, **extra))
            else:
                out += from_deepspeed_other(cmd, batch)
    return out


def from_deepspeed_other(cmd: Any, batch: int) -> list[Instruction]:
    """A DeepSpeed instruction that names no buffer, in batch ``batch``: its commit, gradient reduction and step
    as ours; `ReduceTiedGrads` dropped (no tied layers); anything else a `ValueError`."""
    name = type(cmd).__name__
    made = {
        "CommitP2P": lambda: [CommitP2P()],
        "ReduceGrads": lambda: [ReduceGrads(batch=batch)],
        "OptimizerStep": lambda: [OptimizerStep(batch=batch, src_version=batch, dst_version=batch + 1)],
        "ReduceTiedGrads": lambda: [],
    }
    if name not in made:
        raise ValueError(f"no translation for DeepSpeed instruction {cmd!r}")
    return made[name]()
