"""A schedule's staleness is declared once (its ``versions``) and what else it says about staleness is checked
against it when the config is composed: a schedule whose odd micro-batches run one step stale, declared in a module
of the user's own (by import path, docs/extending.md), is refused in one line with nothing written, instead of
failing in the simulator's first step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncpipe.config import compose
from asyncpipe.errors import ConfigError
from asyncpipe.schedules import check_staleness, get, names

# Odd micro-batches of every batch read the weights one step older, forward and backward, on every stage.
ODD_STALE = '''
"""Odd micro-batches one step stale (a schedule the simulator cannot run)."""
from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight


def versions(P, m, stage, k):
    v = max(k // m - k % 2, 0)
    return v, v


SPEC = declare_schedule(ScheduleSpec(
    name="{name}", note="odd micro-batches one step stale", versions=versions, weight_versions=lambda P, s: 2,
    in_flight=one_f_one_b_in_flight, {extra}
))
'''

# 2BW's stream (batch b pinned to W(b-1)) declared with synchronous versions.
MISPINNED = '''
"""2BW's stream, declared as if every micro-batch read the current weights."""
from asyncpipe.schedules import ScheduleSpec, declare_schedule, one_f_one_b_in_flight, uniform
from asyncpipe.schedules.twobw import SPEC as TWO_BW

SPEC = declare_schedule(ScheduleSpec(
    name="mispinned", note="2BW's stream with synchronous versions", versions=uniform(0),
    weight_versions=lambda P, s: 2, in_flight=one_f_one_b_in_flight, stream=TWO_BW.stream, delay=1,
    stage_delay=lambda P, s, delay: 0, flush=False,
))
'''

VARIANTS = {
    "odd_stale_declared": 'stage_delay=lambda P, s, delay: 0,',  # says one version per batch, current
    "odd_stale_apart": "",  # no stage_delay and no straddle recipe
    "odd_stale_inplace": "inplace=True,",  # stages apart, but backwards on an older version
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lab")
    pkg = root / "lab_schedules"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, extra in VARIANTS.items():
        (pkg / f"{name}.py").write_text(textwrap.dedent(ODD_STALE.format(name=name, extra=extra)))
    (pkg / "mispinned.py").write_text(textwrap.dedent(MISPINNED))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


BASE = ["model=tiny", "pipeline.stages=2", "train.micro_batches=4", "delay=1"]


@pytest.mark.parametrize(
    "module, says",
    [
        ("odd_stale_declared", "declares stage_delay 0 on stage 0 but its versions disagree: micro-batch 5 (batch 1)"),
        ("odd_stale_apart", "declares no stage_delay, so the simulator runs its stages apart"),
        ("odd_stale_inplace", "micro-batch 5 (batch 1) on stage 0 reads W(0) forward, W(0) backward; the simulator"),
    ],
)
def test_an_inconsistent_staleness_is_refused_at_composition(lab: Path, module: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(BASE + [f"pipeline.schedule=lab_schedules.{module}", "engine=simulate"])
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_inplace_variant_names_the_first_stale_backward(lab: Path) -> None:
    with pytest.raises(ConfigError) as err:
        compose(BASE + ["pipeline.schedule=lab_schedules.odd_stale_inplace", "engine=simulate", "train.micro_batches=2"])
    assert "micro-batch 3 (batch 1) on stage 0 reads W(0) forward, W(0) backward" in str(err.value)


def test_a_stream_pinning_other_versions_than_declared_is_refused(lab: Path) -> None:
    with pytest.raises(ConfigError) as err:
        compose(BASE + ["pipeline.schedule=lab_schedules.mispinned", "engine=pipeline"])
    says = "its stream runs the ForwardPass of micro-batch 4 on stage 0 on W(0), its versions say W(1)"
    assert says in str(err.value)


@pytest.mark.parametrize("P, m", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 16)])
def test_every_built_in_schedule_declares_its_staleness_consistently(P: int, m: int) -> None:
    from omegaconf import OmegaConf

    for spec in [get(name) for name in names()]:
        if not spec.module.startswith("asyncpipe."):
            continue  # the lab's
        for engine in spec.engines:
            for delay in sorted({1 if spec.delay is None else spec.delay, 2}):
                node = {"engine": engine, "delay": delay, "pipeline": {"stages": P}, "train": {"micro_batches": m}}
                cfg = OmegaConf.create(node)
                if spec.name == "dualpipev" and m < 2 * P or spec.stream is not None and m < P:
                    continue  # their own checks refuse these first
                check_staleness(spec, cfg)


def test_train_refuses_it_in_one_line_and_writes_nothing(lab: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{lab}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    env.update(ASYNCPIPE_DATA=str(tmp_path / "data"), ASYNCPIPE_PRELOAD="0")
    schedule = "pipeline.schedule=lab_schedules.odd_stale_declared"
    argv = [sys.executable, "-m", "asyncpipe", "train", *BASE, schedule, f"run.dir={run}"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "declares stage_delay 0 on stage 0 but its versions disagree" in lines[0], lines
    assert not run.exists() and not (tmp_path / "data").exists()
