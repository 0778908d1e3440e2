"""The README and the how-to point at files that exist: repository paths in the text and every Markdown link or image."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/usage.md", "docs/results_howto.md"]
# A repository path in running text or a command: starts at a top-level folder of the repository.
PATH = re.compile(r"(?<![\w/.])((?:docs|results|sweeps|asyncpipe|tests|benchmarks|conf)/[\w./=,+-]*[\w/])")
LINK = re.compile(r"\]\(([^)#\s]+)\)")  # [text](target) and ![alt](target)


@pytest.mark.parametrize("doc", DOCS)
def test_paths_and_links_exist(doc: str) -> None:
    text = (REPO / doc).read_text()
    paths = {p.rstrip(".,") for p in PATH.findall(text) if "*" not in p and "{" not in p}
    links = {(REPO / doc).parent / t for t in LINK.findall(text) if "://" not in t}
    assert paths and (doc != "docs/results_howto.md" or links)
    missing = sorted(p for p in paths if not (REPO / p).exists()) + sorted(
        str(p.relative_to(REPO)) for p in links if not p.exists())  # fmt: skip
    assert not missing, f"{doc} points at paths that do not exist: {missing}"


def test_citation_names_its_version_and_release_date() -> None:
    """CITATION.cff (issue 41): the version pyproject.toml builds and a release date (an ISO date, not in the future
    of the commit that set it)."""
    import datetime

    import yaml

    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version and cff["version"] == version.group(1)
    released = datetime.date.fromisoformat(str(cff["date-released"]))
    assert datetime.date(2026, 11, 30) <= released <= datetime.date.today()
    assert cff["license"] == "Apache-2.0" and cff["type"] == "software"
