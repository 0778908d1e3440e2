"""Loss-gap statistics: final val loss at a matched token count, mean ± std over seeds, gap to the reference
variant (sync), its seed noise from paired per-seed differences, and % of a gap closed by a `+...` variant (EF).

Which runs share a table, a row and a column is decided by asyncpipe.report.groups. Only completed runs are
averaged; diverged, failed and unfinished runs are counted and shown, never averaged in. Runs of one cell that
share a seed are never averaged either: the cell shows their values apart. Std is the sample std (ddof=1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from asyncpipe.report.claims import Claim, group_claims, meta_of, other_budget
from asyncpipe.report.groups import Grouping, fmt_value, natural, title_keys
from asyncpipe.report.load import COMPLETED
from asyncpipe.status import DIVERGED, FAILED

CANONICAL = ["sync", "1-step", "1-step+EF"]
EXCLUDED_STATUSES = [DIVERGED, FAILED, "unfinished"]
CONTEXT_KEYS = ["model.name", "data.name"]  # always named in a table's title


@dataclass
class GroupTable:
    """The paper-shaped table of one group: one row per optimizer, display strings."""

    key: dict[str, Any]  # model.name, data.name and the group keys (dotted) that split the runs
    matched_tokens: int | None  # token count at which final val losses are compared
    table: pd.DataFrame  # index: optimizer; columns: [settings], variants, gaps, % closed
    runs: list[str] = field(default_factory=list)  # the runs of this table
    reference: str | None = None  # the variant every gap is measured against
    claims: list[Claim] = field(default_factory=list)  # every interval this table's numbers support

    @property
    def title(self) -> str:
        return ", ".join(f"{k.removesuffix('.name')}={fmt_value(v)}" for k, v in self.key.items())


def matched_values(group_runs: pd.DataFrame, curves: pd.DataFrame) -> tuple[int | None, dict[str, float]]:
    """The last token count every completed run evaluated at (or beyond), and each run's last val loss up to it."""
    done = group_runs.loc[group_runs["status"] == COMPLETED, "run"]
    own = curves[curves["run"].isin(done)]
    if own.empty:
        return None, {}
    matched = int(own.groupby("run")["tokens"].max().min())
    upto = own[own["tokens"] <= matched].sort_values(["run", "tokens"], kind="stable")
    return matched, upto.groupby("run")["val_loss"].last().to_dict()


def variant_order(variants: list[str], named: list[str] | None = None) -> list[str]:
    """Named variants in their file order (then any others); else sync, 1-step, 1-step+EF (always shown), then
    any other variant naturally ordered (pipedream(P=2) < pipedream(P=16))."""
    if named:
        return list(dict.fromkeys(named)) + sorted(set(variants) - set(named), key=natural)
    others = sorted(set(variants) - set(CANONICAL), key=lambda v: (v.split("+")[0] != "sync", natural(v)))
    return CANONICAL + others


def base_variant(variant: str, variants: list[str]) -> str | None:
    """The variant a `X+...` variant adds to (1-step+EF -> 1-step), when it is one of `variants`."""
    cut = len(variant)
    while (cut := variant.rfind("+", 0, cut)) > 0:
        if variant[:cut] in variants:
            return variant[:cut]
    return None


def paired(values: dict, against: dict) -> tuple[float, float, int]:
    """Mean, sample std (ddof=1) and count of the per-seed differences values(seed) - against(seed). A seed fixes
    the init and the data order, so pairing by seed removes the noise both runs share."""
    diffs = pd.Series([values[s] - against[s] for s in values if s in against], dtype="float64")
    return (diffs.mean() if len(diffs) else math.nan), (diffs.std(ddof=1) if len(diffs) > 1 else math.nan), len(diffs)


def _cell(runs: pd.DataFrame, values: dict[str, float]) -> dict:
    """Statistics of one (table, optimizer, variant) cell; runs sharing a seed are listed, not averaged."""
    compared = runs[runs["run"].isin(list(values))]
    seeds = compared["seed"].tolist()
    shared = sorted({s for s in seeds if seeds.count(s) > 1}, key=natural)
    status_counts = runs.loc[runs["status"] != COMPLETED, "status"].value_counts()
    vals = pd.Series([values[r] for r in compared["run"]], dtype="float64")
    by_seed = {} if shared else dict(zip(compared["seed"], vals))
    dup = "; ".join(
        f"seed {s}: " + ", ".join(f"{values[r]:.4f} ({r})" for r in compared.loc[compared["seed"] == s, "run"])
        for s in shared
    )
    return {
        "n": len(vals),
        "mean": math.nan if shared or not len(vals) else vals.mean(),
        "std": vals.std(ddof=1) if len(vals) > 1 and not shared else math.nan,
        **{f"n_{s}": int(status_counts.get(s, 0)) for s in EXCLUDED_STATUSES},
        "excluded": "; ".join(f"{n} {s}" for s, n in sorted(status_counts.items())),
        "shared_seeds": dup,
        **({"tuned": ", ".join(dict.fromkeys(runs["tuned"]))} if "tuned" in runs else {}),  # --best-of's choice
        "_by_seed": by_seed,
    }


