"""Sweep expansion: Hydra's public override parser turns `key=a,b range() glob()` into values, and the grid is
their cartesian product in Hydra's order (the order Hydra's basic sweeper runs them in).

A `SweepPlan` is the grid (swept keys and their values), the fixed overrides shared by every run, the
launcher overrides (which configure the sweep, not the runs) and one `RunSpec` per point of the grid.
Never imports torch.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from asyncpipe.errors import UserError

# Keys the sweep sets on every run itself; a user value would be silently replaced, so it is refused.
RESERVED_KEYS = ("run.dir", "resume")
VARIANT_KEY = "run.variant"  # set from a sweep file's variants: (the report's column name)
MAX_NAME = 180
MAX_RUNS = 2000  # runs one sweep may have: each is composed and validated before any starts (~0.1 s each)
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_VARIANT_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+()=-]*$")


@dataclass(frozen=True)
class RunSpec:
    """One run: a point of the grid crossed with a variant; its run dir name and the overrides that make it."""

    name: str
    swept: tuple[str, ...]  # the grid's `key=value` for this run, in grid order
    overrides: tuple[str, ...]  # fixed + swept + per + variant overrides (no run.dir / resume / wandb group)
    variant: Optional[str] = None  # the sweep file's variant name (also set as run.variant)
    budget: Optional[float] = None  # budgets: this rung's multiple of train.steps
    parent: Optional[str] = None  # budgets: the run this rung branches from (its family's longest rung)
    branches: tuple[int, ...] = ()  # budgets, the longest rung: train.steps of the rungs that branch from it


@dataclass
class SweepPlan:
    name: str
    base: list[str]  # fixed overrides, as typed
    grid: "OrderedDict[str, list[str]]"  # swept key -> values (Hydra's string form)
    launcher: list[str]  # overrides of the launcher group: apply to the sweep, not to the runs
    runs: list[RunSpec] = field(default_factory=list)
    variants: dict[str, list[str]] = field(default_factory=dict)  # name -> overrides, crossed with the grid
    per: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # key -> value -> overrides
    budgets: list[float] = field(default_factory=list)  # multiples of train.steps, one rung each (one run, branched)
    variant_budgets: dict[str, list[float]] = field(default_factory=dict)  # a variant's own budgets ([]: none)


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
            for o in parsed:  # a range's size is known before expanding it: range(0,10**12) must not hang
                n = _range_size(o.value()) if o.is_discrete_sweep() else 0
                if n > MAX_RUNS:
                    raise UserError(
                        f"'{o.input_line}' expands to {n:,} values, more than the {MAX_RUNS:,} runs a sweep "
                        "may have; split it into several sweeps"
                    )
            # glob() needs the loader, which lives only inside this context: expand now.
            expanded = [(o, list(o.sweep_string_iterator()) if o.is_discrete_sweep() else None) for o in parsed]
            return expanded
    except HydraException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot expand the sweep: {first} (Hydra's override grammar: key=a,b range() glob())"
        ) from None
    finally:
        GlobalHydra.instance().clear()


def _points(parsed: Sequence[tuple[Any, Optional[list[str]]]]) -> list[tuple[str, ...]]:
    """Every point of the grid as `key=value` items, one per override: the cartesian product of the swept values
    (a fixed override is an axis of one), the last override varying fastest, as Hydra's basic sweeper orders them."""
    axes = []
    for o, values in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            axes.append([f"{key}={v}" for v in values or []])
        else:
            axes.append([f"{key}={o.get_value_element_as_str()}"])
    return list(itertools.product(*axes))


def _range_size(value: Any) -> int:
    start, stop, step = (getattr(value, k, None) for k in ("start", "stop", "step"))
    if not all(isinstance(x, (int, float)) for x in (start, stop, step)) or not step:
        return len(getattr(value, "list", None) or [])
    return max(0, math.ceil((stop - start) / step))


