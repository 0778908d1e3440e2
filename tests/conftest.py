"""Shared fixtures: a per-session data root so every test reuses one prepared Hamlet dataset, and one SLURM test
cluster for every SLURM test module (started on first use).

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`): most tests are one process on
one core, so the second core was idle most of the time (serial, on an AVX2-only 2-core EPYC: 34 min 6 s, user time
equal to wall time; on two workers 26 min 40 s and 28 min 9 s). The multi-process tests (pipelines, SLURM) then
run beside another worker's test and take about twice as long, which is why the gain is ~20%, not 2x. Each test
file goes to one worker (a module-scoped fixture runs once, not on every worker that got one of its tests), and
every SLURM test to one worker (the `slurm` group), where the session's one cluster serves them all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items: list) -> None:
    """Under xdist: a file's tests on one worker (module fixtures run once); SLURM tests, which share one cluster
    per session, all on one worker."""
    for item in items:
        group = "slurm" if item.get_closest_marker("slurm") is not None else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


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
