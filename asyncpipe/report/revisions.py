"""Which revision of an optimizer's or a compensation method's rule a run ran, so that a report never pools or names
runs of different rules as one.

Each optimizer, method and schedule declares its current revision next to its rule (`asyncpipe.registry`,
`asyncpipe.schedules`: `revision=`), and
a run records it in provenance.json ("revisions"). Records made before runs recorded it get theirs from the commit
they ran at, by the table below: a rule's revision r was introduced by commit `since`; a run whose commit is an
ancestor of it (git, when the commit is known locally) ran an older revision. Where git cannot tell, the run's
start time (provenance.json `started`) is compared with the commit's date. `tests/test_report_revisions.py`
checks that the table's last revision of each rule is the one its module declares.

A cell whose runs ran a rule other than today's is named with its revision (`1-step+stage_lr@r1`), and its
meaning is stated in the report's warnings.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Revision:
    number: int
    since: str  # the commit that introduced it ("" for the first)
    date: str  # that commit's date, ISO 8601 UTC
    rule: str  # what it computes, in one line
    now: str = ""  # the name the same rule has today, where it lives on under another name (paci r1: paci-recompute)


# (kind, name) -> its revisions, oldest first. A rule not listed has only revision 1.
HISTORY: dict[tuple[str, str], tuple[Revision, ...]] = {
    ("compensation", "stage_lr"): (
        Revision(1, "", "", "lr / (1 + k) for the whole run (halves the lr at k = 1)"),
        Revision(
            2,
            "262fe8de190e",
            "2026-12-02T04:43:56+00:00",
            "PipeMare's lr / k^p(t), p annealed from 1 to 0 over 14% of the run (a no-op at k = 1)",
        ),
    ),
    ("compensation", "dc"): (
        Revision(1, "", "", "lam / (sqrt(v) + eps), v = EMA(g*g) seeded with g*g"),
        Revision(2, "262fe8de190e", "2026-12-02T04:43:56+00:00", "DC-ASGD-a: lam / sqrt(v + eps), v = EMA(g*g) from 0"),
    ),
    ("compensation", "basis_rotation"): (
        Revision(1, "", "", "rotates every matrix, embedding and head included"),
        Revision(2, "262fe8de190e", "2026-12-02T04:43:56+00:00", "rotates hidden (block) matrices only"),
    ),
    ("schedule", "paci"): (
        Revision(
            1,
            "",
            "",
            "a straddler's forward recomputed on the stepped weights before its backward (today's paci-recompute)",
            now="paci-recompute",
        ),
        Revision(
            2,
            "e5e0d6136327",
            "2026-12-03T14:45:39+00:00",
            "a straddler back-propagates through its own forward's graph on the stepped weights (in place)",
        ),
    ),
}
HEX = re.compile(r"^[0-9a-f]{7,40}$")


def current(kind: str, name: str) -> int:
    """Today's revision of a rule (the last in HISTORY; 1 for a rule never revised)."""
    return HISTORY[(kind, name)][-1].number if (kind, name) in HISTORY else 1


@lru_cache(maxsize=256)
def _is_ancestor(older: str, newer: str) -> bool | None:
    """Whether git commit `older` is an ancestor of `newer` (both hex), or None when git cannot tell."""
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "merge-base", "--is-ancestor", older, newer],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(out.returncode)  # 128: a commit git does not know


def _started(prov: dict) -> datetime | None:
    try:
        when = datetime.fromisoformat(str(prov.get("started")))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)  # written as the host's local time (UTC here)


def _precedes(commit: str, started: datetime | None, rev: Revision) -> tuple[bool | None, str]:
    """Whether a run predates revision `rev` (its commit lacks rev.since; else, without git, it started before the
    commit's date), and how that was found; None when neither can tell."""
    if HEX.match(commit):
        has = _is_ancestor(rev.since, commit)
        if has is not None:
            return not has, f"its commit {commit[:7]} {'contains' if has else 'lacks'} {rev.since[:7]}"
    if started is None:
        return None, "no commit git knows and no start time"
    before = started < datetime.fromisoformat(rev.date)
    when = "before" if before else "after"
    return before, f"started {started:%Y-%m-%d %H:%M}, {when} {rev.since[:7]} ({rev.date[:10]})"


def derived(kind: str, name: str, prov: dict) -> tuple[int | None, str]:
    """(revision, how it was found) for a record that did not record one: from its commit, else its start time."""
    history = HISTORY.get((kind, name))
    if history is None:
        return 1, "never revised"
    git = prov.get("git") if isinstance(prov.get("git"), dict) else {}
    commit, started = str(git.get("commit") or "").lower(), _started(prov)
    found, how = history[0].number, ""
    for rev in history[1:]:
        before, how = _precedes(commit, started, rev)
        if before is None:
            return None, how
        if before:
            return found, how
        found = rev.number
    return found, how


def of_record(kind: str, name: str, prov: dict | None) -> tuple[int | None, str]:
    """The revision of rule `name` a run ran: as its provenance.json recorded it, else derived; with how."""
    prov = prov or {}
    recorded = prov.get("revisions")
    if isinstance(recorded, dict):
        entry = recorded.get(kind)
        if isinstance(entry, dict) and entry.get("name") == name and type(entry.get("revision")) is int:
            return int(entry["revision"]), "recorded"
    return derived(kind, name, prov)


def today_name(kind: str, name: str, prov: dict | None) -> str:
    """The name today's code gives the rule a run ran: ``name``, or the one its older revision lives on under
    (a paci record of revision 1 ran today's paci-recompute, which is what its throughput is modelled as)."""
    if (kind, name) not in HISTORY:
        return name
    number, _ = of_record(kind, name, prov)
    return next((r.now for r in HISTORY[(kind, name)] if r.number == number and r.now), name)


def suffix(kind: str, name: str, prov: dict | None) -> tuple[str, str]:
    """(`@rN` to add to a cell's name, the warning that says what rN is) when a run ran a rule other than today's,
    else ("", ""). Every rule's recorded revision is compared, revised or not; one this checkout does not know (a
    newer checkout's record) is named and kept apart too."""
    number, how = of_record(kind, name, prov)
    now = current(kind, name)
    if number == now:
        return "", ""
    if number is None:
        return "@r?", f"{name}@r?: which revision of {name} ran is unknown ({how}); today's is r{now}"
    known = {r.number: r for r in HISTORY.get((kind, name), ())}
    if number not in known:
        return f"@r{number}", (
            f"{name}@r{number} ran {kind} {name} revision {number}, which this checkout does not "
            f"know (it knows r1 to r{now}; a newer checkout's record?): kept apart from r{now}"
        )
    today = HISTORY[(kind, name)][-1]
    return f"@r{number}", (
        f"{name}@r{number} ran {kind} {name} revision {number}: {known[number].rule} ({how}); "
        f"today's {name} is r{now} (since {today.since[:7]}): {today.rule}"
    )
