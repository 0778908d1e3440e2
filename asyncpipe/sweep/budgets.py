"""Budget families (a sweep file's `budgets:`): the rungs of one grid point and variant, the longest trained from
step 0 and the others as cooldown branches from its wsd stable phase (`asyncpipe.sweep.expand.rungs`). What a
family costs that way against separate runs, in optimizer steps and in run-equivalents of its 1x rung. Never
imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from asyncpipe.lr_schedule import LRSchedule
from asyncpipe.sweep.expand import SweepPlan


def trained_steps(cfg: Any) -> int:
    """The optimizer steps a run trains itself: all of them, or a branch's decay (it starts at its decay start)."""
    if cfg.run.get("branch_from") is not None:
        return LRSchedule.of(cfg.train).decay_steps
    return int(cfg.train.steps)


@dataclass
class FamilyCost:
    trunk: str  # the family's longest rung (run name)
    budgets: list[float]  # the rungs, as multiples of train.steps
    steps: list[int]  # each rung's train.steps
    trained: list[int]  # the steps each rung trains itself (the longest: all; a branch: its decay)

    @property
    def unit(self) -> float:
        """The 1x run's steps (a run-equivalent)."""
        return self.steps[0] / self.budgets[0]

    @property
    def branched(self) -> float:
        return sum(self.trained) / self.unit

    @property
    def separate(self) -> float:
        return sum(self.steps) / self.unit

    @property
    def longest(self) -> float:
        return max(self.steps) / self.unit


def family_costs(plan: SweepPlan, cfgs: dict[str, Any]) -> list[FamilyCost]:
    """One `FamilyCost` per budget family of the plan (none without `budgets:`)."""
    families: dict[str, list] = {}
    for spec in plan.runs:
        if spec.budget is not None:
            families.setdefault(spec.parent or spec.name, []).append(spec)
    out = []
    for trunk, specs in families.items():
        specs = sorted(specs, key=lambda s: s.budget)
        out.append(FamilyCost(trunk, [s.budget for s in specs], [int(cfgs[s.name].train.steps) for s in specs],
                              [trained_steps(cfgs[s.name]) for s in specs]))  # fmt: skip
    return out


def render_costs(costs: Sequence[FamilyCost]) -> str:
    """One line per distinct family shape: the cost from one run and its branches next to separate runs."""
    lines = []
    shapes: dict[tuple, list[FamilyCost]] = {}
    for c in costs:
        shapes.setdefault((tuple(c.budgets), tuple(c.steps), tuple(c.trained)), []).append(c)
    for (budgets, steps, _), group in shapes.items():
        c = group[0]
        rungs = ", ".join(f"{b:g}" for b in budgets)
        lines.append(
            f"budgets {rungs} (1x = {c.unit:g} steps), {len(group)} famil{'y' if len(group) == 1 else 'ies'}: each "
            f"{c.branched:.2f} run-equivalents as one run and its cooldown branches, {c.separate:.2f} as separate "
            f"runs ({c.branched / c.longest:.2f}x its longest rung alone, against {c.separate / c.longest:.2f}x)"
        )
    return "\n".join(lines)
