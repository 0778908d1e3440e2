"""The report's first lines: the answer at a glance. Per table, the plain delayed column's gap to the reference for
every optimizer, and one optimizer's gap over another's, each with its 95% interval and whether it is resolved;
printed whether resolved or not (the takeaways after it say what each interval supports), and with one seed as the
point values, said to have no interval.

The same claims as the Intervals table (asyncpipe.report.claims): nothing here is computed anew.
"""

from __future__ import annotations

from asyncpipe.report.claims import Claim


def _status(c: Claim) -> str:
    if c.interval.n < 2:
        return "one seed: no interval"
    return "resolved" if not c.note else "not resolved"


def _shown(c: Claim) -> str:
    """The claim's value and interval; with one seed the point value alone (its status says why)."""
    if c.interval.n < 2:
        return f"{c.interval.value:.2f}x" if c.kind == "gap ratio" else f"{c.interval.value:+.4f}"
    return c.shown()


def headline_variant(claims: list[Claim]) -> str | None:
    """The plain delayed column the finding is about: the first column with a gap that no mitigation builds on
    (`1-step` in sync / 1-step / 1-step+EF), else the first column with a gap."""
    mitigated = {c.variant for c in claims if c.kind in ("effect", "closed", "vs EF")}
    gaps = [c.variant for c in claims if c.kind == "gap"]
    plain = [v for v in gaps if v not in mitigated]
    return (plain or gaps or [None])[0]


def headline(claims: list[Claim]) -> list[str]:
    """One line per table with a plain gap: `1-step − sync (95% intervals, 3 seeds): adamw +0.48 [...] resolved;
    muon ...; adamw/muon 3.62x [2.87x, 4.40x] resolved`."""
    tables = list(dict.fromkeys(c.table for c in claims))
    out = []
    for table in tables:
        own = [c for c in claims if c.table == table]
        variant = headline_variant(own)
        if variant is None:
            continue
        gaps = [c for c in own if c.kind == "gap" and c.variant == variant]
        ratios = [c for c in own if c.kind == "gap ratio" and c.variant == variant]
        seeds = sorted({c.interval.n for c in gaps + ratios})
        n = (
            f"{seeds[0]} seed{'s' if seeds[0] != 1 else ''}"
            if len(seeds) == 1
            else "seeds " + "/".join(map(str, seeds))
        )
        parts = [f"{c.optimizer} {_shown(c)} {_status(c)}" for c in gaps]
        parts += [f"{c.optimizer} gap ratio {_shown(c)} {_status(c)}" for c in ratios]
        where = f" [{table}]" if len(tables) > 1 else ""
        label = gaps[0].label if gaps else variant
        out.append(f"{label}{where}, final val loss (95% intervals, {n}): " + "; ".join(parts))
    return out
