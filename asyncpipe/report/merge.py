"""`report --merge`: runs of several sweep dirs pooled into one set of cells.

Each sweep keeps its column names unprefixed, so runs that share a column name (a sweep file's variant name) and
every compared setting fall into one cell and their seeds are pooled (e.g. v3's `main` with seeds 0-2 and v4's
`seeds` with seeds 3-7). Runs that share a column name but differ in a setting still land in different tables (the
grouping never pools them). Two runs of one cell with the same seed are refused: they are never averaged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pandas as pd

from asyncpipe.errors import UserError
from asyncpipe.report.groups import comparable, fmt_value
from asyncpipe.report.load import concat_runs, load_sweep, named_variants, sweep_label


def load_merged(dirs: Sequence[Path], exclude: Path | None = None) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """Frames of every run under `dirs` (run names prefixed `SWEEP/`), and the column order: each sweep's variant
    names in file order, sync first."""
    run_parts, curve_parts, named, labels = [], [], [], []
    for d in dirs:
        label = sweep_label(d)
        label = label if label not in labels else f"{label}-{len(labels)}"
        labels.append(label)
        runs, curves = load_sweep(Path(d), exclude=exclude)
        rename = {r: f"{label}/{r}" for r in runs["run"]}
        run_parts.append(runs.assign(run=runs["run"].map(rename), sweep=label))
        curve_parts.append(curves.assign(run=curves["run"].map(rename)))
        named += [v for v in named_variants(Path(d)) if v not in named]
    runs = concat_runs(run_parts)
    curves = pd.concat(curve_parts, ignore_index=True)
    if "sync" in named:
        named.insert(0, named.pop(named.index("sync")))
    refuse_shared_seeds(runs)
    return runs, curves, named


def refuse_shared_seeds(runs: pd.DataFrame) -> None:
    """One line naming the first two runs that would share a merged cell and a seed."""
    seen: dict[tuple, str] = {}
    for run, variant, seed, flat in zip(runs["run"], runs["variant"], runs["seed"], runs["config"]):
        key = (variant, repr(seed), repr(sorted((k, repr(v)) for k, v in comparable(flat).items())))
        if key in seen:
            raise UserError(
                f"--merge: {seen[key]} and {run} are both column {variant!r} at seed {fmt_value(seed)} "
                "with every compared setting equal; they are never averaged: leave one sweep out or "
                "remove one run"
            )
        seen[key] = run
