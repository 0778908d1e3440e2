"""Fault tolerance of the simulator: exact kill-and-resume, signal checkpoints, partial and foreign checkpoints,
divergence. (The pipeline's counterparts live in test_pipe_fault_tolerance.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from asyncpipe import forkserver
from helpers import asyncpipe, cli_env, losses, read_metrics, read_summary, start, wait_for_step

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


# SIGHUP: the terminal or ssh session closed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_writes_checkpoint_and_exits_4_then_resumes(reference: Path, tmp_path: Path, sig: int) -> None:
    run = tmp_path / "preempted"
    proc = start("train", *RUN, f"run.dir={run}", log=tmp_path / "log")
    wait_for_step(run, 9, proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 4
    summary = read_summary(run)
    assert summary["status"] == "interrupted"
    assert (run / "checkpoints" / f"step_{summary['steps']:08d}" / "COMPLETE").exists()
    assert asyncpipe("train", *RUN, f"run.dir={run}", "resume=true").returncode == 0
    assert losses(run) == losses(reference)


def test_a_reader_of_stdout_going_away_never_ends_the_run(reference: Path, tmp_path: Path) -> None:
    """`asyncpipe train ... | head -1`: stdout breaks after the first line; the run trains on to the same losses and
    train.log says once why its lines stopped reaching stdout."""
    run = tmp_path / "piped"
    read, write = os.pipe()
    with open(tmp_path / "err", "w") as err:
        argv = [sys.executable, "-m", "asyncpipe", "train", *RUN, "train.log_every=1", f"run.dir={run}"]
        proc = forkserver.start(argv, stdout=write, stderr=err, env=cli_env())
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        reader.readline()  # `head -1`: one line, then the reader is gone
    assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()[-2000:]
    assert "Traceback" not in (tmp_path / "err").read_text()
    assert read_summary(run)["status"] == "completed"
    assert losses(run) == losses(reference)
    log = (run / "train.log").read_text()
    assert log.count("note: stdout went away (Broken pipe); training goes on") == 1, log
    assert "step 24/24" in log


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


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(reference: Path, tmp_path: Path,
                                                                     damage: str) -> None:  # fmt: skip
    """A full disk or a killed copy truncates the newest part: resume says so and continues from the one before."""
    run = tmp_path / damage
    shutil.copytree(reference, run)
    (run / "summary.json").unlink()
    older, newest = sorted((run / "checkpoints").iterdir())
    part = newest / "rank0.pt"
    part.write_bytes(b"not a checkpoint" if damage == "corrupt" else part.read_bytes()[: part.stat().st_size // 2])
    proc = asyncpipe("train", *RUN, f"run.dir={run}", "resume=true")
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint {newest.name} cannot be used (checkpoint {part} cannot be read safely" in proc.stdout
    assert "falling back to an earlier one" in proc.stdout and f"resumed from {older}" in proc.stdout
    assert losses(run) == losses(reference)


@pytest.mark.parametrize("damage", ["all truncated", "foreign"])
def test_no_readable_or_a_foreign_checkpoint_is_a_one_line_error(reference: Path, tmp_path: Path, damage: str) -> None:
    run = tmp_path / damage.replace(" ", "-")
    shutil.copytree(reference, run)
    (run / "summary.json").unlink()
    overrides = list(RUN)
    if damage == "all truncated":
        for part in run.glob("checkpoints/step_*/rank0.pt"):
            part.write_bytes(part.read_bytes()[:1000])
    else:  # a run dir that lost its config.yaml: the checkpoint's fingerprint is the guard
        overrides[0] = "optimizer=muon_ef"
        (run / "config.yaml").unlink()
    before = read_metrics(run)
    config = (run / "config.yaml").read_bytes() if damage != "foreign" else None
    proc = asyncpipe("train", *overrides, f"run.dir={run}", "resume=true")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    if damage == "foreign":
        assert "different run" in lines[0]
    else:  # the whole sentence, torch's included: never cut off mid-word
        assert "cannot be read safely (RuntimeError: PytorchStreamReader failed reading zip archive: failed finding " \
               "central directory); no earlier checkpoint can be resumed from" in lines[0]  # fmt: skip
        assert lines[0].endswith("or choose another run.dir")
    assert read_metrics(run) == before  # nothing was rewritten
    if damage != "foreign":
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
