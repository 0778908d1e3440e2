"""Sweep files (sweeps/*.yaml): a named study as one file — grid, named variants, per-value settings, fixed overrides.

    name: smoke
    grid:                      # cartesian product; a key with one value is still an axis (extend it later)
      optimizer: adamw,muon
      seed: [0]
    variants:                  # named override sets crossed with the grid; the report's columns, in this order;
      sync: [delay=0]          # the first is the reference every gap is measured against
      1-step: [delay=1]
      1-step+EF: [delay=1, optimizer.ef.enabled=true]   # `X+...` is also compared with X (% of X's gap closed)
    per:                       # overrides for the runs whose KEY has VALUE (KEY: a grid or fixed key)
      optimizer:
        adamw: [optimizer.lr=3e-3]
        muon: [optimizer.lr=0.01]
    overrides: [model=tiny, train.steps=120]   # fixed, for every run

Command-line overrides come after the file's: `seed=0,1,2` replaces the file's seeds.

A sweep file means what it says: a run's name and the report's columns are the record of what ran, so a
variant or `per:` entry may not set a grid key (the run named `optimizer=adamw` would train another optimizer),
`seed` (two differently named runs would be the same run) or a `launcher.*` key (it configures the whole sweep);
variant names YAML types into one key (`1` and `true`) and an empty file are refused, each in one line.

Budgets: a variant MAY set `train.steps` (and with it the run's tokens and lr schedule): a longer-budget
variant of a study (time to a target loss), e.g.

    variants:
      1-step+EF: [delay=1, optimizer.ef.enabled=true]
      1-step+EF(x1.5): [delay=1, optimizer.ef.enabled=true, train.steps=1650]   # 1.5x the fixed train.steps=1100

A variant's settings come last, so they replace the fixed `overrides:` and `per:` values of the same key.

Budgets from one run: `budgets: [1, 1.25, 1.5, 1.75, 2, 2.5]` (multiples of the run's `train.steps`, with
`train.lr_schedule=wsd`) gives every grid point and variant one rung per budget (run dir `...,budget=1.25`, column
`VARIANT(x1.25)`; the 1x rung keeps the variant's name); a variant written as a mapping sets its own,
`1-step: {overrides: [delay=1], budgets: [1, 1.5, 2]}`, and `budgets: []` makes it a plain run (sync at 1x only).
The longest rung is the one run from step 0; it keeps a
checkpoint at each shorter rung's decay start (`checkpoint.branches`), and each shorter rung is a cooldown branch
from there (`run.branch_from`), equal bit for bit to that rung trained alone. Six rungs at decay_frac 0.2 cost
1.6x the longest rung's steps instead of 4x (`asyncpipe sweep --dry-run` prints both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from asyncpipe.errors import UserError

KEYS = ("name", "description", "grid", "variants", "per", "overrides", "budgets")
MAX_FILE = 1 << 20  # a sweep file is a page of YAML; a megabyte is far beyond any study


@dataclass
class SweepFile:
    name: Optional[str]
    overrides: list[str]  # fixed overrides, then one `key=a,b` per grid key
    grid_keys: list[str] = field(default_factory=list)
    variants: dict[str, list[str]] = field(default_factory=dict)
    per: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    budgets: list[float] = field(default_factory=list)  # rungs as multiples of train.steps (one run, branched)
    variant_budgets: dict[str, list[float]] = field(default_factory=dict)  # a variant's own budgets ([]: none)


def _items(where: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or any(isinstance(v, (dict, list)) for v in value):
        raise UserError(f"{where} must be a list of key=value overrides")
    return [str(v) for v in value]


def _budgets(path: Path, value: Any, allow_empty: bool = False) -> list[float]:
    """`budgets:`: distinct positive numbers (multiples of train.steps), in increasing order (a variant's own may be
    empty: no rungs)."""
    if value is None or (allow_empty and value == []):
        return []
    if not isinstance(value, list) or not value:
        raise UserError(f"{path}: budgets must be a list of multiples of train.steps, e.g. [1, 1.25, 1.5, 2]")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6 for v in value):
        raise UserError(f"{path}: budgets: {value} must be positive numbers (multiples of train.steps)")
    if len(set(value)) != len(value):
        raise UserError(f"{path}: budgets: {value} repeats a budget")
    return sorted(float(v) for v in value)


def _scalar(value: Any) -> str:
    """A YAML scalar as it would be typed in an override (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _collisions(path: Path, root: Any, section: str, data: dict) -> None:
    """Refuse keys of one mapping of the file that YAML types into the same key (`1` and `true` are both 1; the
    later would silently replace the earlier): the raw spellings are compared with what was loaded."""
    import yaml

    if not isinstance(root, yaml.MappingNode):
        return
    tables = [(section, n) for k, n in root.value if k.value == section and isinstance(n, yaml.MappingNode)]
    if section == "per":  # each per: KEY holds a table of values
        tables = [(f"per: {k.value}", n) for _, per in tables for k, n in per.value if isinstance(n, yaml.MappingNode)]
    for where, node in tables:
        loaded: dict[Any, str] = {}
        for key_node, _ in node.value:
            typed = yaml.safe_load(key_node.value) if key_node.tag != "tag:yaml.org,2002:str" else key_node.value
            for other, spelled in loaded.items():
                if other == typed and spelled != key_node.value:
                    raise UserError(
                        f"{path}: {where}: {spelled!r} and {key_node.value!r} are the same key once YAML "
                        "types them (1 == true == 1.0); quote them or choose other names"
                    )
            loaded[typed] = key_node.value


def load_sweep_file(path: Path) -> SweepFile:
    """Read and check a sweep file (see the module docstring). The file is untrusted input: its size, its alias
    expansion (an alias bomb) and keys YAML would merge are refused in one line before anything is composed."""
    from omegaconf import OmegaConf
    from omegaconf._utils import get_yaml_loader

    from asyncpipe.track.files import load_untrusted_yaml, read_untrusted

    path = Path(path)
    if not path.is_file():
        raise UserError(f"no sweep file at {path} (see sweeps/ for examples)")
    try:
        raw, root = load_untrusted_yaml(read_untrusted(path, MAX_FILE), str(path), get_yaml_loader())
        data: Any = OmegaConf.to_container(OmegaConf.create(raw), resolve=False) if raw is not None else None
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None or data == {}:
        raise UserError(
            f"{path} is empty; a sweep file defines runs with grid, variants, per and overrides (see sweeps/smoke.yaml)"
        )
    if not isinstance(data, dict):
        raise UserError(f"{path}: a sweep file is a mapping with name, grid, variants, per and overrides")
    unknown = sorted(set(map(str, data)) - set(KEYS))
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(KEYS)}")
    if not any(data.get(k) for k in ("grid", "variants", "per", "overrides")):
        raise UserError(f"{path} defines no runs (no grid, variants or overrides); see sweeps/smoke.yaml")
    for section in ("variants", "per"):
        _collisions(path, root, section, data)
    grid = data.get("grid") or {}
    variants = data.get("variants") or {}
    per = data.get("per") or {}
    if not isinstance(grid, dict) or not isinstance(variants, dict) or not isinstance(per, dict):
        raise UserError(f"{path}: grid, variants and per must be mappings (see asyncpipe/sweep/sweepfile.py)")
    overrides = _items(f"{path}: overrides", data.get("overrides") or [])
    for key, values in grid.items():
        if isinstance(values, list):
            values = ",".join(_scalar(v) for v in values)
        elif isinstance(values, dict):
            raise UserError(f"{path}: grid: {key} must be a value or a list of values")
        overrides.append(f"{key}={_scalar(values)}")
    out = SweepFile(
        name=str(data["name"]) if data.get("name") is not None else None,
        overrides=overrides,
        grid_keys=[str(k) for k in grid],
    )
    out.budgets = _budgets(path, data.get("budgets"))
    for name, items in variants.items():
        if isinstance(items, dict):  # {overrides: [...], budgets: [...]}: a variant with its own budgets
            extra = sorted(set(map(str, items)) - {"overrides", "budgets"})
            if extra:
                raise UserError(
                    f"{path}: variant {name}: unknown key(s) {', '.join(extra)}; allowed: overrides, budgets"
                )
            if "budgets" in items:
                out.variant_budgets[str(name)] = _budgets(path, items["budgets"], allow_empty=True)
            items = items.get("overrides")
        out.variants[str(name)] = _items(f"{path}: variant {name}", items or [])
    for key, table in per.items():
        if not isinstance(table, dict):
            raise UserError(f"{path}: per: {key} must map each value of {key} to a list of overrides")
        out.per[str(key)] = {_scalar(v): _items(f"{path}: per: {key}: {v}", items or []) for v, items in table.items()}
    return out
