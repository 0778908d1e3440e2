"""The bad-input matrix: every user mistake is one line on stderr, exit code 2, and no run dir that looks complete.

Config-level mistakes are composed through the real CLI (`asyncpipe train`), so the whole path from argv to exit
code is exercised, not only the validator.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import asyncpipe, cli_env

CONFIG_MISTAKES = {
    "unknown group option": (["model=nope"], "unknown model 'nope'"),
    "unknown key": (["train.stepz=3"], "unknown config key 'train.stepz'"),
    "wrong type": (["train.steps=many"], "is not a valid int"),
    "negative delay": (["delay=-1"], "delay=-1 must be >= 0"),
    "pipeline delay > 1": (["engine=pipeline", "delay=2"], "supports delay 0 (1F1B) or 1 (2BW)"),
    "2BW with m < P": (["engine=pipeline", "delay=1", "pipeline.stages=4", "train.micro_batches=3"], "micro_batches >= pipeline.stages"),
    "more stages than layers": (["engine=pipeline", "pipeline.stages=6"], "exceeds the 4 transformer blocks"),
    "seq_len above model max": (["train.seq_len=1024"], "exceeds model 'tiny' maximum of 256"),
    "lr <= 0": (["optimizer.lr=-1e-3"], "optimizer.lr=-0.001 must be > 0"),
    "EF lam < 0": (["optimizer=adamw_ef", "optimizer.ef.lam=-1"], "optimizer.ef.lam=-1.0 must be >= 0"),
    "unparsable override": (["delay"], "key=value"),
}


def assert_one_line_exit_2(proc, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-800:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", sorted(CONFIG_MISTAKES))
def test_config_mistake(case: str, tmp_path: Path) -> None:
    overrides, needle = CONFIG_MISTAKES[case]
    run = tmp_path / "run"
    assert_one_line_exit_2(asyncpipe("train", *overrides, f"run.dir={run}"), needle)
    assert not run.exists()


def test_token_file_size_mismatch(tmp_path: Path) -> None:
    root = tmp_path / "data"
    env = cli_env(ASYNCPIPE_DATA=str(root))
    assert asyncpipe("data", "prepare", env=env).returncode == 0
    train_bin = root / "hamlet-byte" / "train.bin"
    train_bin.write_bytes(train_bin.read_bytes()[:-10])
    run = tmp_path / "run"
    proc = asyncpipe("train", f"run.dir={run}", env=env)
    assert_one_line_exit_2(proc, "train.bin")
    assert not run.exists()


def test_missing_manifest(tmp_path: Path) -> None:
    from asyncpipe.data import load_manifest
    from asyncpipe.errors import UserError

    (tmp_path / "train.bin").write_bytes(b"\0" * 64)
    with pytest.raises(UserError) as err:
        load_manifest(tmp_path)
    assert "no data manifest" in str(err.value) and "\n" not in str(err.value)


def test_report_on_directory_without_runs(tmp_path: Path) -> None:
    assert_one_line_exit_2(asyncpipe("report", str(tmp_path)), "no runs found")


def test_wandb_online_without_key_falls_back_to_offline(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in cli_env().items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env["HOME"] = str(tmp_path)  # no ~/.netrc with a key
    proc = asyncpipe("train", "train.steps=2", "tracker.wandb.mode=online", f"run.dir={run}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "offline" in proc.stderr and "API key" in proc.stderr
    assert list((run / "wandb").glob("offline-run-*"))


def test_sweep_with_empty_grid_is_one_run(tmp_path: Path) -> None:
    sweep = tmp_path / "empty.yaml"
    sweep.write_text("name: empty\ngrid: {}\noverrides: []\n")
    proc = asyncpipe("sweep", "--file", str(sweep), "--out", str(tmp_path), "--dry-run")
    assert proc.returncode == 0 and "sweep empty: 1 runs" in proc.stdout, proc.stderr
    sweep.write_text("name: bad\ngrid: {seed: '0,1'}\nvariants: {a: [delay=1], b: ['delay=0,1']}\n")
    assert_one_line_exit_2(asyncpipe("sweep", "--file", str(sweep), "--out", str(tmp_path)), "is a sweep")


def test_slurm_launcher_without_sbatch(tmp_path: Path) -> None:
    env = cli_env(PATH=os.path.dirname(os.sys.executable))  # python only: no sbatch anywhere on PATH
    proc = asyncpipe("sweep", "optimizer=adamw,muon", "launcher=slurm", "--out", str(tmp_path), env=env)
    assert_one_line_exit_2(proc, "sbatch")


def test_pipedream_profile_needs_delay_1(tmp_path: Path) -> None:
    proc = asyncpipe("train", "delay_profile=pipedream", "delay=0", f"run.dir={tmp_path / 'run'}")
    assert_one_line_exit_2(proc, "use it with delay=1")
