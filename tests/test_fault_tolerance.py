"""Fault tolerance of the simulator: exact kill-and-resume, signal checkpoints, partial and foreign checkpoints,
divergence. (The pipeline's counterparts live in test_pipe_fault_tolerance.py.)"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from helpers import asyncpipe, losses, read_metrics, read_summary, start, wait_for_step

RUN = ["optimizer=adamw_ef", "delay=1", "train.steps=24", "train.eval_every=6", "checkpoint.every=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ft") / "reference"
    proc = asyncpipe("train", *RUN, f"run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    return run


def test_sigkill_then_resume_is_bit_identical(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "killed"
    proc = start("train", *RUN, f"run.dir={run}", log=tmp_path / "log")
    wait_for_step(run, 14, proc)
    proc.kill()
    proc.wait()
    assert not (run / "summary.json").exists() or read_summary(run)["status"] != "completed"
    done = asyncpipe("train", *RUN, f"run.dir={run}", "resume=true")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout
    assert losses(run) == losses(reference)  # exact float equality, every step and every evaluation
    assert read_summary(run)["final_val_loss"] == read_summary(reference)["final_val_loss"]


def test_sigterm_writes_checkpoint_and_exits_4_then_resumes(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "preempted"
    proc = start("train", *RUN, f"run.dir={run}", log=tmp_path / "log")
    wait_for_step(run, 9, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 4
    summary = read_summary(run)
    assert summary["status"] == "interrupted"
    assert (run / "checkpoints" / f"step_{summary['steps']:08d}" / "COMPLETE").exists()
    assert asyncpipe("train", *RUN, f"run.dir={run}", "resume=true").returncode == 0
    assert losses(run) == losses(reference)


def test_partial_checkpoint_is_refused_and_previous_used(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "partial"
    shutil.copytree(reference, run)
    (run / "summary.json").unlink()
    ckpts = sorted((run / "checkpoints").iterdir())
    assert len(ckpts) == 2  # checkpoint.keep=2
    (ckpts[-1] / "COMPLETE").unlink()  # a crash between the parts and the marker
    proc = asyncpipe("train", *RUN, f"run.dir={run}", "resume=true")
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint {ckpts[-1].name} is incomplete" in proc.stdout
    assert f"resumed from {ckpts[-2]}" in proc.stdout
    assert losses(run) == losses(reference)


@pytest.mark.parametrize("damage", ["corrupt", "foreign"])
def test_corrupt_or_foreign_checkpoint_is_a_one_line_error(reference: Path, tmp_path: Path, damage: str) -> None:
    run = tmp_path / damage
    shutil.copytree(reference, run)
    (run / "summary.json").unlink()
    newest = sorted((run / "checkpoints").iterdir())[-1]
    overrides = list(RUN)
    if damage == "corrupt":
        (newest / "rank0.pt").write_bytes(b"not a checkpoint")
    else:  # a run dir that lost its config.yaml: the checkpoint's fingerprint is the guard
        overrides[0] = "optimizer=muon_ef"
        (run / "config.yaml").unlink()
    before = read_metrics(run)
    config = (run / "config.yaml").read_bytes() if damage == "corrupt" else None
    proc = asyncpipe("train", *overrides, f"run.dir={run}", "resume=true")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and ("cannot be read" in lines[0] or "different run" in lines[0])
    assert read_metrics(run) == before  # nothing was rewritten
    if damage == "corrupt":
        assert (run / "config.yaml").read_bytes() == config  # nor the record rewritten
    else:
        assert not (run / "config.yaml").exists()  # nor written


def test_loss_above_limit_ends_run_as_diverged(tmp_path: Path) -> None:
    run = tmp_path / "div"
    proc = asyncpipe("train", "train.steps=20", "train.diverge_loss=5.0", f"run.dir={run}")
    assert proc.returncode == 3
    summary = read_summary(run)
    assert summary["status"] == "diverged" and summary["steps"] < 20
    assert read_metrics(run)[-1]["train_loss"] > 5.0


def test_nan_loss_is_divergence(tmp_path: Path) -> None:
    run = tmp_path / "nan"
    # init_std 1e30 overflows the logits at once (lr x weight decay >= 1, the old way to blow up, is now refused)
    proc = asyncpipe("train", "train.steps=30", "model.init_std=1e30", "train.grad_clip=0", "train.diverge_loss=1e30",
                     f"run.dir={run}")
    assert proc.returncode == 3, proc.stdout[-500:]
    assert read_summary(run)["status"] == "diverged"
