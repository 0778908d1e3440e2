"""DualPipeV's per-rank instruction stream (DeepSpeed's `DualPipeVSchedule` ticks), written out torch-free in our
vocabulary (`asyncpipe.schedules.instructions`), for the cost model's replay (`timelines.timeline.simulate`). The
engine still runs DeepSpeed's own schedule; `dualpipev_stream_from_deepspeed` translates that one for the tests.

A rank's batch is DualPipeV's eight steps as rounds, each a pattern of tokens: ``F0``/``B0`` the
forward/backward of its phase-0 chunk (chunk r, activations towards the last rank), ``F1``/``B1`` of its phase-1
chunk (chunk 2P-1-r, back towards rank 0); ``a``/``g`` + phase receive an activation/gradient, ``A``/``G`` + phase
send one; ``C`` posts everything queued since the last one (`CommitP2P`). A send or receive to a rank that does not
exist (rank 0's phase-0 inputs, the last rank's turn-around from chunk P-1 to chunk P) is dropped. Rank 0 loads
each micro-batch before its phase-0 forward."""

from __future__ import annotations

from typing import Any, Iterator

from asyncpipe.errors import UserError
from asyncpipe.schedules.instructions import (
    DEEPSPEED_NAMES,
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
    from_deepspeed_other,
)

_TOKENS = {
    "F": ForwardPass,
    "B": BackwardPass,
    "a": RecvActivation,
    "g": RecvGrad,
    "A": SendActivation,
    "G": SendGrad,
}
# Each kind and phase a counter of its own: the n-th of them on a rank is micro-batch n of the batch.
_COUNTED = tuple(f"{kind}{phase}" for kind in _TOKENS for phase in (0, 1))


def _rounds(P: int, m: int, r: int) -> list[tuple[int, str]]:
    """Rank r's batch as (repeats, tokens of one round). a = P-1-r ranks after it, b = r+1 up to and including it.
    The warm-up's second round receives its next phase-0 input one round ahead; the last rank holds its final
    warm-up phase-1 send (``A1``) until after the first forward of the main rounds, which then commits alone."""
    a, b = P - 1 - r, r + 1
    last = r == P - 1
    warm = "C F0 a0 a1 C F1 A1 A0"
    first_main = "C F0 A1 g1 C B1 A0 G1" if last else "g1 C F0 B1 A0 G1"
    pair1 = "a1 g0 C F1 B0 A1 G0"  # the phase-1 forward overlapped with a phase-0 backward
    return [
        (2 * a, "a0 C F0 A0"),
        (1, "a0"),
        (b - 1, warm),
        (1, warm.replace(" A1", "") if last else warm),
        (a, "g1 C B1 G1 a1 C C F1 A1"),  # the second commit stands where the reference runs a deferred W
        (1, f"{first_main} {pair1}"),
        (m - 2 * P + b - 1, f"a0 g1 C F0 B1 A0 G1 {pair1}"),
        (a, f"g1 C B1 G1 {pair1}"),
        (b, "g1 C B1 G1 g0 C B0 G0"),
        (a, "C g0 C B0 G0"),
        (b, "C"),  # the reference's deferred weight gradients: only their commits
    ]


def _exists(token: str, P: int, r: int) -> bool:
    """Whether a send or receive has a partner rank: phase 0 flows r -> r+1, phase 1 r -> r-1 (gradients back)."""
    kind, phase = token[0], int(token[1])
    if kind in "FB":
        return True
    towards_next = (kind in "Ag") == (phase == 0)  # sends an activation to, or receives a gradient from, r+1
    return r < P - 1 if towards_next else r > 0


def dualpipev_stream(
    micro_batches: int, stages: int, stage_id: int, batches: int = 1, start: int = 0, defer_step: bool = False
) -> Iterator[list[Instruction]]:
    """Rank ``stage_id``'s instruction stream for ``batches`` batches of DualPipeV, one tick per batch: the passes
    carry ``phase``, their model ``chunk``, ``micro_batch`` (numbered over the run) and ``version`` (batch b reads
    W(b)); sends and receives carry ``phase``; every batch ends with a commit, `ReduceGrads` and `OptimizerStep`.
    ``start``: the first batch's number; ``defer_step`` does not apply (one weight version, a flush per batch)."""
    check_stream(micro_batches, stages, stage_id, batches)
    P, m, r = stages, micro_batches, stage_id
    if m < 2 * P:
        raise UserError(f"dualpipev needs micro-batches >= 2 x stages (got m={m}, P={P})")
    chunk = (r, 2 * P - 1 - r)
    tokens = [t for n, pattern in _rounds(P, m, r) for _ in range(n) for t in pattern.split()]
    tokens = [t for t in tokens if t == "C" or _exists(t, P, r)]
    for b in range(start, start + batches):
        seen = dict.fromkeys(_COUNTED, 0)
        tick: list[Instruction] = []
        for t in tokens:
            if t == "C":
                tick.append(CommitP2P())
                continue
            phase, n = int(t[1]), seen[t]
            seen[t] = n + 1
            args: dict[str, Any] = {"buffer_id": phase * m + n, "micro_batch": b * m + n}
            if t[0] in "FB":
                if t == "F0" and r == 0:
                    tick.append(LoadMicroBatch(**args, phase=0, chunk=chunk[0]))
                tick.append(_TOKENS[t[0]](**args, version=b, phase=phase, chunk=chunk[phase]))
            else:
                tick.append(_TOKENS[t[0]](**args, phase=phase))
        tick += [CommitP2P(), ReduceGrads(batch=b), OptimizerStep(batch=b, src_version=b, dst_version=b + 1)]
        yield tick


def dualpipev_stream_from_deepspeed(micro_batches: int, stages: int, stage_id: int, batches: int = 1) -> list:
    """DeepSpeed's own `DualPipeVSchedule` ticks for rank ``stage_id``, ``batches`` times over, translated into our
    instructions as `dualpipev_stream` writes them (imports DeepSpeed: for the tests). DeepSpeed names a buffer
    ``phase * m + n``: n is the micro-batch; `ReduceTiedGrads` is dropped (as `instructions.from_deepspeed` does)."""
    from deepspeed.runtime.pipe.schedule import DualPipeVSchedule

    P, m, r = stages, micro_batches, stage_id
    chunk = (r, 2 * P - 1 - r)
    out: list[Instruction] = []
    for b in range(batches):
        for tick in DualPipeVSchedule(micro_batches=m, stages=P, stage_id=r):
            for cmd in tick:
                name = type(cmd).__name__
                if name in DEEPSPEED_NAMES:
                    phase = cmd.kwargs.get("phase", 0)
                    args: dict[str, Any] = {"buffer_id": cmd.buffer_id, "micro_batch": b * m + cmd.buffer_id % m}
                    if name in ("ForwardPass", "BackwardPass"):
                        args["version"] = b
                    if name in ("LoadMicroBatch", "ForwardPass", "BackwardPass"):
                        args["chunk"] = chunk[phase]
                    out.append(DEEPSPEED_NAMES[name](**args, phase=phase))
                else:
                    out += from_deepspeed_other(cmd, b)
    return out
