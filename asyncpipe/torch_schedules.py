"""PyTorch's own pipeline schedules (`torch.distributed.pipelining`) as `pipeline.torch_schedule` values: which
class each name runs, how many model chunks a rank holds and where they sit, and what in a config one cannot run.
Torch-free (`config` validates with it), with the layer cut (`chunk_layers`); the orders and ideal bubbles are
`asyncpipe.timelines.torch_orders`, the engine `asyncpipe.engines.pipeline.torch_engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class TorchSchedule:
    name: str  # pipeline.torch_schedule value
    cls: str  # class in torch.distributed.pipelining.schedules
    chunks: int  # model chunks (torch "stages") per rank
    placement: str  # "loop": rank r holds chunks r, r+P, ...; "v": rank r holds chunks r and 2P-1-r
    split_backward: bool  # input and weight gradients as separate actions (zero bubble)


SCHEDULES = {
    s.name: s
    for s in (
        TorchSchedule("1f1b", "Schedule1F1B", 1, "loop", False),
        TorchSchedule("interleaved1f1b", "ScheduleInterleaved1F1B", 2, "loop", False),
        TorchSchedule("loopedbfs", "ScheduleLoopedBFS", 2, "loop", False),
        TorchSchedule("interleavedzb", "ScheduleInterleavedZeroBubble", 2, "loop", True),
        TorchSchedule("zbv", "ScheduleZBVZeroBubble", 2, "v", True),
        TorchSchedule("dualpipev", "ScheduleDualPipeV", 2, "v", True),
    )
}


def spec(name: str) -> TorchSchedule:
    from asyncpipe.errors import ConfigError

    if name not in SCHEDULES:
        raise ConfigError(f"pipeline.torch_schedule={name} is not allowed; choose one of: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def rank_chunks(s: TorchSchedule, stages: int, rank: int) -> list[int]:
    """The chunk (torch stage) indices rank ``rank`` holds, in the order its stages are built."""
    if s.placement == "v":
        return [rank, 2 * stages - 1 - rank]
    return [rank + k * stages for k in range(s.chunks)]


def config_problem(cfg: Any) -> Optional[str]:
    """What in ``cfg`` a torch schedule cannot run (torch-free checks; None: fine). One line."""
    p, t, m = cfg.pipeline, cfg.train, cfg.model
    s = spec(p.torch_schedule)
    if cfg.engine != "pipeline":
        return f"pipeline.torch_schedule={s.name} runs on engine=pipeline, got engine={cfg.engine}"
    if cfg.delay != 0:
        return f"pipeline.torch_schedule={s.name} is synchronous; use it with delay=0, got delay={cfg.delay}"
    if p.schedule not in ("auto", "1f1b"):
        return f"pipeline.torch_schedule={s.name} replaces pipeline.schedule; leave it auto, got {p.schedule}"
    if p.data_parallel != 1:
        return (
            f"pipeline.torch_schedule={s.name} runs one replica here (pipeline.data_parallel=1), got {p.data_parallel}"
        )
    if cfg.compensation.name != "none":
        return f"pipeline.torch_schedule={s.name} has no stale weights to compensate; use compensation=none (no EF)"
    if m.moe.experts:
        return f"pipeline.torch_schedule={s.name} runs dense models here; model '{m.name}' has experts"
    if s.chunks * p.stages > m.n_layer:
        return (
            f"PyTorch's {s.cls} cuts the model into {s.chunks} x {p.stages} chunks of at least one block; "
            f"model '{m.name}' has {m.n_layer} blocks"
        )
    if m.tie_embeddings and s.split_backward and p.stages > 1:  # measured: ZBV gets the tied gradient wrong
        return (
            f"pipeline.torch_schedule={s.name} splits its backward, which a tied matrix does not survive "
            f"(engines.pipeline.tied); add model.tie_embeddings=false"
        )
    if t.compile in (True, "true") and s.split_backward:
        return f"PyTorch's {s.cls} splits input and weight gradients, which it refuses under torch.compile"
    return None


def chunk_layers(
    s: TorchSchedule, n_layers_total: int, stages: int, blocks: Optional[list[int]] = None
) -> list[list[int]]:
    """Layer indices of each chunk: ``[Embedding, Block x n, Head]`` cut into P x chunks pieces where
    `asyncpipe.partition` cuts them (``blocks`` per chunk: `partition.cut_blocks`, the run's `pipeline.cut`; one
    chunk per rank: exactly DeepSpeed's stages)."""
    from asyncpipe.partition import partition

    parts = partition(n_layers_total, stages * s.chunks, blocks)
    return [list(range(parts[c], parts[c + 1])) for c in range(stages * s.chunks)]
