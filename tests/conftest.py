"""Shared fixtures: a per-session data root so every test reuses one prepared Hamlet dataset, and one SLURM test
cluster for every SLURM test module (started on first use); and how `make test` spreads the files over workers.

`make test` runs the suite on two pytest-xdist workers (`-n 2`): most tests are one process on one core, so the
second core was idle most of the time. Each test file goes to one worker (its module fixtures, such as the
pipeline parity launches, run once, not on every worker that got one of its tests), and every SLURM test file
(`test_slurm*.py`) to one worker, where the session's one cluster serves them all: `pytest_xdist_make_scheduler`
below. (xdist's own `--dist loadgroup` does not group under pytest 9, whose node ids no longer take the group
suffix xdist writes: measured, a module fixture ran once per worker.) Files start longest first (SLURM, then files
with `slow` tests), so no long file is left to run alone at the end. Timings: docs/performance.md, "The test
suite"."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


def _scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "slurm" if Path(path).name.startswith("test_slurm") else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scope scheduling with one scope per file, and one for all SLURM files."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ByFile(config, log)


def pytest_collection_modifyitems(items: list) -> None:
    """Longest files first: the SLURM files, then files with a `slow` test, then the rest (a stable sort: each
    file's tests stay together and in order)."""
    rank: dict[str, int] = {}
    for item in items:
        scope = _scope(item.nodeid)
        weight = 0 if scope == "slurm" else 1 if item.get_closest_marker("slow") is not None else 2
        rank[scope] = min(rank.get(scope, 2), weight)
    items.sort(key=lambda item: rank[_scope(item.nodeid)])


@pytest.fixture(scope="session", autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Data cache and W&B stay inside the test session; no test talks to the network."""
    os.environ.setdefault("ASYNCPIPE_DATA", str(tmp_path_factory.mktemp("data_cache")))
    os.environ["WANDB_MODE"] = "disabled"
    os.environ["WANDB_SILENT"] = "true"
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One running test cluster for the session (2 nodes where possible, else 1; a skip where none is): its
    clients (SLURM_CONF, the sacct shim) are in os.environ while it runs. Starting one costs tens of seconds
    (the first time also an apt install), so the SLURM modules share it. A sweep polls SLURM every POLL_S (2 s)
    until its jobs end; the test jobs last seconds, so they poll every 0.5 s while the cluster runs."""
    import asyncpipe.sweep.slurm as slurm_launcher
    from slurm_cluster import running_cluster

    poll, slurm_launcher.POLL_S = slurm_launcher.POLL_S, 0.5
    try:
        with running_cluster(tmp_path_factory.mktemp("slurm"), 2, fallback=True) as root:
            yield root
    finally:
        slurm_launcher.POLL_S = poll


@pytest.fixture(autouse=True)
def schedules_registered_by_a_test_stay_in_it() -> Iterator[None]:
    """A test that declares a schedule (by import path, from tests/user_lab) leaves the registry as it found it, so
    a later test in the same worker (bench pipeline's default variants: every registered schedule) never sees it."""
    from asyncpipe import schedules

    schedules.schedules()  # the built-ins loaded first: they stay
    before = dict(schedules._SCHEDULES)
    yield
    for name, spec in list(schedules._SCHEDULES.items()):
        if name not in before:  # its module is imported afresh (and declares again) by the next test that names it
            sys.modules.pop(spec.module, None)
    schedules._SCHEDULES.clear()
    schedules._SCHEDULES.update(before)
