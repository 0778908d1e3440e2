"""Throughput's own error, and the net speed-up's interval once it is in: a measured throughput ratio carries the
spread of its bench file's paired rounds, a modelled one the cost model's validated error band, and the net
speed-up (throughput ratio / token ratio) combines that interval with the token ratio's.

- **Measured** (a `bench pipeline` file): every round times every schedule back to back under the same load, so
  the per-round ratio (schedule's tokens/s over 1F1B's, or over the strongest sync schedule's, in the same round)
  is paired and the load the round shares cancels. The interval is the 95% t-interval of the mean of the per-round
  log ratios, exponentiated: a ratio's error is multiplicative (log scale; the interval stays above 0), and a
  paired t-interval is the report's convention for every paired mean (`asyncpipe.report.stats`). Not min/max over
  rounds: the range of n rounds covers the median with only 1 - 2^(1-n) (75% at 3 rounds), a weaker statement
  than every other interval in the report makes; the t-interval at 3 rounds is wide (t_2 = 4.30), and that width is
  what three rounds support. The point stays the file's own ratio (median tokens/s over 1F1B's median); where it
  falls outside the t-interval the interval is widened to hold it. One round (or rounds not recorded): no spread,
  nothing resolved.
- **Modelled** (the cost model at a depth no file measured): the worst relative error of a modelled throughput
  ratio over the same synchronous schedule in the cost model's committed validation tables
  (benchmarks/results/cost-table.json, rendered in docs/performance.md: real compute at P = 2, stand-in compute at
  P = 2, 4, 8), read from the records, not typed in: with error e = predicted / measured - 1 and |e| <= band, the
  true ratio lies in [predicted / (1 + band), predicted / (1 - band)]. The band covers what the model was checked
  on; real compute at depth it has not been checked on (docs/performance.md says so).
- **Ideal** ((m+P-1)/m, no bench file at all): an analytic figure with no error band, taken as exact.

Combined: the net speed-up's interval is [throughput lo / token-ratio hi, throughput hi / token-ratio lo] (interval
arithmetic on the two independent intervals). Whenever both cover their truths the combined one covers the
speed-up (probability >= 0.95 x 0.95 for the independent bench rounds and training seeds, distribution-free; a
modelled band is a bound, so 0.95 there); on the log scale the half-widths add where the delta method would add
them in quadrature, so with near-normal logs it covers at least 95%. A cell is resolved only when that interval
excludes 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from asyncpipe.report.stats import LEVEL, Interval, t_quantile

VALIDATION = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cost-table.json"
VALIDATION_DOC = "docs/performance.md, cost tables"


@dataclass(frozen=True)
class Spread:
    """A throughput ratio's interval and where its width comes from (`how`, said beside every cell)."""

    lo: float
    hi: float
    how: str  # "measured, 3 rounds" / "modelled, ±4.0%" / "ideal (m+P-1)/m" / "measured, 1 round: no spread"
    rounds: int = 0  # paired bench rounds behind a measured ratio
    band: float = math.nan  # a modelled ratio's validated relative error band

    @property
    def known(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)


def exact(value: float, how: str) -> Spread:
    """A figure taken as exact (the analytic ideal)."""
    return Spread(value, value, how)


def rounds_spread(per_round: Sequence[float] | None, point: float, how: str = "measured") -> Spread:
    """The 95% t-interval of the paired per-round ratios' geometric mean, holding `point` (module docstring)."""
    logs = [math.log(r) for r in per_round or () if isinstance(r, (int, float)) and math.isfinite(r) and r > 0]
    n = len(logs)
    if n < 2:
        why = "rounds not recorded" if n == 0 else "1 round"
        return Spread(math.nan, math.nan, f"{how}, {why}: no spread", n)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t_quantile(n, LEVEL) * sd / math.sqrt(n)
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    return Spread(min(lo, point), max(hi, point), f"{how}, {n} rounds", n)


def paired_over(a: Sequence[float] | None, b: Sequence[float] | None) -> list[float] | None:
    """Per-round a / b (two variants' ratios to the same round's 1F1B): the ratio of a over b in each round."""
    if not a or not b or len(a) != len(b):
        return None
    return [x / y for x, y in zip(a, b)]


