"""What must stay light: the config, the report, the sweep layer and the run dir's files never import torch (a
report or a sweep's bookkeeping runs where torch is slow to import or absent), and nothing imports Hydra's
private modules. Each check imports in a fresh interpreter, so modules loaded by other tests cannot hide an import."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "asyncpipe"
LIGHT = [
    "asyncpipe.config", "asyncpipe.config.compose", "asyncpipe.config.validate", "asyncpipe.config.describe",
    "asyncpipe.config.keys", "asyncpipe.report", "asyncpipe.report.build", "asyncpipe.report.load",
    "asyncpipe.report.groups", "asyncpipe.sweep", "asyncpipe.sweep.state", "asyncpipe.sweep.expand",
    "asyncpipe.track.files", "asyncpipe.track.lock", "asyncpipe.session.rundir", "asyncpipe.paths",
    "asyncpipe.timelines.draw", "asyncpipe.timelines.orders", "asyncpipe.timelines.timeline", "asyncpipe.timelines.trace_load",
    "asyncpipe.timelines.cost", "asyncpipe.timelines.cost_source", "asyncpipe.partition", "asyncpipe.plan", "asyncpipe.plan_speed",
]  # fmt: skip
HEAVY = ("torch", "deepspeed")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def heavy_after_import(modules: list[str]) -> list[str]:
    """The heavy modules in sys.modules after importing `modules` in a fresh interpreter."""
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=ENV)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def test_the_probe_sees_torch_when_it_is_imported() -> None:
    assert heavy_after_import(["asyncpipe.config", "asyncpipe.model"]) == ["torch"]


def test_config_report_sweep_and_run_dir_files_never_import_torch() -> None:
    assert heavy_after_import(LIGHT) == []


@pytest.mark.parametrize("module", ["asyncpipe.config.compose", "asyncpipe.report"])
def test_importtime_of_config_and_report_names_no_torch(module: str) -> None:
    """The check of the issue: `python -X importtime -c "import asyncpipe.config.compose"` lists no torch module."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True,
                          text=True, timeout=300, env=ENV)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) > 50 and any(module in line for line in lines)  # importtime did report the imports
    assert [line for line in lines if "torch" in line] == []


def test_nothing_imports_hydras_private_modules() -> None:
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])  # fmt: skip
            found += [f"{path.relative_to(PACKAGE.parent)}: {n}" for n in names if n.startswith("hydra._internal")]
    assert found == []
