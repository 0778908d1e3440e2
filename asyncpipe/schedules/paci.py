"""PACI (`pipeline.schedule=paci`): asynchronous 1F1B with one weight version and no flush, after *Breaking the
Bubble: Asynchronous Pipeline Parallel Training with Bounded Weight Inconsistency* (arXiv 2606.07881).

Each stage runs 1F1B across batch boundaries (backward takes the oldest in-flight micro-batch first, stage s holds
at most P-s in flight) and steps its own optimizer in place right after every a-th backward (a = m =
`train.micro_batches`), with no barrier across stages. Numbering micro-batches over the run (k = b*m + j) and
versions by the stage's own updates, stage s with w = P-1-s warm-up forwards runs

    forward of k on  W(floor(max(k - w, 0) / m))      backward of k on  W(floor(k / m))

so within batch b the first w micro-batches (b >= 1) straddle one update: forward on W(b-1), backward on W(b);
the rest, and every micro-batch of the last stage, are fresh. A straddling micro-batch's backward is *recomputed*:
the stage re-runs its forward from the saved stage input on W(b) and back-propagates the gradient received from
the next stage through that graph, so it is exactly the gradient of the stage at W(b) given its input (autograd
never back-propagates through a graph whose saved weights the in-place step overwrote, so stock torch's version
check holds; the forward graph of a straddler is discarded). The simulator runs the same recipe stage by stage.

No global step: clipping is per stage (pipeline.clip=stage; pipeline.clip=global is refused). Compensation: none or
EF. EF under PACI is EF's rule, x -= u(t) + lam (u(t) - u(t-1)), applied by each stage to its own update stream at
its own step (u: the optimizer's update from that stage's gradient). PACI's staleness is partial: in a batch only
micro-batches j < P-1 read a one-step-older version on some stage (j < P-1-s' on stage s'), so a stage's gradient is
a mix of fresh and partly stale terms; to first order its error is at most (P-1)/m of 2BW's, and lam = (P-1)/m is EF's
matching strength (the default lam = 1 corrects for a fully stale gradient). Methods that read the stale weights
(dc, weight prediction, ...) are refused: the stage's weights at backward are the current ones. A resumed run re-runs the micro-batches in flight at its checkpoint on
the checkpoint's weights (the straddlers of that one batch read W(b), not W(b-1)).
"""

from __future__ import annotations

from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.pipe.schedule import BackwardPass, ForwardPass, Instruction, TwoBWSchedule
from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight


def versions(P: int, m: int, stage: int, k: int) -> tuple[int, int]:
    """(forward, backward) version of micro-batch ``k`` on ``stage``: see the module docstring."""
    w = P - 1 - stage
    return max(k - w, 0) // m, k // m


class PACISchedule(TwoBWSchedule):
    """2BW's tick order (1F1B without a flush, a step right after each batch's last backward on every stage,
    never deferred) with PACI's versions: forward and backward of a micro-batch may read consecutive versions.
    A resumed stream (``start``) forwards its warm-up micro-batches on W(start)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, batches: int, start: int = 0) -> None:
        super().__init__(micro_batches, stages, stage_id, batches, defer_step=False, start=start)

    def versions_of(self, micro_batch: int) -> tuple[int, int]:
        f, b = versions(self.stages, self.micro_batches, self.stage_id, micro_batch)
        return max(f, self.start), b

    def _forward(self, k: int) -> list[Instruction]:
        cmds = super()._forward(k)
        return cmds[:-1] + [ForwardPass(buffer_id=self._buf(k), micro_batch=k, version=self.versions_of(k)[0])]

    def _backward(self, k: int) -> list[Instruction]:
        return [BackwardPass(buffer_id=self._buf(k), micro_batch=k, version=self.versions_of(k)[1])]


def _stream(m: int, P: int, stage: int, batches: int, start: int = 0, defer_step: bool = False) -> Any:
    return PACISchedule(m, P, stage, batches, start).steps()


def _check(cfg: Any) -> None:
    t, p = cfg.train, cfg.pipeline
    if t.micro_batches < p.stages:
        raise ConfigError(f"pipeline.schedule=paci needs train.micro_batches >= pipeline.stages (a forward straddles "
                          f"at most one update), got {t.micro_batches} < {p.stages}")
    if cfg.model.moe.experts:
        raise ConfigError("pipeline.schedule=paci recomputes straddling forwards, which would count MoE router "
                          "losses twice; use a dense model (model.moe.experts=0)")
    if cfg.delay_profile != "uniform":
        raise ConfigError(f"pipeline.schedule=paci has its own staleness; use delay_profile=uniform, got {cfg.delay_profile}")


SPEC = declare_schedule(ScheduleSpec(
    name="paci", note="PACI: asynchronous 1F1B, one weight version, each stage steps in place with no barrier",
    versions=versions, weight_versions=lambda P, s: 1, in_flight=one_f_one_b_in_flight, stream=_stream,
    delay=1, clip_modes=("stage",), compensations=("none", "ef"), check=_check, recompute=True, flush=False,
))  # fmt: skip
