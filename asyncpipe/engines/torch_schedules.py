"""PyTorch's own pipeline schedules (`torch.distributed.pipelining`) as `pipeline.torch_schedule` values: which
class each name runs, how many model chunks a rank holds and where they sit, the layers of each rank's chunks
(the same `asyncpipe.model.partition` cut as DeepSpeed's engine), why a schedule cannot run a configuration, and
its ideal bubble replayed from its own per-rank action order (`pipeline_order`) by data dependencies.

Torch-free at import (`config` reads the names); `problem` and `ideal_plan` import torch when called.
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


SCHEDULES = {s.name: s for s in (
    TorchSchedule("1f1b", "Schedule1F1B", 1, "loop", False),
    TorchSchedule("interleaved1f1b", "ScheduleInterleaved1F1B", 2, "loop", False),
    TorchSchedule("loopedbfs", "ScheduleLoopedBFS", 2, "loop", False),
    TorchSchedule("interleavedzb", "ScheduleInterleavedZeroBubble", 2, "loop", True),
    TorchSchedule("zbv", "ScheduleZBVZeroBubble", 2, "v", True),
    TorchSchedule("dualpipev", "ScheduleDualPipeV", 2, "v", True),
)}  # fmt: skip


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


def chunk_layers(s: TorchSchedule, n_layers_total: int, stages: int) -> list[list[int]]:
    """Layer indices of each chunk: ``[Embedding, Block x n, Head]`` cut into P x chunks pieces where
    `asyncpipe.model.partition` cuts them (one chunk per rank: exactly DeepSpeed's stages)."""
    from asyncpipe.model.partition import partition

    parts = partition(n_layers_total, stages * s.chunks)
    return [list(range(parts[c], parts[c + 1])) for c in range(stages * s.chunks)]


def rank_layers(s: TorchSchedule, n_layers_total: int, stages: int, rank: int) -> list[int]:
    per_chunk = chunk_layers(s, n_layers_total, stages)
    return sorted(i for c in rank_chunks(s, stages, rank) for i in per_chunk[c])


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
        return f"pipeline.torch_schedule={s.name} runs one replica here (pipeline.data_parallel=1), got {p.data_parallel}"
    if cfg.optimizer.ef.enabled or cfg.compensation.name != "none":
        return f"pipeline.torch_schedule={s.name} has no stale weights to compensate; use compensation=none without EF"
    if m.moe.experts:
        return f"pipeline.torch_schedule={s.name} runs dense models here; model '{m.name}' has experts"
    if s.chunks * p.stages > m.n_layer:
        return (f"PyTorch's {s.cls} cuts the model into {s.chunks} x {p.stages} chunks of at least one block; "
                f"model '{m.name}' has {m.n_layer} blocks")  # fmt: skip
    if t.compile in (True, "true") and s.split_backward:
        return f"PyTorch's {s.cls} splits input and weight gradients, which it refuses under torch.compile"
    return None


def _stub_stages(s: TorchSchedule, stages: int) -> list[Any]:
    from types import SimpleNamespace

    n = stages * s.chunks
    return [SimpleNamespace(num_stages=n, group_size=stages, group_rank=0, stage_index=c, submod=None,
                            is_first=c == 0, is_last=c == n - 1) for c in rank_chunks(s, stages, 0)]  # fmt: skip


def build_order(s: TorchSchedule, stages: int, micro_batches: int) -> Optional[dict[int, list]]:
    """The schedule's per-rank action order as torch computes it (None for a single-chunk schedule, which has
    none: `Schedule1F1B` runs DeepSpeed's 1F1B order). Raises torch's own ValueError where P and m do not fit."""
    import torch.distributed.pipelining.schedules as ts

    cls = getattr(ts, s.cls)
    if s.chunks == 1:
        return None
    sched = cls(_stub_stages(s, stages), micro_batches, loss_fn=lambda out, target: out)
    return {r: [a for a in ops if a is not None] for r, ops in sched.pipeline_order.items()}


def problem(s: TorchSchedule, stages: int, micro_batches: int) -> Optional[str]:
    """Why torch refuses this P and m (its own message), or None."""
    try:
        build_order(s, stages, micro_batches)
    except (ValueError, RuntimeError, AssertionError) as err:
        return f"PyTorch's {s.cls} refuses P={stages}, m={micro_batches}: {err}"
    return None


def ideal_plan(s: TorchSchedule, stages: int, micro_batches: int) -> Any:
    """The schedule's order as an `asyncpipe.pipe.orders.Plan` (B split into input gradient B and weight
    gradient W; a full backward is B then W at once; an overlapped F;B pair runs one after the other, as one
    CPU core does), for `asyncpipe.pipe.orders.replay`."""
    from asyncpipe.pipe.orders import Op, Plan, one_f_one_b

    order = build_order(s, stages, micro_batches)
    if order is None:
        return one_f_one_b(stages, micro_batches)
    n = stages * s.chunks
    chunk_rank = [0] * n
    ranks: list[list[Op]] = []
    for r in range(stages):
        ops: list[Op] = []
        for action in order[r]:
            for a in getattr(action, "sub_actions", None) or [action]:
                kind, c, k = a.computation_type.value, a.stage_index, a.microbatch_index
                chunk_rank[c] = r
                ops += {"F": [Op("F", c, k)], "I": [Op("B", c, k)], "W": [Op("W", c, k)],
                        "B": [Op("B", c, k), Op("W", c, k)]}.get(kind, [])  # fmt: skip
        ranks.append(ops)
    return Plan(f"torch-{s.name}", stages, micro_batches, chunk_rank, ranks, split_backward=True)


def ideal_bubble(s: TorchSchedule, stages: int, micro_batches: int, backward_over_forward: float) -> float:
    """Idle fraction of the most idle rank over one batch of the schedule's own order, communication free."""
    from asyncpipe.pipe.orders import replay

    tl = replay(ideal_plan(s, stages, micro_batches), 1.0, backward_over_forward)
    return max(tl.idle_fraction)
