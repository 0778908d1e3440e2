"""`plan`'s bubble column is defined where it is printed and in docs/usage.md (issue 55: 1F1B's 0.468 where the
docs' formula gives 0.30, and 2BW's 0.332 though 2BW has no flush, were unexplained)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from asyncpipe.cli import app

USAGE = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()


def test_the_schedules_table_is_followed_by_its_bubble_legend() -> None:
    res = CliRunner().invoke(app, ["plan", "model=tiny", "pipeline.stages=2"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    header = next(i for i, ln in enumerate(lines) if " bubble " in ln and "schedule" in ln)
    legend = next(i for i, ln in enumerate(lines) if ln.startswith("bubble: "))
    assert legend > header and "least busy stage's idle share" in lines[legend]
    assert "(P-1)/(m+P-1)" in res.output and "2BW's (no flush) is not 0" in res.output
    assert lines[-1].startswith("verdict:")  # still the last line
    no_speed = CliRunner().invoke(app, ["plan", "model=tiny", "pipeline.stages=2", "--no-speed"]).output
    assert "bubble: " not in no_speed  # no schedules table, no legend for it


def test_usage_has_a_plan_section_defining_bubble() -> None:
    section = USAGE[USAGE.index("## Planning a run: `asyncpipe plan`"):]
    section = section[:section.index("\n## ")]
    assert "**bubble**" in section and "least busy stage's idle share" in section and "2BW's" in section
    assert re.search(r"asyncpipe plan model=\S+", section)
