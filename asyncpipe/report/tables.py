"""Loss-gap statistics: final val loss at a matched token count, mean ± std over seeds, gap to sync, % closed by EF.

Only completed runs are averaged; diverged, failed and unfinished runs are counted and shown, never averaged in.
Std is the sample standard deviation (ddof=1), so a single seed has no std.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import pandas as pd

from asyncpipe.report.load import COMPLETED
from asyncpipe.status import DIVERGED, FAILED

BASE_KEYS = ["model", "data"]
# Axes that, when they vary for one optimizer, split a (model, data) group into settings.
SETTING_AXES = ["tokenizer", "engine", "stages", "lr"]
CANONICAL = ["sync", "1-step", "1-step+EF"]
EXCLUDED_STATUSES = [DIVERGED, FAILED, "unfinished"]


@dataclass
class GroupTable:
    """The paper-shaped table of one group: one row per optimizer, display strings."""

    key: dict[str, Any]  # model, data and any setting axes that split the sweep
    matched_tokens: int | None  # token count at which final val losses are compared
    table: pd.DataFrame  # index: optimizer; columns: variants, gaps, % closed

    @property
    def title(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.key.items())


def group_keys(runs: pd.DataFrame) -> list[str]:
    """model, data, plus each setting axis that takes several values for one optimizer within a (model, data)."""
    keys = list(BASE_KEYS)
    for axis in SETTING_AXES:
        counts = runs.groupby([*BASE_KEYS, "optimizer"], dropna=False)[axis].nunique(dropna=False)
        if (counts > 1).any():
            keys.append(axis)
    return keys


def matched_values(group_runs: pd.DataFrame, curves: pd.DataFrame) -> tuple[int | None, dict[str, float]]:
    """The last token count every completed run evaluated at (or beyond), and each run's last val loss up to it."""
    done = group_runs.loc[group_runs["status"] == COMPLETED, "run"]
    own = curves[curves["run"].isin(done)]
    if own.empty:
        return None, {}
    matched = int(own.groupby("run")["tokens"].max().min())
    upto = own[own["tokens"] <= matched].sort_values(["run", "tokens"], kind="stable")
    return matched, upto.groupby("run")["val_loss"].last().to_dict()


def variant_order(variants: list[str]) -> list[str]:
    """Canonical columns first (always shown), then any other variants in a stable order."""
    def natural(v: str) -> list:  # pipedream(P=2) < pipedream(P=16)
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", v)]

    others = sorted(set(variants) - set(CANONICAL), key=lambda v: (v.split("+")[0] != "sync", natural(v)))
    return CANONICAL + others


def base_variant(variant: str) -> str | None:
    """The no-EF variant an EF variant is compared with (1-step+EF -> 1-step); None for non-EF variants."""
    return variant.split("+EF")[0] if "+EF" in variant else None


