"""What must stay light: the config, the report, the sweep layer and the run dir's files never import torch (a
report or a sweep's bookkeeping runs where torch is slow to import or absent), nor does running them: composing
every built-in optimizer and compensation method (their declarations, `asyncpipe.optimizers` and
`asyncpipe.compensation`), `config show`, `plan`, `schedule`, `report --bench` and the report's cost model; and
nothing imports Hydra's private modules. Each check runs in a fresh interpreter, so modules loaded by other tests
cannot hide an import."""

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
REPO = PACKAGE.parent
BENCH = REPO / "benchmarks" / "results" / "pipeline-small-P2-m4.json"  # a committed `bench pipeline` record, P = 2
SWEEP = REPO / "results" / "cpu_study" / "lr_adamw"  # a committed sweep (five runs)


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


# Every light code path in one interpreter; each step asserts it did its work (a path that failed early would
# prove nothing), and the last line lists the heavy modules loaded.
LIGHT_PATHS = r"""
import contextlib, io, sys
from pathlib import Path
from asyncpipe import registry
from asyncpipe.cli import main
from asyncpipe.config import compose, group_options
from asyncpipe.config.validate import validate
from asyncpipe.plan import plan
from asyncpipe.report.throughput import load_bench, throughput

bench, sweep, out = (Path(a) for a in sys.argv[1:4])


def cli(*argv):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            main(list(argv))
        except SystemExit as exc:
            assert exc.code in (0, None), (argv, exc.code, text.getvalue()[-2000:])
    return text.getvalue()


optimizers = group_options("optimizer")
methods = group_options("compensation")
assert {"adamw", "muon", "nadam", "soap"} <= set(optimizers) and len(methods) >= 8, (optimizers, methods)
for name in optimizers:
    cfg = compose(["model=tiny", f"optimizer={name}"])
    validate(cfg)
    assert plan(cfg, 80.0).ok, name
for name in methods:
    cfg = compose(["model=tiny", f"compensation={name}", "delay=1"])
    validate(cfg)
    assert cfg.compensation.name == name and registry.method_spec(name).name == name
    assert plan(cfg, 80.0).ok, name
assert "compensation:" in cli("config", "show", "model=tiny", "compensation=basis_rotation", "delay=1")
assert "fits" in cli("plan", "model=tiny", "optimizer=muon", "compensation=ef", "delay=1")
assert "2bw" in cli("schedule").lower()
modelled = throughput(4, 8, load_bench([bench]))  # no record at P = 4: the cost model, calibrated on the P = 2 one
assert modelled.kind == "modelled", modelled
cli("report", str(sweep), "--bench", str(bench), "--no-plots", "--no-wandb-log", "--out", str(out))
assert (out / "report.md").is_file()
print(sorted(m for m in ("torch", "deepspeed") if m in sys.modules))
"""


def test_composing_planning_and_reporting_never_import_torch(tmp_path: Path) -> None:
    """Compose (and validate, and plan) every built-in optimizer preset and compensation method, `config show`,
    `plan`, `schedule`, the report's modelled throughput and `report --bench` on committed records: no torch."""
    proc = subprocess.run([sys.executable, "-c", LIGHT_PATHS, str(BENCH), str(SWEEP), str(tmp_path / "report")],
                          capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ast.literal_eval(proc.stdout.strip().splitlines()[-1]) == []


def test_nothing_imports_hydras_private_modules() -> None:
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])  # fmt: skip
            found += [f"{path.relative_to(PACKAGE.parent)}: {n}" for n in names if n.startswith("hydra._internal")]
    assert found == []
