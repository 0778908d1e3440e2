"""The paper's own numbers, held once: the final val losses of its results table, and the targets a report derives
from them (`asyncpipe report --target paper`).

Source: Zmushko, Petrov, Abdullaev, Khrushchev & Horváth, "One-Step Gradient Delay is Not a Barrier for
Large-Scale Asynchronous Pipeline Parallel LLM Pretraining", ICML 2026 (PMLR 306, 168444-168472;
arXiv:2606.30634; CITATION.cff, README "Citing"): val loss of sync / 1-step / 1-step+EF (lambda = 1), 360M dense
model for AdamW, Muon and SOAP, and the 10B MoE with Muon.

Derived, never typed: a closure is (1-step - EF) / (1-step - sync) (AdamW 90%, Muon 58%, SOAP 67%), a gap ratio is
one optimizer's 1-step gap over another's on the same model (AdamW / Muon 23.2x). A report judges its own
closures and gap ratios against these by their intervals (asyncpipe.report.claims).
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = (
    "Zmushko et al., ICML 2026 (PMLR 306; arXiv:2606.30634), val loss sync / 1-step / 1-step+EF "
    "(asyncpipe.report.paper)"
)
PAPER = "paper"  # the value of `--target` that asks for these


@dataclass(frozen=True)
class PaperRow:
    """One row of the paper's table: an optimizer on a model, final val loss of each column."""

    optimizer: str
    model: str
    sync: float
    one_step: float
    ef: float

    @property
    def gap(self) -> float:
        return self.one_step - self.sync

    @property
    def closure(self) -> float:
        """The fraction of the one-step gap that EF closes: (1-step - EF) / (1-step - sync)."""
        return (self.one_step - self.ef) / self.gap

    def losses(self) -> str:
        return f"{self.sync:.3f} / {self.one_step:.3f} / {self.ef:.3f}"


TABLE = (
    PaperRow("adamw", "360M", 2.612, 2.890, 2.640),
    PaperRow("muon", "360M", 2.578, 2.590, 2.583),
    PaperRow("soap", "360M", 2.581, 2.608, 2.590),
    PaperRow("muon", "MoE-10B", 1.906, 1.911, 1.906),
)
DENSE = "360M"


def row(optimizer: str, model: str | None = None) -> PaperRow | None:
    """The paper's row for an optimizer: the MoE-10B one for a run on an MoE model (`model.name` moe_*), else the
    dense 360M one; None when the paper has no such row."""
    wanted = "MoE-10B" if str(model or "").startswith("moe") else DENSE
    return next((r for r in TABLE if r.optimizer == optimizer and r.model == wanted), None)


def gap_ratio(top: str, bottom: str, model: str | None = None) -> float | None:
    """The paper's `top` 1-step gap over `bottom`'s on one model, None when it lacks either."""
    a, b = row(top, model), row(bottom, model)
    if a is None or b is None or a.model != b.model:
        return None
    return a.gap / b.gap


@dataclass(frozen=True)
class Goal:
    """What a closure is judged against: a stated fraction, or the paper's figure for that optimizer."""

    value: float
    paper: PaperRow | None = None

    def name(self) -> str:
        """`the 85% target` or `the paper's 90% for adamw` (MoE rows: `for muon on MoE-10B`)."""
        if self.paper is None:
            return f"the {self.value * 100:g}% target"
        p = self.paper
        return f"the paper's {self.value * 100:.0f}% for {p.optimizer}" + (f" on {p.model}" if p.model != DENSE else "")


def table_lines() -> list[str]:
    """The paper's table and what a report derives from it, one line per row (report.md's Targets section)."""
    lines = [
        f"{r.optimizer}, {r.model}: sync / 1-step / 1-step+EF {r.losses()}; 1-step gap {r.gap:.3f}, EF closes "
        f"{r.closure:.0%} of it"
        for r in TABLE
    ]
    dense = [r for r in TABLE if r.model == DENSE]
    lines += [
        f"gap ratio {a.optimizer} / {b.optimizer} ({DENSE}): {a.gap / b.gap:.1f}x"
        for a in dense
        for b in dense
        if a.gap > b.gap
    ]
    return lines


def goal(target: float | str | None, optimizer: str, model: str | None = None) -> Goal | None:
    """The closure goal of one optimizer's cells: `target` as given (a fraction), or with `--target paper` the
    paper's own closure for that optimizer (None when the paper has no row for it)."""
    if target is None:
        return None
    if target == PAPER:
        found = row(optimizer, model)
        return Goal(found.closure, found) if found is not None else None
    return Goal(float(target))
