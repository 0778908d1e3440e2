"""Stand-in compute for the pipeline engine (`asyncpipe bench pipeline --standin F,B`, `pipeline.standin`): every
stage's forward and backward of a micro-batch waits a configured time on top of a tiny real op, while the
schedule's instruction stream, DeepSpeed's engine, the p2p sends over gloo, the deferred global-norm
all-reduce and the optimizer step on the real (small) parameters all run for real. A waiting rank does not
compete for cores, so P = 4 and 8 run on a 2-core machine, and a schedule's ideal step time is known from the
configured times alone: what the measured step adds to it is the engine's.

Why "on top of a tiny real op" and not "instead of compute": the real forward keeps every activation,
gradient and p2p message exactly the shape the engine expects (no fake tensors), and with the tiny model at a
small micro-batch its cost is a small, measured part of the per-instruction overhead reported here
(instruction wall time minus the configured wait), not hidden.

One record per (schedule, P, m) (`RECORD_KEYS`; docs/performance.md "Stand-in compute"):
``schedule``, ``stages``, ``micro_batches``, ``forward_s`` / ``backward_s`` (configured per stage and
micro-batch; a V's two chunks wait half each; ``weight_s`` null: no schedule here splits the weight-gradient
pass), ``step_time_s`` (median steady step, rank 0's `train_batch` wall), ``min_step_time_s``,
``tokens_per_s``, ``ideal_step_s`` (the schedule's own instruction stream or op order replayed at F, B with a
free optimizer step and free messages: `ideal_step_s`), ``bubble_model_step_s`` ((m+P-1)(F+B) for a flush,
m(F+B) without), ``fraction_of_ideal`` (ideal / measured; ``fraction_of_ideal_best_step``: ideal / the
fastest steady step), ``timing`` (the stage clock's mode), and the
per-instruction figures of stage 0..P-1 (replica 0) over the whole job: ``per_instruction_s`` (mean wall time
per instruction kind), ``overhead_s_per_instruction`` (the same minus the configured wait, for forward and
backward; equal to the wall time for the rest), ``instructions_per_step`` and ``step_breakdown_s`` (per stage,
seconds per step: configured ``wait`` (the stand-in), forward/backward ``compute_overhead``, p2p ``comm``,
``reduce``, ``optimizer_step`` (of which ``norm_wait``), ``other`` instructions and ``outside`` any instruction;
and ``cpu``, the rank's CPU seconds in those calls).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence

from asyncpipe.errors import UserError

RECORD_KEYS = (
    "schedule",
    "stages",
    "micro_batches",
    "forward_s",
    "backward_s",
    "weight_s",
    "step_time_s",
    "min_step_time_s",
    "tokens_per_s",
    "ideal_step_s",
    "bubble_model_step_s",
    "fraction_of_ideal",
    "timing",
    "per_instruction_s",
    "overhead_s_per_instruction",
    "instructions_per_step",
    "step_breakdown_s",
)
COMPUTE = {"ForwardPass": 0, "BackwardPass": 1}  # instruction -> index of its configured time
COMM = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P")


def parse_standin(text: str) -> tuple[float, float]:
    """``F,B`` seconds (e.g. ``0.02,0.04``) -> (F, B); a bad value is one line."""
    parts = [x.strip() for x in text.split(",")]
    try:
        fb = tuple(float(x) for x in parts)
    except ValueError:
        fb = ()
    if len(fb) != 2 or not all(math.isfinite(x) and 0 < x <= 60 for x in fb):
        raise UserError(
            f"--standin {text!r}: give forward and backward seconds per stage and micro-batch, "
            "each in (0, 60], e.g. --standin 0.02,0.04"
        )
    return fb[0], fb[1]


def standin_overrides(forward_s: float, backward_s: float) -> list[str]:
    return [f"pipeline.standin.forward_s={forward_s}", f"pipeline.standin.backward_s={backward_s}"]


def ideal_step_s(
    schedule: str,
    P: int,
    m: int,
    forward_s: float,
    backward_s: float,
    batches: int = 4,
    chunks: Optional[tuple[Sequence[float], Sequence[float]]] = None,
) -> Optional[float]:
    """The step time of ``schedule`` with stage costs F, B per micro-batch (or ``chunks``: F and B of every chunk,
    a per-layer stand-in's: `engines.pipeline.standin.chunk_seconds`), a free optimizer step and free messages: a
    flushed one-batch order replayed (`asyncpipe.timelines.orders`), or what one more batch adds to a run of the
    schedule's own instruction streams (no flush: its steady state). None where it cannot run."""
    from asyncpipe.schedules import get
    from asyncpipe.timelines import orders
    from asyncpipe.timelines.timeline import simulate_schedule

    spec = get(schedule)
    fwd, bwd = (forward_s, backward_s) if chunks is None else (list(chunks[0]), list(chunks[1]))
    try:
        if spec.orders:
            per_chunk = None if chunks is None else {"F": fwd, "B": bwd}
            plan = orders.plan(spec.orders, P, m)
            return orders.replay(plan, forward_s, backward_s, chunk_costs=per_chunk).makespan
        runs = [
            simulate_schedule(spec.name, m, P, n, forward=fwd, backward=bwd, step=0.0).makespan
            for n in (batches, batches + 1)
        ]
    except UserError:
        return None
    return runs[1] - runs[0]


def bubble_model_step_s(schedule: str, P: int, m: int, forward_s: float, backward_s: float) -> float:
    """(m+P-1)(F+B) for a schedule that flushes every batch, m(F+B) for one that does not."""
    from asyncpipe.schedules import get

    return (m + (P - 1 if get(schedule).flush else 0)) * (forward_s + backward_s)


def _steady(x: dict, skip: int) -> list[dict]:
    """A stage summary's per-batch figures without ``skip`` batches at each end (fill; drain and final sync)."""
    batches = x.get("per_batch", [])
    return batches[skip : len(batches) - skip] or batches


def _sum(batches: list[dict], key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for bt in batches:
        for k, v in bt.get(key, {}).items():
            out[k] = out.get(k, 0.0) + v
    return out


def _stage_breakdown(batches: list[dict]) -> dict[str, float]:
    """Seconds per steady batch of one stage's train_batch() calls, partitioned (the keys but ``wall``,
    ``norm_wait``, which is inside ``optimizer_step``, and ``cpu`` add up to ``wall``); ``cpu``: the rank's CPU
    seconds in the calls (all its threads; NaN in records from before it was kept)."""
    n = max(1, len(batches))
    by, target = _sum(batches, "seconds_by_op"), sum(_sum(batches, "standin_target_s").values())
    wall = sum(bt["wall_s"] for bt in batches)
    compute, comm = sum(by.get(k, 0.0) for k in COMPUTE), sum(by.get(k, 0.0) for k in COMM)
    reduce, opt = by.get("ReduceGrads", 0.0), by.get("OptimizerStep", 0.0)
    return {
        k: v / n
        for k, v in {
            "standin": target,
            "compute_overhead": compute - target,
            "comm": comm,
            "reduce": reduce,
            "optimizer_step": opt,
            "norm_wait": _sum(batches, "seconds_blocked_in").get("norm_allreduce", 0.0),
            "other": sum(by.values()) - compute - comm - reduce - opt,
            "outside": wall - sum(by.values()),
            "wall": wall,
            "cpu": sum(bt.get("cpu_s", math.nan) for bt in batches),
        }.items()
    }


def instruction_figures(summaries: list[dict], P: int, skip: int = 1) -> dict[str, Any]:
    """Per-instruction wall time, overhead over the configured compute time and per-batch breakdown over the
    steady batches (``skip`` dropped at each end, as the step times) of the stage summaries (replica 0) of one
    job (`ScheduledPipelineEngine.stage_summary`'s ``per_batch``)."""
    by_stage = {x["stage"]: x for x in summaries if x.get("replica", 0) == 0}
    steady = [_steady(by_stage[s], skip) for s in range(P) if s in by_stage]
    by = [_sum(b, "seconds_by_op") for b in steady]
    count = [_sum(b, "count_by_op") for b in steady]
    target = [_sum(b, "standin_target_s") for b in steady]
    kinds = sorted({k for c in count for k in c})
    per: dict[str, float] = {}
    over: dict[str, float] = {}
    for k in kinds:
        n = sum(c.get(k, 0) for c in count)
        wall = sum(x.get(k, 0.0) for x in by)
        per[k] = over[k] = wall / n if n else float("nan")
        if k in COMPUTE and n:
            kind = "forward" if COMPUTE[k] == 0 else "backward"
            over[k] = (wall - sum(t.get(kind, 0.0) for t in target)) / n
    real: dict[str, float] = {}
    for k, kind in (("ForwardPass", "forward"), ("BackwardPass", "backward")):  # whole job: the real op's mean
        n = sum(x.get("count_by_op", {}).get(k, 0) for x in by_stage.values())
        real[k] = sum(x.get("standin_real_s", {}).get(kind, 0.0) for x in by_stage.values()) / n if n else float("nan")
    batches = max(1, len(steady[0])) if steady else 1
    return {
        "per_instruction_s": per,
        "overhead_s_per_instruction": over,
        "real_op_s_per_instruction": real,
        "instructions_per_step": {k: sum(c.get(k, 0) for c in count) / len(count) / batches for k in kinds},
        "step_breakdown_s": [_stage_breakdown(b) for b in steady],
        "steady_batches": batches,
        "recomputed_per_step": [
            x.get("recomputed_backwards", 0) / max(1, len(x.get("per_batch", []))) for x in by_stage.values()
        ],
        "weight_versions_peak": [x.get("weight_versions_peak") for x in by_stage.values()],
        "peak_weight_mb": [x.get("peak_weight_bytes", 0) / 2**20 for x in by_stage.values()],
    }


def standin_record(
    schedule: str,
    P: int,
    m: int,
    forward_s: float,
    backward_s: float,
    jobs: Sequence[dict],
    skip: int = 1,
    chunks: Optional[tuple[Sequence[float], Sequence[float]]] = None,
) -> dict[str, Any]:
    """One (schedule, P, m) record from its jobs' stats (`asyncpipe.bench.pipeline` ``job_stats``: step
    times of the steady steps and the stage summaries; the last job's summaries give the instruction figures).
    ``chunks``: a per-layer stand-in's F and B per chunk (then ``forward_s`` / ``backward_s`` are the slowest
    stage's), kept in the record as ``forward_s_per_chunk`` / ``backward_s_per_chunk``."""
    step = statistics.median(j["step_time_s"] for j in jobs)
    ideal = ideal_step_s(schedule, P, m, forward_s, backward_s, chunks=chunks)
    return {
        "schedule": schedule,
        "stages": P,
        "micro_batches": m,
        "forward_s": forward_s,
        "backward_s": backward_s,
        "weight_s": None,
        **({} if chunks is None else {"forward_s_per_chunk": list(chunks[0]), "backward_s_per_chunk": list(chunks[1])}),
        "step_time_s": step,
        "min_step_time_s": min(j["min_step_time_s"] for j in jobs),
        "step_time_s_per_round": [j["step_time_s"] for j in jobs],
        "tokens_per_s": statistics.median(j["tokens_per_s"] for j in jobs),
        "ideal_step_s": ideal,
        "bubble_model_step_s": bubble_model_step_s(schedule, P, m, forward_s, backward_s),
        "fraction_of_ideal": ideal / step if ideal else None,
        # Load only ever slows a step down: the fastest steady step is the least disturbed.
        "fraction_of_ideal_best_step": ideal / min(j["min_step_time_s"] for j in jobs) if ideal else None,
        "timing": sorted({x.get("timing", "host") for x in jobs[-1]["stages"]}),
        **instruction_figures(jobs[-1]["stages"], P, skip),
    }


def stage_figures(cfg: Any) -> tuple[float, float, Optional[tuple[list[float], list[float]]]]:
    """(F, B) per stage and micro-batch of ``cfg``'s stand-in, and its per-chunk (F, B) lists under a per-layer
    profile (None otherwise; F and B then the slowest stage's: a V's two chunks summed)."""
    from asyncpipe.engines.pipeline.standin import chunk_seconds

    chunks = chunk_seconds(cfg)
    if chunks is None:
        node = cfg.pipeline.standin
        return float(node.forward_s), float(node.backward_s), None
    fwd, bwd = chunks
    n = len(fwd)
    P = int(cfg.pipeline.stages)
    mine = [[r] if n == P else [r, n - 1 - r] for r in range(P)]
    slowest = max(range(P), key=lambda r: sum(fwd[c] + bwd[c] for c in mine[r]))
    return sum(fwd[c] for c in mine[slowest]), sum(bwd[c] for c in mine[slowest]), chunks
