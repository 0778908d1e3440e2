"""End-to-end: `asyncpipe train` on the tiny model writes a complete run dir and learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def asyncpipe(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "asyncpipe", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_tiny_adamw_writes_run_dir_and_learns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = asyncpipe("train", "model=tiny", "optimizer=adamw", "train.steps=50", f"run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    assert {"config.yaml", "metrics.jsonl", "summary.json"} <= {p.name for p in run.iterdir()}
    metrics = read_metrics(run)
    assert metrics[0]["step"] == 0 and "val_loss" in metrics[0]
    steps = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, 51))
    for key in ("step", "tokens", "train_loss", "lr", "grad_norm", "step_time", "tokens_per_s"):
        assert key in steps[-1]
    assert "val_loss" in steps[-1]
    assert steps[-1]["val_loss"] < metrics[0]["val_loss"] - 0.5
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final_val_loss"] == steps[-1]["val_loss"]
    assert summary["tokens"] == steps[-1]["tokens"] == 50 * 8 * 4 * 64
    assert "optimizer:\n  name: adamw" in (run / "config.yaml").read_text()


def test_muon_ef_delay1_records_ef_in_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = asyncpipe("train", "optimizer=muon_ef", "delay=1", "train.steps=20", f"run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    recorded = yaml.safe_load((run / "config.yaml").read_text())  # the *_ef switch resolved at composition
    assert recorded["compensation"]["name"] == "ef" and recorded["compensation"]["ef"]["lam"] == 1.0
    assert recorded["optimizer"]["ef"]["enabled"] is False and recorded["delay"] == 1
    last = read_metrics(run)[-1]
    assert last["update_norm"] > 0 and last["correction_norm"] > 0


def test_user_mistake_is_one_line_exit_2_and_no_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = asyncpipe("train", "model=nope", f"run.dir={run}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'nope'" in lines[0] and "tiny" in lines[0]
    assert not run.exists()


def test_existing_run_dir_is_not_overwritten(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert asyncpipe("train", "train.steps=2", f"run.dir={run}").returncode == 0
    proc = asyncpipe("train", "train.steps=2", f"run.dir={run}")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr


def test_fresh_gradient_cosine_diagnostic(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = asyncpipe("train", "delay=1", "train.steps=6", "diagnostics.fresh_grad_every=2", f"run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    metrics = [m for m in read_metrics(run) if m["step"] > 0]
    with_cos = [m["step"] for m in metrics if "fresh_grad_cos" in m]
    assert with_cos == [1, 3, 5]  # measured before the steps 0, 2, 4 are applied
    assert all(-1.0 <= m["fresh_grad_cos"] <= 1.0 for m in metrics if "fresh_grad_cos" in m)
    # at step 0 the stale weights are W(0) itself: stale and fresh gradients coincide
    assert metrics[0]["fresh_grad_cos"] == pytest.approx(1.0, abs=1e-6)
    assert metrics[2]["fresh_grad_cos"] < 1.0 - 1e-6
