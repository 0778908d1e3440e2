"""A named schedule implies what it declares: ``pipeline.schedule=paci`` composes at PACI's delay (1) and clipping
(per stage) in either engine; only a value the user typed that contradicts it is refused, in one line, before
anything is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncpipe.config import compose
from asyncpipe.errors import ConfigError
from asyncpipe.schedules import get

PACI = ["model=tiny", "pipeline.schedule=paci", "pipeline.stages=2"]


@pytest.mark.parametrize("engine", ["pipeline", "simulate"])
def test_naming_paci_gives_its_delay_and_clipping(engine: str) -> None:
    cfg = compose(PACI + [f"engine={engine}"])
    spec = get("paci")
    assert (cfg.delay, cfg.pipeline.clip) == (spec.delay, spec.clip_modes[0]) == (1, "stage")
    assert "-d1" in cfg.run.dir  # the default run dir names the implied delay


def test_what_the_user_types_in_agreement_is_kept_and_no_clipping_needs_no_mode() -> None:
    cfg = compose(PACI + ["engine=pipeline", "delay=1", "pipeline.clip=stage"])
    assert (cfg.delay, cfg.pipeline.clip) == (1, "stage")
    cfg = compose(PACI + ["engine=pipeline", "train.grad_clip=0"])
    assert (cfg.delay, cfg.pipeline.clip) == (1, "global")  # no clipping: the mode is never read, left as it is


@pytest.mark.parametrize(
    "typed, says",
    [
        (["delay=0"], "its delay is 1; use delay=1, got delay=0"),
        (["pipeline.clip=global"], "cannot clip with pipeline.clip=global"),
    ],
)
def test_an_explicit_contradiction_is_refused_in_one_line(typed: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(PACI + ["engine=pipeline"] + typed)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_auto_and_other_schedules_imply_nothing_new() -> None:
    assert compose(["model=tiny"]).delay == 0  # auto at delay 0 is 1F1B
    cfg = compose(["model=tiny", "pipeline.schedule=1f1b", "pipeline.stages=2"])
    assert (cfg.delay, cfg.pipeline.clip) == (0, "global")


def test_train_refuses_a_typed_contradiction_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "ASYNCPIPE_DATA": str(tmp_path / "data"), "OMP_NUM_THREADS": "1", "ASYNCPIPE_PRELOAD": "0"}
    argv = [sys.executable, "-m", "asyncpipe", "train", *PACI, "engine=pipeline", "delay=0", f"run.dir={run}"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "its delay is 1" in lines[0]
    assert not run.exists() and not (tmp_path / "data").exists()
