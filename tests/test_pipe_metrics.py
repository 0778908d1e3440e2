"""Combining the per-rank step numbers into one metrics record (pure Python)."""

from __future__ import annotations

import math

import pytest

from asyncpipe.engines.pipeline.metrics import FIELDS, combine_step


def _rec(stage: int, replica: int, **kw: float) -> dict[str, float]:
    rec = dict.fromkeys(FIELDS, 0.0)
    rec.update(step=6, stage=stage, replica=replica, lr=0.5, global_norm=math.nan, update_sq=math.nan)
    rec.update(kw)
    return rec


def test_loss_is_the_mean_over_every_replica_and_norm_sums_stages():
    recs = [
        _rec(0, 0, stage_sq_norm=9.0, wait_s=1.0, compute_s=3.0, weight_bytes=2**21),
        _rec(0, 1, stage_sq_norm=9.0),
        _rec(1, 0, stage_sq_norm=16.0, loss_sum=8.0, loss_count=4),
        _rec(1, 1, stage_sq_norm=16.0, loss_sum=12.0, loss_count=4),
    ]
    out = combine_step(recs, step_time=0.25)
    assert out["step"] == 7 and out["lr"] == 0.5 and out["step_time"] == 0.25
    assert out["train_loss"] == pytest.approx(20.0 / 8)
    assert out["grad_norm"] == pytest.approx(5.0)  # sqrt(9 + 16), replicas hold the same averaged gradient
    assert out["stage0_idle_frac"] == pytest.approx(0.25) and out["stage0_weight_mb"] == 2.0
    assert "update_norm" not in out


def test_cross_stage_norm_is_taken_as_is_and_ef_norms_add_up():
    recs = [_rec(0, 0, global_norm=7.0, update_sq=1.0, correction_sq=4.0), _rec(1, 0, update_sq=3.0, correction_sq=5.0)]
    out = combine_step(recs, step_time=1.0)
    assert out["grad_norm"] == 7.0
    assert out["update_norm"] == pytest.approx(2.0) and out["correction_norm"] == pytest.approx(3.0)
