"""Long work is not silent (issue 27): a running run's step/total, latest val loss and ETA; `sweep status` never
pairs a step with an older val loss; a sweep stopped by SIGTERM says so and how to resume."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import yaml

from asyncpipe.sweep import display as display_mod
from asyncpipe.sweep.display import SweepDisplay, state_table
from asyncpipe.sweep.expand import expand
from asyncpipe.sweep.local import LocalLauncher
from asyncpipe.sweep.state import INTERRUPTED, RUNNING, RunState, run_state


def interrupted_run(path: Path) -> Path:
    """Stopped at step 20: its summary (written at the stop) holds the step-0 val loss as final_val_loss."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 120}}))
    lines = [{"step": 0, "tokens": 0, "val_loss": 5.5}] + [{"step": s, "tokens": s * 64, "train_loss": 4.0}
                                                            for s in range(1, 21)]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (path / "summary.json").write_text(json.dumps({"status": "interrupted", "final_val_loss": 5.5, "steps": 20}))
    return path


def test_status_never_pairs_a_step_with_an_older_val_loss(tmp_path: Path) -> None:
    state = run_state(interrupted_run(tmp_path / "r"), "r")
    assert state.state == INTERRUPTED and state.step == 20 and state.steps == 120
    assert (state.val_loss, state.val_step) == (5.5, 0)
    out = io.StringIO()
    from rich.console import Console

    Console(file=out, width=200).print(state_table("t", [state]))
    row = next(line for line in out.getvalue().splitlines() if "interrupted" in line)
    assert "20/120" in row and "5.5000 (step 0)" in row


def test_status_shows_a_running_runs_latest_val_loss(tmp_path: Path) -> None:
    run = interrupted_run(tmp_path / "r")
    (run / "summary.json").unlink()  # a run still training has no summary yet
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 21, "tokens": 1344, "train_loss": 3.9, "val_loss": 4.25}) + "\n")
    state = run_state(run, "r")
    assert state.step == 21 and (state.val_loss, state.val_step) == (4.25, 21) and state.steps == 120


