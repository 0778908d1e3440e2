"""The house's shape, checked: the formatter is configured once (pyproject's [tool.ruff]) and the package is
formatted by it, `# fmt: skip` stays rare (hand-aligned tables only), files stay under 400 lines and functions
under 80 (read with `ast`, nothing imported)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "asyncpipe"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_formatted_by_the_configured_formatter():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is a dev dependency: make install)")
    res = subprocess.run([ruff, "format", "--check", str(PACKAGE)], capture_output=True, text=True,
                         cwd=PACKAGE.parent)  # fmt: skip
    assert res.returncode == 0, f"run `ruff format asyncpipe`:\n{res.stdout[-2000:]}{res.stderr[-500:]}"


def test_the_formatter_is_rarely_switched_off():
    skips = sum(p.read_text().count("# fmt: skip") for p in SOURCES)
    assert skips <= 40, f"{skips} `# fmt: skip` in asyncpipe/: configure the formatter instead"


def test_no_file_over_400_lines():
    big = {p.relative_to(PACKAGE.parent): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 400}
    assert not big, f"files over 400 lines (split them where their concepts are): {big}"


def test_no_function_over_80_lines():
    long = []
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{p.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over 80 lines (split them where their steps are): {long}"