def _check_meaning(where: str, items: Sequence[str], grid: Sequence[str]) -> None:
    """A variant or per: entry may not contradict the run's name: no grid key, no seed, no launcher key."""
    for text in items:
        key = _key_of(text)
        if is_launcher_key(text):
            raise UserError(
                f"{where}: '{text}': launcher keys configure the whole sweep, not some of its runs; "
                "set it on the command line or in the file's overrides"
            )
        if key == "seed":
            raise UserError(
                f"{where}: '{text}' sets the seed, which the grid chooses: differently named runs would "
                "train the same seed; sweep seeds in grid: (or seed=...) instead"
            )
        if key in grid:
            raise UserError(
                f"{where}: '{text}' sets {key}, a grid key: the run named {key}=<value> would train "
                f"another {key}; drop {key} from the grid or make it a variant of its own"
            )


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
        raise UserError(
            f"sweep name {name!r} is not allowed: use letters, digits, '.', '_' and '-' (start with a letter or digit)"
        )
    return name


def _check_fixed(where: str, items: Sequence[str]) -> None:
    """Overrides of a variant or a `per:` entry: plain key=value, never a sweep or a reserved key."""
    for text in items:
        if _key_of(text) in RESERVED_KEYS or _key_of(text) == VARIANT_KEY:
            raise UserError(f"{where}: '{text}': the sweep sets {_key_of(text)} for each run itself")
    for o, _ in _parse(list(items)):
        if o.is_sweep_override():
            raise UserError(
                f"{where}: '{o.input_line}' is a sweep; a variant or per: entry holds fixed key=value overrides"
            )


def expand(
    overrides: Sequence[str],
    name: Optional[str] = None,
    *,
    grid_keys: Sequence[str] = (),
    variants: Optional[dict[str, list[str]]] = None,
    per: Optional[dict[str, dict[str, list[str]]]] = None,
    budgets: Sequence[float] = (),
    variant_budgets: Optional[dict[str, list[float]]] = None,
) -> SweepPlan:
    """Expand overrides into one run per point of the grid (Hydra's order), crossed with
    the named `variants` (each a list of overrides, in order), plus the `per` overrides of each point's values
    (per[key][value]: overrides for runs whose `key` is `value`). `grid_keys` are grid axes even with one value
    (a sweep file's grid), so extending them later keeps the fixed overrides unchanged. A later override of a
    key replaces an earlier one, as in Hydra. `budgets`: each run becomes a family of rungs (`rungs`), unless its
    variant has its own (`variant_budgets`; [] = a plain run)."""
    launcher = [o for o in overrides if is_launcher_key(o)]
    run_overrides = [o for o in overrides if not is_launcher_key(o)]
    variants = dict(variants or {})
    per = {k: dict(v) for k, v in (per or {}).items()}
    _check_inputs(run_overrides, launcher, variants, per)
    plan = SweepPlan(name=check_name(name or default_name()), base=[], grid=OrderedDict(), launcher=launcher)
    last, given, swept = _grid(plan, run_overrides, grid_keys)
    for where, items in [
        *((f"variant {v}", i) for v, i in variants.items()),
        *((f"per {k}={v}", i) for k, t in per.items() for v, i in t.items()),
    ]:
        _check_meaning(where, items, list(plan.grid))
    _check_size(plan, variants)
    plan.base = [o.input_line for key, (o, _) in last.items() if not swept[key]]
    plan.variants, plan.per = variants, per
    plan.budgets = sorted(float(b) for b in budgets)
    plan.variant_budgets = {str(k): sorted(float(b) for b in v) for k, v in (variant_budgets or {}).items()}
    _check_budgets_and_per(plan, given)
    plan.runs = _runs(plan, last, swept)
    if not plan.runs:
        raise UserError("the sweep expands to no runs")
    return plan


