"""Sweep expansion: Hydra's own override parser and BasicSweeper turn `key=a,b range() glob()` into runs.

A `SweepPlan` is the grid (swept keys and their values), the fixed overrides shared by every run, the
launcher overrides (which configure the sweep, not the runs) and one `RunSpec` per point of the grid.
Never imports torch.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from asyncpipe.errors import UserError

# Keys the sweep sets on every run itself; a user value would be silently replaced, so it is refused.
RESERVED_KEYS = ("run.dir", "resume")
MAX_NAME = 180
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class RunSpec:
    """One point of the grid: its run dir name and the overrides that make it (grid values last)."""

    name: str
    swept: tuple[str, ...]  # the grid's `key=value` for this run, in grid order
    overrides: tuple[str, ...]  # fixed + swept overrides (no run.dir / resume / wandb group)


@dataclass
class SweepPlan:
    name: str
    base: list[str]  # fixed overrides, as typed
    grid: "OrderedDict[str, list[str]]"  # swept key -> values (Hydra's string form)
    launcher: list[str]  # overrides of the launcher group: apply to the sweep, not to the runs
    runs: list[RunSpec] = field(default_factory=list)


def _key_of(text: str) -> str:
    """The key of an override as typed (`+a.b=1` -> `a.b`), for splitting before parsing."""
    key = text.split("=", 1)[0].lstrip("+~")
    return key.split("@", 1)[0]


def is_launcher_key(text: str) -> bool:
    key = _key_of(text)
    return key == "launcher" or key.startswith("launcher.") or key.startswith("launcher/")


def _parse(overrides: Sequence[str]) -> list:
    """Parse with Hydra's grammar and expand sweeps inside a config loader, so `glob()` sees conf/ groups."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from asyncpipe.config import conf_dir

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
            parsed = parser.parse_overrides(list(overrides))
            # glob() needs the loader, which lives only inside this context: expand now.
            expanded = [(o, list(o.sweep_string_iterator()) if o.is_discrete_sweep() else None) for o in parsed]
            return expanded
    except HydraException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot expand the sweep: {first} (Hydra's override grammar: key=a,b range() glob())") from None
    finally:
        GlobalHydra.instance().clear()


def sanitize(text: str) -> str:
    """A file-system-safe directory name for `key=value,key=value` (no `/`, no leading dot, bounded length)."""
    name = re.sub(r"[^A-Za-z0-9._=,+@~-]", "_", text)
    if name.startswith((".", "-")) or not name:
        name = "_" + name
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(text.encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME - 9]}-{digest}"
    return name


def default_name() -> str:
    return datetime.now().strftime("sweep-%Y%m%d-%H%M%S")


def check_name(name: str) -> str:
    if not _NAME_OK.match(name) or len(name) > MAX_NAME:
        raise UserError(f"sweep name {name!r} is not allowed: use letters, digits, '.', '_' and '-' (start with a letter or digit)")
    return name


def expand(overrides: Sequence[str], name: Optional[str] = None) -> SweepPlan:
    """Expand overrides with Hydra's BasicSweeper into one run per point of the grid (Hydra's order)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    launcher = [o for o in overrides if is_launcher_key(o)]
    run_overrides = [o for o in overrides if not is_launcher_key(o)]
    for text in run_overrides:
        if _key_of(text) in RESERVED_KEYS:
            raise UserError(f"'{text}': the sweep sets {_key_of(text)} for each run itself; use --out / --name to place runs")
    plan = SweepPlan(name=check_name(name or default_name()), base=[], grid=OrderedDict(), launcher=launcher)

    for o, values in _parse(launcher):
        if o.is_sweep_override():
            raise UserError(f"'{o.input_line}': launcher keys configure the whole sweep and cannot be swept")
    expanded = _parse(run_overrides)
    swept: "OrderedDict[str, bool]" = OrderedDict()
    for o, values in expanded:
        key = o.get_key_element()
        if o.is_sweep_override() and values is None:
            raise UserError(f"'{o.input_line}': only comma lists, range() and glob() can be swept here (not interval())")
        swept[key] = o.is_sweep_override()
        if o.is_sweep_override():
            if not values:
                raise UserError(f"'{o.input_line}' expands to no values (glob() matched no option?)")
            plan.grid[key] = values
        else:
            plan.grid.pop(key, None)  # a later fixed value replaces an earlier sweep, as in Hydra
    # Later duplicates win in Hydra; keep only the last fixed override per key.
    last: "OrderedDict[str, str]" = OrderedDict()
    for o, _ in expanded:
        if not o.is_sweep_override():
            last[o.get_key_element()] = o.input_line
    plan.base = [text for key, text in last.items() if not swept[key]]
    if not plan.grid:
        raise UserError(
            "nothing to sweep: give at least one key several values (e.g. optimizer=muon,adamw delay=0,1); "
            "for a single run use `asyncpipe train`"
        )

    batches = BasicSweeper.split_arguments([o for o, _ in expanded], None)[0]
    seen: dict[str, tuple[str, ...]] = {}
    for batch in batches:
        grid_part = tuple(item for item in batch if swept.get(item.split("=", 1)[0], False))
        fixed_part = tuple(item for item in batch if not swept.get(item.split("=", 1)[0], False))
        run_name = sanitize(",".join(grid_part))
        if run_name in seen:
            raise UserError(
                f"the grid yields run dir {run_name!r} twice ({' '.join(seen[run_name])} / {' '.join(grid_part)}): "
                "remove the repeated value"
            )
        seen[run_name] = grid_part
        plan.runs.append(RunSpec(name=run_name, swept=grid_part, overrides=fixed_part + grid_part))
    if not plan.runs:
        raise UserError("the sweep expands to no runs")
    return plan


def load_sweep_file(path: Path) -> tuple[Optional[str], list[str]]:
    """A named sweep YAML -> (name, overrides): `name`, `grid: {key: "a,b" | [a, b]}`, `overrides: [..]`."""
    from omegaconf import OmegaConf

    if not path.is_file():
        raise UserError(f"no sweep file at {path} (see sweeps/ for examples)")
    try:
        data: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:
        raise UserError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a sweep file is a mapping with name, grid and overrides")
    unknown = sorted(set(data) - {"name", "grid", "overrides", "description"})
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: name, description, grid, overrides")
    grid = data.get("grid") or {}
    fixed = data.get("overrides") or []
    if not isinstance(grid, dict) or not isinstance(fixed, list):
        raise UserError(f"{path}: grid must be a mapping (key: \"a,b\") and overrides a list of key=value")
    overrides = [str(item) for item in fixed]
    for key, values in grid.items():
        if isinstance(values, list):
            values = ",".join(str(v) for v in values)
        overrides.append(f"{key}={values}")
    name = data.get("name")
    return (str(name) if name is not None else None), overrides


def quote(value: str) -> str:
    """`value` as a single-quoted Hydra override value (paths hold `=` and `,`, which the grammar would split)."""
    if "'" in value or "\\" in value:
        raise UserError(f"path {value!r} holds a quote or backslash; choose an --out without them")
    return f"'{value}'"


def run_overrides(plan: SweepPlan, spec: RunSpec, run_dir: Path, resume: bool) -> list[str]:
    """The full override list of one run: its grid point plus run.dir, the W&B group and resume."""
    extra = [f"run.dir={quote(str(run_dir))}"]
    if not any(_key_of(o) == "tracker.wandb.group" for o in spec.overrides):
        extra.append(f"tracker.wandb.group={plan.name}")
    if resume:
        extra.append("resume=true")
    return [*spec.overrides, *extra]
