"""Data-parallel simulation: D local replicas of m micro-batches train like one process of D*m micro-batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import asyncpipe, read_metrics, read_summary

COMMON = ["delay=1", "train.steps=12", "train.eval_every=6", "train.micro_batch_size=4"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,rtol", [("adamw_ef", 1e-5), ("muon", 1e-4)])
def test_two_replicas_match_one_process_at_the_same_global_batch(tmp_path: Path, optimizer: str, rtol: float) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    a = asyncpipe("train", f"optimizer={optimizer}", *COMMON, "train.micro_batches=4", f"run.dir={one}")
    assert a.returncode == 0, a.stderr
    b = asyncpipe("train", f"optimizer={optimizer}", *COMMON, "train.micro_batches=2", "pipeline.data_parallel=2",
                  f"run.dir={two}")
    assert b.returncode == 0, b.stderr
    ma, mb = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(13))
    assert [m["tokens"] for m in ma] == [m["tokens"] for m in mb]  # same global batch
    for x, y in zip(ma, mb):
        for key in ("train_loss", "val_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=rtol), (x["step"], key)
    assert read_summary(two)["status"] == "completed"
    assert (two / "config.yaml").read_text().count("data_parallel: 2") == 1
