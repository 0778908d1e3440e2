"""DeepSpeed-side setup of one pipeline rank (its comm: `asyncpipe.runtime.setup.init_deepspeed_comm`): a `PipelineModule`
cut exactly where `asyncpipe.model.partition` cuts, the DeepSpeed config of an `engine=pipeline` run and the
engine's own settings beside it (`PipeSettings`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from deepspeed.runtime.pipe.module import PipelineModule

from asyncpipe.lr_schedule import LRSchedule


class StagedModule(PipelineModule):
    """A `PipelineModule` cut at exactly the boundaries ``parts`` (from `asyncpipe.model.partition`)."""

    def __init__(self, layers: list, parts: list[int], topology: Any, loss_fn: Any) -> None:
        object.__setattr__(self, "_fixed_parts", list(parts))  # read by _partition_layers inside super().__init__
        super().__init__(layers, topology=topology, loss_fn=loss_fn, partition_method="asyncpipe")

    def _partition_layers(self, method: str = "asyncpipe") -> None:
        self.parts = list(self._fixed_parts)
        if len(self.parts) != self.num_stages + 1:
            raise ValueError(f"{len(self.parts) - 1} partitions for {self.num_stages} stages")
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def deepspeed_config(micro_batch_size: int, micro_batches: int, replicas: int, bf16: bool) -> dict[str, Any]:
    """Batch geometry only: clipping, the lr schedule and the optimizer are ours (client fp32 optimizer);
    bf16 is torch autocast over fp32 weights, never DeepSpeed's bf16 optimizer (it flattens parameters)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batch_size * micro_batches * replicas,
        "steps_per_print": 10**12,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
    }
    if bf16:
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return config


@dataclass
class PipeSettings:
    """What the engine needs beyond DeepSpeed's config: the schedule, the run length and the update rule."""

    schedule: str  # a declared schedule's name (`asyncpipe.schedules`): 1f1b, 2bw, paci, dualpipev, ...
    total_steps: int
    max_norm: float  # train.grad_clip (0 = off)
    lr_schedule: LRSchedule  # the run's lr multiplier per step (train.lr_schedule)
    clip: str = "global"  # global: norm over all stages; stage: each stage its own
    defer_step: Optional[bool] = None  # None: defer when a cross-stage norm is needed (2BW only)
    trace: bool = False  # record (instruction, micro-batch, start, end) per instruction
    # Stand-in compute (pipeline.standin): seconds each forward / backward of a stage's micro-batch lasts at least,
    # its real op padded by a wait (a V's chunks half each; a recomputed forward adds the forward's): known compute.
    standin: tuple[float, ...] = (0.0, 0.0)  # (F, B) per stage, or per chunk held (`standin.stage_standin`)
    tied: bool = False  # a tied embedding split over stage 0 and stage P-1: sum its two copies' gradients (`tied`)
