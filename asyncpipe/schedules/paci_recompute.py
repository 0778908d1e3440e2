"""PACI's recompute recipe (`pipeline.schedule=paci-recompute`): PACI's stream and staleness pattern
(`asyncpipe.schedules.paci`), but a straddling micro-batch's backward re-runs its forward on the stage's current
weights W(b) from the saved stage input and back-propagates the next stage's gradient through that graph, so it is
exactly the gradient of the stage at W(b) given its input (the forward graph built on W(b-1) is dropped unused, so
stock torch's version check holds). One more forward per straddler: (P-1-s) per batch on stage s. This was
`paci` until `paci` became the authors' in-place recipe (revision 2 of `paci`).
"""

from __future__ import annotations

from dataclasses import replace

from asyncpipe.schedules import declare_schedule
from asyncpipe.schedules.paci import SPEC as PACI

# PACI's declaration with the other straddle recipe: same stream, versions, memory and constraints.
SPEC = declare_schedule(
    replace(
        PACI,
        name="paci-recompute",
        note="PACI with each straddling micro-batch's forward recomputed on the current weights",
        inplace=False,
        recompute=True,
        revision=1,
        module="",
        label="PACI (recompute)",
    )
)
