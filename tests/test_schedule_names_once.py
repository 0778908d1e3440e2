"""grep-level: the pipeline schedules' names are listed in one place, the registry (`asyncpipe.schedules.names()`,
filled by each schedule module's own `declare_schedule`). No other module holds a tuple, list, set or dict keyed by
two or more of them; code that needs such a list (the orders drawn, the bubble table's notes) asks the registry.
And each schedule's order is written once: the one-batch orders replayed by data dependencies are the declared
schedules' own (1F1B's read off its stream)."""

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
            elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and elts is not None:
                hits = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in names]
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


def test_the_reader_sees_a_dict_keyed_by_schedule_names(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "m.py").write_text('NOTES = {"1f1b": "a", "2bw": "b"}\nONE = {"1f1b": 1}\n')
    monkeypatch.setattr(__import__(__name__), "PKG", tmp_path)
    assert _name_lists({"1f1b", "2bw"}) == [("m.py", 1, ["1f1b", "2bw"])]


def test_each_declared_order_is_the_schedules_own() -> None:
    from asyncpipe.schedules.instructions import BackwardPass, ForwardPass
    from asyncpipe.schedules.onef1b import flushed_1f1b_stream
    from asyncpipe.schedules.orders import drawn_orders, plans

    declared = {s.name for s in schedules.schedules() if s.order is not None}
    assert {"1f1b", "dualpipev"} <= declared and set(plans()) == declared | set(drawn_orders())
    for P, m in [(1, 1), (2, 3), (4, 8), (5, 2)]:  # 1F1B's plan is its stream's passes, in order
        for r, ops in enumerate(plans()["1f1b"](P, m).ranks):
            passes = [c for c in flushed_1f1b_stream(m, P, r) if isinstance(c, (ForwardPass, BackwardPass))]
            assert [(o.kind, o.micro_batch) for o in ops] == [(type(c).__name__[0], c.micro_batch) for c in passes]
