"""Bad inputs that need a real process (the entry point end to end, prepared data that goes bad, W&B's
fallback): one line on stderr, exit code 2, and no run dir that looks complete.

The table of config, path and option mistakes, run in-process, is tests/test_bad_input_table.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import asyncpipe, cli_env, truncated_dataset


def assert_one_line_exit_2(proc, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-800:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train", "optimizer.betas=[0.9]"], "optimizer.betas=[0.9] needs two values"),
        (["trian"], "No such command 'trian'"),
    ],
)
def test_one_line_from_a_real_process(args: list[str], needle: str, tmp_path: Path) -> None:
    """The table in test_bad_input_table.py runs in-process; here the installed entry point, end to end."""
    proc = subprocess.run([sys.executable, "-m", "asyncpipe", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=cli_env(), timeout=120)  # fmt: skip
    assert_one_line_exit_2(proc, needle)
    assert list(tmp_path.iterdir()) == []


def test_token_file_size_mismatch(tmp_path: Path) -> None:
    env = truncated_dataset(tmp_path / "data")
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


def test_wandb_online_without_key_falls_back_to_offline(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in cli_env().items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env["HOME"] = str(tmp_path)  # no ~/.netrc with a key
    proc = asyncpipe("train", "train.steps=2", "tracker.wandb.mode=online", f"run.dir={run}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "offline" in proc.stderr and "API key" in proc.stderr
    assert list((run / "wandb").glob("offline-run-*"))


def test_sweep_file_with_empty_grid_is_refused(tmp_path: Path) -> None:
    sweep = tmp_path / "empty.yaml"
    sweep.write_text("name: empty\ngrid: {}\noverrides: []\n")  # an empty file no longer becomes one default run
    assert_one_line_exit_2(asyncpipe("sweep", "--file", str(sweep), "--out", str(tmp_path), "--dry-run"), "defines no runs")
    sweep.write_text("name: one\ngrid: {}\noverrides: [train.steps=5]\n")
    proc = asyncpipe("sweep", "--file", str(sweep), "--out", str(tmp_path), "--dry-run")
    assert proc.returncode == 0 and "sweep one: 1 runs" in proc.stdout, proc.stderr
    sweep.write_text("name: bad\ngrid: {seed: '0,1'}\nvariants: {a: [delay=1], b: ['delay=0,1']}\n")
    assert_one_line_exit_2(asyncpipe("sweep", "--file", str(sweep), "--out", str(tmp_path)), "is a sweep")

