"""grep-level: the pipeline schedules' names are listed in one place, the registry (`asyncpipe.schedules.names()`,
filled by each schedule module's own `declare_schedule`). No other module holds a tuple, list or set of two or
more of them; code that needs such a list asks the registry."""

from __future__ import annotations

import ast
from pathlib import Path

from asyncpipe import schedules

PKG = Path(__file__).resolve().parents[1] / "asyncpipe"
# PyTorch's own schedules (`pipeline.torch_schedule`) are another namespace: torch.distributed.pipelining's classes,
# listed once in asyncpipe/torch_schedules.py; some share a name with ours (1f1b, dualpipev) but not the code.
TORCH_LIST = "torch_schedules.py"


def _name_lists(names: set[str]) -> list[tuple[str, int, list[str]]]:
    found = []
    for path in PKG.rglob("*.py"):
        rel = str(path.relative_to(PKG))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                hits = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(hits) >= 2:
                    found.append((rel, node.lineno, hits))
    return found


def test_schedule_names_are_listed_once() -> None:
    names = set(schedules.names())
    assert {"1f1b", "2bw", "dualpipev", "pipedream", "paci"} <= names
    assert _name_lists(names) == []


def test_torch_schedule_names_are_listed_once() -> None:
    from asyncpipe.torch_schedules import SCHEDULES

    torch_names = set(SCHEDULES) - set(schedules.names())  # the ones only torch has
    found = [f for f in _name_lists(torch_names) if f[0] != TORCH_LIST]
    assert found == []
