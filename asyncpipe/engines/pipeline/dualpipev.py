"""DeepSpeed's DualPipeV under our run loop (`pipeline.schedule=dualpipev`): the strongest synchronous baseline.

`DualPipeVModule` cuts the model into 2P chunks at `asyncpipe.model.partition`'s boundaries (rank r holds chunk r
and chunk 2P-1-r, so rank 0 holds the embedding and the loss); `DualPipeVRunEngine` runs DeepSpeed's
`DualPipeVSchedule` and DualPipeV handlers unchanged, and ends each batch with our `ReduceGrads` /
`OptimizerStep` (clipping over all chunks, the lr schedule, `asyncpipe.optim`), so the update is the one
1F1B and the simulator apply and only the schedule differs. Synchronous: one weight version, delay 0.
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.pipe import dualpipev as ds_dualpipev
from deepspeed.runtime.pipe import schedule as ds_schedule

from asyncpipe.engines.pipeline.deepspeed_engine import ScheduledPipelineEngine


class DualPipeVModule(ds_dualpipev.DualPipeVModule):
    """DeepSpeed's V-shaped module cut exactly at ``parts`` (2P+1 boundaries from `asyncpipe.model.partition`)."""

    def __init__(self, layers: list, parts: list[int], topology: Any, loss_fn: Any) -> None:
        object.__setattr__(self, "_fixed_parts", list(parts))  # read by _partition_layers inside super().__init__
        super().__init__(layers, topology=topology, loss_fn=loss_fn, partition_method="asyncpipe")

    def _partition_layers(self, method: str = "asyncpipe") -> None:
        self.num_stages *= 2  # as DeepSpeed's: 2P chunks
        self.parts = list(self._fixed_parts)
        if len(self.parts) != self.num_stages + 1:
            raise ValueError(f"{len(self.parts) - 1} partitions for {self.num_stages} chunks")
        rank = self._topo.get_coord(self.global_rank).pipe
        mirror = self.num_stages - 1 - rank
        self._set_bounds(start=self.parts[rank], stop=self.parts[rank + 1])
        self.phase_bounds = [(self.parts[rank], self.parts[rank + 1]), (self.parts[mirror], self.parts[mirror + 1])]


class DualPipeVRunEngine(ScheduledPipelineEngine, ds_dualpipev.DualPipeVEngine):
    """`ScheduledPipelineEngine` at delay 0 whose training and evaluation schedules are DeepSpeed's DualPipeV.

    The MRO puts DeepSpeed's DualPipeV methods (schedules, phases, loss stage = rank 0) under our run-loop API
    (`train_batch`, `evaluate`, metrics, instruction timing); the instruction map takes DualPipeV's handlers for
    compute and communication and ours for the end of a batch."""

    def _phase1_buffer(self, buffer_id: int) -> int:
        """The phase-1 slot of the micro-batch in phase-0 slot ``buffer_id``. DeepSpeed's offsets by the training
        micro-batch count, which overruns the buffers of an evaluation with another count; half the reserved
        buffers is right for both (`evaluate` reserves 2 x its own count)."""
        return buffer_id + self.num_pipe_buffers // 2

    _INSTRUCTION_MAP = {
        **ScheduledPipelineEngine._INSTRUCTION_MAP,
        **{
            k: v
            for k, v in ds_dualpipev.DualPipeVEngine._INSTRUCTION_MAP.items()
            if k not in (ds_schedule.ReduceGrads, ds_schedule.OptimizerStep, ds_schedule.ReduceTiedGrads)
        },
    }
