"""The end of a batch, the same for every schedule (`BatchEnd`, a mixin of
`engines.pipeline.deepspeed_engine.ScheduledPipelineEngine`): `ReduceGrads` takes the batch's gradients off its
weight version, averages them over data-parallel replicas and starts the cross-stage norm all-reduce; `OptimizerStep`
waits for it and applies `asyncpipe.optim.apply_update` (clipping, lr schedule, compensation, update), so the
math is the simulator's. It reads the engine's own attributes (stash, tied, settings, groups); it owns none.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as tdist
from deepspeed.runtime.pipe import schedule as ds_schedule

from asyncpipe.optim import apply_update, grad_sq_norm
from asyncpipe.schedules import instructions as sched


def _sq_norm_of(norms: torch.Tensor) -> torch.Tensor:
    """Squared global norm from per-tensor norms, reduced by `asyncpipe.optim.grad_sq_norm` itself (the norm
    of a scalar is the scalar), so the pipeline sums them exactly as the single-process trainer does."""
    return grad_sq_norm([SimpleNamespace(grad=n) for n in norms.unbind()])


class BatchEnd:
    """The `ReduceGrads` / `OptimizerStep` handlers of a `ScheduledPipelineEngine` (`INSTRUCTIONS`)."""

    stash: Any
    tied: Any
    spec: Any
    settings: Any
    optimizer: Any
    micro_batches: int
    num_stages: int
    stage_id: int
    global_steps: int
    global_samples: int

    def _batch_version(self, batch: int) -> int:
        """The version batch ``batch``'s gradients accumulate on here: its last micro-batch's backward's."""
        m = self.micro_batches
        return self.spec.versions(self.num_stages, m, self.stage_id, (batch + 1) * m - 1)[1]

    def _exec_reduce(self, batch: Optional[int] = None) -> None:
        """Take the batch's gradients off its weight version, average them over data-parallel replicas and
        start the cross-stage norm all-reduce (waited for by the step, so a deferred step overlaps it)."""
        b = self.global_steps if batch is None else batch
        if self.is_last_stage():  # the batch's mean loss, known at its cut (divergence is checked there)
            total, count = (self.total_loss, self.micro_batches) if self._cmds is None else self._batch_loss[b]
            self.last_loss = float(total) / max(1, count)
        grads = self.stash.take_grads(self._batch_version(b))
        if self._dp > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            with self._waiting("dp_grad_allreduce"):
                tdist.all_reduce(flat, group=self._dp_group)
            flat.div_(self._dp)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        # Per-tensor norms, placed at this stage's offset in the model-wide list; the all-reduce sums zeros
        # elsewhere, so every stage gets the exact list one process would have and reduces it like
        # `grad_sq_norm` does there (bit-identical clipping, which Muon's bf16 Newton-Schulz would amplify).
        self.tied.reduce(grads, self._waiting)  # a tied matrix: the two copies' gradients summed
        norms = torch.stack(torch._foreach_norm(self.tied.counted(grads), 2, dtype=torch.float32))
        stage_sq = _sq_norm_of(norms)
        if self.settings.max_norm > 0 and not self._global_norm:
            self.tied.share_norm(stage_sq)  # per-stage clipping: the copy is clipped by stage 0's norm
        work = None
        if self._global_norm:
            everywhere = torch.zeros(self._n_tensors_total, dtype=torch.float32, device=norms.device)
            everywhere[self._tensor_offset : self._tensor_offset + norms.numel()] = norms
            norms = everywhere
            work = tdist.all_reduce(norms, group=self._pipe_group, async_op=True)
        self._pending[b] = (grads, stage_sq, norms, work)

    def _exec_step(
        self, batch: Optional[int] = None, src_version: Optional[int] = None, dst_version: Optional[int] = None
    ) -> None:
        b = self.global_steps
        if batch is not None and batch != b:
            raise RuntimeError(f"stage {self.stage_id}: optimizer step for batch {batch} but {b} is next")
        grads, stage_sq, norms, work = self._pending.pop(b)
        self.tied.wait(self._waiting)
        if work is not None:
            with self._waiting("norm_allreduce"):
                work.wait()
        total_sq = _sq_norm_of(norms)
        params = self.stash.params
        for p, g in zip(params, grads):
            p.grad = g
        s = self.settings
        src = self.stash.latest if src_version is None else src_version
        # Compensation reads the batch's weight version while it is still stashed; the step writes a fresh one.
        norm = apply_update(
            self.optimizer,
            b,
            s.lr_schedule,
            s.max_norm,
            self.tied.clip_groups(params, total_sq.sqrt()),
            dict(zip(params, self.stash.weights(self._batch_version(b)))),
            before_step=lambda: self.stash.begin_update(src, src + 1 if dst_version is None else dst_version),
            after_step=lambda: self.stash.end_update(self.stash.latest + 1),
        )[0]
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._record(b, float(stage_sq), norm if self._global_norm else math.nan)

    INSTRUCTIONS = {
        ds_schedule.ReduceGrads: _exec_reduce,
        ds_schedule.OptimizerStep: _exec_step,
        sched.ReduceGrads: _exec_reduce,
        sched.OptimizerStep: _exec_step,
    }
