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
