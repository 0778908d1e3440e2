"""The report's interval and time-to-target formulas against hand-computed cases (asyncpipe.report.stats, .target,
.throughput). Student t quantiles are the printed-table values."""

from __future__ import annotations

import json
import math

import pytest

from asyncpipe.report.stats import (Interval, fieller_ratio, power_at, ratio_resolved, ratio_seeds_needed,
                                    seeds_to_resolve, t_interval, t_quantile, verdict)
from asyncpipe.report.target import Ladder, along_curve, net_speedup, phrase, seed_tokens, speedup_table
from asyncpipe.report.throughput import load_bench, throughput
from asyncpipe.errors import UserError

T_975 = {1: 12.706204736174705, 2: 4.302652729911275, 5: 2.570581835636314, 16: 2.119905299221011,
         17: 2.109815577833181, 29: 2.045229642132703}  # df -> t_{df, 0.975}


@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_the_table(df):
    assert t_quantile(df + 1) == pytest.approx(T_975[df], rel=1e-8)


def test_t_interval_by_hand():
    iv = t_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, n 3
    half = T_975[2] * 1.0 / math.sqrt(3)
    assert (iv.value, iv.n, iv.kind) == (2.0, 3, "t")
    assert iv.lo == pytest.approx(2 - half, rel=1e-9) and iv.hi == pytest.approx(2 + half, rel=1e-9)
    assert not iv.excludes(0.0)  # [-0.48, 4.48] contains 0
    one = t_interval([0.5])
    assert one.value == 0.5 and not one.known and one.fmt() == "+0.5000 (n=1)"


def test_fieller_with_a_constant_denominator_is_the_t_interval_scaled():
    """den = [2, 2] has no spread: r is in the interval iff mean(num) - 2r lies within t_1 * sd(num) / sqrt(2), i.e.
    1 +- 12.7062 * sqrt(2) / sqrt(2) / 2 = 1 +- 6.3531."""
    iv = fieller_ratio([1.0, 3.0], [2.0, 2.0])
    assert (iv.value, iv.kind) == (1.0, "fieller")
    assert iv.lo == pytest.approx(1 - T_975[1] / 2, rel=1e-9) and iv.hi == pytest.approx(1 + T_975[1] / 2, rel=1e-9)


def test_fieller_point_is_the_ratio_of_means_and_its_ends_are_where_the_t_test_turns():
    num, den = [0.30, 0.41, 0.35, 0.28, 0.50], [0.45, 0.52, 0.40, 0.49, 0.58]
    iv = fieller_ratio(num, den)
    assert iv.value == pytest.approx(sum(num) / sum(den))  # not the mean of per-seed ratios
    assert iv.value != pytest.approx(sum(x / y for x, y in zip(num, den)) / 5)
    assert iv.lo < iv.value < iv.hi
    for end in (iv.lo, iv.hi):  # at each end the paired t-interval of num - r*den just touches 0
        t = t_interval([a - end * b for a, b in zip(num, den)])
        assert min(abs(t.lo), abs(t.hi)) == pytest.approx(0.0, abs=1e-12)
    inside, outside = (iv.lo + iv.value) / 2, iv.hi * 1.01
    assert not ratio_resolved(num, den, inside) and ratio_resolved(num, den, outside)  # interval and verdict agree


def test_fieller_is_unbounded_when_the_denominator_may_be_zero():
    iv = fieller_ratio([1.0, 1.0, 1.0], [1.0, -1.0, 0.5])
    assert math.isinf(iv.lo) and math.isinf(iv.hi) and not iv.excludes(0.0)
    assert iv.fmt("+.2f").endswith("[unbounded]")


def test_seeds_to_resolve_at_80_percent_power_matches_published_sample_sizes():
    """A paired two-sided 5% t-test at 80% power needs n = 10 for an effect of 1 sd (power 0.8031; 9 seeds give
    0.7480) and n = 34 for 0.5 sd (0.8078; 33 give 0.7954): G*Power's figures for dz = 1 and 0.5. The plug-in rule
    "the n at which the observed interval just clears 0" said 7 and 18."""
    assert power_at(10, 1.0) == pytest.approx(0.8031, abs=1e-4) and power_at(9, 1.0) == pytest.approx(0.7480, abs=1e-4)
    assert power_at(34, 0.5) == pytest.approx(0.8078, abs=1e-4) and power_at(33, 0.5) == pytest.approx(0.7954, abs=1e-4)
    assert seeds_to_resolve(1.0, 1.0) == 10 and seeds_to_resolve(0.5, 1.0) == 34
    assert seeds_to_resolve(0.9, 1.0, target=0.4) == 34  # the distance to the target is what counts
    assert seeds_to_resolve(0.0, 1.0) is None and seeds_to_resolve(1.0, math.nan) is None


