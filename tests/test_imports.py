"""The package's import graph, read with `ast` (nothing is imported): no import circles between modules of
`asyncpipe/`, no module importing another module's private (`_name`) names, and the layering the docs promise."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asyncpipe"


def _modules(package: Path) -> dict[str, Path]:
    mods = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """(module -> the package's modules it imports, anywhere in the file), and (module, private name) pairs."""
    mods = _modules(package)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    if full in mods:
                        edges[mod].add(full)
                    elif target in mods:
                        edges[mod].add(target)
                        name = alias.name
                        if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                            if target != mod:
                                private.append((mod, full))
            elif isinstance(node, ast.Import):
                edges[mod].update(a.name for a in node.names if a.name in mods)
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub.b import g, _h\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n\ndef g(): ...\n\ndef _h(): ...\n")
    edges, private = import_graph(pkg)
    assert cycles(edges) == [["pkg.a", "pkg.sub.b"]]
    assert private == [("pkg.a", "pkg.sub.b._h")]


def test_no_import_cycles() -> None:
    edges, _ = import_graph()
    assert len(edges) > 50 and edges["asyncpipe.run"]  # the reader found the package
    assert cycles(edges) == []


def test_no_module_imports_a_private_name_of_another() -> None:
    _, private = import_graph()
    assert private == []


def test_layering() -> None:
    """config never imports torch-side modules; the simulator and the pipeline runtime (`engines.pipeline`) do not
    import each other; the lifecycle and the runtime import no engine; report never imports torch-side modules, nor
    do the compensation methods' declarations (their rules, in optim.compensation, import the declarations, never the
    other way)."""
    edges, _ = import_graph()

    def reaches(prefix: str | tuple[str, ...], target: str | tuple[str, ...]) -> list[tuple[str, str]]:
        return [(m, t) for m, ts in edges.items() if m.startswith(prefix) for t in ts if t.startswith(target)]

    engines = [m for m in edges if m.startswith("asyncpipe.engines.")]
    pipeline = tuple(m for m in engines if m.startswith("asyncpipe.engines.pipeline"))
    simulator = tuple(m for m in engines if m not in pipeline)  # every other engines module: the delay simulator
    assert {"asyncpipe.engines.pipeline.adapter", "asyncpipe.engines.pipeline.deepspeed_engine"} <= set(pipeline)
    assert {"asyncpipe.engines.simulator", "asyncpipe.engines.staged"} <= set(simulator)
    assert reaches(pipeline, simulator) == []
    assert reaches(simulator, pipeline) == []
    for below in ("asyncpipe.session", "asyncpipe.runtime"):
        assert reaches(below, "asyncpipe.engines") == []
    for light in ("asyncpipe.config", "asyncpipe.report", "asyncpipe.compensation"):
        for heavy in ("asyncpipe.runtime", "asyncpipe.model", "asyncpipe.optim", "asyncpipe.engines"):
            assert reaches(light, heavy) == []


# The package's layers, bottom first: a module may import its own layer and those below, never one above. A module
# belongs to the layer of its longest matching prefix (``asyncpipe`` alone is the package's own __init__).
LAYERS: tuple[tuple[str, ...], ...] = (
    # stdlib-only foundations: errors, statuses, streams, the lr rule, run-dir file names and the lock, path checks
    ("asyncpipe", "asyncpipe.errors", "asyncpipe.status", "asyncpipe.terminal", "asyncpipe.lr_schedule",
     "asyncpipe.track.files", "asyncpipe.track.lock", "asyncpipe.paths", "asyncpipe.dist"),
    ("asyncpipe.config.tree", "asyncpipe.config.tuned"),  # conf/ and the tuned-lr table (a run's regime)
    ("asyncpipe.data",),  # corpora, tokenizers, micro-batches
    # the extension points, torch-free: the registry and the declarations it finds (it imports the built-in methods
    # by walking their package; each imports it to declare itself, so they are one layer); schedules (instructions,
    # orders, one module each)
    ("asyncpipe.registry", "asyncpipe.schedules", "asyncpipe.compensation"),
    # the layer list's sizes, the stage cut (reads the schedule), PyTorch's schedules (their chunks' layers)
    # ... and the per-layer seconds of a device profile and of a stand-in profile (the balanced cut weighs them),
    # which reads a model preset over the typed schema (its dataclasses import only the registry)
    ("asyncpipe.shapes", "asyncpipe.partition", "asyncpipe.torch_schedules", "asyncpipe.device_profile",
     "asyncpipe.standin_costs", "asyncpipe.config.schema"),
    ("asyncpipe.config",),  # schema, compose, validate: reads the declarations
    ("asyncpipe.track",),  # tracker, W&B mirror, provenance: read a composed config
    ("asyncpipe.plan", "asyncpipe.plan_table"),  # memory on paper, and its table
    ("asyncpipe.timelines",),  # one replay of any order: ideal, traced, modelled timelines, the cost model, drawings
    ("asyncpipe.model",),
    ("asyncpipe.optim", "asyncpipe.optimizers"),
    ("asyncpipe.runtime",),  # device, checkpoints, signals, set-up, the engine protocol
    ("asyncpipe.engines",),  # the runtimes that execute a schedule: the delay simulator and engines.pipeline
    ("asyncpipe.session",),  # the run record and progress
    ("asyncpipe.forkserver", "asyncpipe.forkchild", "asyncpipe.spawn"),  # the launcher
    ("asyncpipe.trainer",),  # the one owner of a run
    ("asyncpipe.run", "asyncpipe.rank", "asyncpipe.bench", "asyncpipe.sweep", "asyncpipe.report"),
    ("asyncpipe.plan_speed",),
    ("asyncpipe.cli_perf", "asyncpipe.cli_sweep", "asyncpipe.cli", "asyncpipe.__main__"),
)


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int:
    """The index of ``module``'s layer: its longest matching prefix's (``asyncpipe`` matches only itself)."""
    best, index = "", -1
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "asyncpipe" and module.startswith(prefix + "."))
            if matches and len(prefix) > len(best):
                best, index = prefix, i
    if index < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_imports.py")
    return index


def upward(edges: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[tuple[str, str]]:
    """The imports from a module to one in a higher layer, sorted."""
    return sorted((m, t) for m, ts in edges.items() for t in ts if layer_of(t, layers) > layer_of(m, layers))


def test_the_layer_reader_sees_an_import_that_climbs() -> None:
    layers = (("pkg.low",), ("pkg.high",))
    edges = {"pkg.low.a": {"pkg.low.b"}, "pkg.low.b": {"pkg.high.c"}, "pkg.high.c": {"pkg.low.a"}}
    assert upward(edges, layers) == [("pkg.low.b", "pkg.high.c")]


def test_no_import_climbs_a_layer() -> None:
    edges, _ = import_graph()
    assert upward(edges) == []
