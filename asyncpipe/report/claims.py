"""Every claim a report makes, as a 95% interval (asyncpipe.report.stats), paired by seed:

- gap: a column minus the reference column (sync), same seed;
- effect: a mitigated column (EF, weight prediction, ...) minus its plain delayed column (1-step), same seed;
- vs EF: a mitigation other than lambda-1 EF minus the lambda-1 EF column (lambda 2 - lambda 1, method - EF);
- closed: % of the plain column's gap the mitigation closes, (gap_plain - gap_method) / gap_plain as a ratio of
  means with Fieller's interval, optionally judged against a goal: a stated fraction, or with `--target paper` the
  paper's own closure for that optimizer (asyncpipe.report.paper); a closure whose interval is wider than the whole
  [0%, 100%] range says nothing of how much closes: it is shown and judged "not resolved", never as a percentage;
- gap ratio: one optimizer's gap over another's for the same column (seeds paired by number); with `--target
  paper`, also set against the paper's ratio of the same two optimizers by its interval.

A column's role comes from its runs' settings (delay, delay profile, EF and its lambda, compensation, train.steps),
not its name, so `EF(lam=2)` of one sweep finds `main:1-step` and `main:1-step+EF` of another. Only columns with the
same train.steps are compared here (a longer budget is a time-to-target question: asyncpipe.report.target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from asyncpipe.report.paper import PAPER, Goal, gap_ratio, goal
from asyncpipe.report.stats import (
    Interval,
    fieller_ratio,
    diff_seeds_needed,
    ratio_resolved,
    ratio_seeds_needed,
    t_interval,
    verdict,
)

NO_COMPENSATION = (None, "none", "ef")  # compensation=ef is EF itself (the *_ef presets), not another method


@dataclass
class Claim:
    table: str
    optimizer: str
    kind: str  # gap | effect | vs EF | closed | gap ratio
    label: str  # e.g. "1-step − sync", "1-step+EF closes of 1-step's gap"
    variant: str
    interval: Interval
    target: float = 0.0
    needed: int | None = None  # seeds that would resolve it with 80% power at the observed mean and spread
    note: str = ""  # "" when resolved, else "not resolved ..."
    clears_zero: bool | None = None  # a closure: whether it is resolved above/below 0 (its note may be the target's)
    goal: str = ""  # what `target` is: "the 85% target", "the paper's 90% (adamw, 360M: ...)"
    versus: str = ""  # a gap ratio set against the paper's: "below the paper's 23.17x (...)"
    seeds: tuple = ()  # the seeds the interval is over (a gap ratio, a closure): which runs a comparison used

    @property
    def percent(self) -> bool:
        return self.kind in ("closed",)

    @property
    def uninformative(self) -> bool:
        """A closure whose interval is wider than [0%, 100%] (or unbounded): it cannot say how much closes."""
        iv = self.interval
        if self.kind != "closed" or iv.n < 2 or math.isnan(iv.lo) or math.isnan(iv.hi):
            return False
        return math.isinf(iv.lo) or math.isinf(iv.hi) or iv.hi - iv.lo > 1.0

    def shown(self) -> str:
        if self.uninformative:  # the interval alone, no point value to be read as a finding
            return "not resolved " + self.interval.fmt(".0f", 100, "%").split(" ", 1)[1]
        if self.percent:
            return self.interval.fmt(".0f", 100, "%")
        if self.kind == "gap ratio":
            return self.interval.fmt(".2f", 1, "x")
        return self.interval.fmt("+.4f")

    def row(self) -> dict[str, Any]:
        iv = self.interval
        return {
            "table": self.table,
            "optimizer": self.optimizer,
            "kind": self.kind,
            "claim": self.label,
            "variant": self.variant,
            "value": iv.value,
            "lo": iv.lo,
            "hi": iv.hi,
            "n": iv.n,
            "method": iv.kind,
            "target": self.target,
            "goal": self.goal,
            "resolved": not self.note,
            "seeds_to_resolve": self.needed,
            "note": self.note,
            "versus": self.versus,
        }


def meta_of(cell_runs: Any) -> dict[str, Any]:
    """A column's role-defining settings from its first run's row (a pandas row of the report's runs frame)."""
    first = cell_runs.iloc[0]
    lam = first.get("ef_lam")
    return {
        "delay": int(first["delay"] or 0),
        "profile": first.get("delay_profile"),
        "ef": bool(first["ef"]),
        "lam": 1.0 if lam is None or (isinstance(lam, float) and math.isnan(lam)) else float(lam),
        "comp": first.get("compensation"),
        "steps": (first.get("config") or {}).get("train.steps"),
    }


def _same_schedule(a: dict, b: dict) -> bool:
    return a["delay"] == b["delay"] and a["profile"] == b["profile"] and a["steps"] == b["steps"]


def is_mitigated(m: dict) -> bool:
    return m["delay"] > 0 and (m["ef"] or m["comp"] not in NO_COMPENSATION)


def is_plain(m: dict) -> bool:
    return m["delay"] > 0 and not m["ef"] and m["comp"] in NO_COMPENSATION


def plain_of(variant: str, meta: dict[str, dict]) -> str | None:
    """The plain delayed column a mitigated column adds to (same delay, profile and steps)."""
    m = meta[variant]
    if not is_mitigated(m):
        return None
    return next((v for v, o in meta.items() if v != variant and is_plain(o) and _same_schedule(o, m)), None)


def ef_of(variant: str, meta: dict[str, dict]) -> str | None:
    """The lambda-1 EF column a mitigated column is compared with (not itself)."""
    m = meta[variant]
    if not is_mitigated(m):
        return None
    found = [v for v, o in meta.items() if o["ef"] and o["lam"] == 1.0 and _same_schedule(o, m)]
    found.sort(key=lambda v: meta[v]["comp"] == "ef")  # optimizer.ef.enabled (the canonical EF) first
    return found[0] if found and found[0] != variant else None


def other_budget(meta: dict[str, dict], variant: str, reference: str) -> bool:
    """A column trained for another train.steps than the reference: compared by time to target, not here (at the
    matched token count it would be caught mid-schedule)."""
    return reference in meta and meta[variant]["steps"] != meta[reference]["steps"]


def _diffs(a: dict, b: dict, seeds: list | None = None) -> list[float]:
    seeds = seeds if seeds is not None else [s for s in a if s in b]
    return [a[s] - b[s] for s in seeds]


def _diff_claim(table: str, opt: str, kind: str, label: str, variant: str, a: dict, b: dict) -> Claim:
    diffs = _diffs(a, b)
    iv = t_interval(diffs)
    needed = None if iv.excludes(0.0) else diff_seeds_needed(diffs)
    return Claim(table, opt, kind, label, variant, iv, 0.0, needed, verdict(iv, 0.0, needed))


def closure_claim(
    table: str, opt: str, variant: str, plain: str, by_seed: dict[str, dict], reference: str, target: Goal | None
) -> Claim | None:
    """% of `plain`'s gap that `variant` closes, over the seeds all three columns share, judged against 0 and
    `target` (a stated fraction or the paper's figure for this optimizer)."""
    ref, base, own = by_seed.get(reference, {}), by_seed[plain], by_seed[variant]
    seeds = [s for s in own if s in base and s in ref]
    if not seeds:
        return None
    num = _diffs(base, own, seeds)  # gap_plain - gap_variant = plain - variant
    den = _diffs(base, ref, seeds)  # gap_plain
    iv = fieller_ratio(num, den)
    notes, needed = [], None
    wide = Claim(table, opt, "closed", "", variant, iv).uninformative
    if wide:
        notes.append("not resolved: its interval is wider than [0%, 100%]")
    for goal_ in [0.0] + ([target.value] if target is not None else []):
        if not ratio_resolved(num, den, goal_):
            needed = ratio_seeds_needed(num, den, goal_)
            note = verdict(iv, goal_, needed, 100, "%", resolved=False)
            notes.append(note.replace("not resolved (", "not resolved vs 0% (") if goal_ == 0.0 else note)
    return Claim(
        table,
        opt,
        "closed",
        f"{variant} closes of {plain}'s gap",
        variant,
        iv,
        target.value if target is not None else 0.0,
        needed,
        "; ".join(notes),
        ratio_resolved(num, den, 0.0),
        target.name() if target is not None else "",
        seeds=tuple(seeds),
    )


def group_claims(
    table: str,
    stats: dict[str, dict[str, dict]],
    meta: dict[str, dict[str, dict]],
    reference: str,
    order: list[str],
    target: float | str | None = None,
    model: str | None = None,
) -> list[Claim]:
    """Claims of one table. stats[optimizer][variant] has `_by_seed` ({seed: compared val loss}; empty when the
    cell has runs sharing a seed); meta[optimizer][variant] the column's settings (meta_of). `target`: a fraction
    or `paper` (each optimizer's closure in the paper's table, on `model`'s kind: dense or MoE)."""
    claims: list[Claim] = []
    stats = {
        opt: {v: row for v, row in cells.items() if not other_budget(meta[opt], v, reference)}
        for opt, cells in stats.items()
    }
    for opt, cells in stats.items():
        by_seed = {v: row["_by_seed"] for v, row in cells.items()}
        ref = by_seed.get(reference)
        variants = sorted(cells, key=lambda v: order.index(v) if v in order else len(order))
        for v in variants:
            if v == reference or ref is None or not by_seed[v]:
                continue
            claims.append(_diff_claim(table, opt, "gap", f"{v} − {reference}", v, by_seed[v], ref))
        for v in variants:
            if not by_seed[v]:
                continue
            plain = plain_of(v, meta[opt])
            if plain and by_seed.get(plain):
                claims.append(_diff_claim(table, opt, "effect", f"{v} − {plain}", v, by_seed[v], by_seed[plain]))
            ef = ef_of(v, meta[opt])
            if ef and by_seed.get(ef):
                claims.append(_diff_claim(table, opt, "vs EF", f"{v} − {ef}", v, by_seed[v], by_seed[ef]))
            if plain and by_seed.get(plain) and ref and plain != reference:
                claim = closure_claim(table, opt, v, plain, by_seed, reference, goal(target, str(opt), model))
                if claim is not None:
                    claims.append(claim)
    claims += gap_ratio_claims(table, stats, reference, target == PAPER, model)
    return claims


def versus_paper(num: list[float], den: list[float], iv: Interval, top: str, bottom: str, model: str | None) -> str:
    """A gap ratio set against the paper's ratio of the same optimizers by its interval (the t-test of
    num - r·den at the paper's r, which agrees with Fieller's interval): below, above, or consistent with it."""
    paper = gap_ratio(top, bottom, model)
    if paper is None or not iv.known:
        return ""
    where = f"the paper's {paper:.1f}x ({top} / {bottom} 1-step gap)"
    if not ratio_resolved(num, den, paper):
        return f"consistent with {where}"
    return f"{'below' if iv.value < paper else 'above'} {where}"


def gap_ratio_claims(
    table: str, stats: dict[str, dict[str, dict]], reference: str, paper: bool = False, model: str | None = None
) -> list[Claim]:
    """For each column two optimizers share: the larger mean gap over the smaller, seeds paired by number (with
    `paper`, set against the paper's ratio of the two)."""
    opts = list(stats)
    out = []
    for i, a in enumerate(opts):
        for b in opts[i + 1 :]:
            for v in stats[a]:
                if v == reference or v not in stats[b] or reference not in stats[a] or reference not in stats[b]:
                    continue
                ga = {
                    s: x - stats[a][reference]["_by_seed"][s]
                    for s, x in stats[a][v]["_by_seed"].items()
                    if s in stats[a][reference]["_by_seed"]
                }
                gb = {
                    s: x - stats[b][reference]["_by_seed"][s]
                    for s, x in stats[b][v]["_by_seed"].items()
                    if s in stats[b][reference]["_by_seed"]
                }
                seeds = [s for s in ga if s in gb]
                if len(seeds) < 1:
                    continue
                top, bottom, names = (ga, gb, (a, b))
                if sum(gb[s] for s in seeds) > sum(ga[s] for s in seeds):
                    top, bottom, names = gb, ga, (b, a)
                num, den = [top[s] for s in seeds], [bottom[s] for s in seeds]
                iv = fieller_ratio(num, den)
                ok = ratio_resolved(num, den, 1.0)
                needed = None if ok else ratio_seeds_needed(num, den, 1.0)
                claim = Claim(
                    table,
                    f"{names[0]}/{names[1]}",
                    "gap ratio",
                    f"{v}: {names[0]}'s gap / {names[1]}'s",
                    v,
                    iv,
                    1.0,
                    needed,
                    verdict(iv, 1.0, needed, 1, "x", ok),
                    seeds=tuple(seeds),
                )
                if paper:
                    claim.versus = versus_paper(num, den, iv, str(names[0]), str(names[1]), model)
                out.append(claim)
    return out
