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


def test_make_verdict_reports_committed_records_into_runs_never_docs() -> None:
    """`make verdict` (issue 55): the wall-clock verdict from committed records alone (no training), written under
    runs/ by default, with the same report arguments as the v6 write-up's time-to-target report."""
    lines = recipe("verdict")
    assert lines[0].startswith("@echo") and "no training" in lines[0]
    assert not [ln for ln in lines if re.search(r"\brm\b|\bsweep\b|\btrain\b ", ln)]
    out = re.search(r"^VERDICT_OUT \?= (\S+)$", MAKEFILE, re.M)
    assert out and out.group(1).startswith("runs/")
    names = {k: re.search(rf"^{k} := (\S+)$", MAKEFILE, re.M).group(1) for k in ("V5", "V6", "BENCH")}
    command = " ".join(ln.rstrip("\\").strip() for ln in lines[1:])
    for k, v in names.items():
        command = command.replace(f"$({k})", v)
    args = command.replace("$(BIN)/", "").split()
    assert args[:2] == ["asyncpipe", "report"] and args[args.index("--out") + 1] == "$(VERDICT_OUT)"
    repo = Path(__file__).resolve().parents[1]
    read = [a for a in args if a.startswith(("results/", "benchmarks/"))]
    assert len(read) == 15 and all((repo / a).exists() for a in read)
    doc = (repo / "docs" / "results" / "cpu_study_v6.md").read_text()
    written = next(ln for ln in doc.splitlines() if ln.startswith("asyncpipe report") and "--wallclock-at" in ln)
    written = written.replace("$R", "results").split()
    strip = lambda a: [x for i, x in enumerate(a) if x != "--out" and (i == 0 or a[i - 1] != "--out")]  # noqa: E731
    assert sorted(strip(written)) == sorted(strip([a for a in args if a != "--no-wandb-log"]))
