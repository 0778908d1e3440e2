"""Tuned against tuned (`asyncpipe report --best-of optimizer.lr`): every column at its own best value of a swept
key, chosen on some seeds and measured on the others, so the choice does not flatter a variant.

A column here is a cell of the report without the swept key: the same optimizer, variant and every other compared
setting. For each, the value of the key with the lowest mean final val loss over the *selection* seeds is chosen
(a value any of whose selection runs did not complete, or lacks a selection seed, is not eligible); the report is
then built from that value's runs at the *measurement* seeds only, with the key no longer splitting tables, and each
cell says which value it used. Default split: the lower half of the seeds (at least one) select, the rest measure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import pandas as pd

from asyncpipe.errors import UserError
from asyncpipe.report.groups import SEED, comparable, fill_unrecorded, fmt_value, natural
from asyncpipe.report.load import COMPLETED


@dataclass
class Tuning:
    key: str
    select: list[Any]  # seeds the values were chosen on
    measure: list[Any]  # seeds every reported number comes from
    table: pd.DataFrame = field(default_factory=pd.DataFrame)  # per column: mean selection loss per value, chosen

    @property
    def short(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    def seeds_text(self) -> str:
        said = lambda seeds: ", ".join(map(fmt_value, seeds))  # noqa: E731
        return f"chosen on seed(s) {said(self.select)}, measured on seed(s) {said(self.measure)}"

    def sentence(self) -> str:
        """The takeaway that says what the comparison is: which value each column used, on which seeds."""
        chosen = "; ".join(
            f"{r['optimizer']} {r['column']} {self.short}={r['chosen']}" for _, r in self.table.iterrows()
        )
        return (
            f"Tuned against tuned: each column at its own best `{self.key}` ({self.seeds_text()}, so the choice "
            f"does not flatter a variant): {chosen}."
        )


def split_seeds(seeds: Sequence[Any], select: Sequence[str] | None) -> tuple[list[Any], list[Any]]:
    """(selection seeds, measurement seeds): `select` as given (matched by text), else the lower half."""
    ordered = sorted(dict.fromkeys(seeds), key=natural)
    if len(ordered) < 2:
        raise UserError(
            f"--best-of needs runs at 2 or more seeds (a value is chosen on some and measured on the "
            f"others); these runs have {len(ordered)}"
        )
    if select:
        wanted = {str(s).strip() for s in select}
        chosen = [s for s in ordered if str(s) in wanted]
        if len(chosen) != len(wanted) or len(chosen) == len(ordered):
            raise UserError(
                f"--select-seeds {','.join(select)}: give some, not all, of the runs' seeds "
                f"({', '.join(map(fmt_value, ordered))})"
            )
    else:
        chosen = ordered[: max(1, len(ordered) // 2)]
    return chosen, [s for s in ordered if s not in chosen]


def _number(text: str) -> Any:
    """A value column's heading as the number it shows (so 0.0025 sorts between 0.002 and 0.004), else the text."""
    try:
        return float(text)
    except ValueError:
        return text


def _final_losses(curves: pd.DataFrame) -> dict[str, float]:
    last = curves.sort_values(["run", "tokens"], kind="stable").groupby("run")["val_loss"].last()
    return last.to_dict()


def best_of(
    runs: pd.DataFrame, curves: pd.DataFrame, key: str, select: Sequence[str] | None = None
) -> tuple[pd.DataFrame, Tuning]:
    """The runs to report (each column's chosen value at the measurement seeds, `key` dropped from their configs,
    column `tuned` = `lr=0.004`) and the Tuning that says what was chosen on what."""
    if key == SEED:
        raise UserError(
            "--best-of seed: the seed is what selection and measurement are split by; give a swept "
            "setting (e.g. optimizer.lr)"
        )
    values = [flat.get(key) for flat in runs["config"]]
    if all(v is None for v in values):
        raise UserError(f"--best-of {key}: no run records that setting (give a dotted config key, e.g. optimizer.lr)")
    if len({repr(v) for v in values}) < 2:
        raise UserError(f"--best-of {key}: every run has {fmt_value(values[0])}; there is nothing to choose between")
    settings = [comparable(flat) for flat in runs["config"]]
    fill_unrecorded(settings)  # a run recorded before a key existed is in the same column as one that records it
    runs = runs.assign(
        _value=values, _column=[repr(sorted((k, repr(v)) for k, v in flat.items() if k != key)) for flat in settings]
    )
    columns = runs.groupby(["optimizer", "variant", "_column"], sort=False, dropna=False)
    if all(cell["_value"].map(repr).nunique() < 2 for _, cell in columns):
        raise UserError(
            f"--best-of {key}: no column has runs at two values of it (it defines the columns, or "
            "varies only between them), so nothing would be tuned; give a setting swept within each "
            "column, e.g. optimizer.lr"
        )
    sel, meas = split_seeds(list(runs["seed"]), select)
    tuning = Tuning(key, sel, meas)
    finals = _final_losses(curves)
    keep, rows = [], []
    for (opt, variant, _), cell in columns:
        by_repr = {repr(v): v for v in cell["_value"]}
        scores = {}
        for shown, value in sorted(by_repr.items(), key=lambda kv: natural(kv[1])):
            at = cell[(cell["_value"].map(repr) == shown) & cell["seed"].isin(sel)]
            ok = at[(at["status"] == COMPLETED) & at["run"].isin(list(finals))]
            complete = set(ok["seed"]) == set(sel) and len(ok) == len(sel)
            scores[shown] = sum(finals[r] for r in ok["run"]) / len(ok) if complete else math.inf
        best = min(scores, key=lambda v: scores[v])  # ties: the smaller value
        if not math.isfinite(scores[best]):
            seeds = ", ".join(map(fmt_value, sel))
            raise UserError(
                f"--best-of {key}: {opt} {variant} has no value whose runs at the selection seed(s) "
                f"{seeds} all completed; nothing can be chosen for it"
            )
        keep.append(cell[(cell["_value"].map(repr) == best) & cell["seed"].isin(meas)])
        means = {fmt_value(by_repr[v]): f"{x:.4f}" if math.isfinite(x) else "incomplete" for v, x in scores.items()}
        rows.append({"optimizer": opt, "column": variant, "chosen": fmt_value(by_repr[best]), **means})
    table = pd.DataFrame(rows).fillna("—")
    values_shown = sorted(table.columns[3:], key=lambda c: natural(_number(c)))  # one ascending axis for every row
    tuning.table = table[[*table.columns[:3], *values_shown]]
    out = pd.concat(keep, ignore_index=False) if keep else runs.iloc[:0]
    out = out.assign(
        config=[{k: v for k, v in flat.items() if k != key} for flat in out["config"]],
        tuned=[f"{tuning.short}={fmt_value(v)}" for v in out["_value"]],
    )
    out = out.drop(columns=["_value", "_column"]).reset_index(drop=True)
    out.attrs.update(runs.attrs)
    return out, tuning
