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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from asyncpipe.errors import UserError

KEYS = ("name", "description", "grid", "variants", "per", "overrides")


@dataclass
class SweepFile:
    name: Optional[str]
    overrides: list[str]  # fixed overrides, then one `key=a,b` per grid key
    grid_keys: list[str] = field(default_factory=list)
    variants: dict[str, list[str]] = field(default_factory=dict)
    per: dict[str, dict[str, list[str]]] = field(default_factory=dict)


def _items(where: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or any(isinstance(v, (dict, list)) for v in value):
        raise UserError(f"{where} must be a list of key=value overrides")
    return [str(v) for v in value]


def _scalar(value: Any) -> str:
    """A YAML scalar as it would be typed in an override (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def load_sweep_file(path: Path) -> SweepFile:
    """Read and check a sweep file (see the module docstring)."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise UserError(f"no sweep file at {path} (see sweeps/ for examples)")
    try:
        data: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:
        raise UserError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a sweep file is a mapping with name, grid, variants, per and overrides")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(KEYS)}")
    grid = data.get("grid") or {}
    variants = data.get("variants") or {}
    per = data.get("per") or {}
    if not isinstance(grid, dict) or not isinstance(variants, dict) or not isinstance(per, dict):
        raise UserError(f"{path}: grid, variants and per must be mappings (see asyncpipe/launch/sweepfile.py)")
    overrides = _items(f"{path}: overrides", data.get("overrides") or [])
    for key, values in grid.items():
        if isinstance(values, list):
            values = ",".join(_scalar(v) for v in values)
        overrides.append(f"{key}={_scalar(values)}")
    out = SweepFile(name=str(data["name"]) if data.get("name") is not None else None, overrides=overrides,
                    grid_keys=[str(k) for k in grid])  # fmt: skip
    for name, items in variants.items():
        out.variants[str(name)] = _items(f"{path}: variant {name}", items or [])
    for key, table in per.items():
        if not isinstance(table, dict):
            raise UserError(f"{path}: per: {key} must map each value of {key} to a list of overrides")
        out.per[str(key)] = {_scalar(v): _items(f"{path}: per: {key}: {v}", items or []) for v, items in table.items()}
    return out