def test_progress_lines_show_step_total_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(display_mod.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    disp = SweepDisplay("sweep t", stream=out, live=False)
    with disp:
        disp.update([RunState("a", RUNNING, step=10, steps=110)])
        clock[0] += display_mod.PROGRESS_LINE_S + 10  # 40 s for 20 steps: 2 s/step, 80 steps left -> 160 s = 2.7 min
        disp.update([RunState("a", RUNNING, step=30, steps=110, val_loss=3.25, val_step=30)])
    lines = out.getvalue().splitlines()
    assert lines[0] == "[0/1] a: running"
    assert lines[1] == "[0/1] a: running, step 30/110, val loss 3.2500, ETA 2.7 min | sweep: 40 s elapsed, ~2.7 min left"


def test_pending_runs_are_one_line_and_the_sweep_says_elapsed_and_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: 11 "pending (waiting)" lines became one; a finished run's line says the sweep's elapsed time and
    the time left: the runs not started at the mean time of the finished ones, shared by the runs seen at once."""
    from asyncpipe.sweep.state import COMPLETED, PENDING

    clock = [0.0]
    monkeypatch.setattr(display_mod.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    disp = SweepDisplay("sweep t", stream=out, live=False)
    names = [f"r{i}" for i in range(6)]

    def states(running: list[str], done: list[str]) -> list[RunState]:
        return [RunState(n, COMPLETED, final_val_loss=2.5) if n in done else RunState(n, RUNNING) if n in running
                else RunState(n, PENDING, note="waiting") for n in names]  # fmt: skip

    with disp:
        disp.update(states(["r0", "r1"], []))
        clock[0] = 20.0
        disp.update(states(["r1"], ["r0"]))  # r0 took 20 s; r1 has no step yet: its ETA is the mean, 20 s
    lines = out.getvalue().splitlines()
    assert lines[0] == "[0/6] 4 run(s) not started yet (pending)"
    assert [ln for ln in lines if "pending" in ln] == [lines[0]]
    # 20 s elapsed; left: r1 (20 s) + 4 waiting x 20 s = 100 s of runs, two at a time -> 50 s
    assert lines[-1] == "[1/6] r0: completed in 20s, val loss 2.5000 | sweep: 20 s elapsed, ~50 s left"


def test_the_live_table_folds_pending_runs_into_one_row() -> None:
    from rich.console import Console

    from asyncpipe.sweep.state import PENDING

    rows = [RunState("a", RUNNING)] + [RunState(f"p{i}", PENDING, note="waiting") for i in range(11)]
    out = io.StringIO()
    Console(file=out, width=200).print(state_table("t", rows, {}, {}, fold_waiting=True))
    text = out.getvalue()
    assert "11 run(s) not started yet" in text and "p3" not in text and text.count("waiting") == 1


def test_eta_falls_back_on_the_dry_run_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(display_mod.time, "monotonic", lambda: clock[0])
    disp = SweepDisplay("sweep t", stream=io.StringIO(), live=False)
    disp.expected = {"a": 100.0}
    disp.update([RunState("a", RUNNING)])
    clock[0] = 30.0
    assert disp.etas([RunState("a", RUNNING)]) == {"a": 70.0}


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_sigterm_says_interrupted_and_how_to_resume(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plan = expand(["seed=0,1"], name="t")
    sleeper = lambda overrides: [sys.executable, "-c", "import time; time.sleep(60)"]  # noqa: E731
    launcher = LocalLauncher(plan, tmp_path / "t", parallel=1, command=sleeper,
                             display=SweepDisplay("sweep t", stream=io.StringIO(), live=False))  # fmt: skip
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run()
    finally:
        timer.cancel()
    err = capsys.readouterr().err
    assert "sweep t interrupted: 1 running run(s) stopped (resumable)" in err
    assert "re-running the same command resumes it" in err
    assert launcher.states[plan.runs[0].name].state == INTERRUPTED


def test_checking_a_large_sweep_reports_progress(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A dry-run (or launch) of many runs says how far its checks are, instead of composing in silence."""
    from asyncpipe.sweep import runner as sweep_mod

    monkeypatch.setattr(sweep_mod, "PROGRESS_MIN_RUNS", 3)
    monkeypatch.setattr(sweep_mod, "PROGRESS_EVERY_S", 0.0)
    plan = expand(["seed=0,1,2"], name="t")
    out = io.StringIO()
    cfgs, _ = sweep_mod.compose_runs(plan, tmp_path / "t", progress=out)
    assert len(cfgs) == 3
    lines = out.getvalue().splitlines()
    assert [line.split(" composed")[0] for line in lines] == ["checking runs: 1/3", "checking runs: 2/3", "checking runs: 3/3"]
    small = io.StringIO()
    monkeypatch.setattr(sweep_mod, "PROGRESS_MIN_RUNS", 4)
    sweep_mod.compose_runs(plan, tmp_path / "t", progress=small)
    assert small.getvalue() == ""  # a small sweep stays quiet


def test_status_of_a_run_whose_files_are_fifos_does_not_hang(tmp_path: Path) -> None:
    run = tmp_path / "a"
    run.mkdir()
    for name in (".lock", "metrics.jsonl", "summary.json", "config.yaml", "launch.json"):
        os.mkfifo(run / name)  # each would block an open() for reading until a writer came
    state = run_state(run, "a")
    assert state.step is None and state.val_loss is None and state.final_val_loss is None


def test_a_sweep_says_once_what_its_runs_will_do_unasked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: a default lr tuned for another regime, and W&B files written offline into every run dir, are each
    said in one line when the sweep starts (not once per run)."""
    from asyncpipe.config import compose
    from asyncpipe.sweep.runner import warn_lr_regimes

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfgs = {f"r{s}": compose(["train.steps=1000", f"seed={s}"]) for s in range(3)}
    out = io.StringIO()
    said = warn_lr_regimes(cfgs, out)
    assert len(said) == 2 and out.getvalue().splitlines() == said
    assert said[0].startswith("warning: optimizer.lr=0.005 is adamw's tuned lr on tiny for 100 steps")
    assert said[1].startswith("W&B: 3 of 3 runs write offline into RUN/wandb")
    quiet = {"r": compose(["tracker.wandb.mode=disabled"])}
    assert warn_lr_regimes(quiet, io.StringIO()) == []
