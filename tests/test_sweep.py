"""`asyncpipe sweep` on this machine: Hydra-grammar expansion, the local launcher, re-runs, locks, status, errors.

Launcher logic (failures, concurrency, kills) runs against a fake run command (plain Python, no torch) so it
is fast; one quick sweep and the slow tests use the real `asyncpipe train`.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from asyncpipe import cli_sweep
from asyncpipe.config import compose, conf_dir
from asyncpipe.errors import UserError
from asyncpipe.sweep import expand, plan_sweep, run_sweep, sweep_states, sweep_status
from asyncpipe.sweep.display import SweepDisplay
from asyncpipe.track.lock import DirLock

REPO = Path(__file__).resolve().parents[1]

# A stand-in for `asyncpipe train`: seed 1 crashes, seed 2 diverges, the rest complete; FAKE_SLEEP seconds
# of work, and FAKE_GRANDCHILD starts a grandchild (to check that killing the sweep kills the whole tree).
FAKE_TRAIN = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from pathlib import Path
    args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    run_dir = Path(args["run.dir"].strip("'"))
    with open(run_dir / "starts", "a") as f:
        f.write(" ".join(sys.argv[1:]) + "\\n")
    (run_dir / "config.yaml").write_text("fake: true\\n")
    if os.environ.get("FAKE_GRANDCHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (run_dir / "pids").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
    seed = args.get("seed", "0")
    if seed == "1":
        sys.exit("fake crash")
    status = "diverged" if seed == "2" else "completed"
    (run_dir / "summary.json").write_text(json.dumps({"status": status, "steps": 3, "final_val_loss": 1.5}))
    sys.exit(3 if status == "diverged" else 0)
    """
)


@pytest.fixture()
def fake_command(tmp_path: Path):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    return lambda overrides: [sys.executable, str(script), *overrides]


def quiet() -> SweepDisplay:
    return SweepDisplay("test", stream=io.StringIO(), live=False)


def starts(run_dir: Path) -> int:
    path = run_dir / "starts"
    return len(path.read_text().splitlines()) if path.exists() else 0


# --- expansion ---------------------------------------------------------------------------------------------


def test_comma_lists_expand_in_hydras_order():
    plan = expand(["optimizer=muon,adamw", "delay=0,1", "train.steps=5"], name="t")
    assert [r.swept for r in plan.runs] == [
        ("optimizer=muon", "delay=0"),
        ("optimizer=muon", "delay=1"),
        ("optimizer=adamw", "delay=0"),
        ("optimizer=adamw", "delay=1"),
    ]
    assert plan.base == ["train.steps=5"]
    assert dict(plan.grid) == {"optimizer": ["muon", "adamw"], "delay": ["0", "1"]}
    assert [r.name for r in plan.runs][1] == "optimizer=muon,delay=1"
    for spec in plan.runs:  # fixed overrides reach every run
        assert spec.overrides[0] == "train.steps=5"


def test_range_glob_and_quoting_follow_the_grammar():
    plan = expand(["seed=range(1,7,2)", "optimizer=glob(muon*)", "run.name='a,b',c"], name="t")
    assert plan.grid["seed"] == ["1", "3", "5"]
    options = sorted(p.stem for p in (conf_dir() / "optimizer").glob("*.yaml"))
    assert plan.grid["optimizer"] == [o for o in options if fnmatch.fnmatch(o, "muon*")]
    assert plan.grid["run.name"] == ["'a,b'", "c"]  # the quoted comma is one value
    assert len(plan.runs) == 3 * len(plan.grid["optimizer"]) * 2
    # What each run composes to is what the grammar says: the quoted value is the plain string a,b.
    quoted = next(r for r in plan.runs if "run.name='a,b'" in r.swept)
    cfg = compose(list(quoted.overrides))
    assert cfg.run.name == "a,b"
    assert cfg.optimizer.name.startswith("muon")


def test_launcher_keys_configure_the_sweep_not_the_runs():
    plan = expand(["seed=0,1", "launcher.parallel=2"], name="t")
    assert plan.launcher == ["launcher.parallel=2"]
    assert all(not any(o.startswith("launcher") for o in r.overrides) for r in plan.runs)
    with pytest.raises(UserError, match="cannot be swept"):
        expand(["seed=0,1", "launcher.parallel=1,2"], name="t")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimizer=glob(zzz*)"], "no values"),
        (["seed=range("], "cannot expand"),
        (["seed=0,1", "run.dir=/tmp/x"], "sets run.dir"),
        (["seed=interval(0,1)"], "only comma lists"),
        (["seed=1,1"], "twice"),
    ],
)
def test_bad_grids_are_one_line_user_errors(overrides, message):
    with pytest.raises(UserError, match=message) as err:
        expand(overrides, name="t")
    assert "\n" not in str(err.value)