def compute_cells(
    runs: pd.DataFrame,
    curves: pd.DataFrame,
    grouping: Grouping,
    named: list[str] | None,
    reference: str | None = None,
    target: float | str | None = None,
) -> tuple[pd.DataFrame, list[GroupTable], list[str]]:
    """The long-form table (gaps.csv: one row per table, optimizer and variant), the display tables (with their
    claims' intervals; `target`: a stated fraction of the gap a mitigation should close, or `paper`: each
    optimizer's closure in the paper's table, asyncpipe.report.paper), and warnings."""
    present = list(runs["variant"].unique())
    order = variant_order(present, named)
    reference = reference or (order[0] if named else "sync")
    order = [v for v in order if v in present]
    members: dict[tuple, list[str]] = {}
    for run in runs["run"]:
        members.setdefault(grouping.group_of(run), []).append(run)
    rows, tables, warnings = [], [], []
    for gkey in sorted(members, key=lambda t: [natural(v) for v in t]):
        group = runs[runs["run"].isin(members[gkey])]
        group_rows, table = group_table(group, curves, grouping, order, reference, target, warnings)
        rows.extend(group_rows)
        tables.append(table)
    return pd.DataFrame(rows), tables, warnings


def group_table(
    group: pd.DataFrame,
    curves: pd.DataFrame,
    grouping: Grouping,
    order: list[str],
    reference: str,
    target: float | str | None,
    warnings: list[str],
) -> tuple[list[dict], GroupTable]:
    """One group's long-form rows (optimizers in natural order, variants in `order`) and its display table with
    its claims; a cell whose runs share a seed adds a line to `warnings`."""
    matched, values = matched_values(group, curves)
    first = group["run"].iloc[0]
    key = {k: grouping.value(first, k) for k in CONTEXT_KEYS if k not in grouping.group_keys}
    key.update({k: grouping.value(first, k) for k in title_keys(grouping, list(group["run"]))})
    group_rows, all_stats, all_meta = [], {}, {}
    for optimizer, opt_runs in sorted(group.groupby("optimizer", dropna=False), key=lambda kv: natural(kv[0])):
        stats, all_meta[optimizer] = optimizer_cells(opt_runs, optimizer, grouping, matched, values, key, warnings)
        add_gaps(stats, reference)
        group_rows.extend(stats[v] for v in sorted(stats, key=order.index))
        all_stats[optimizer] = stats
    title = ", ".join(f"{k.removesuffix('.name')}={fmt_value(v)}" for k, v in key.items())
    model = str(grouping.value(first, "model.name"))
    claims = group_claims(title, all_stats, all_meta, reference, order, target, model)
    for row in group_rows:
        row.pop("_by_seed")
    budgets = {(o, v) for o, m in all_meta.items() for v in m if other_budget(m, v, reference)}
    shown = display_table(group_rows, order, reference, bool(grouping.row_keys), claims, budgets)
    return group_rows, GroupTable(key, matched, shown, list(group["run"]), reference, claims)


def optimizer_cells(
    opt_runs: pd.DataFrame,
    optimizer: Any,
    grouping: Grouping,
    matched: int | None,
    values: dict[str, float],
    key: dict[str, Any],
    warnings: list[str],
) -> tuple[dict[str, dict], dict[str, dict]]:
    """One optimizer's cells by variant (its settings, delay, EF and the cell statistics) and each cell's run
    metadata (`meta_of`); a cell whose runs share a seed adds a line to `warnings`."""
    settings = ", ".join(
        f"{k.removeprefix('optimizer.')}={fmt_value(grouping.value(opt_runs['run'].iloc[0], k))}"
        for k in grouping.row_keys
    )
    stats, meta = {}, {}
    for variant, cell in opt_runs.groupby("variant", sort=False):
        meta[variant] = meta_of(cell)
        stats[variant] = {
            **{k: grouping.value(cell["run"].iloc[0], k) for k in grouping.group_keys},
            "optimizer": optimizer,
            "settings": settings,
            "variant": variant,
            "delay": int(cell["delay"].iloc[0]),
            "ef": bool(cell["ef"].iloc[0]),
            "matched_tokens": matched,
            **_cell(cell, values),
        }
        if stats[variant]["shared_seeds"]:
            warnings.append(
                f"{optimizer} {variant} ({', '.join(f'{k}={fmt_value(v)}' for k, v in key.items())}): runs share "
                f"a seed and every compared setting, so they are shown apart, not averaged: {stats[variant]['shared_seeds']}"
            )
    return stats, meta


