"""Trust, round four (issue 56): the new surfaces. No child process asyncpipe starts imports from the working
directory; a budget branch is exact or refused; a refused resume leaves the run dir as it was; failure advice
that works. (One-line refusals of flags are rows of tests/test_bad_input_table.py; records pooled across
revisions are in tests/test_report_revisions.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncpipe import forkserver
from helpers import cli_env, read_summary

TINY = ["model=tiny", "train.micro_batch_size=4", "train.seq_len=32", "train.eval_batches=2"]
PLANTED = ("yaml", "random", "asyncpipe_planted")  # a dependency's name, a stdlib name, and one nothing has imported


def _plant(where: Path, marker: Path) -> None:
    """Modules that leave ``marker`` behind (and break the importer) if anything imports them from ``where``."""
    for name in PLANTED:
        (where / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\nraise SystemExit(3)\n")


@pytest.mark.parametrize("preload", ["1", "0"])
def test_a_sweep_never_imports_from_its_working_directory(tmp_path: Path, preload: str) -> None:
    """`asyncpipe sweep` started in a directory holding `yaml.py` and `random.py`: the fork server, the runs it
    forks (preload=1) and fresh run processes (preload=0, as on a GPU machine) never import them."""
    work, marker = tmp_path / "work", tmp_path / "imported"
    work.mkdir()
    _plant(work, marker)
    env = cli_env(ASYNCPIPE_PRELOAD=preload)
    # `asyncpipe` (the console script) puts its own bin directory first, not the working directory: so does -P.
    argv = forkserver.python_module("asyncpipe", "sweep", "seed=0", *TINY, "train.steps=2", "--out", str(tmp_path / "sw"))
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert not marker.exists(), marker.read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = [p for p in (tmp_path / "sw").glob("*/*") if (p / "summary.json").exists()]
    assert read_summary(run)["status"] == "completed"


def test_a_forked_child_in_the_safe_form_has_no_working_directory_on_its_path(tmp_path: Path, monkeypatch) -> None:
    """`python_module`'s children, forked or fresh, see PYTHONPATH but never their working directory (whatever the
    directory the fork server itself started in)."""
    monkeypatch.setattr(forkserver, "MODULES", (*forkserver.MODULES, "forkserver_probe"))
    work, marker = tmp_path / "work", tmp_path / "imported"
    work.mkdir()
    _plant(work, marker)
    env = cli_env(PYTHONPATH=str(Path(__file__).resolve().parent))
    monkeypatch.chdir(work)
    seen = []
    for preload in ("1", "0"):
        monkeypatch.setenv("ASYNCPIPE_PRELOAD", preload)
        out = tmp_path / f"out-{preload}"
        with open(out, "wb") as f:
            argv = forkserver.python_module("forkserver_probe", "import", "asyncpipe_planted")
            assert forkserver.start(argv, env=env, stdout=f, stderr=subprocess.STDOUT).wait(timeout=120) == 0
        seen.append(json.loads(out.read_text()))
    assert not marker.exists(), marker.read_text()
    for report in seen:
        assert report["imported"] is False and str(work) not in report["path"] and "" not in report["path"]
        assert str(Path(__file__).resolve().parent) in report["path"]


def test_slurm_jobs_start_python_without_the_working_directory() -> None:
    """The submitit job script's interpreter and each task's run command carry the safe-path flag."""
    from asyncpipe.sweep.local import train_command
    from asyncpipe.sweep.slurm import job_python

    assert forkserver.SAFE_PATH and job_python().endswith(" ".join([sys.executable, *forkserver.SAFE_PATH]))
    assert train_command(["seed=0"])[:4] == [sys.executable, *forkserver.SAFE_PATH, "-m", "asyncpipe"]
    assert os.path.isdir(os.path.join(forkserver.child_environ()["PYTHONPATH"].split(os.pathsep)[0], "asyncpipe"))


def test_a_report_labels_a_branch_only_when_its_record_shows_it_exact() -> None:
    """A 20-step wsd run (decay from 16) recorded as a branch of a 16-step parent (decay from 12): from step 12 it
    is a branch; from the parent's step 15 (inside the parent's decay), or past its own decay start, it is not."""
    from asyncpipe.config import compose
    from asyncpipe.report.load import exact_branch

    train = {k: v for k, v in compose(["train.lr_schedule=wsd", "train.warmup_steps=2", "train.steps=20",
                                       "train.decay_frac=0.2"]).train.items()}
    config = {"train": train}
    branch = {"branch_of": "/runs/p", "branch_step": 12, "branch_parent_steps": 16}
    assert exact_branch(config, branch) == ("/runs/p", "")
    for bad in ({**branch, "branch_step": 15}, {"branch_of": "/runs/p", "branch_step": 17},
                {**branch, "branch_step": "12"}, {**branch, "branch_parent_steps": "x"}):
        parent, why = exact_branch(config, bad)
        assert parent is None and "not shown as a branch" in why


def _record(root: Path, name: str, delay: int, seed: int, loss: float, revisions: dict) -> None:
    import yaml

    from asyncpipe.track import RunDir

    cfg = {"model": {"name": "tiny"}, "data": {"name": "hamlet"}, "seed": seed, "delay": delay, "engine": "simulate",
           "delay_profile": "uniform", "train": {"steps": 10}, "pipeline": {"schedule": revisions["schedule"]["name"]},
           "optimizer": {"name": "adamw", "lr": 1e-3, "ef": {"enabled": False, "lam": 1.0}},
           "compensation": {"name": "none"}}
    run = RunDir(root / name)
    run.write_config(yaml.safe_dump(cfg))
    run.append_metrics({"step": 10, "tokens": 1000, "val_loss": loss})
    run.write_summary({"status": "completed", "final_val_loss": loss, "tokens": 1000})
    (root / name / "provenance.json").write_text(json.dumps({"started": "2026-12-06T08:00:00", "revisions": revisions}))


def test_every_recorded_revision_is_compared_and_an_unknown_one_is_named_and_kept_apart(tmp_path: Path) -> None:
    """adamw has never been revised here, yet a record of adamw revision 2 (a newer checkout's) is not pooled with
    revision 1; a PACI record of revision 3 is a cell of its own, named in one warning line, never a traceback."""
    from asyncpipe.report import build_report

    today = {"optimizer": {"name": "adamw", "revision": 1}, "compensation": {"name": "none", "revision": 1},
             "schedule": {"name": "2bw", "revision": 1}}
    newer = {**today, "optimizer": {"name": "adamw", "revision": 2}}
    paci3 = {**today, "schedule": {"name": "paci", "revision": 3}}
    for seed in range(2):
        _record(tmp_path / "sw", f"sync-{seed}", 0, seed, 3.0, today)
        _record(tmp_path / "sw", f"async-{seed}", 1, seed, 3.1, today)
        _record(tmp_path / "sw", f"async-new-{seed}", 1, seed + 2, 3.2, newer)
        _record(tmp_path / "sw", f"paci-{seed}", 1, seed + 4, 3.3, paci3)
    report = build_report(tmp_path / "sw", out_dir=tmp_path / "out", plots=False)
    runs = report.runs.set_index("run")
    assert {runs.loc[f"async-new-{s}", "optimizer"] for s in range(2)} == {"adamw@r2"}
    assert {runs.loc[f"async-{s}", "optimizer"] for s in range(2)} == {"adamw"}
    assert all(str(runs.loc[f"paci-{s}", "variant"]).endswith("@r3") for s in range(2))
    said = [w for w in report.warnings if "which this checkout does not know" in w]
    assert any(w.startswith("adamw@r2") for w in said) and any(w.startswith("paci@r3") for w in said)
    assert all("\n" not in w for w in said)


def test_best_of_a_key_that_defines_the_columns_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    """`report --best-of delay`: delay names the columns (sync, 1-step), so no column has two values to choose
    between; before, nothing was tuned, seed 0 was spent, and the report still said "tuned against tuned"."""
    from asyncpipe.cli import main

    today = {"optimizer": {"name": "adamw", "revision": 1}, "compensation": {"name": "none", "revision": 1},
             "schedule": {"name": "2bw", "revision": 1}}
    for seed in range(4):
        _record(tmp_path / "sw", f"sync-{seed}", 0, seed, 3.0, today)
        _record(tmp_path / "sw", f"async-{seed}", 1, seed, 3.1, today)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "sw"), "--best-of", "delay", "--out", str(tmp_path / "out"), "--no-plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "--best-of delay: no column has runs at two values of it (it defines the columns" in err[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_500_seed_dry_run_checks_every_run_from_one_composition(tmp_path: Path) -> None:
    """`sweep "seed=range(0,500)" model=tiny --dry-run` took 11 s of CPU (a tuned-lr table read per run, a config
    copied per run): now one composition, each run's own values checked, its config composed only when read."""
    import time

    from asyncpipe.config import compose, to_yaml
    from asyncpipe.errors import UserError
    from asyncpipe.sweep.expand import run_overrides
    from asyncpipe.sweep.runner import compose_runs, dry_run_sweep, plan_sweep

    began = time.process_time()
    text = dry_run_sweep(["seed=range(0,500)", "model=tiny"], out=tmp_path / "sweeps")
    assert "500 runs" in text and text.count("model=tiny seed=") == 500
    assert time.process_time() - began < 5  # CPU seconds (a loaded machine stretches the wall clock, not these)
    plan = plan_sweep(["seed=range(0,500)", "model=tiny"], out=tmp_path / "sweeps")
    cfgs, _ = compose_runs(plan, tmp_path / "sweeps" / plan.name)
    for spec in (plan.runs[7], plan.runs[499]):
        over = run_overrides(plan, spec, (tmp_path / "sweeps" / plan.name / spec.name).resolve(), resume=False)
        assert to_yaml(cfgs[spec.name]) == to_yaml(compose([*over, *plan.launcher]))  # the very config Hydra makes
        assert cfgs[spec.name].seed == int(spec.name.split("=")[1]) and cfgs.template(spec.name).seed == 0
    with pytest.raises(UserError, match=r"run seed=4294967296: seed=4294967296 must be an integer in \[0, "):
        compose_runs(plan_sweep(["seed=0,4294967296", "model=tiny"], out=tmp_path / "s"), tmp_path / "s" / "x")


def test_retry_failed_of_a_branch_whose_trunk_lost_its_checkpoints_trains_the_trunk_again(tmp_path: Path) -> None:
    """The advice a failed branch gets (`--retry-failed`) works: with it, the completed trunk missing the branch's
    checkpoint is retired to be trained again; without it (the branch stays failed) the trunk is left alone."""
    from asyncpipe.sweep import plan_sweep
    from asyncpipe.sweep.budgets import retrain_lost_trunks
    from asyncpipe.sweep.runner import compose_runs
    from test_budgets import _family_file

    path = _family_file(tmp_path, budgets="[1, 2]")
    path.write_text(path.read_text().replace("  1-step: [delay=1]\n", ""))
    plan = plan_sweep(file=path, out=tmp_path / "out")
    sweep = tmp_path / "out" / plan.name
    cfgs, _ = compose_runs(plan, sweep)
    trunk, branch = sweep / "seed=0,variant=sync,budget=2", sweep / "seed=0,variant=sync,budget=1"
    for run, status in ((trunk, "completed"), (branch, "failed")):
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"status": status}))
    (trunk / "checkpoints" / "step_00000002").mkdir(parents=True)  # before the branch's decay start (3), unmarked
    assert retrain_lost_trunks(plan, sweep, cfgs, retry_failed=False) == [] and trunk.is_dir()
    (note,) = retrain_lost_trunks(plan, sweep, cfgs, retry_failed=True)
    assert note.startswith(f"{trunk.name}: completed, but its checkpoint at step 3 (where {branch.name} branches")
    assert not trunk.exists() and [p.name.split(".")[0] for p in (sweep / ".retired").iterdir()] == [trunk.name]