def test_a_ratio_is_resolved_by_the_t_interval_of_its_linearisation():
    """mean(num)/mean(den) > r exactly when mean(num - r·den) > 0: num - 0.5 = [0.5, 0.7, 0.3] has mean 0.5 and
    half-width t_2 · 0.2 / sqrt(3) = 0.497 (clear of 0); against 0.6 the mean is 0.4 (not clear)."""
    num, den = [1.0, 1.2, 0.8], [1.0, 1.0, 1.0]
    assert T_975[2] * 0.2 / math.sqrt(3) == pytest.approx(0.4968, abs=1e-4)
    assert ratio_resolved(num, den, 0.5) and not ratio_resolved(num, den, 0.6)
    assert ratio_seeds_needed(num, den, 0.6) == seeds_to_resolve(0.4, 0.2)


def test_verdict_text():
    clear = Interval(0.48, 0.37, 0.60, 3, "t")
    assert verdict(clear) == ""
    open_ = Interval(0.13, -0.07, 0.33, 3, "t")
    assert verdict(open_, needed=4) == ("not resolved (3 seeds; ~4 seeds would resolve it with 80% power at this mean "
                                        "and spread)")
    assert verdict(clear, 0.5, 9, 100, "%").startswith("not resolved vs 50% (3 seeds; ~9 seeds")
    assert clear.fmt(".0f", 100, "%") == "48% [37%, 60%]"


def test_tokens_to_target_interpolates_along_the_curve():
    assert along_curve([(0, 5.0), (100, 3.0), (200, 2.0)], 2.5) == pytest.approx(150.0)
    assert along_curve([(0, 5.0), (100, 3.0)], 2.5) is None


def test_tokens_to_target_between_budgets_and_bounds():
    # 1x budget ends at 2.5, 1.5x at 1.5; target 2.0 lies half-way: 100 + 0.5 * 50 tokens.
    assert seed_tokens(2.0, [(150, 1.5), (100, 2.5)]) == (pytest.approx(125.0), True)
    # Never reached: the largest budget is a lower bound.
    assert seed_tokens(1.0, [(100, 2.5), (150, 1.5)]) == (150.0, False)
    # The smallest budget already reaches it: along that run's curve, 50 + (3 - 2.5) / (3 - 2) * 50.
    assert seed_tokens(2.5, [(100, 2.0), (150, 1.5)], [(0, 5.0), (50, 3.0), (100, 2.0)]) == (pytest.approx(75.0), True)


def test_net_speedup_is_throughput_over_token_ratio():
    ratio = Interval(1.25, 1.0, 1.5, 3, "fieller")
    assert net_speedup(ratio, None, 1.25) == "1.00x [0.83, 1.25]"
    assert net_speedup(None, 1.5, 1.25) == "≤ 0.83x"  # not reached within 1.5x the tokens: at most 1.25 / 1.5


def test_throughput_measured_nearest_or_ideal(tmp_path):
    path = tmp_path / "pipeline-P2-m4.json"
    path.write_text(json.dumps({"stages": 2, "micro_batches": 4, "variants": {
        "1f1b": {"ratio_to_1f1b": 1.0}, "dualpipev": {"ratio_to_1f1b": 1.04},
        "2bw": {"ratio_to_1f1b": 1.24}, "2bw_ef": {"ratio_to_1f1b": 1.19}}}))  # fmt: skip
    bench = load_bench([path])
    exact = throughput(2, 4, bench)
    assert exact.vs_1f1b == 1.24 and exact.best_sync == "dualpipev" and exact.vs_best_sync == pytest.approx(1.24 / 1.04)
    assert exact.source.startswith("measured, 2bw")
    assert throughput(2, 4, bench, ef=True).vs_1f1b == 1.19
    assert "at m=4" in throughput(2, 8, bench).source  # nearest measured m at the same depth
    ideal = throughput(4, 8, bench)
    assert (ideal.vs_1f1b, ideal.source, ideal.vs_best_sync) == ((8 + 4 - 1) / 8, "ideal (m+P-1)/m", None)
    bad = tmp_path / "bad.json"
    bad.write_text('{"stages": 2}')
    with pytest.raises(UserError, match="not a `bench pipeline` result"):
        load_bench([bad])


