"""Shared fixtures: a per-session data root so every test reuses one prepared Hamlet dataset."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Data cache and W&B stay inside the test session; no test talks to the network."""
    os.environ.setdefault("ASYNCPIPE_DATA", str(tmp_path_factory.mktemp("data_cache")))
    os.environ["WANDB_MODE"] = "disabled"
    os.environ["WANDB_SILENT"] = "true"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
