"""The Makefile's two commands say what they do before doing it (issue 41): `make smoke-test` deletes nothing (a
re-run keeps the seeds a sweep already holds), `make test` says what it may install and how to skip it."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = (Path(__file__).resolve().parents[1] / "Makefile").read_text()


def recipe(target: str) -> list[str]:
    block = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", MAKEFILE, re.M)
    assert block, f"no recipe for {target}"
    return [line.strip() for line in block.group(1).splitlines()]


def test_smoke_test_deletes_nothing_and_says_so() -> None:
    lines = recipe("smoke-test")
    assert not [ln for ln in lines if re.search(r"\brm\b", ln)]
    assert lines[0].startswith("@echo") and "kept" in lines[0]


def test_make_test_names_what_it_installs_and_how_to_skip_it() -> None:
    said = " ".join(ln for ln in recipe("test") if ln.startswith("@echo"))
    for package in ("apt-get", "slurmctld", "munge", "slurmdbd", "mariadb-server", "PYTEST_MARK='not slurm'"):
        assert package in said
    cluster = (Path(__file__).resolve().parent / "slurm" / "cluster.sh").read_text()
    named = re.findall(r"^(?:ACCT_)?PKGS=\(([^)]*)\)", cluster, re.M)
    assert named and all(p in said for group in named for p in group.split())  # the same list cluster.sh installs
