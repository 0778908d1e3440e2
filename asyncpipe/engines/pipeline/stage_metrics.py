"""What a pipeline stage reports (`StageMetrics`, a mixin of `deepspeed_engine.ScheduledPipelineEngine`):
one small vector per rank and optimizer step to rank 0 (never waited for mid-run: `engines.pipeline.metrics`), and
the stage's totals over the run (idle fraction, weight and activation memory, schedule facts, per-instruction
seconds). It reads the engine's own attributes (timer, stash, reporter, spec, settings); it owns none.
"""

from __future__ import annotations

import math
import time
from typing import Any

from asyncpipe.model import pop_moe_sums
from asyncpipe.engines.pipeline import memory


class StageMetrics:
    """Per-step records and the run's stage summary of a `ScheduledPipelineEngine`."""

    def _ops_mark(self) -> tuple | None:
        """Stand-in on host timing (settled per instruction, so no device sync): the counters before a batch."""
        if self.timer.mode != "host" or not self.standin.on:
            return None
        return (
            dict(self.timer.by_op),
            dict(self.timer.count_by_op),
            dict(self.timer.by_wait),
            dict(self.standin.target),
            time.process_time(),
        )

    def _ops_record(self, before: tuple | None, wall_s: float) -> None:
        """This train_batch call's seconds and counts per instruction kind (the stand-in breakdowns)."""
        if before is None:
            return
        diff = lambda now, was: {k: v - was.get(k, 0) for k, v in now.items() if v != was.get(k, 0)}  # noqa: E731
        self.batch_ops.append(
            {
                "wall_s": wall_s,
                "seconds_by_op": diff(self.timer.by_op, before[0]),
                "count_by_op": diff(self.timer.count_by_op, before[1]),
                "seconds_blocked_in": diff(self.timer.by_wait, before[2]),
                "standin_target_s": diff(self.standin.target, before[3]),
                # CPU seconds of the whole process (all its threads: gloo's too) in the call
                "cpu_s": time.process_time() - before[4],
            }
        )

    def _record(self, b: int, stage_sq: float, global_norm: float) -> None:
        loss_sum, count = 0.0, 0
        if self.is_last_stage():
            if self._cmds is None:  # DeepSpeed's schedule sums the batch's losses itself
                loss_sum, count = float(self.total_loss), self.micro_batches
            else:
                acc = self._batch_loss.pop(b)
                loss_sum, count = float(acc[0]), acc[1]
        self.timer.settle()  # CUDA: the step's events have completed (its numbers are read here anyway)
        d = {k: self.timer.totals.get(k, 0.0) - self._mark.get(k, 0.0) for k in ("wait", "compute", "norm_allreduce")}
        self._mark = dict(self.timer.totals)
        moe_lb, moe_z, moe_count = pop_moe_sums(self.module)
        update = getattr(self.optimizer, "last_update_norm", None)
        corr = getattr(self.optimizer, "last_correction_norm", None)
        self.reporter.send(
            b,
            {
                "step": b,
                "stage": self.stage_id,
                "replica": self.grid.data_parallel_id,
                "loss_sum": loss_sum if self.is_last_stage() else math.nan,
                "loss_count": count,
                "stage_sq_norm": stage_sq,
                "global_norm": global_norm,
                "lr": self.optimizer.param_groups[0]["lr"],
                "wait_s": d["wait"],
                "compute_s": d["compute"],
                "norm_wait_s": d["norm_allreduce"],
                "weight_bytes": self.stash.weight_bytes,
                "peak_weight_bytes": self.stash.peak_bytes,
                "update_sq": math.nan if update is None else float(update) ** 2,
                "correction_sq": math.nan if corr is None else float(corr) ** 2,
                "moe_lb_sum": moe_lb,
                "moe_z_sum": moe_z,
                "moe_count": moe_count,
            },
        )

    def poll_metrics(self, synced: bool = False) -> list[dict[str, float]]:
        """Rank 0: whole-pipeline records (see `combine_step`) of the steps every rank has surely applied, in
        order: all but the latest, or with ``synced`` (call it only where all ranks meet, e.g. right after
        `evaluate`, or at the end) every step so far. Other ranks get [] (``synced`` finishes their sends)."""
        upto = None if synced else self.global_steps - 1 - self.reporter.LAG
        return self.reporter.collect(self._batch_periods, upto)

    def stage_summary(self) -> dict[str, Any]:
        """This rank's totals over the run: idle fraction, weight memory, schedule facts."""
        self.timer.settle()
        wait, compute = self.timer.totals["wait"], self.timer.totals["compute"]
        return {
            "stage": self.stage_id,
            "replica": self.grid.data_parallel_id,
            "wait_s": wait,
            "compute_s": compute,
            "idle_frac": wait / (wait + compute) if wait + compute > 0 else 0.0,
            "param_bytes": self.stash.param_bytes,
            "peak_weight_bytes": self.stash.peak_bytes,
            "weight_versions_peak": self.stash.peak_bytes / max(1, self.stash.param_bytes),
            "deferred_step": self.defer_step,
            "global_norm_allreduce": self._global_norm,
            "schedule": self.spec.name,
            "straddled_backwards": self.straddled,
            "recomputed_backwards": self.straddled if self.spec.recompute else 0,
            "seconds_by_op": dict(self.timer.by_op),
            "seconds_blocked_in": dict(self.timer.by_wait),
            "count_by_op": dict(self.timer.count_by_op),
            # Stand-in compute: the configured seconds per micro-batch and what the waits took (pipeline.standin).
            "standin_s": list(self.settings.standin),
            "standin_real_s": dict(self.standin.real),
            "standin_target_s": dict(self.standin.target),
            # Seconds inside train_batch() calls in all (instructions plus the engine's own work between them).
            "batch_wall_s": self.batch_wall_s,
            "eval_seconds_by_op": dict(self.eval_seconds_by_op),
            "per_batch": list(self.batch_ops),
            "timing": self.timer.mode,  # host: perf_counter (CPU, or trace); cuda_events: the stream's view
            "peak_mem_bytes": memory.peak_since(self.memory_baseline, self.device),  # since the stage was built
            "peak_activation_bytes": self.activations.peak_bytes,
            "activation_bytes_per_micro_batch": self.activations.max_micro_batch_bytes,
        }
