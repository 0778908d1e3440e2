"""PyTorch's own pipeline schedules as `bench pipeline` variants (``pt_*``): each runs `pipeline.torch_schedule`
(`asyncpipe.engines.pipeline.torch_engine`) on the same model, cut, micro-batches, data and optimizer as DeepSpeed's
engine, in the same launch. Here: the variants, why one cannot run a configuration (its constraints in torch, or
ours), its ideal bubble from its own action order, and each rank's layers (for optimizer memory)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe.timelines.torch_orders import ideal_bubble, problem, rank_layers
from asyncpipe.torch_schedules import SCHEDULES

PREFIX = "pt_"
VARIANTS = {PREFIX + name: ["delay=0", f"pipeline.torch_schedule={name}"] for name in SCHEDULES}


def is_torch(variant: str) -> bool:
    return variant.split("+")[0] in VARIANTS


def label(variant: str) -> str:
    """The schedule a variant runs, as a reader knows it: "PyTorch ScheduleZBVZeroBubble"."""
    return f"PyTorch {SCHEDULES[variant.split('+')[0][len(PREFIX) :]].cls}"


def skip_reasons(
    variants: Sequence[str],
    base: list[str],
    compose: Callable[[list[str]], DictConfig],
    P: int,
    m: int,
    modes: Sequence[str],
) -> dict[str, str]:
    """variant -> one line saying why it cannot run here (torch's own refusal at this P and m, or a constraint of
    this configuration), for every ``pt_*`` variant asked for that cannot; never skipped silently."""
    from asyncpipe.errors import UserError

    out = {}
    for name in (v for v in variants if v in VARIANTS):
        why = problem(SCHEDULES[name[len(PREFIX) :]], P, m)
        if why is None:
            for mode in modes:
                try:
                    compose([*base, *VARIANTS[name], f"train.compile={mode == 'compiled'}"])
                except UserError as err:
                    why = f"not run{' compiled' if mode == 'compiled' else ''}: {err}"
                    break
        if why is not None:
            out[name] = why
    return out


def analytic_bubble(variant: str, P: int, m: int, backward_over_forward: float) -> Optional[float]:
    """The schedule's ideal bubble: its own `pipeline_order` replayed with free communication (B = input and
    weight gradient halves where the schedule splits them), at the measured backward/forward cost ratio."""
    return ideal_bubble(SCHEDULES[variant.split("+")[0][len(PREFIX) :]], P, m, backward_over_forward)


def layers_of(cfg: DictConfig, rank: int) -> list[int]:
    """The layer indices a ``pt_*`` variant's rank ``rank`` holds (both chunks for a two-chunk schedule)."""
    s = SCHEDULES[cfg.pipeline.torch_schedule]
    return rank_layers(s, cfg.model.n_layer + 2, cfg.pipeline.stages, rank)