@cache
def model_band(reference: str) -> tuple[float, str] | None:
    """(the worst validated relative error of a modelled throughput ratio over `reference`, where it was), from the
    cost model's validation table; over any synchronous schedule when none was checked against `reference`; None
    when the table is not there (then a modelled cell has no band and resolves nothing)."""
    errors = validated_errors()
    if not errors:
        return None
    own = [e for e in errors if e[1] == reference] or errors
    worst = max(own, key=lambda e: abs(e[0]))
    return abs(worst[0]), worst[2]


@cache
def validated_errors(path: Path = VALIDATION) -> tuple[tuple[float, str, str], ...]:
    """(relative error, synchronous schedule, where) of every validated ratio of an asynchronous schedule over a
    synchronous one at the same P and m: the real-compute rows (their ratios to 1F1B, median of rounds) and the
    stand-in rows (ratios of step times)."""
    from asyncpipe import schedules

    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    sync = {s.name for s in schedules.schedules() if s.flush}
    out: list[tuple[float, str, str]] = []
    real = {}
    for row in table.get("rows", []):  # real compute at P = 2: throughput ratios to 1F1B
        real.setdefault((2, row["m"]), {})[row["variant"]] = (row["measured_ratio"], row["predicted_ratio"])
    for (P, m), at in real.items():
        out += _pairs(at, sync, f"real compute, P = {P}, m = {m}")
    standin: dict = {}
    for row in table.get("standin", {}).get("rows", []):  # stand-in compute at P = 2, 4, 8: throughput = 1 / step
        standin.setdefault((row["P"], row["m"]), {})[row["schedule"]] = (
            1 / row["measured_step_s"],
            1 / row["predicted_step_s"],
        )
    for (P, m), at in standin.items():
        out += _pairs(at, sync, f"stand-in compute, P = {P}, m = {m}")
    return tuple(out)


def _pairs(at: dict, sync: set, where: str) -> list[tuple[float, str, str]]:
    """Every asynchronous variant's ratio over every synchronous one at one (P, m): predicted / measured - 1."""
    out = []
    for a, (meas_a, pred_a) in at.items():
        if a.split("_ef")[0] in sync:
            continue
        for s, (meas_s, pred_s) in at.items():
            if s in sync:
                out.append(((pred_a / pred_s) / (meas_a / meas_s) - 1, s, f"{a} over {s}, {where}"))
    return out


def modelled_spread(point: float, reference: str) -> Spread:
    """A modelled ratio over `reference` within the cost model's validated band."""
    found = model_band(reference)
    if found is None:
        return Spread(math.nan, math.nan, "modelled, no validated band (cost-table.json not found)")
    band, _ = found
    return Spread(point / (1 + band), point / (1 - band), f"modelled, ±{band:.1%}", band=band)


@dataclass(frozen=True)
class Speedup:
    """A net speed-up (throughput ratio / token ratio) with its combined interval."""

    value: float
    lo: float
    hi: float
    resolved: bool  # the combined interval excludes 1
    bounded: bool = False  # the tokens are a lower bound (a seed did not reach the target): value is an upper limit

    @property
    def direction(self) -> str:
        if not self.resolved:
            return ""
        return "faster" if self.lo > 1 else "slower"


def combine(ratio: Interval | None, bound: float | None, thr: float, spread: Spread) -> Speedup:
    """Throughput / tokens with both intervals: [spread.lo / ratio.hi, spread.hi / ratio.lo] (module docstring); a
    token ratio reaching 0 or below leaves it unbounded above. A token lower bound gives an upper limit only."""
    if bound is not None:
        top = spread.hi / bound if spread.known else math.nan
        return Speedup(thr / bound, 0.0, top, False, True)
    if ratio is None or not math.isfinite(ratio.value) or ratio.value <= 0:
        return Speedup(math.nan, math.nan, math.nan, False)
    value = thr / ratio.value
    if ratio.n < 2 or math.isnan(ratio.lo) or math.isnan(ratio.hi) or not spread.known:
        return Speedup(value, math.nan, math.nan, False)
    lo = spread.lo / ratio.hi if math.isfinite(ratio.hi) and ratio.hi > 0 else 0.0
    hi = spread.hi / ratio.lo if ratio.lo > 0 else math.inf
    return Speedup(value, lo, hi, lo > 1 or hi < 1)