def compute_cells(runs: pd.DataFrame, curves: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The long-form table (gaps.csv): one row per (group, optimizer, variant), and the group key columns."""
    keys = group_keys(runs)
    rows = []
    for key_values, group in runs.groupby(keys, dropna=False, sort=True):
        key = dict(zip(keys, key_values))
        matched, values = matched_values(group, curves)
        for optimizer, opt_runs in group.groupby("optimizer", dropna=False, sort=True):
            stats, by_seed = {}, {}
            for variant, cell in opt_runs.groupby("variant", sort=False):
                vals = pd.Series([values[r] for r in cell["run"] if r in values], dtype="float64")
                by_seed[variant] = {s: values[r] for r, s in zip(cell["run"], cell["seed"]) if r in values}
                status_counts = cell.loc[cell["status"] != COMPLETED, "status"].value_counts()
                stats[variant] = {
                    **key,
                    "optimizer": optimizer,
                    "variant": variant,
                    "delay": int(cell["delay"].iloc[0]),
                    "ef": bool(cell["ef"].iloc[0]),
                    "matched_tokens": matched,
                    "n": len(vals),
                    "mean": vals.mean() if len(vals) else math.nan,
                    "std": vals.std(ddof=1) if len(vals) > 1 else math.nan,
                    **{f"n_{s}": int(status_counts.get(s, 0)) for s in EXCLUDED_STATUSES},
                    "excluded": "; ".join(f"{n} {s}" for s, n in sorted(status_counts.items())),
                }
            sync_mean = stats.get("sync", {}).get("mean", math.nan)
            for variant, row in stats.items():
                row["gap_to_sync"] = row["mean"] - sync_mean if variant != "sync" else math.nan
                row["gap_std"] = paired_gap_std(by_seed[variant], by_seed.get("sync", {})) if variant != "sync" else math.nan
            for variant, row in stats.items():
                base = stats.get(base_variant(variant) or "", {})
                gap_base = base.get("gap_to_sync", math.nan)
                closed = (gap_base - row["gap_to_sync"]) / gap_base * 100 if gap_base else math.nan
                row["gap_closed_pct"] = closed if variant != "sync" else math.nan
            order = variant_order(list(stats))
            rows.extend(stats[v] for v in sorted(stats, key=order.index))
    return pd.DataFrame(rows), keys


def paired_gap_std(runs: dict, sync: dict) -> float:
    """Seed noise of a gap: sample std (ddof=1) of the per-seed differences run(seed) - sync(seed). A seed fixes
    the init and the data order, so pairing by seed removes the noise both runs share."""
    diffs = pd.Series([runs[s] - sync[s] for s in runs if s in sync], dtype="float64")
    return diffs.std(ddof=1) if len(diffs) > 1 else math.nan


def fmt_gap(row: pd.Series | None) -> str:
    if row is None or not math.isfinite(row["gap_to_sync"]):
        return "—"
    spread = f" ± {row['gap_std']:.4f}" if math.isfinite(row["gap_std"]) else ""
    return f"{row['gap_to_sync']:+.4f}{spread}"


def fmt_cell(row: pd.Series | None) -> str:
    if row is None:
        return "—"
    excluded = row["excluded"]
    if row["n"] == 0:
        return f"— ({excluded})" if excluded else "—"
    spread = f" ± {row['std']:.4f}" if row["n"] > 1 else ""
    extra = f"; {excluded}" if excluded else ""
    return f"{row['mean']:.4f}{spread} (n={row['n']}{extra})"


def fmt_number(value: float, fmt: str) -> str:
    return "—" if value is None or not math.isfinite(value) else format(value, fmt)


def group_tables(cells: pd.DataFrame, keys: list[str]) -> list[GroupTable]:
    """Per group: rows = optimizers; columns = each variant, each non-sync variant's gap, % closed per EF variant."""
    out = []
    for key_values, group in cells.groupby(keys, dropna=False, sort=True):
        variants = variant_order(list(group["variant"].unique()))
        table_rows = {}
        for optimizer, opt_cells in group.groupby("optimizer", sort=True):
            by_variant = {r["variant"]: r for _, r in opt_cells.iterrows()}
            row = {v: fmt_cell(by_variant.get(v)) for v in variants}
            for v in variants[1:]:
                row[f"gap {v}"] = fmt_gap(by_variant.get(v))
            for v in variants:
                if base_variant(v) in variants and base_variant(v) != "sync":
                    r = by_variant.get(v)
                    pct = fmt_number(r["gap_closed_pct"] if r is not None else math.nan, ".1f")
                    row[f"% gap closed {v}"] = pct if pct == "—" else pct + "%"
            table_rows[optimizer] = row
        table = pd.DataFrame.from_dict(table_rows, orient="index")
        table.index.name = "optimizer"
        matched = group["matched_tokens"].dropna()
        out.append(
            GroupTable(
                key=dict(zip(keys, key_values)),
                matched_tokens=int(matched.iloc[0]) if len(matched) else None,
                table=table,
            )
        )
    return out
