"""Every time-to-target ladder's net wall-clock speed-up at every grid point, as a long table with its numbers in
explicit columns (one row per P, m, column and synchronous schedule it is held against): the speed-up table, the
takeaways and the verdict figure read these, and the report writes them to speedups.csv.

Columns: P, m; table, optimizer, variant (the ladder's first column), ladder, schedule, ef; own (the ladder's own
P and m); against (1f1b, or the strongest synchronous schedule where it is another), against_label; throughput,
throughput_lo, throughput_hi (the throughput ratio and its interval), throughput_source (`measured, N rounds`,
`measured at m=M, N rounds`, `modelled, ±x%`, `ideal (m+P-1)/m`), throughput_detail (the file or calibration, and
which optimizer's step it timed), rounds, band; token_ratio, token_lo, token_hi (Fieller over seeds), token_bound
(a lower bound when a seed did not reach the target), seeds; speedup, lo, hi (the combined interval,
`asyncpipe.report.spread.combine`), resolved (it excludes 1), bounded (speedup is an upper limit), direction
(faster / slower / "").
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from asyncpipe.report.spread import Speedup, Spread, combine
from asyncpipe.report.stats import Interval
from asyncpipe.report.throughput import GRID, Throughput, throughput

Ladder = Any  # an `asyncpipe.report.target.Ladder` (which imports this module)

SPEEDUP_RULE = (
    "Net wall-clock speed-up over synchronous training = throughput ratio ÷ token ratio, with an interval that "
    "carries both errors: [throughput's low end ÷ token ratio's high end, throughput's high end ÷ token ratio's low "
    "end] (interval arithmetic on two independent intervals). A measured throughput (a bench file at this P) "
    "carries the 95% t-interval of its paired rounds' ratios (on logs; 'measured, N rounds'); a modelled one (the "
    "cost model) the model's worst validated error on a throughput ratio over the same synchronous schedule "
    "('modelled, ±x%', from benchmarks/results/cost-table.json); the analytic ideal is taken as exact. A cell is "
    "resolved only when that interval excludes 1; a bench file with one round (or none recorded) resolves nothing. "
    "Each column's throughput comes from bench files that timed its own optimizer's step, or says whose it is."
)


def net(sp: Speedup, ratio: Interval | None) -> str:
    """`0.63x [0.52, 0.80]` (the combined interval); `≤ 0.60x` for a token bound (with the throughput's high end's
    limit where it has a spread); `0.83x (n=1)` for one seed; the point alone where the throughput has no spread
    (the cell's throughput source says why)."""
    if sp.bounded:
        top = f" (≤ {sp.hi:.2f}x at the throughput's high end)" if math.isfinite(sp.hi) and sp.hi > sp.value else ""
        return f"≤ {sp.value:.2f}x{top}"
    if not math.isfinite(sp.value):
        return "—"
    if ratio is not None and ratio.n < 2:
        return f"{sp.value:.2f}x (n={ratio.n})"
    if math.isnan(sp.lo):
        return f"{sp.value:.2f}x"
    return f"{sp.value:.2f}x [{sp.lo:.2f}, " + ("∞)" if math.isinf(sp.hi) else f"{sp.hi:.2f}]")


def ladder_speedup(lad: Ladder, thr: Throughput, best: bool = False) -> tuple[Speedup, Spread]:
    """The ladder's net speed-up at `thr` over 1F1B (over the strongest sync schedule when `best`)."""
    spread = thr.error(best)
    value = thr.vs_best_sync if best and thr.vs_best_sync is not None else thr.vs_1f1b
    return combine(lad.ratio, lad.bound, value, spread), spread


def _row(P: int, m: int, lad: Ladder, thr: Throughput, best: bool) -> dict[str, Any]:
    sp, spread = ladder_speedup(lad, thr, best)
    iv = lad.ratio
    return {
        "P": P,
        "m": m,
        "table": lad.table,
        "optimizer": lad.optimizer,
        "variant": lad.columns[0],
        "ladder": lad.name,
        "schedule": lad.schedule,
        "ef": lad.ef,
        "own": (P, m) == (lad.stages, lad.micro_batches),
        "against": thr.best_sync if best else "1f1b",
        "against_label": thr.best_sync_label if best else "1f1b",
        "throughput": thr.vs_best_sync if best else thr.vs_1f1b,
        "throughput_lo": spread.lo,
        "throughput_hi": spread.hi,
        "throughput_source": spread.how,
        "throughput_detail": thr.source,
        "rounds": spread.rounds,
        "band": spread.band,
        "token_ratio": iv.value if iv is not None else math.nan,
        "token_lo": iv.lo if iv is not None else math.nan,
        "token_hi": iv.hi if iv is not None else math.nan,
        "token_bound": lad.bound if lad.bound is not None else math.nan,
        "seeds": len(lad.per_seed),
        "speedup": sp.value,
        "lo": sp.lo,
        "hi": sp.hi,
        "resolved": sp.resolved,
        "bounded": sp.bounded,
        "direction": sp.direction,
    }


def points(ladders: list[Ladder]) -> list[tuple[int, int]]:
    """The grid (P = 2, 4, 8; m = P, 2P, 4P) and each ladder's own P, m."""
    return sorted(dict.fromkeys(GRID + [(lad.stages, lad.micro_batches) for lad in ladders]))


def speedup_cells(ladders: list[Ladder], bench: list[dict]) -> pd.DataFrame:
    """The long table (module docstring): each ladder at each point, over 1F1B and, where it is another schedule,
    over the strongest synchronous one."""
    rows = []
    for P, m in points(ladders):
        for lad in ladders:
            thr = throughput(P, m, bench, lad.ef, lad.schedule, lad.optimizer)
            rows.append(_row(P, m, lad, thr, best=False))
            if thr.vs_best_sync is not None and thr.best_sync != "1f1b":
                rows.append(_row(P, m, lad, thr, best=True))
    return pd.DataFrame(rows)
