"""The CLI explains itself: --version, and train / config show help listing config groups and the main keys."""

from __future__ import annotations

import os
import subprocess
import sys

from asyncpipe import __version__
from asyncpipe.config import group_options
from asyncpipe.config.describe import schema_fields


def asyncpipe(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "asyncpipe", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_version():
    proc = asyncpipe("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"asyncpipe {__version__}"


def test_train_and_config_show_help_list_groups_and_main_keys():
    fields = schema_fields()
    kind, default, comment = fields["optimizer.ef.enabled"]  # EF's switch, declared in its method's module
    assert (kind, default) == ("bool", "False") and "error feedback" in comment and "compensation=ef" in comment
    assert fields["train.steps"][0] == "int" and "tracker.wandb.mode" in fields
    for args in (("train", "--help"), ("config", "show", "--help")):
        proc = asyncpipe(*args)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert "model=  " + ", ".join(group_options("model")) in out
        assert "optimizer=  " + ", ".join(group_options("optimizer")) in out
        assert "optimizer.ef.enabled=False  (bool)" in out and "error feedback" in out
        assert "train.steps=100  (int)" in out and "optimizer steps" in out


def _commands(group, path=()):  # noqa: ANN001, ANN202 (click objects)
    """Every command path of the CLI, groups included: ("",), ("bench",), ("bench", "pipeline"), ..."""
    yield path
    for name, sub in getattr(group, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_help_fits_80_columns_without_cut_text_or_flag_types():
    """A flag takes no value, so its help shows no `<bool>`; a default or path is never cut to `…` at 80 columns."""
    import typer.main
    from typer.testing import CliRunner

    from asyncpipe.cli import app

    paths = list(_commands(typer.main.get_command(app)))
    assert ("bench", "pipeline") in paths and ("sweep", "status") in paths and ("report",) in paths
    for path in paths:
        res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
        assert res.exit_code == 0, (path, res.output)
        assert "--help" in res.output and max(len(line) for line in res.output.splitlines()) <= 80, path
        assert "<bool>" not in res.output, (path, res.output)
        assert "\u2026" not in res.output, (path, res.output)
        if path == ("report",):
            assert "<path>" in res.output  # options that take a value keep their type
