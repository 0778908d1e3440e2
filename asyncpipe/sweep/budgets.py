"""Budget families (a sweep file's `budgets:`): the rungs of one grid point and variant, the longest trained from
step 0 and the others as cooldown branches from its wsd stable phase (`asyncpipe.sweep.expand.rungs`). What a
family costs that way against separate runs, in optimizer steps and in run-equivalents of its 1x rung. Never
imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from asyncpipe.lr_schedule import LRSchedule
from asyncpipe.status import COMPLETED
from asyncpipe.sweep.expand import SweepPlan
from asyncpipe.sweep.state import FINAL, file_state, retire
from asyncpipe.track.lock import DirLock


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
        out.append(
            FamilyCost(
                trunk,
                [s.budget for s in specs],
                [int(cfgs[s.name].train.steps) for s in specs],
                [trained_steps(cfgs[s.name]) for s in specs],
            )
        )
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


def _has_checkpoint_at_most(run_dir: Path, step: int) -> bool:
    """A marked checkpoint (`runtime.checkpoint`'s layout, read here without torch) at ``step`` or earlier."""
    for marker in run_dir.glob("checkpoints/step_*/COMPLETE"):
        number = marker.parent.name.split("_", 1)[1]
        if number.isdigit() and int(number) <= step:
            return True
    return False


def retrain_lost_trunks(plan: SweepPlan, sweep_dir: Path, cfgs: dict[str, Any], retry_failed: bool) -> list[str]:
    """Completed trunks whose checkpoint at a branch's decay start is gone (deleted to free space) while that
    branch is still to run: each is retired (into the sweep's `.retired/`) so this sweep trains it again, with
    its branch checkpoints, before its branches. Returns one line per trunk retired."""
    lost: dict[str, tuple[str, int]] = {}
    for spec in plan.runs:
        if spec.parent is None or spec.parent in lost:
            continue
        state = file_state(sweep_dir / spec.name)
        if state == COMPLETED or (state in FINAL and not retry_failed):
            continue  # it will not run: it needs nothing of its parent
        trunk = sweep_dir / spec.parent
        at = LRSchedule.of(cfgs[spec.name].train).decay_start
        if file_state(trunk) == COMPLETED and not _has_checkpoint_at_most(trunk, at):
            lost[spec.parent] = (spec.name, at)
    notes = []
    for trunk, (branch, at) in lost.items():
        lock = DirLock.sweep(sweep_dir / trunk)
        if not lock.acquire():
            continue  # running elsewhere: its own sweep decides
        try:
            old = retire(sweep_dir / trunk)
        finally:
            lock.release()
        notes.append(
            f"{trunk}: completed, but its checkpoint at step {at} (where {branch} branches off) is gone: "
            f"training it again (old attempt in {old.parent.name}/{old.name})"
        )
    return notes
