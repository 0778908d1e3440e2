"""A run dir is a trustworthy record: one writer at a time, never a sweep root, resumed only with the settings it
was started with; and stop signals at the edges of a run (set-up, the last step, Ctrl-C) end it cleanly."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import asyncpipe, cli_env, read_metrics, read_summary, start, wait_for_step

RUN = ["optimizer=adamw_ef", "delay=1", "train.micro_batch_size=4", "train.seq_len=32", "train.eval_batches=2"]


def _one_line(proc: subprocess.CompletedProcess, needle: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    return lines[0]


# -- one writer ------------------------------------------------------------------------------------------------
def test_a_second_process_in_a_training_run_dir_is_refused_and_the_first_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # long enough that the first run is still training while two more processes start (40 steps ended first)
    args = ["train", *RUN, "train.steps=200", "train.eval_every=100", "checkpoint.every=50", f"run.dir={run}"]
    first = start(*args, log=tmp_path / "log")
    wait_for_step(run, 1, first)
    _one_line(asyncpipe(*args, "resume=true"), "is in use by another process")
    _one_line(asyncpipe(*args), "already holds a run")  # refused before it would even ask for the lock
    assert first.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-2000:]
    steps = [m["step"] for m in read_metrics(run)]
    assert steps == list(range(201))  # no step twice, none lost
    assert read_summary(run)["status"] == "completed"


def test_the_writer_lock_dies_with_its_process(tmp_path: Path) -> None:
    from asyncpipe.errors import UserError
    from asyncpipe.session.rundir import hold_writer_lock
    from asyncpipe.track.lock import DirLock

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from asyncpipe.session.rundir import hold_writer_lock; "
         f"hold_writer_lock({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env=cli_env(),
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match="in use by another process"):
        hold_writer_lock(tmp_path)
    assert DirLock.writer(tmp_path).held_elsewhere()
    assert not DirLock.sweep(tmp_path).held_elsewhere()  # the run dir's other lock is another file
    holder.kill()  # SIGKILL: no clean-up code runs
    holder.wait()
    assert not DirLock.writer(tmp_path).held_elsewhere()
    lock = hold_writer_lock(tmp_path)  # the kernel dropped the dead process's lock
    lock.release()


# -- the record matches what was trained -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def unfinished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run stopped by SIGTERM at a checkpoint: config.yaml, metrics, summary `interrupted`."""
    run = tmp_path_factory.mktemp("rundir") / "stopped"
    proc = start("train", *RUN, "train.steps=30", "checkpoint.every=2", f"run.dir={run}",
                 log=run.parent / "log")  # fmt: skip
    wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 4
    return run


@pytest.mark.parametrize(
    "change,key,was,now",
    [
        ("optimizer.lr=0.002", "optimizer.lr", "0.005", "0.002"),  # 0.005: tiny's tuned AdamW lr on Hamlet
        ("seed=3", "seed", "0", "3"),
        ("train.steps=31", "train.steps", "30", "31"),
        ("model=small", "model.", "", ""),
        ("data=kjv", "data.name", "'hamlet'", "'kjv'"),
    ],
)
def test_a_resume_with_a_changed_setting_is_refused_and_rewrites_nothing(unfinished: Path, change: str, key: str,
                                                                          was: str, now: str) -> None:  # fmt: skip
    before = {p.name: p.read_bytes() for p in unfinished.iterdir() if p.is_file()}
    steps = [] if change.startswith("train.steps") else ["train.steps=30"]
    proc = asyncpipe("train", *RUN, *steps, "checkpoint.every=2", f"run.dir={unfinished}", "resume=true", change)
    line = _one_line(proc, f"resume=true with a changed setting: {key}")
    if was:
        assert f"was {was} when the run started, now {now}" in line
    assert {p.name: p.read_bytes() for p in unfinished.iterdir() if p.is_file()} == before