def _check_inputs(run_overrides: Sequence[str], launcher: Sequence[str], variants: dict, per: dict) -> None:
    """What the sweep sets itself, variant names, fixed overrides where only fixed ones may go, a swept launcher."""
    for text in run_overrides:
        if _key_of(text) in RESERVED_KEYS or _key_of(text) == VARIANT_KEY:
            raise UserError(
                f"'{text}': the sweep sets {_key_of(text)} for each run itself; use --out / --name to place runs"
            )
    for vname, items in variants.items():
        if not _VARIANT_OK.match(str(vname)):
            raise UserError(f"variant name {vname!r} is not allowed: letters, digits and . _ + - ( ) =")
        _check_fixed(f"variant {vname}", items)
    for key, table in per.items():
        for value, items in table.items():
            _check_fixed(f"per {key}={value}", items)
    for o, values in _parse(launcher):
        if o.is_sweep_override():
            raise UserError(f"'{o.input_line}': launcher keys configure the whole sweep and cannot be swept")


def _grid(plan: SweepPlan, run_overrides: Sequence[str], grid_keys: Sequence[str]) -> tuple[dict, dict, dict]:
    """Fill ``plan.grid``; returns (the last override per key with its values, every value each key was given,
    whether each key is a grid axis). Later duplicates win, as in Hydra (at the first one's position)."""
    last: "OrderedDict[str, Any]" = OrderedDict()
    given: dict[str, list[str]] = {}  # every value a key was given (a file's grid narrowed on the command line too)
    for o, values in _parse(run_overrides):
        last[o.get_key_element()] = (o, values)
        given.setdefault(o.get_key_element(), []).extend(
            values if o.is_sweep_override() and values else [o.input_line.split("=", 1)[1]]
        )
    swept: "OrderedDict[str, bool]" = OrderedDict()
    for key, (o, values) in last.items():
        if o.is_sweep_override() and values is None:
            raise UserError(
                f"'{o.input_line}': only comma lists, range() and glob() can be swept here (not interval())"
            )
        swept[key] = o.is_sweep_override() or key in grid_keys
        if o.is_sweep_override():
            if not values:
                raise UserError(f"'{o.input_line}' expands to no values (glob() matched no option?)")
            plan.grid[key] = values
        elif key in grid_keys:
            plan.grid[key] = [o.input_line.split("=", 1)[1]]
    return last, given, swept


def _check_size(plan: SweepPlan, variants: dict) -> None:
    size = math.prod(len(v) for v in plan.grid.values()) * max(1, len(variants))
    if size > MAX_RUNS:
        shape = " x ".join(
            [*(f"{len(v)} {k}" for k, v in plan.grid.items()), *([f"{len(variants)} variants"] if variants else [])]
        )
        raise UserError(
            f"the sweep has {size:,} runs ({shape}), more than the {MAX_RUNS:,} one sweep may have; "
            "split it into several sweeps (each --name'd)"
        )


def _check_budgets_and_per(plan: SweepPlan, given: dict[str, list[str]]) -> None:
    unknown = sorted(set(plan.variant_budgets) - set(plan.variants))
    if unknown:
        raise UserError(f"budgets given for {', '.join(unknown)}, which are not variants of this sweep")
    for key, table in plan.per.items():
        allowed = list(dict.fromkeys(given.get(key, [])))  # per: values of a narrowed grid are simply unused
        if not allowed:
            raise UserError(f"per: {key!r} is not a key of this sweep; per: is keyed by a grid (or fixed) key")
        unknown = [v for v in table if v not in allowed]
        if unknown:
            raise UserError(f"per: {key}: {', '.join(map(str, unknown))} not among its values ({', '.join(allowed)})")


