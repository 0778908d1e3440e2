"""`asyncpipe bench simulator`: one column per staleness mitigation, with the memory each one keeps."""

from __future__ import annotations

from asyncpipe.bench.simulator import bench_simulator
from asyncpipe.optim.compensation import available


def test_every_method_gets_a_column_with_its_extra_memory() -> None:
    small = ["train.seq_len=32", "train.micro_batches=1", "train.micro_batch_size=2", "run.dir=unused"]
    res = bench_simulator(small, rounds=1, steps_per_round=1, warmup=2, log=lambda m: None)
    methods = [m for m in available() if m not in ("none", "ef")]
    assert list(res["median_step_s"]) == ["delay0", "delay1", "delay1_ef", *(f"delay1_{m}" for m in methods)]
    extra, params = res["extra_bytes"], res["param_bytes"]
    # delay 1 keeps one stale copy of every weight; EF adds u(t-1), adaptive EF u(t-1) and d(t-1),
    # update averaging its EMA m, prediction W(t-k-1) (velocity EMA off by default); dc, stage_lr: no buffer.
    assert extra["delay0"] == 0 and extra["delay1"] == params
    assert extra["delay1_ef"] == 2 * params and extra["delay1_ef_adaptive"] == 3 * params
    assert extra["delay1_update_averaging"] == 2 * params and extra["delay1_weight_prediction"] == 2 * params
    assert extra["delay1_stage_lr"] == params
    assert params < extra["delay1_dc"] <= 2 * params  # DC-ASGD-a: EMA of g*g
    assert extra["delay1_basis_rotation"] > params  # Kronecker factors and eigenbases of the matrices
    assert all(t > 0 for t in res["median_step_s"].values())


def test_delay_k_is_measured_at_k_and_what_the_variants_set_is_refused() -> None:
    import pytest

    from asyncpipe.bench.simulator import all_variants, split_delay
    from asyncpipe.errors import UserError

    rest, delay = split_delay(["model=tiny", "delay=5"])
    assert (rest, delay) == (["model=tiny"], 5)
    variants = all_variants(delay)
    assert list(variants)[:3] == ["delay0", "delay5", "delay5_ef"]
    assert all(v[0] == "delay=5" for name, v in variants.items() if name != "delay0")
    for bad, match in [("delay=0", "need delay >= 1"), ("delay=x", "need delay >= 1"),
                       ("compensation=dc", "would be replaced"), ("optimizer.ef.enabled=true", "would be replaced"),
                       ("train.compile=true", "would be replaced")]:  # fmt: skip
        with pytest.raises(UserError, match=match):
            bench_simulator([bad], rounds=1, log=lambda m: None)  # refused before any trainer is built


def test_a_ratio_inside_its_spread_is_marked_as_noise() -> None:
    from asyncpipe.bench.simulator import format_result, ratio_spread

    base = [1.0, 1.1, 0.9, 1.0, 1.2]
    lo, hi = ratio_spread([1.05, 1.0, 1.15, 0.95, 1.1], base)
    assert lo < 1.0 < hi  # overlapping step times: the ratio is not a finding
    lo, hi = ratio_spread([2.0, 2.1, 1.9, 2.2, 2.0], base)
    assert lo > 1.0  # twice as slow in every quartile
    res = {"model": "tiny", "optimizer": "adamw", "delay": 1, "threads": 1, "samples_per_variant": 5,
           "load_avg": [3.5, 2, 1], "load_avg_after": [4.25, 2, 1], "cpu_count": 2, "modes": ["eager"],
           "median_step_s": {"delay0": 0.1, "delay1": 0.095}, "ratio_to_delay0": {"delay0": 1.0, "delay1": 0.95},
           "within_spread": {"delay0": True, "delay1": True}, "extra_bytes": {"delay0": 0, "delay1": 2**20},
           "param_bytes": 2**20}  # fmt: skip
    text = format_result(res)
    assert "load 3.50 -> 4.25 on 2 CPUs" in text
    assert "x0.950~" in text.splitlines()[-1]  # faster than sync, but within the noise: said so