def test_a_fresh_start_in_an_unfinished_run_dir_is_refused(unfinished: Path) -> None:
    before = (unfinished / "config.yaml").read_bytes()
    _one_line(asyncpipe("train", *RUN, f"run.dir={unfinished}"), "already holds a run")
    assert (unfinished / "config.yaml").read_bytes() == before


def test_a_run_never_lands_in_a_sweep_root(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    _one_line(asyncpipe("train", *RUN, f"run.dir={sweep}"), "is a sweep directory")
    assert sorted(p.name for p in sweep.iterdir()) == ["sweep.json"]


# -- signals at the edges --------------------------------------------------------------------------------------
def test_a_signal_before_the_first_step_ends_interrupted_with_a_summary(tmp_path: Path) -> None:
    run = tmp_path / "early"
    proc = start("train", *RUN, "train.steps=20", f"run.dir={run}", log=tmp_path / "log")
    deadline = time.time() + 120
    while not (run / "config.yaml").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)  # set-up (imports, data, model) takes seconds after config.yaml
    assert proc.wait(timeout=120) == 4, (tmp_path / "log").read_text()[-2000:]
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["steps"] == 0 and summary["exit_code"] == 4
    assert not any("train_loss" in m for m in read_metrics(run))
    done = asyncpipe("train", *RUN, "train.steps=20", f"run.dir={run}", "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_summary(run)["status"] == "completed"


def test_ctrl_c_checkpoints_and_exits_4_like_sigterm(tmp_path: Path) -> None:
    run = tmp_path / "ctrl-c"
    proc = start("train", *RUN, "train.steps=40", f"run.dir={run}", log=tmp_path / "log")
    wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 4, (tmp_path / "log").read_text()[-2000:]
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and 2 <= summary["steps"] < 40
    assert (run / "checkpoints" / f"step_{summary['steps']:08d}" / "COMPLETE").exists()
    assert "SIGINT: checkpoint" in (tmp_path / "log").read_text()


def test_a_stop_during_the_last_step_completes_the_run_with_its_final_val_loss(tmp_path: Path) -> None:
    """The trainer's loop itself, with the simulator as engine: SIGTERM arrives while the last step runs."""
    from asyncpipe.config import compose
    from asyncpipe.trainer import Trainer

    steps = 3
    cfg = compose([*RUN, f"train.steps={steps}", "train.eval_every=2", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path, log=lambda _: None)
    engine = trainer.engine
    step_once = engine.train_step

    def last_step_signalled(sync: bool = True, save: bool = False):
        if engine.step == steps - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the trainer's StopRequest: a flag, not a death
        return step_once(sync, save)

    engine.train_step = last_step_signalled
    summary = trainer.run(show_progress=False)
    assert summary["status"] == "completed" and summary["exit_code"] == 0 and summary["steps"] == steps
    assert math.isfinite(summary["final_val_loss"])
    last = read_metrics(tmp_path)[-1]
    assert last["step"] == steps and last["val_loss"] == summary["final_val_loss"]
    assert not (tmp_path / "checkpoints").exists()  # nothing to resume: the run is complete


def test_a_setting_added_after_a_run_started_is_no_change_at_its_default() -> None:
    """A run recorded before the schema gained `train.deterministic` (a study run stopped under an older commit)
    resumes: the key is absent from its record and holds its default now. Absent with another value, or present
    and changed, it is refused as before."""
    from omegaconf import OmegaConf

    from asyncpipe.config import compose
    from asyncpipe.session.rundir import changed_settings

    cfg = compose(["model=tiny", "run.dir=unused"])
    recorded = OmegaConf.to_container(cfg, resolve=True)
    del recorded["train"]["deterministic"]
    assert changed_settings(recorded, cfg) == []
    cfg.train.deterministic = True
    assert changed_settings(recorded, cfg) == [("train.deterministic", False, True)]  # what the run ran with
    recorded["train"]["lr_schedule"] = "wsd"
    assert [k for k, _, _ in changed_settings(recorded, cfg)] == ["train.deterministic", "train.lr_schedule"]
