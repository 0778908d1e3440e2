"""PACI (`pipeline.schedule=paci`): asynchronous 1F1B with one weight version and no flush, after *Breaking the
Bubble: Asynchronous Pipeline Parallel Training with Bounded Weight Inconsistency* (arXiv 2606.07881).

Each stage runs 1F1B across batch boundaries (backward takes the oldest in-flight micro-batch first, stage s holds
at most P-s in flight) and steps its own optimizer in place right after every a-th backward (a = m =
`train.micro_batches`), with no barrier across stages. Numbering micro-batches over the run (k = b*m + j) and
versions by the stage's own updates, stage s with w = P-1-s warm-up forwards runs

    forward of k on  W(floor(max(k - w, 0) / m))      backward of k on  W(floor(k / m))

so within batch b the first w micro-batches (b >= 1) straddle one update: forward on W(b-1), backward on W(b);
the rest, and every micro-batch of the last stage, are fresh.

A straddler's backward goes through its own forward's graph, as the authors' patched PyTorch does: the activations
it saved are W(b-1)'s, the weight tensors it saved are the stage's parameters, which the in-place step has since
moved to W(b). So its weight gradient is the forward-time inputs times the output gradient, and the input gradient
it sends back goes through W(b). Stock torch refuses such a backward (a saved tensor was modified in place); the
forward of a straddler runs under `torch.autograd.graph.saved_tensors_hooks` that keep each saved tensor as it
is, which lifts that check for that forward only (fresh micro-batches keep it). No recompute: a stage does m
forwards and m backwards per batch, as 2BW. `pipeline.schedule=paci-recompute` (`asyncpipe.schedules.paci_recompute`)
is the other recipe, the authors' recompute mode: re-run the straddler's forward on W(b) from its saved stage input
and back-propagate through that graph (the gradient of the stage at W(b); one more forward per straddler).
Revision 1 of `paci` (to the commit that split them) was the recompute recipe (`asyncpipe.report.revisions`).

No global step: clipping is per stage (pipeline.clip=stage; pipeline.clip=global is refused). Compensation: none or
EF. EF under PACI is EF's rule, x -= u(t) + lam (u(t) - u(t-1)), applied by each stage to its own update stream at
its own step (u: the optimizer's update from that stage's gradient). PACI's staleness is partial: in a batch only
micro-batches j < P-1 read a one-step-older version on some stage (j < P-1-s' on stage s'), so a stage's gradient is
a mix of fresh and partly stale terms; to first order its error is at most (P-1)/m of 2BW's, and lam = (P-1)/m is EF's
matching strength (the default lam = 1 corrects for a fully stale gradient). Methods that read the stale weights
(dc, weight prediction, ...) are refused: the stage holds one version. A resumed run re-runs the micro-batches in
flight at its checkpoint on the W(b-1) they first read: each stage with straddlers copies its weights before the
step a checkpoint follows (`asyncpipe.runtime.previous`), so a resumed run is bit-identical to one not interrupted.
"""

from __future__ import annotations

from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight
from asyncpipe.schedules.instructions import BackwardPass, ForwardPass, Instruction
from asyncpipe.schedules.twobw import TwoBWSchedule, min_micro_batches


def versions(P: int, m: int, stage: int, k: int) -> tuple[int, int]:
    """(forward, backward) version of micro-batch ``k`` on ``stage``: see the module docstring."""
    w = P - 1 - stage
    return max(k - w, 0) // m, k // m


class PACISchedule(TwoBWSchedule):
    """2BW's tick order (1F1B without a flush, a step right after each batch's last backward on every stage,
    never deferred) with PACI's versions: forward and backward of a micro-batch may read consecutive versions.
    A resumed stream (``start``) declares the versions of the full one: its warm-up forwards read W(start-1),
    which the engine keeps with a checkpoint (`asyncpipe.runtime.previous`)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, batches: int, start: int = 0) -> None:
        super().__init__(micro_batches, stages, stage_id, batches, defer_step=False, start=start)

    def versions_of(self, micro_batch: int) -> tuple[int, int]:
        return versions(self.stages, self.micro_batches, self.stage_id, micro_batch)

    def _forward(self, k: int) -> list[Instruction]:
        cmds = super()._forward(k)
        return cmds[:-1] + [ForwardPass(buffer_id=self._buf(k), micro_batch=k, version=self.versions_of(k)[0])]

    def _backward(self, k: int) -> list[Instruction]:
        return [BackwardPass(buffer_id=self._buf(k), micro_batch=k, version=self.versions_of(k)[1])]


def stream(m: int, P: int, stage: int, batches: int, start: int = 0, defer_step: bool = False) -> Any:
    return PACISchedule(m, P, stage, batches, start).steps()


def check(cfg: Any) -> None:
    """PACI's own constraints (both recipes)."""
    named = f"pipeline.schedule={cfg.pipeline.schedule}"
    if cfg.model.moe.experts:
        raise ConfigError(
            f"{named} does not run MoE models (the simulator's stage-by-stage run collects no router "
            "losses); use a dense model (model.moe.experts=0)"
        )
    if cfg.delay_profile != "uniform":
        raise ConfigError(f"{named} has its own staleness; use delay_profile=uniform, got {cfg.delay_profile}")


SPEC = declare_schedule(
    ScheduleSpec(
        name="paci",
        note="PACI: asynchronous 1F1B, one weight version, each stage steps in place with no barrier",
        versions=versions,
        weight_versions=lambda P, s: 1,
        in_flight=one_f_one_b_in_flight,
        stream=stream,
        delay=1,
        clip_modes=("stage",),
        compensations=("none", "ef"),
        check=check,
        in_order=True,
        inplace=True,
        flush=False,
        revision=2,
        min_micro_batches=min_micro_batches,
        label="PACI",
    )
)
