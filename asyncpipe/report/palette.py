"""The one place a report's figures get a variant's colour and marker, so a variant looks the same in every plot
(loss curves, gap, glance, wall-clock, verdict).

A variant's **family** is its name without a sweep label (`main:`), a schedule revision (`@r1`) and a budget rung
(`(x1.5)`): `main:1-step+EF(x1.5)@r1` is `1-step+EF`. The families every study has get fixed colours (sync blue,
1-step red, 1-step+EF green, PACI purple, PACI+EF orange); any other family takes the next unused colour in the
report's column order. A budget family's rungs share its colour; figures tell rungs apart by marker or shade, and
an older revision's curve by a dash-dotted line (its points by their own marker, `point_style`).
Neutral colours (NEUTRAL) are for what is not a variant: reference lines, targets, legend keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FIXED = {  # family -> (colour, marker)
    "sync": ("#1f77b4", "o"),
    "1-step": ("#d62728", "s"),
    "1-step+EF": ("#2ca02c", "D"),
    "PACI": ("#9467bd", "^"),
    "PACI+EF": ("#ff7f0e", "v"),
}
SPARE = [
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#393b79",
    "#ad494a",
    "#637939",
    "#7b4173",
    "#3182bd",
    "#e6550d",
]
SPARE_MARKERS = "P*Xh<>pd8H"
OLDER_REVISION_MARKER = "<"  # points of a rule's older revision (no family's own marker)
NEUTRAL = {"black": "black", "grey": "grey", "dark": "#555555"}  # reference lines, targets, generic legend keys
RUNG = re.compile(r"\(x\d+(?:\.\d+)?\)")
REVISION = re.compile(r"@r\d+$")


def family(variant: str) -> str:
    """`main:1-step+EF(x1.5)@r1` -> `1-step+EF`: the name without sweep label, revision and budget rung."""
    name = str(variant).split(":", 1)[1] if ":" in str(variant) else str(variant)
    return RUNG.sub("", REVISION.sub("", name)).strip()


def older_revision(variant: str) -> bool:
    """A column of a rule's older revision (`PACI(x2)@r1`): figures draw its curve dash-dotted, beside today's solid
    one of the same family and colour."""
    return bool(REVISION.search(str(variant)))


def is_rung(variant: str) -> bool:
    """A longer budget of a family (`1-step(x1.5)`), not the family's own 1x column."""
    return bool(RUNG.search(str(variant)))


@dataclass
class Palette:
    """Colours and markers for one report's variants; `order` (the report's column order) fixes which spare
    colour an unlisted family gets, so every figure of the report agrees."""

    order: list[str] = field(default_factory=list)
    _spare: dict[str, tuple[str, str]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        for v in self.order:
            self._assign(family(v))

    def _assign(self, fam: str) -> tuple[str, str]:
        if fam in FIXED:
            return FIXED[fam]
        if fam not in self._spare:
            i = len(self._spare)
            self._spare[fam] = (SPARE[i % len(SPARE)], SPARE_MARKERS[i % len(SPARE_MARKERS)])
        return self._spare[fam]

    def colour(self, variant: str) -> str:
        return self._assign(family(variant))[0]

    def marker(self, variant: str) -> str:
        return self._assign(family(variant))[1]

    def style(self, variant: str) -> tuple[str, str]:
        """(colour, marker) of the variant's family."""
        return self._assign(family(variant))

    def point_style(self, variant: str) -> tuple[str, str]:
        """(colour, marker) for a figure of points, where no line style can tell an older revision (`PACI@r1`) from
        today's: the family's colour, and the older revision's own marker."""
        colour, marker = self.style(variant)
        return colour, OLDER_REVISION_MARKER if older_revision(variant) else marker