def log_t_interval(per_round: list[float]) -> tuple[float, float]:
    """95% t-interval of the per-round ratios' geometric mean, by hand: exp(mean log ± t sd / sqrt(n))."""
    logs = [math.log(x) for x in per_round]
    n, mean = len(logs), sum(logs) / len(logs)
    half = T_975[n - 1] * math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1)) / math.sqrt(n)
    return math.exp(mean - half), math.exp(mean + half)


def test_the_strongest_sync_schedule_includes_pytorchs_named(tmp_path):
    """A bench file with PyTorch's schedules (``synchronous`` flags): the fastest of every synchronous variant is the
    one 2BW is held against, named as the file names it; 2BW itself and compiled rows never count as sync. Against
    it, the throughput's interval is the t-interval of the per-round 2BW / pt_zbv ratios (paired in each round)."""
    sync = lambda r, label, rounds=None: {"ratio_to_1f1b": r, "synchronous": True, "schedule": label,  # noqa: E731
                                          **({"ratio_to_1f1b_per_round": rounds} if rounds else {})}
    path = tmp_path / "pipeline-torch-P2-m4.json"
    path.write_text(json.dumps({"stages": 2, "micro_batches": 4, "variants": {
        "1f1b": sync(1.0, "asyncpipe/DeepSpeed 1f1b"), "dualpipev": sync(1.04, "asyncpipe/DeepSpeed dualpipev"),
        "pt_1f1b": sync(1.02, "PyTorch Schedule1F1B"),
        "pt_zbv": sync(1.11, "PyTorch ScheduleZBVZeroBubble", [1.10, 1.11, 1.12]),
        "pt_zbv+compiled": sync(1.5, "PyTorch ScheduleZBVZeroBubble"),
        "2bw": {"ratio_to_1f1b": 1.24, "synchronous": False, "ratio_to_1f1b_per_round": [1.20, 1.24, 1.28]}}}))  # fmt: skip
    thr = throughput(2, 4, load_bench([path]))
    assert (thr.best_sync, thr.best_sync_label) == ("pt_zbv", "PyTorch ScheduleZBVZeroBubble")
    assert thr.vs_best_sync == pytest.approx(1.24 / 1.11)
    table = speedup_table([], load_bench([path]))
    assert table.loc[(2, 4), "strongest sync schedule (x1F1B)"] == "pt_zbv = PyTorch ScheduleZBVZeroBubble, 1.110"
    # The verdict's clause: 2BW's net speed-up over 1F1B, then over the strongest sync schedule, named.
    lad = Ladder("t", "adamw", ["2bw"], [1.0], False, 2, 4, ratio=Interval(1.1, 1.0, 1.2, 3, "fieller"))
    text = phrase(lad, load_bench([path]))
    b = 1.24 / 1.11
    lo, hi = log_t_interval([1.20 / 1.10, 1.24 / 1.11, 1.28 / 1.12])
    assert (f"against the strongest synchronous schedule measured, pt_zbv (PyTorch ScheduleZBVZeroBubble): "
            f"{b / 1.1:.2f}x [{lo / 1.2:.2f}, {hi / 1.0:.2f}] (not resolved)") in text
    assert text.startswith("at P=2, m=4 (1.24x throughput, measured, 3 rounds)")


def test_an_unbounded_ratio_is_never_called_resolved():
    """Fieller's set can be the outside of an interval (shown as unbounded): the verdict follows the interval shown,
    so such a ratio is 'not resolved' even where the t-test at the target alone would reject."""
    iv = fieller_ratio([1.0, 1.0, 1.0], [1.0, -1.0, 0.5])
    text = verdict(iv, target=1.0, resolved=True)
    assert text.startswith("not resolved") and "denominator" in text