def test_run_dir_names_are_sanitized():
    plan = expand(["data.root=/a/b,/c/d", "seed=0"], name="t")
    names = [r.name for r in plan.runs]
    assert names == ["data.root=_a_b", "data.root=_c_d"]
    assert all("/" not in n for n in names)


def test_a_sweep_of_one_run():
    plan = expand(["seed=3", "delay=1"], name="t")
    assert [(r.name, r.overrides) for r in plan.runs] == [("run", ("seed=3", "delay=1"))]
    assert [r.name for r in expand([], name="t").runs] == ["run"]


def test_sweep_file_variants_and_per_settings(tmp_path: Path):
    assert compose(list(plan_sweep(file=REPO / "sweeps" / "smoke.yaml").runs[0].overrides)).optimizer.lr == 5e-3  # tuned
    smoke = tmp_path / "smoke.yaml"  # the smoke sweep with a per-optimizer lr of its own
    smoke.write_text((REPO / "sweeps" / "smoke.yaml").read_text()
                     + "per:\n  optimizer:\n    adamw: [optimizer.lr=3e-3]\n    muon: [optimizer.lr=0.01]\n")
    plan = plan_sweep(file=smoke)
    assert plan.name == "smoke" and len(plan.runs) == 6
    assert list(plan.grid) == ["optimizer", "seed"] and list(plan.variants) == ["sync", "1-step", "1-step+EF"]
    by_name = {r.name: r for r in plan.runs}
    ef = by_name["optimizer=muon,seed=0,variant=1-step+EF"]
    assert ef.variant == "1-step+EF"
    cfg = compose(list(ef.overrides))
    assert (cfg.optimizer.name, cfg.delay, cfg.compensation.name, cfg.run.variant) == ("muon", 1, "ef", "1-step+EF")
    assert cfg.optimizer.lr == 0.01 and compose(list(by_name["optimizer=adamw,seed=0,variant=sync"].overrides)).optimizer.lr == 3e-3
    # Command-line values replace the file's: three seeds, each crossed with every variant.
    three = plan_sweep(["seed=0,1,2"], file=smoke)
    assert len(three.runs) == 18 and three.base == plan.base
    assert [r.name for r in three.runs if r.name in by_name] == [r.name for r in plan.runs]
    # One optimizer at a time (the command line narrows the file's grid): the other's per: entry is unused, not an error.
    muon = plan_sweep(["optimizer=muon"], file=smoke)
    assert [r.name for r in muon.runs] == [r.name for r in plan.runs if r.name.startswith("optimizer=muon")]
    assert all(compose(list(r.overrides)).optimizer.lr == 0.01 for r in muon.runs)
    for text, message in (
        ("per: {delay: {'0': [a=1]}}", "not a key of this sweep"),
        ("per: {optimizer: {sgd: [optimizer.lr=1]}}", "not among its values"),
        ("variants: {a: ['delay=0,1']}", "is a sweep"),
        ("variants: {a: [run.variant=x]}", "sets run.variant"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(f"name: x\ngrid: {{optimizer: 'adamw,muon'}}\n{text}\n")
        with pytest.raises(UserError, match=message):
            plan_sweep(file=bad)


def test_sweep_file_and_invalid_names(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngrids: {seed: '0,1'}\n")
    with pytest.raises(UserError, match="unknown key"):
        plan_sweep(file=bad)
    with pytest.raises(UserError, match="not allowed"):
        expand(["seed=0,1"], name="../escape")


def test_invalid_run_config_fails_before_anything_launches(tmp_path: Path, fake_command):
    with pytest.raises(UserError, match="unknown optimizer"):
        run_sweep(["seed=0,1", "optimizer=nope"], out=tmp_path, name="s", command=fake_command, display=quiet())
    assert not (tmp_path / "s").exists()


def test_slurm_without_sbatch_is_a_user_error(tmp_path: Path, monkeypatch, fake_command):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="sbatch") as err:
        run_sweep(["seed=0,1", "launcher=slurm"], out=tmp_path, name="s", command=fake_command, display=quiet())
    assert "\n" not in str(err.value)
    assert not (tmp_path / "s").exists()


# --- the local launcher ------------------------------------------------------------------------------------


def test_failures_do_not_stop_the_sweep_and_are_final(tmp_path: Path, fake_command):
    result = run_sweep(["seed=0,1,2,3"], out=tmp_path, name="s", command=fake_command, display=quiet())
    states = {s.name: s.state for s in result.states}
    assert states == {"seed=0": "completed", "seed=1": "failed", "seed=2": "diverged", "seed=3": "completed"}
    assert result.failed == ["seed=1"]
    sweep = tmp_path / "s"
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert [r["name"] for r in manifest["runs"]] == ["seed=0", "seed=1", "seed=2", "seed=3"]
    assert manifest["grid"] == {"seed": ["0", "1", "2", "3"]}
    argv = (sweep / "seed=3" / "starts").read_text()
    assert "tracker.wandb.group=s" in argv and "resume=true" not in argv
    assert "fake crash" in (sweep / "seed=1" / "launch.log").read_text()

    # Re-running starts nothing: completed is done, failed and diverged are final.
    again = run_sweep(["seed=0,1,2,3"], out=tmp_path, name="s", command=fake_command, display=quiet())
    assert {s.name: s.state for s in again.states} == states
    assert [starts(sweep / f"seed={i}") for i in range(4)] == [1, 1, 1, 1]

    # --retry-failed starts the failed and diverged runs over, keeping the old attempts.
    retried = run_sweep(
        ["seed=0,1,2,3"], out=tmp_path, name="s", command=fake_command, display=quiet(), retry_failed=True
    )
    assert [starts(sweep / f"seed={i}") for i in range(4)] == [1, 1, 1, 1]  # fresh dirs for 1 and 2
    assert sorted(p.name.split(".")[0] for p in (sweep / ".retired").iterdir()) == ["seed=1", "seed=2"]
    assert {s.name: s.state for s in retried.states}["seed=0"] == "completed"


def test_interrupted_runs_resume_and_status_tells_running_from_dead(tmp_path: Path, fake_command):
    sweep = tmp_path / "s"
    run_sweep(["seed=0,3"], out=tmp_path, name="s", command=fake_command, display=quiet())
    # Make seed=3 look unfinished: started (config.yaml) but no summary, nobody holding its lock.
    (sweep / "seed=3" / "summary.json").unlink()
    _, states = sweep_states(sweep)
    assert [s.state for s in states] == ["completed", "interrupted"]
    lock = DirLock.sweep(sweep / "seed=3")
    assert lock.acquire()
    try:
        _, states = sweep_states(sweep)
        assert states[1].state == "running"
        out = io.StringIO()
        sweep_status(sweep, stream=out)
        table = out.getvalue()
        assert "seed=3" in table and "running" in table and "completed" in table
    finally:
        lock.release()
    run_sweep(["seed=0,3"], out=tmp_path, name="s", command=fake_command, display=quiet())
    assert starts(sweep / "seed=0") == 1
    lines = (sweep / "seed=3" / "starts").read_text().splitlines()
    assert len(lines) == 2 and "resume=true" in lines[1] and "resume=true" not in lines[0]


def _driver(tmp_path: Path, grid: list[str]) -> Path:
    """A script running one sweep with the fake command: a second process, like a second `asyncpipe sweep`."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            from asyncpipe.sweep import run_sweep
            result = run_sweep({grid!r}, out=Path({str(tmp_path)!r}), name="s",
                               command=lambda o: [sys.executable, {str(script)!r}, *o])
            for s in result.states:
                print("STATE", s.name, s.state, s.note)
            """
        )
    )
    return driver


