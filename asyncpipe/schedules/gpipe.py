"""GPipe (drawn only, no config runs it): all forwards of a batch, then all backwards (last first), then the step.
The baseline `asyncpipe schedule` draws beside the engine's streams."""

from __future__ import annotations

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
)


def gpipe_stream(micro_batches: int, stages: int, stage_id: int, batches: int = 1) -> list[Instruction]:
    """GPipe with a flush per batch: all forwards, then all backwards (last first), then the step.

    Blocking communication (no `CommitP2P`), like DeepSpeed's engine; delay 0, so batch b runs on W(b).
    """
    check_stream(micro_batches, stages, stage_id, batches)
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
