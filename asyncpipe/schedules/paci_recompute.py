"""PACI's recompute recipe (`pipeline.schedule=paci-recompute`): PACI's stream and staleness pattern
(`asyncpipe.schedules.paci`), but a straddling micro-batch's backward re-runs its forward on the stage's current
weights W(b) from the saved stage input and back-propagates the next stage's gradient through that graph, so it is
exactly the gradient of the stage at W(b) given its input (the forward graph built on W(b-1) is dropped unused, so
stock torch's version check holds). One more forward per straddler: (P-1-s) per batch on stage s. This was
`paci` until `paci` became the authors' in-place recipe (revision 2 of `paci`).
"""

from __future__ import annotations

from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight
from asyncpipe.schedules.paci import check, stream, versions

SPEC = declare_schedule(ScheduleSpec(
    name="paci-recompute", note="PACI with each straddling micro-batch's forward recomputed on the current weights",
    versions=versions, weight_versions=lambda P, s: 1, in_flight=one_f_one_b_in_flight, stream=stream,
    delay=1, clip_modes=("stage",), compensations=("none", "ef"), check=check, in_order=True, recompute=True, flush=False,
))  # fmt: skip
