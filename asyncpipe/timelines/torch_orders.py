"""The layer cut, action orders and ideal bubbles of PyTorch's own pipeline schedules (`asyncpipe.torch_schedules`):
the layers of each rank (`asyncpipe.torch_schedules.chunk_layers`), why torch refuses
a P and m (its own message, from building the schedule's `pipeline_order` on stub stages), and the ideal bubble of
that order replayed by data dependencies (`asyncpipe.timelines.orders.replay`). Imports torch only when called.
"""

from __future__ import annotations

from typing import Any, Optional

from asyncpipe.torch_schedules import TorchSchedule, chunk_layers, rank_chunks


def rank_layers(s: TorchSchedule, n_layers_total: int, stages: int, rank: int) -> list[int]:
    per_chunk = chunk_layers(s, n_layers_total, stages)
    return sorted(i for c in rank_chunks(s, stages, rank) for i in per_chunk[c])


def _stub_stages(s: TorchSchedule, stages: int) -> list[Any]:
    from types import SimpleNamespace

    n = stages * s.chunks
    return [
        SimpleNamespace(
            num_stages=n,
            group_size=stages,
            group_rank=0,
            stage_index=c,
            submod=None,
            is_first=c == 0,
            is_last=c == n - 1,
        )
        for c in rank_chunks(s, stages, 0)
    ]


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
    """The schedule's order as an `asyncpipe.timelines.orders.Plan` (B split into input gradient B and weight
    gradient W; a full backward is B then W at once; an overlapped F;B pair runs one after the other, as one
    CPU core does), for `asyncpipe.timelines.orders.replay`."""
    from asyncpipe.schedules.onef1b import one_f_one_b
    from asyncpipe.schedules.orders import Op, Plan

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
                ops += {
                    "F": [Op("F", c, k)],
                    "I": [Op("B", c, k)],
                    "W": [Op("W", c, k)],
                    "B": [Op("B", c, k), Op("W", c, k)],
                }.get(kind, [])
        ranks.append(ops)
    return Plan(f"torch-{s.name}", stages, micro_batches, chunk_rank, ranks, split_backward=True)


def ideal_bubble(s: TorchSchedule, stages: int, micro_batches: int, backward_over_forward: float) -> float:
    """Idle fraction of the most idle rank over one batch of the schedule's own order, communication free."""
    from asyncpipe.timelines.orders import replay

    tl = replay(ideal_plan(s, stages, micro_batches), 1.0, backward_over_forward)
    return max(tl.idle_fraction)
