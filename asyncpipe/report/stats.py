"""95% intervals for the report's claims, one convention throughout (numpy and scipy.stats; never torch).

- A difference (a gap to sync, EF's own effect, lambda 2 - lambda 1, method - EF) is paired by seed: the per-seed
  differences d_s get a t-interval, mean ± t_{n-1, 0.975} · sd / sqrt(n) (sd: sample std, ddof=1).
- A ratio (% of a gap closed, one optimizer's gap over another's) is the ratio of the means (never the mean of
  per-seed ratios) with Fieller's interval: the r for which the paired t-interval of num - r·den contains 0. (A
  bootstrap over 3-5 seeds has a handful of distinct resamples and comes out far too narrow: AdamW's v3 closure,
  73%, bootstraps to [61%, 92%] where Fieller gives the width its t-test supports.)
- "Not resolved": a difference's t-interval contains 0 (or the stated target); a ratio's Fieller interval contains
  the target (the same t-test of num - r·den, so the interval shown and the verdict always agree).
- Seeds needed: the smallest n at which the paired two-sided 5% t-test would reject the target with 80% power
  (POWER) if the observed mean and spread were the truth (noncentral t: scipy.stats.nct). The plug-in rule "the
  n at which the observed interval would just clear it" has only ~50% power, and says far fewer seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np
from scipy.stats import nct
from scipy.stats import t as student_t

LEVEL = 0.95
POWER = 0.80  # the power at which "seeds needed" is stated (two-sided test at 1 - LEVEL)
MAX_SEEDS = 10_000  # beyond this "seeds to resolve" is reported as not resolvable by seeds alone


@dataclass(frozen=True)
class Interval:
    """A point value with its 95% interval over n seeds; lo/hi are nan when n < 2 (no spread to measure)."""

    value: float
    lo: float
    hi: float
    n: int
    kind: str  # "t" (paired t-interval of a mean difference) or "fieller" (Fieller's interval of a ratio of means)

    @property
    def known(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)

    def excludes(self, target: float = 0.0) -> bool:
        """True when the whole interval lies on one side of `target` (the claim is resolved)."""
        return self.known and (self.lo > target or self.hi < target)

    def fmt(self, spec: str = "+.4f", scale: float = 1.0, suffix: str = "") -> str:
        """`+0.4800 [+0.3700, +0.6000]` (scale 100 and suffix % for a fraction shown as a percentage)."""
        if not math.isfinite(self.value):
            return "—"
        point = format(self.value * scale, spec) + suffix
        if self.n >= 2 and math.isinf(self.lo) and math.isinf(self.hi):
            return f"{point} [unbounded]"
        if not self.known:
            return f"{point} (n={self.n})"
        return f"{point} [{format(self.lo * scale, spec)}{suffix}, {format(self.hi * scale, spec)}{suffix}]"


def _clean(values: Sequence[float]) -> np.ndarray:
    return np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype="float64")


def t_quantile(n: int, level: float = LEVEL) -> float:
    """t_{n-1} quantile of a two-sided `level` interval (scipy.stats)."""
    return float(student_t.ppf(0.5 + level / 2, n - 1))


def t_interval(diffs: Sequence[float], level: float = LEVEL) -> Interval:
    """Paired t-interval of the mean of per-seed differences."""
    d = _clean(diffs)
    n = len(d)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "t")
    mean = float(d.mean())
    if n < 2:
        return Interval(mean, math.nan, math.nan, n, "t")
    half = t_quantile(n, level) * float(d.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t")


def fieller_ratio(num: Sequence[float], den: Sequence[float], level: float = LEVEL) -> Interval:
    """mean(num) / mean(den), num[i] and den[i] from the same seed, with Fieller's interval: every r for which the
    paired t-test of num - r·den does not reject 0. It is the set of ratios the t-criterion of `ratio_resolved`
    cannot rule out, so the interval shown and the verdict agree; it is unbounded (lo = -inf, hi = inf) when the
    denominator's own interval reaches 0."""
    pairs = [
        (a, b) for a, b in zip(num, den) if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
    ]
    n = len(pairs)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "fieller")
    a, b = np.asarray(pairs, dtype="float64").T
    point = float(a.mean() / b.mean()) if b.mean() != 0 else math.nan
    if n < 2 or not math.isfinite(point):
        return Interval(point, math.nan, math.nan, n, "fieller")
    q2 = t_quantile(n, level) ** 2 / n
    cov = np.cov(a, b, ddof=1)
    qa = (
        b.mean() ** 2 - q2 * cov[1, 1]
    )  # (mean a - r mean b)^2 <= q2 (s_aa - 2 r s_ab + r^2 s_bb), as A r^2 - 2 B r + C <= 0
    qb = a.mean() * b.mean() - q2 * cov[0, 1]
    qc = a.mean() ** 2 - q2 * cov[0, 0]
    disc = qb * qb - qa * qc
    if qa <= 0 or disc < 0:
        return Interval(point, -math.inf, math.inf, n, "fieller")
    root = math.sqrt(disc)
    return Interval(point, float((qb - root) / qa), float((qb + root) / qa), n, "fieller")


