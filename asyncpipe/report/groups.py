"""Which runs a report may compare: every config key that differs between runs is a table, a column or a row.

A run's config is flattened to dotted keys. Apart from the keys that cannot change a result (IGNORED) and the
seed (averaged over), each key whose value differs between runs is exactly one of:
- a **variant key**: it defines the table's columns (sync / 1-step / 1-step+EF, or a sweep file's named variants);
- a **group key**: it differs between runs of one optimizer (and, with named variants, one variant), so it splits
  the report into one table per value combination;
- a **row key**: it differs only between optimizers (each optimizer's own lr, say), shown in the row's settings.
Runs of one table, row and column that also share a seed are never averaged: the report shows them apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from asyncpipe.config.describe import schema_defaults
from asyncpipe.config.keys import flatten, frozen
from asyncpipe.track.files import NO_RESULT_KEYS, NO_RESULT_PREFIXES

# Keys that never change what a run computes: where it writes, how it is tracked or launched, how often it
# prints, whether it resumed (resuming reproduces the uninterrupted run), where token files are cached.
IGNORED_PREFIXES, IGNORED_KEYS = NO_RESULT_PREFIXES, NO_RESULT_KEYS  # the one list (track.files), shared with resume
SEED = "seed"
ROW = "optimizer.name"
# Without named variants a run's column is named from these keys (see load.variant_label).
DERIVED_VARIANT_KEYS = ("delay", "delay_profile", "optimizer.ef.enabled", "optimizer.ef.lam", "pipeline.stages")
ABSENT = "<absent>"


def flat_config(config: Any) -> dict[str, Any]:
    """A run's config as dotted keys (`config.keys.flatten`), lists as tuples (`config.keys.frozen`):
    {"a": {"b": 1, "c": [1, 2]}} -> {"a.b": 1, "a.c": (1, 2)}."""
    return {k: frozen(v) for k, v in flatten(config).items()}


def comparable(flat: dict[str, Any]) -> dict[str, Any]:
    """The keys that can change a result, minus the seed. A simulated run's `pipeline.stages` only matters through
    delay_profile=pipedream, so it is dropped otherwise (it would split sync runs from the async runs they pair with)."""
    out = {k: v for k, v in flat.items() if k not in IGNORED_KEYS and not k.startswith(IGNORED_PREFIXES) and k != SEED}
    if flat.get("engine") != "pipeline" and flat.get("delay_profile") != "pipedream":
        out.pop("pipeline.stages", None)
    return out


def fmt_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ",".join(fmt_value(v) for v in value) + "]"
    return str(value)


def natural(value: Any) -> list:
    """Sort key: numbers by value, text with embedded numbers naturally (P=2 < P=16), absent last."""
    if value == ABSENT:
        return [2]
    if isinstance(value, bool) or value is None:
        return [0, str(value)]
    if isinstance(value, (int, float)):
        return [0, "", float(value)]
    return [1, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(value))]]


@dataclass
class Grouping:
    """How the runs of a report split: see the module docstring."""

    group_keys: list[str]
    variant_keys: list[str]
    row_keys: list[str]
    named_variants: bool
    values: dict[str, dict[str, Any]] = field(default_factory=dict)  # run -> comparable flat config
    unrecorded: list[str] = field(default_factory=list)  # keys some runs lack (older configs), one value elsewhere

    def value(self, run: str, key: str) -> Any:
        return self.values[run].get(key, ABSENT)

    def group_of(self, run: str) -> tuple:
        return tuple(self.value(run, k) for k in self.group_keys)

    def describe(self) -> list[str]:
        """The lines a report prints to say what it compared."""
        by = ", ".join(f"`{k}`" for k in self.group_keys) or "nothing (no setting differs within an optimizer)"
        how = "a sweep file's named variants" if self.named_variants else "delay, delay profile and EF"
        cols = ", ".join(f"`{k}`" for k in self.variant_keys) or "nothing"
        rows = ", ".join(f"`{k}`" for k in self.row_keys)
        lines = [
            f"Tables split by: {by}.",
            f"Columns are variants ({how}); they differ in: {cols}.",
            f"Rows are `{ROW}`" + (f"; rows also differ in: {rows} (the settings column)." if rows else "."),
            "Averaged over: `seed` only. Keys that cannot change a result are not compared: "
            + ", ".join(f"`{p}*`" for p in IGNORED_PREFIXES)
            + ", "
            + ", ".join(f"`{k}`" for k in sorted(IGNORED_KEYS))
            + ".",
        ]
        if self.unrecorded:
            lines.append(
                "Keys some runs do not record (their configs predate them), taken at their schema default "
                "there: " + ", ".join(f"`{k}`" for k in self.unrecorded) + "."
            )
        return lines


def _distinct(values: Iterable[Any]) -> int:
    return len({repr(v) for v in values})


def fill_unrecorded(values: Iterable[dict[str, Any]]) -> list[str]:
    """Give every comparable config (`comparable`) the schema default of each key some of them do not record (a run
    whose config predates a key ran with that key's default behaviour); the keys filled, sorted."""
    values = list(values)
    defaults = schema_defaults()
    keys = sorted({k for v in values for k in v} - {ROW})
    unrecorded = [
        k
        for k in keys
        if k in defaults
        and k != "pipeline.stages"  # dropped on purpose by comparable()
        and any(k not in v for v in values)
    ]
    for v in values:
        v.update({k: defaults[k] for k in unrecorded if k not in v})
    return unrecorded


def classify(runs: list[tuple[str, dict, str, str, bool]]) -> Grouping:
    """Grouping of runs given as (run, flat config, optimizer, variant, variant is named) tuples."""
    values = {run: comparable(flat) for run, flat, _, _, _ in runs}
    named = any(n for *_, n in runs)
    keys = sorted({k for v in values.values() for k in v} - {ROW})
    unrecorded = fill_unrecorded(values.values())
    cells: dict[tuple, list[str]] = {}
    optimizers: dict[str, list[str]] = {}
    for run, _, opt, variant, _ in runs:
        cells.setdefault((opt, variant), []).append(run)
        optimizers.setdefault(opt, []).append(run)
    grouping = Grouping([], [], [], named, values, unrecorded)

    def varies(key: str, partition: dict) -> bool:
        return any(_distinct(values[r].get(key, ABSENT) for r in members) > 1 for members in partition.values())

    for key in keys:
        if _distinct(v.get(key, ABSENT) for v in values.values()) < 2:
            continue
        if not named and key in DERIVED_VARIANT_KEYS:
            grouping.variant_keys.append(key)
        elif varies(key, cells if named else optimizers):
            grouping.group_keys.append(key)
        elif named and varies(key, optimizers):
            grouping.variant_keys.append(key)
        else:
            grouping.row_keys.append(key)
    return grouping


def title_keys(grouping: Grouping, runs: list[str]) -> list[str]:
    """Group keys worth naming in a table's title: a key fixed by its config group's name (model.n_layer by
    model.name) over these runs is left out when that name is a group key too."""
    shown = []
    for key in grouping.group_keys:
        parent = key.rsplit(".", 1)[0] + ".name" if "." in key else None
        if parent and parent != key and parent in grouping.group_keys:
            by_parent: dict[str, set] = {}
            for r in runs:
                by_parent.setdefault(repr(grouping.value(r, parent)), set()).add(repr(grouping.value(r, key)))
            if all(len(v) == 1 for v in by_parent.values()):
                continue
        shown.append(key)
    return shown