def _runs(plan: SweepPlan, last: dict, swept: dict) -> list[RunSpec]:
    """One run per point of the grid and variant (a family of rungs under budgets), each with its overrides."""
    runs: list[RunSpec] = []
    seen: dict[str, tuple[str, ...]] = {}
    variants, per = plan.variants, plan.per
    for batch in _points(list(last.values())):
        grid_part = tuple(item for item in batch if swept.get(item.split("=", 1)[0], False))
        fixed_part = tuple(item for item in batch if not swept.get(item.split("=", 1)[0], False))
        point = dict(item.split("=", 1) for item in batch)
        extra = tuple(o for key, table in per.items() for o in table.get(point.get(key, ""), []))
        for vname in variants or [None]:
            label = grid_part + ((f"variant={vname}",) if vname is not None else ())
            run_name = sanitize(",".join(label)) if label else "run"
            if run_name in seen:
                raise UserError(
                    f"the grid yields run dir {run_name!r} twice ({' '.join(seen[run_name])} / {' '.join(label)}): "
                    "remove the repeated value"
                )
            seen[run_name] = label
            own = tuple(variants[vname]) if vname is not None else ()
            ladder = plan.variant_budgets.get(vname, plan.budgets) if vname is not None else plan.budgets
            if ladder:
                runs.extend(rungs(RunSpec(run_name, grid_part, fixed_part + grid_part + extra + own, vname), ladder))
                continue
            own += (f"{VARIANT_KEY}='{vname}'",) if vname is not None else ()
            runs.append(RunSpec(run_name, grid_part, fixed_part + grid_part + extra + own, vname))
    return runs


def rungs(spec: RunSpec, budgets: Sequence[float]) -> list[RunSpec]:
    """One run per budget (a multiple of the run's `train.steps`): the longest first, which runs from step 0 and
    keeps a checkpoint where each shorter one's decay starts (`branches`); the others branch from it (`parent`).
    Run dirs `NAME,budget=B`; columns `VARIANT(xB)` (the 1x rung keeps the variant's name, or `xB` without one)."""
    given = [o for o in spec.overrides if _key_of(o) == "train.steps"]
    if not given:
        raise UserError(
            "budgets: are multiples of train.steps: set train.steps in the sweep's overrides (or a variant)"
        )
    base_text = given[-1].split("=", 1)[1]
    try:
        base = int(base_text)
    except ValueError:
        raise UserError(f"budgets: train.steps={base_text} is not a whole number of steps") from None
    steps = {}
    for b in budgets:
        if abs(b * base - round(b * base)) > 1e-6 or round(b * base) < 1:
            raise UserError(f"budgets: {b:g} x train.steps={base} = {b * base:g} is not a whole number of steps >= 1")
        steps[b] = round(b * base)
    longest = max(budgets)

    def name(b: float) -> str:
        return sanitize(f"budget={b:g}" if spec.name == "run" else f"{spec.name},budget={b:g}")

    def column(b: float) -> str:
        if spec.variant is None:
            return f"x{b:g}"
        return spec.variant if b == 1 else f"{spec.variant}(x{b:g})"

    out = []
    for b in sorted(budgets, key=lambda b: (b != longest, b)):  # the longest (the one run from step 0) first
        overrides = (*spec.overrides, f"train.steps={steps[b]}", f"{VARIANT_KEY}='{column(b)}'")
        if b == longest:
            branches = tuple(steps[o] for o in budgets if o != longest)
            out.append(RunSpec(name(b), spec.swept, overrides, spec.variant, budget=b, branches=branches))
        else:
            out.append(RunSpec(name(b), spec.swept, overrides, spec.variant, budget=b, parent=name(longest)))
    return out


def quote(value: str) -> str:
    """`value` as a single-quoted Hydra override value (paths hold `=` and `,`, which the grammar would split)."""
    if "'" in value or "\\" in value:
        raise UserError(f"path {value!r} holds a quote or backslash; choose an --out without them")
    return f"'{value}'"


def run_overrides(plan: SweepPlan, spec: RunSpec, run_dir: Path, resume: bool) -> list[str]:
    """The full override list of one run: its grid point plus run.dir, the W&B group and resume."""
    extra = [f"run.dir={quote(str(run_dir))}"]
    if spec.parent is not None:  # budgets: a cooldown branch from its family's longest rung
        extra.append(f"run.branch_from={quote(str(Path(run_dir).parent / spec.parent))}")
    if spec.branches:
        extra.append(f"checkpoint.branches=[{','.join(map(str, spec.branches))}]")
    if not any(_key_of(o) == "tracker.wandb.group" for o in spec.overrides):
        extra.append(f"tracker.wandb.group={plan.name}")
    if resume:
        extra.append("resume=true")
    return [*spec.overrides, *extra]
