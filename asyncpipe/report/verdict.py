"""One takeaway sentence per optimizer (and table), built only from the claims' 95% intervals: what the plain
delayed column costs, what each mitigation recovers, and, where a ladder of budgets exists, the net wall-clock
speed-up. A clause says only what its interval supports: an interval that contains 0 (or the stated target) is
said to be "not resolved", with the seeds that would resolve it with 80% power at the observed mean and spread."""

from __future__ import annotations

from asyncpipe.report.claims import Claim
from asyncpipe.report.target import Ladder, phrase


def _gap_clause(c: Claim) -> str:
    if c.note:
        return f"{c.variant}'s gap {c.shown()} is {c.note}"
    verb = "costs" if c.interval.value > 0 else "gains"
    return f"{c.variant} {verb} {c.shown()}"


def _closure_clause(closed: Claim | None, effect: Claim | None) -> str:
    """What a mitigation recovers: a closure only where its interval clears 0 and is no wider than [0%, 100%];
    otherwise its own effect (mitigated − plain), and, for too wide a closure, that it is not resolved."""
    if closed is None or not closed.clears_zero or closed.uninformative:
        said = f"{effect.label} {effect.shown()} is {effect.note or 'resolved'}" if effect is not None else ""
        if closed is not None and closed.clears_zero and closed.uninformative:  # clear of 0, but says nothing more
            wide = closed.shown().removeprefix("not resolved ")
            said += (
                f"{'; ' if said else ''}{closed.label}: not resolved ({wide}, wider than [0%, 100%], "
                f"{closed.interval.n} seeds)"
            )
        return said
    clause = f"{closed.variant} recovers {closed.shown()} of the gap"
    if closed.goal:
        if not closed.note:
            clause += f" ({'above' if closed.interval.value > closed.target else 'short of'} {closed.goal})"
        elif closed.goal.startswith("the paper's"):
            clause += f" (consistent with {closed.goal}: {closed.note})"
        else:
            clause += f" ({closed.note})"
    return clause


def takeaways(claims: list[Claim], ladders: list[Ladder], bench: list[dict], several_tables: bool) -> list[str]:
    """The sentences, in table then optimizer order; a cell with nothing measured says nothing."""
    out = []
    keys = list(dict.fromkeys((c.table, c.optimizer) for c in claims if c.kind != "gap ratio"))
    keys += [k for k in dict.fromkeys((lad.table, lad.optimizer) for lad in ladders) if k not in keys]
    for table, opt in keys:
        own = [c for c in claims if (c.table, c.optimizer) == (table, opt)]
        single = {c.variant for c in own if c.interval.n < 2}  # one seed: no spread, nothing to judge
        own = [c for c in own if c.variant not in single]
        clauses = []
        mitigated = {c.variant for c in own if c.kind in ("effect", "closed")}
        for c in own:
            if c.kind == "gap" and c.variant not in mitigated:
                clauses.append(_gap_clause(c))
        for v in dict.fromkeys(c.variant for c in own if c.kind == "effect"):
            closed = next((c for c in own if c.kind == "closed" and c.variant == v), None)
            effect = next((c for c in own if c.kind == "effect" and c.variant == v), None)
            clause = _closure_clause(closed, effect)
            if clause:
                clauses.append(clause)
            versus = next((c for c in own if c.kind == "vs EF" and c.variant == v), None)
            if versus is not None:  # two closures side by side invite a comparison: say what it supports
                clauses.append(f"{versus.label} {versus.shown()}" + (f" is {versus.note}" if versus.note else ""))
        for lad in ladders:
            if (lad.table, lad.optimizer) == (table, opt) and (len(lad.columns) > 1 or lad.bound is None):
                clause = phrase(lad, bench)
                if clause:
                    clauses.append(clause)
        if single and not own:  # a one-seed sweep (make smoke-test): the point values, said to be unjudged
            every = [c for c in claims if (c.table, c.optimizer) == (table, opt)]
            clauses += [
                f"{c.variant} {'costs' if c.interval.value > 0 else 'gains'} {abs(c.interval.value):.4f}"
                for c in every
                if c.kind == "gap"
            ]
            clauses += [
                f"{c.variant} closes {c.interval.value:.0%} of the delayed gap" for c in every if c.kind == "closed"
            ]
            clauses.append("one seed: no interval, nothing resolved (add seeds: seed=0,1,2)")
        elif single:
            clauses.append(f"{len(single)} one-seed column(s) not judged (no spread: {', '.join(sorted(single))})")
        if clauses:
            where = f" ({table})" if several_tables else ""
            out.append(f"{opt}{where}: " + "; ".join(clauses) + ".")
    mitigated = {c.variant for c in claims if c.kind == "effect"}
    resolved_gaps = {c.variant for c in claims if c.kind == "gap" and not c.note}
    for c in claims:
        if c.kind == "gap ratio" and c.variant in resolved_gaps and c.variant not in mitigated:
            if not c.note:
                said = f"{c.label} ({c.table}): {c.shown()}" if several_tables else f"{c.label}: {c.shown()}"
                out.append(said + (f", {c.versus}." if c.versus else "."))
    return out


MAX_LINE = 200  # no printed takeaway line is longer (issue 55)


def _top_level(text: str) -> list[str]:
    """`text` split at each "; " outside brackets and parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += 1 if ch in "([" else -1 if ch in ")]" else 0
        if depth == 0 and text.startswith("; ", i):
            parts.append(text[start:i])
            start = i + 2
    return parts + [text[start:]]


def takeaway_lines(sentence: str) -> list[str]:
    """A takeaway as printed: its first clause on the bullet's line, every further clause a sub-bullet (`  - `), each
    line at most MAX_LINE characters (a longer clause wraps onto indented continuation lines)."""
    import textwrap

    first, *rest = _top_level(sentence.rstrip("."))
    # "against the strongest synchronous schedule ...: X" qualifies the clause before it: one level deeper
    lines = [first] + [("    - " if clause.startswith("against ") else "  - ") + clause for clause in rest]
    out = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        out += textwrap.wrap(line, MAX_LINE - 2, subsequent_indent=indent, break_on_hyphens=False) or [line]
    return out


def paper_basis(claims: list[Claim], matched: dict[str, int | None]) -> list[str]:
    """One line per table whose claims are set against the paper: which of this report's runs the comparison uses
    (seeds, token count), so two reports' verdicts against the same paper figure can be told apart."""
    out = []
    judged = [c for c in claims if c.versus or (c.kind == "closed" and c.goal.startswith("the paper's"))]
    for table in dict.fromkeys(c.table for c in judged):
        seeds = sorted({s for c in judged if c.table == table for s in c.seeds}, key=str)
        tokens = matched.get(table)
        at = f"; final val loss at {tokens:,} tokens" if tokens else ""
        out.append(
            f"Against the paper: this report's runs ({table}; seeds {', '.join(map(str, seeds))}{at}); "
            "the paper's table (360M; MoE-10B for MoE runs); other seeds give other intervals."
        )
    return out