def power_at(n: int, effect: float, level: float = LEVEL) -> float:
    """Power of the two-sided paired t-test at `level` with n seeds when the true mean is `effect` standard
    deviations from the target: P(|T| > t_{n-1}) for T noncentral t with n-1 df and noncentrality effect·sqrt(n)."""
    crit = t_quantile(n, level)
    nc = abs(effect) * math.sqrt(n)
    return float(nct.sf(crit, n - 1, nc) + nct.cdf(-crit, n - 1, nc))


def seeds_to_resolve(
    mean: float, sd: float, target: float = 0.0, level: float = LEVEL, power: float = POWER
) -> int | None:
    """The smallest n (>= 2) at which the two-sided paired t-test at `level` rejects `target` with probability
    `power`, if the observed mean and spread were the true ones. None when nothing would (mean at the target, no
    spread measured, or more than MAX_SEEDS)."""
    gap = abs(mean - target)
    if not (math.isfinite(gap) and math.isfinite(sd)) or gap == 0:
        return None
    if sd == 0:
        return 2
    effect = gap / sd
    z = NormalDist().inv_cdf
    n = max(2, math.ceil(((z(0.5 + level / 2) + z(power)) / effect) ** 2))  # the normal bound, then walk
    if n > MAX_SEEDS:
        return None
    while power_at(n, effect, level) < power:
        n += 1
        if n > MAX_SEEDS:
            return None
    while n > 2 and power_at(n - 1, effect, level) >= power:
        n -= 1
    return n


def diff_seeds_needed(diffs: Sequence[float], target: float = 0.0) -> int | None:
    d = _clean(diffs)
    return seeds_to_resolve(float(d.mean()), float(d.std(ddof=1)), target) if len(d) > 1 else None


def ratio_resolved(num: Sequence[float], den: Sequence[float], target: float) -> bool:
    """Whether mean(num)/mean(den) clears `target`: the t-interval of the per-seed num - target·den excludes 0."""
    return t_interval([a - target * b for a, b in zip(num, den)]).excludes(0.0)


def ratio_seeds_needed(num: Sequence[float], den: Sequence[float], target: float) -> int | None:
    """Seeds that would resolve mean(num)/mean(den) against `target` at POWER: the ratio clears the target exactly
    when the mean of the per-seed num - target·den clears 0 (for a positive denominator), so its t-test applies."""
    return diff_seeds_needed([a - target * b for a, b in zip(num, den)])


def verdict(
    interval: Interval,
    target: float = 0.0,
    needed: int | None = None,
    scale: float = 1.0,
    unit: str = "",
    resolved: bool | None = None,
) -> str:
    """ "" when the claim clears `target` (`resolved`, default: the interval excludes it); else "not resolved[ vs
    TARGET] (~N seeds would resolve it)"."""
    shown = f"{target * scale:.0f}" if unit == "%" else f"{target * scale:g}"
    where = f" vs {shown}{unit}" if target != 0 else ""
    if interval.n >= 2 and math.isinf(interval.lo) and math.isinf(interval.hi):  # Fieller, denominator may be 0
        return f"not resolved{where} ({interval.n} seeds: the denominator's own interval reaches 0)"
    if interval.excludes(target) if resolved is None else resolved:
        return ""
    if not interval.known:
        return f"not resolved{where} (n={interval.n}: no spread measured)"
    more = (
        f"; ~{needed} seeds would resolve it with {POWER:.0%} power at this mean and spread"
        if needed
        else "; more seeds would not resolve it"
    )
    return f"not resolved{where} ({interval.n} seeds{more})"
