"""Build a sweep's loss-gap report (tables, CSV, plots, markdown) from run dirs, render it, and mirror it to W&B.

Files go to DIR/NAME/report/: report.md, gaps.csv, loss_curves.png, gap_vs_tokens.png, all written atomically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from asyncpipe.report.load import COMPLETED, load_sweep
from asyncpipe.report.tables import GroupTable, compute_cells, group_tables, matched_values
from asyncpipe.track.files import atomic_write_text

REPORT_DIR = "report"


@dataclass
class Report:
    """Everything a report shows; `cells` is the long-form table written to gaps.csv."""

    source: str  # the sweep dir or W&B project/group the runs came from
    runs: pd.DataFrame  # one row per run: config axes, variant, status
    curves: pd.DataFrame  # one row per evaluation: run, tokens, val_loss
    cells: pd.DataFrame  # one row per (group, optimizer, variant): n, mean, std, gap_to_sync, gap_closed_pct
    group_keys: list[str]
    groups: list[GroupTable]
    out_dir: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)


def assemble(runs: pd.DataFrame, curves: pd.DataFrame, source: str, out_dir: Path | None) -> Report:
    """Tables from the frames, then (when out_dir is given) every report file."""
    cells, keys = compute_cells(runs, curves)
    report = Report(source, runs, curves, cells, keys, group_tables(cells, keys), out_dir)
    if out_dir is not None:
        write_files(report, out_dir)
    return report


def build_report(sweep_dir: Path, out_dir: Path | None = None) -> Report:
    """The report of every run under `sweep_dir`, written to `out_dir` (default: sweep_dir/report)."""
    sweep_dir = Path(sweep_dir)
    out_dir = Path(out_dir) if out_dir is not None else sweep_dir / REPORT_DIR
    runs, curves = load_sweep(sweep_dir, exclude=out_dir)
    return assemble(runs, curves, str(sweep_dir), out_dir)


def write_files(report: Report, out_dir: Path) -> None:
    from asyncpipe.report.plots import plot_gap_vs_tokens, plot_loss_curves  # matplotlib only when writing

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {name: out_dir / name for name in ("report.md", "gaps.csv", "loss_curves.png", "gap_vs_tokens.png")}
    atomic_write_text(files["gaps.csv"], report.cells.to_csv(index=False))
    plot_loss_curves(report.runs, report.curves, report.groups, files["loss_curves.png"])
    plot_gap_vs_tokens(report.runs, report.curves, report.groups, files["gap_vs_tokens.png"])
    atomic_write_text(files["report.md"], to_markdown(report))
    report.files = files


def _md_table(frame: pd.DataFrame) -> str:
    header = [frame.index.name or "", *map(str, frame.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for idx, row in frame.iterrows():
        lines.append("| " + " | ".join([str(idx), *(str(v) for v in row)]) + " |")
    return "\n".join(lines)


def _matched_note(group: GroupTable) -> str:
    if group.matched_tokens is None:
        return "No completed run with a validation loss in this group."
    return (
        f"Final val loss compared at **{group.matched_tokens} tokens** (the last token count every completed run "
        "in this group evaluated at; each run's last val loss at or before it). Mean ± sample std (ddof=1) over "
        "seeds; a gap's ± is the sample std of the per-seed differences to the same seed's sync run. Diverged, "
        "failed and unfinished runs are counted, never averaged."
    )


def run_table(report: Report) -> pd.DataFrame:
    """One row per run with its compared val loss (blank when it was not compared)."""
    compared: dict[str, float] = {}
    for group in report.groups:
        mask = pd.Series(True, index=report.runs.index)
        for k, v in group.key.items():
            mask &= report.runs[k].isna() if pd.isna(v) else report.runs[k] == v
        compared.update(matched_values(report.runs[mask], report.curves)[1])
    table = report.runs[["run", *report.group_keys, "optimizer", "variant", "seed", "status", "final_tokens"]].copy()
    table["compared_val_loss"] = [f"{compared[r]:.4f}" if r in compared else "" for r in table["run"]]
    return table.astype(object).where(table.notna(), "").set_index("run")


def to_markdown(report: Report) -> str:
    parts = [f"# Loss-gap report\n\nSource: `{report.source}` — {len(report.runs)} runs "
             f"({int((report.runs['status'] == COMPLETED).sum())} completed).\n"]
    for group in report.groups:
        parts += [f"## {group.title}\n", _matched_note(group) + "\n", _md_table(group.table) + "\n"]
    parts += [
        "## Plots\n",
        "![val loss vs tokens](loss_curves.png)\n",
        "![loss gap to sync vs tokens](gap_vs_tokens.png)\n",
        "## Runs\n",
        _md_table(run_table(report)) + "\n",
        "Long-form numbers (full precision): `gaps.csv`. Regenerate: `asyncpipe report " + report.source + "`.\n",
    ]
    return "\n".join(parts)


def render_terminal(report: Report) -> Any:
    """A rich renderable: one table per group, with the matched token count in the caption."""
    from rich.console import Group
    from rich.table import Table

    tables = []
    for group in report.groups:
        table = Table(title=group.title, caption=_matched_note(group).replace("**", ""), caption_justify="left")
        table.add_column("optimizer", style="bold")
        for column in group.table.columns:
            table.add_column(str(column), justify="right")
        for optimizer, row in group.table.iterrows():
            table.add_row(str(optimizer), *(str(v) for v in row))
        tables.append(table)
    return Group(*tables)


def log_report_to_wandb(report: Report, cfg_like: Any) -> bool:
    """Best effort: log the gap table and plots to a `report` run in the W&B group; True when something was logged."""
    from asyncpipe.track.wandb_mirror import WandbMirror, config_value

    if report.out_dir is None or not report.files:
        return False
    group = config_value(cfg_like, "tracker.wandb.group")
    mirror = WandbMirror(cfg_like, report.out_dir, rank=0, name=f"{group or 'sweep'}-report", job_type="report")
    if not mirror.active:
        return False
    cells = report.cells.astype(object).where(report.cells.notna(), None)
    rows = [[None if isinstance(v, float) and math.isnan(v) else v for v in row] for row in cells.values.tolist()]
    mirror.log_table("loss_gaps", list(map(str, cells.columns)), rows)
    mirror.log_images({name.removesuffix(".png"): path for name, path in report.files.items() if name.endswith(".png")})
    mirror.log_files([p for name, p in report.files.items() if not name.endswith(".png")])
    ok = mirror.active
    mirror.finish()
    return ok
