"""Per-step pipeline metrics without a sync point: each rank sends a small vector to rank 0 after its step;
rank 0 combines a step from every rank's vector one step later (or at the next sync point), so no rank ever
waits on metrics mid-run."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as tdist

# The numbers every rank reports per optimizer step, in vector order.
FIELDS = (
    "step",
    "stage",
    "replica",
    "loss_sum",
    "loss_count",
    "stage_sq_norm",
    "global_norm",
    "lr",
    "wait_s",
    "compute_s",
    "weight_bytes",
    "peak_weight_bytes",
    "update_sq",
    "correction_sq",
    "moe_lb_sum",
    "moe_z_sum",
    "moe_count",
    "norm_wait_s",
)


def combine_step(recs: list[dict[str, float]], step_time: float) -> dict[str, float]:
    """One step's record from every rank's numbers: the metrics.jsonl keys plus per-stage extras.

    train_loss: mean over all micro-batches of every replica (the simulator's mean at the same global batch);
    grad_norm: the pre-clip global norm (from the cross-stage all-reduce when there was one); per stage of
    replica 0: idle fraction (time waiting on communication / time in the schedule) and weight memory.
    """
    last_stage = max(int(r["stage"]) for r in recs)
    # The ranks that computed losses: the last stage's, or rank 0's in a V-shaped schedule (DualPipeV).
    last = [r for r in recs if r["loss_count"] > 0] or [r for r in recs if int(r["stage"]) == last_stage]
    loss = sum(r["loss_sum"] for r in last) / max(1.0, sum(r["loss_count"] for r in last))
    replica0 = sorted((r for r in recs if int(r["replica"]) == 0), key=lambda r: r["stage"])
    head = replica0[0]  # global rank 0: stage 0 of replica 0
    norm = head["global_norm"]
    if math.isnan(norm):
        norm = math.sqrt(sum(r["stage_sq_norm"] for r in replica0))
    out = {"step": int(head["step"]) + 1, "train_loss": loss, "lr": head["lr"], "grad_norm": norm}
    out["step_time"] = step_time
    if not math.isnan(head["update_sq"]):
        out["update_norm"] = math.sqrt(sum(r["update_sq"] for r in replica0))
        out["correction_norm"] = math.sqrt(sum(r["correction_sq"] for r in replica0))
    moe_count = sum(r.get("moe_count", 0.0) for r in recs)
    if moe_count:  # MoE router statistics of the forwards since each rank's previous step, per layer and micro-batch
        out["moe_lb_loss"] = sum(r["moe_lb_sum"] for r in recs) / moe_count
        out["moe_z_loss"] = sum(r["moe_z_sum"] for r in recs) / moe_count
    for r in replica0:
        s = int(r["stage"])
        busy = r["wait_s"] + r["compute_s"]
        out[f"stage{s}_idle_frac"] = r["wait_s"] / busy if busy > 0 else 0.0
        out[f"stage{s}_norm_wait_s"] = r["norm_wait_s"]  # blocked on the cross-stage norm all-reduce this step
        out[f"stage{s}_weight_mb"] = r["weight_bytes"] / 2**20
        out[f"stage{s}_peak_weight_mb"] = r["peak_weight_bytes"] / 2**20
    return out


class StepReporter:
    """Moves each rank's per-step numbers to rank 0 over ``group`` (gloo: the vectors stay on the CPU).

    gloo reports a receive complete only once it is waited on, so rank 0 never polls: it waits for steps
    that every rank has certainly sent. At a cut where rank 0 has applied step b, every rank has applied step
    b-1 (in 2BW with m >= P the data dependencies order it so, deferred or not, rank 0's own step b then
    following the cut; in 1F1B stage 0 steps last), so the records up to b-1 cost no waiting; the rest are
    collected at sync points (evaluation, the end).
    """

    LAG = 1  # steps rank 0 stays behind its own latest step when collecting without a sync

    def __init__(self, rank: int, world: int, group: Any) -> None:
        self.rank, self.world, self.group = rank, world, group
        self._sends: list[tuple[int, Any]] = []  # (step, work) of this rank's unfinished sends
        self._recvs: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # rank 0: step -> (vector, work)

    def send(self, step: int, rec: dict[str, float]) -> None:
        vec = torch.tensor([float(rec[k]) for k in FIELDS], dtype=torch.float64)
        if self.rank == 0:
            parts = self._recvs.setdefault(step, [(vec, None)])
            for r in range(1, self.world):
                buf = torch.empty(len(FIELDS), dtype=torch.float64)
                parts.append((buf, tdist.irecv(buf, src=r, group=self.group)))
            return
        # Rank 0 has posted its receives of step-1 by now (same ordering argument): finishing older sends
        # keeps the list short and never blocks for long.
        for old, work in self._sends:
            if old < step - 1:
                work.wait()
        self._sends = [(old, w) for old, w in self._sends if old >= step - 1]
        self._sends.append((step, tdist.isend(vec, dst=0, group=self.group)))

    def collect(self, step_times: dict[int, float], upto: Optional[int]) -> list[dict[str, float]]:
        """Rank 0: the combined records of steps <= ``upto`` (None: every step posted so far), in order.
        Other ranks: [] (with ``upto=None`` their own sends are finished first)."""
        if self.rank != 0:
            if upto is None:
                for _, w in self._sends:
                    w.wait()
                self._sends = []
            return []
        out = []
        for step in sorted(self._recvs):
            if upto is not None and step > upto:
                break
            parts = self._recvs.pop(step)
            for _, w in parts:
                if w is not None:
                    w.wait()
            recs = [dict(zip(FIELDS, t.tolist())) for t, _ in parts]
            out.append(combine_step(recs, step_times.pop(step, math.nan)))
        return out