def add_gaps(stats: dict[str, dict], reference: str) -> None:
    """Each cell's gap to the reference and its difference to its base variant (`X+...` -> X), paired by seed,
    then the % of the base's gap it closes (none for a base that is the reference itself)."""
    present = list(stats)
    ref = stats.get(reference, {})
    for variant, row in stats.items():
        is_ref = variant == reference
        # Paired by seed over the seeds both cells have (a 1-seed cell against a 3-seed reference is
        # compared with that seed's run, not with the mean of three); unpaired only when none is shared.
        gap = paired(row["_by_seed"], ref.get("_by_seed", {})) if not is_ref else (math.nan, math.nan, 0)
        unpaired = row["mean"] - ref.get("mean", math.nan) if not is_ref else math.nan
        row["gap_to_sync"] = gap[0] if gap[2] else unpaired
        row["gap_std"] = gap[1]
        base = base_variant(variant, present)
        diff = paired(row["_by_seed"], stats[base]["_by_seed"]) if base else (math.nan, math.nan, 0)
        row["base_variant"], row["diff_to_base"], row["diff_to_base_std"] = base or "", diff[0], diff[1]
    for variant, row in stats.items():
        base = stats.get(row["base_variant"], {})
        gap_base = base.get("gap_to_sync", math.nan) if row["base_variant"] != reference else math.nan
        row["gap_closed_pct"] = (gap_base - row["gap_to_sync"]) / gap_base * 100 if gap_base else math.nan


def fmt_gap(row: dict | None, claim: Claim | None = None) -> str:
    """A gap with its 95% paired t-interval (from its claim), else the unpaired difference of means."""
    if claim is not None:
        return claim.shown()
    if row is None or not math.isfinite(row["gap_to_sync"]):
        return "—"
    return f"{row['gap_to_sync']:+.4f} (unpaired)"


def fmt_cell(row: dict | None) -> str:
    if row is None:
        return "—"
    excluded = row["excluded"]
    if row["shared_seeds"]:
        return f"not averaged, {row['shared_seeds']}" + (f"; {excluded}" if excluded else "")
    if row["n"] == 0:
        return f"— ({excluded})" if excluded else "—"
    spread = f" ± {row['std']:.4f}" if row["n"] > 1 else ""
    extra = (f", {row['tuned']}" if row.get("tuned") else "") + (f"; {excluded}" if excluded else "")
    return f"{row['mean']:.4f}{spread} (n={row['n']}{extra})"


def display_table(
    rows: list[dict],
    order: list[str],
    reference: str,
    settings: bool,
    claims: list[Claim] | None = None,
    budgets: set | None = None,
) -> pd.DataFrame:
    """Rows = optimizers; columns = [settings], each variant present, each non-reference variant's gap with its
    95% interval, and % of a plain delayed column's gap each mitigation closes (ratio of means, Fieller interval).
    A column trained for another train.steps in every row (a budget rung) is left out: at the matched token count
    its loss says nothing of its own budget (a cooldown branch there is still its trunk); Time to target has it."""
    other = budgets or set()
    variants = [
        v
        for v in order
        if any(r["variant"] == v for r in rows)
        and not all((r["optimizer"], v) in other for r in rows if r["variant"] == v)
    ]
    found = {(c.optimizer, c.kind, c.variant): c for c in claims or []}
    closers = [v for v in variants if any(k == (o, "closed", v) for o in (r["optimizer"] for r in rows) for k in found)]
    table_rows = {}
    for optimizer in dict.fromkeys(r["optimizer"] for r in rows):
        by_variant = {r["variant"]: r for r in rows if r["optimizer"] == optimizer}
        row = {"settings": next(iter(by_variant.values()))["settings"]} if settings else {}
        row.update({v: fmt_cell(by_variant.get(v)) for v in variants})
        for v in variants:
            if v != reference:
                row[f"gap {v}"] = (
                    "another train.steps: see Time to target"
                    if (optimizer, v) in other
                    else fmt_gap(by_variant.get(v), found.get((optimizer, "gap", v)))
                )
        for v in closers:
            claim = found.get((optimizer, "closed", v))
            row[f"% gap closed {v}"] = claim.shown() if claim is not None else "—"
        table_rows[optimizer] = row
    table = pd.DataFrame.from_dict(table_rows, orient="index")
    table.index.name = "optimizer"
    return table
