"""1F1B with a flush per batch (`pipeline.schedule=1f1b`, delay 0): DeepSpeed's own `TrainSchedule`, run unchanged
by the engine. Stage s runs P-1-s warm-up forwards, then one forward per backward, then drains; the optimizer
steps once per batch on W(b) after every backward of batch b. One weight version."""

from __future__ import annotations

from typing import Optional

from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight, uniform
from asyncpipe.schedules.instructions import (
    BackwardPass,
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
    from_deepspeed,
)
from asyncpipe.schedules.orders import Op, Plan


def flushed_1f1b_stream(micro_batches: int, stages: int, stage_id: int, batches: int = 1) -> list[Instruction]:
    """DeepSpeed's `TrainSchedule` instruction order without importing DeepSpeed (`train_schedule_stream` is the
    same order translated from DeepSpeed itself; `tests/test_pipe_schedule.py` holds them equal for P <= 8, m <= 12).

    A batch is 2 (m + P - 1) ticks. On stage s, tick t runs the forward of micro-batch (t - s) / 2 when t - s is
    even, the backward of micro-batch (t - 2P + 1 + s) / 2 when it is odd (none outside 0 .. m-1). A tick first
    sends what the previous tick produced (an activation forward, a gradient backward) and receives what its own op
    needs, the receive first when its op is a backward, the send first otherwise; then the first and last stages
    load their micro-batch for a forward; then the op. Blocking communication (no `CommitP2P`); the step follows
    the batch's last tick, on W(b)."""
    check_stream(micro_batches, stages, stage_id, batches)
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
    check_stream(micro_batches, stages, stage_id, batches)
    from deepspeed.runtime.pipe.schedule import TrainSchedule  # heavy import, only when asked for

    out: list[Instruction] = []
    for b in range(batches):
        out += from_deepspeed(TrainSchedule(micro_batches, stages, stage_id), micro_batches, batch=b)
    return out


def one_f_one_b(stages: int, micro_batches: int) -> Plan:
    """1F1B's one-batch order: each rank's forwards and backwards in its flushed stream's order."""
    ranks = []
    for r in range(stages):
        stream = flushed_1f1b_stream(micro_batches, stages, r)
        passes = [cmd for cmd in stream if isinstance(cmd, (ForwardPass, BackwardPass))]
        ranks.append([Op("F" if isinstance(cmd, ForwardPass) else "B", r, cmd.micro_batch) for cmd in passes])
    return Plan("1f1b", stages, micro_batches, list(range(stages)), ranks)


def _ideal(m: int, P: int, stage: int, batches: int, start: int = 0, defer_step: bool = False) -> list:
    return [flushed_1f1b_stream(m, P, stage, batches)]  # TrainSchedule's order, without DeepSpeed


SPEC = declare_schedule(
    ScheduleSpec(
        name="1f1b",
        note="synchronous 1F1B with a flush per batch (DeepSpeed's TrainSchedule)",
        versions=uniform(0),
        weight_versions=lambda P, s: 1,
        in_flight=one_f_one_b_in_flight,
        stream=None,
        ideal=_ideal,
        order=one_f_one_b,
        delay=0,
        bubble_note="(P-1)/(m+P-1)",
        label="1F1B",
        stage_delay=lambda P, s, delay: 0,
    )
)