def test_two_sweeps_at_once_never_run_a_run_twice(tmp_path: Path):
    driver = _driver(tmp_path, ["seed=0,3,4,5"])
    env = dict(os.environ, FAKE_SLEEP="1")
    procs = [
        subprocess.Popen([sys.executable, str(driver)], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert [starts(tmp_path / "s" / f"seed={i}") for i in (0, 3, 4, 5)] == [1, 1, 1, 1]
    assert "running in another sweep" in "".join(outputs)
    _, states = sweep_states(tmp_path / "s")
    assert [s.state for s in states] == ["completed"] * 4


def test_killing_the_sweep_kills_each_runs_whole_tree(tmp_path: Path):
    driver = _driver(tmp_path, ["seed=0,3"])
    env = dict(os.environ, FAKE_SLEEP="60", FAKE_GRANDCHILD="1")
    sweep = subprocess.Popen([sys.executable, str(driver)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids_file = tmp_path / "s" / "seed=0" / "pids"
    deadline = time.monotonic() + 30
    while not pids_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_file.exists(), sweep.communicate(timeout=5)[0]
    time.sleep(0.2)
    pids = [int(p) for p in pids_file.read_text().split()]
    sweep.send_signal(signal.SIGTERM)
    sweep.wait(timeout=30)
    for pid in pids:
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"process {pid} of the run outlived the sweep"
    _, states = sweep_states(tmp_path / "s")
    assert [s.state for s in states] == ["interrupted", "pending"]  # resumable, not failed


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap if it happens to be our child
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


# --- the command line --------------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(cli_sweep.app, name="sweep")
    app.command("noop")(lambda: None)  # two commands: `sweep` stays a subcommand, as in asyncpipe's app
    return app


def test_extending_a_finished_sweep_keeps_its_runs(tmp_path: Path, fake_command):
    first = run_sweep(["seed=0,3", "train.steps=5"], out=tmp_path, name="s", command=fake_command, display=quiet())
    assert [s.state for s in first.states] == ["completed", "completed"]
    more = run_sweep(["seed=0,3,4", "train.steps=5"], out=tmp_path, name="s", command=fake_command, display=quiet())
    assert [(s.name, s.note) for s in more.states][:2] == [("seed=0", "already completed"), ("seed=3", "already completed")]
    assert [starts(tmp_path / "s" / f"seed={i}") for i in (0, 3, 4)] == [1, 1, 1]
    manifest = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [r["name"] for r in manifest["runs"]] == ["seed=0", "seed=3", "seed=4"]
    assert manifest["grid"] == {"seed": ["0", "3", "4"]}
    one_more = run_sweep(["seed=5", "train.steps=5"], out=tmp_path, name="s", command=fake_command, display=quiet())
    assert [s.name for s in one_more.states] == ["seed=5"] and starts(tmp_path / "s" / "seed=5") == 1
    with pytest.raises(UserError, match="other fixed overrides"):
        run_sweep(["seed=5", "train.steps=6"], out=tmp_path, name="s", command=fake_command, display=quiet())
    with pytest.raises(UserError, match="grid keys"):
        run_sweep(["seed=5", "delay=0,1", "train.steps=5"], out=tmp_path, name="s", command=fake_command, display=quiet())


def test_dry_run_lists_runs_tokens_and_time_from_recorded_runs(tmp_path: Path):
    from asyncpipe.sweep import dry_run_sweep

    text = dry_run_sweep(["seed=0,1", "train.steps=10"], out=tmp_path, name="d")
    tokens = 10 * 8 * 4 * 64  # steps x micro_batch_size x micro_batches x seq_len (conf/config.yaml)
    assert "sweep d: 2 runs (2 to run, 0 already completed)" in text and "estimated wall time: unknown" in text
    assert text.count(f"{tokens / 1e3:.3g}k tokens") == 2 and not (tmp_path / "d").exists()
    old = tmp_path / "old" / "run"  # a completed run of the same model recorded 1000 tokens/s
    old.mkdir(parents=True)
    (old / "config.yaml").write_text(_yaml(["train.steps=3"]))
    (old / "summary.json").write_text(json.dumps({"status": "completed", "tokens": 5000, "wall_time": 5.0}))
    text = dry_run_sweep(["seed=0,1", "train.steps=10", "launcher.parallel=2"], out=tmp_path, name="d")
    assert f"estimated wall time: {tokens / 1000:.0f} s" in text and "2 at a time" in text


def _yaml(overrides: list[str]) -> str:
    from asyncpipe.config import to_yaml

    return to_yaml(compose(overrides))


def test_cli_status_and_errors(tmp_path: Path, fake_command):
    run_sweep(["seed=0,1"], out=tmp_path, name="s", command=fake_command, display=quiet())
    result = CliRunner().invoke(_app(), ["sweep", "status", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    assert "completed" in result.output and "failed" in result.output and "seed=1" in result.output
    result = CliRunner().invoke(_app(), ["sweep", "status", "--help"])
    assert result.exit_code == 0 and "A sweep directory" in result.output
    result = CliRunner().invoke(_app(), ["sweep", "--out", str(tmp_path), "--name", "s", "seed=0,1", "optimizer=nope"])
    assert isinstance(result.exception, UserError) and "unknown optimizer" in str(result.exception)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncpipe", "sweep", "status", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a sweep directory" in proc.stderr


# --- the real trainer --------------------------------------------------------------------------------------


def test_local_sweep_of_real_runs_and_rerun_starts_nothing(tmp_path: Path):
    overrides = ["optimizer=muon,adamw", "delay=0,1", "train.steps=5", "launcher.parallel=2"]
    result = run_sweep(overrides, out=tmp_path, name="real", display=quiet())
    assert [s.state for s in result.states] == ["completed"] * 4, (tmp_path / "real").glob("*/launch.log")
    for spec in result.plan.runs:
        run_dir = tmp_path / "real" / spec.name
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 5
        cfg = (run_dir / "config.yaml").read_text()
        assert "group: real" in cfg
        opt, delay = (kv.split("=")[1] for kv in spec.swept)
        assert f"name: {opt}" in cfg and f"delay: {delay}" in cfg
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "real").glob("*/summary.json")}
    again = run_sweep(overrides, out=tmp_path, name="real", display=quiet())
    assert [s.note for s in again.states] == ["already completed"] * 4
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
