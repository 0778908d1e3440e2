"""One colour per variant in every figure (issue 55): the plotting modules take a variant's colour and marker from
asyncpipe.report.palette only (a colour written into a plotting module is a plot picking its own), and every figure
of a real report draws each variant in its palette colour (wallclock.png's 1-step+EF is green as in the others)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import matplotlib.colors as mcolors
import pytest

from asyncpipe.report import build_report
from asyncpipe.report.palette import FIXED, NEUTRAL, Palette, family
from report_runs import line, sweep, write

REPORT = Path(__file__).resolve().parents[1] / "asyncpipe" / "report"
PLOTTING = sorted(p for p in REPORT.glob("*.py") if p.name != "palette.py" and "matplotlib" in p.read_text())
COLOUR_WORDS = set(mcolors.CSS4_COLORS) | set(mcolors.BASE_COLORS) | {f"C{i}" for i in range(10)}
HEX = re.compile(r"^#[0-9a-fA-F]{3,8}$")


def _literal_colours(path: Path) -> list[str]:
    """Every string literal in `path` that names a colour: as a `color=` argument or anywhere (a hex code)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and HEX.match(node.value):
            found.append(f"{path.name}:{node.lineno} {node.value}")
        if isinstance(node, ast.keyword) and node.arg in ("color", "colour", "c", "facecolor", "edgecolor", "mfc",
                                                          "mec", "markerfacecolor", "markeredgecolor", "ecolor"):
            keys = {id(k) for sub in ast.walk(node.value) if isinstance(sub, ast.Subscript)
                    for k in ast.walk(sub.slice)}  # fmt: skip
            for sub in ast.walk(node.value):  # NEUTRAL["black"]'s key is a name, not a colour picked here
                if id(sub) not in keys and isinstance(sub, ast.Constant) and isinstance(sub.value, str) and (
                        sub.value in COLOUR_WORDS or HEX.match(sub.value)):  # fmt: skip
                    found.append(f"{path.name}:{sub.lineno} color={sub.value!r}")
    return found


def test_no_plotting_module_picks_its_own_colour() -> None:
    names = {p.name for p in PLOTTING}
    assert {"plots.py", "glance.py", "wallclock.py", "verdict_figure.py"} <= names, names
    assert [c for p in PLOTTING for c in _literal_colours(p)] == []
    assert not [p.name for p in PLOTTING if re.search(r"^(COLOURS|COLORS|MARKERS)\s*=", p.read_text(), re.M)]


def test_families_and_fixed_colours() -> None:
    assert family("main:1-step+EF(x1.5)@r1") == "1-step+EF" and family("PACI(x2)@r1") == "PACI"
    assert family("EF(lam=2)") == "EF(lam=2)" and family("sync") == "sync"
    palette = Palette(["sync", "EF(lam=2)", "1-step", "pipedream(P=4)"])
    assert palette.colour("1-step(x2.5)") == palette.colour("1-step") == FIXED["1-step"][0]
    assert palette.colour("EF(lam=2)") != palette.colour("pipedream(P=4)")
    used = {palette.colour(v) for v in ("sync", "1-step", "1-step+EF", "PACI", "PACI+EF", "EF(lam=2)")}
    assert len(used) == 6 and not used & set(NEUTRAL.values())


def _handles(fig) -> list[tuple[str, object]]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [(t.get_text(), h) for lg in legends for t, h in zip(lg.get_texts(), lg.legend_handles)]


def test_every_figure_draws_a_variant_in_its_palette_colour(tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    from asyncpipe.report import plots

    figures: list = []
    real_close = plt.close
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: figures.append(fig) or real_close(fig))
    main = sweep(tmp_path / "main", "main", ["sync", "1-step", "1-step+EF"])
    longer = sweep(tmp_path / "longer", "longer", ["1-step(x2)", "1-step+EF(x2)"])
    for seed in range(3):
        L = 3.0 + 0.01 * seed
        write(main, "sync", "adamw", seed, line(L))
        write(main, "1-step", "adamw", seed, line(L + 0.2 + 0.01 * seed))
        write(main, "1-step+EF", "adamw", seed, line(L + 0.1 + 0.02 * seed))
        write(longer, "1-step(x2)", "adamw", seed, line(L - 0.2, 10000), steps=200)
        write(longer, "1-step+EF(x2)", "adamw", seed, line(L - 0.3, 10000), steps=200)
    report = build_report([main, longer], out_dir=tmp_path / "o", merge=True)
    assert {"wallclock.png", "glance.png", "loss_curves.png", "verdict.png"} <= set(report.files)
    palette = Palette()
    checked: dict[str, set] = {}
    for fig in figures:
        title = fig._suptitle.get_text() if fig._suptitle else ""
        for label, handle in _handles(fig):
            variant = re.split(r"[ ,]", label, maxsplit=1)[0]
            if family(variant) not in FIXED or not hasattr(handle, "get_color"):
                continue
            colour = mcolors.to_hex(handle.get_color())
            assert colour == palette.colour(variant), (title, label, colour)
            checked.setdefault(family(variant), set()).add(title.split(":")[0][:20])
    assert len(checked.get("1-step+EF", ())) >= 4 and len(checked.get("1-step", ())) >= 4, checked


def test_points_of_an_older_revision_have_their_own_marker() -> None:
    """A figure of points (the verdict, the glance's time to target) cannot dash a point: `PACI@r1` keeps PACI's
    colour and takes a marker no family has, so the two are told apart."""
    from asyncpipe.report.palette import FIXED, OLDER_REVISION_MARKER, Palette

    pal = Palette(["PACI", "PACI@r1"])
    (c_new, m_new), (c_old, m_old) = pal.point_style("PACI"), pal.point_style("PACI@r1")
    assert c_new == c_old and m_new == FIXED["PACI"][1] and m_old == OLDER_REVISION_MARKER != m_new
    assert OLDER_REVISION_MARKER not in {m for _, m in FIXED.values()}
    assert pal.point_style("main:1-step") == pal.style("main:1-step")
