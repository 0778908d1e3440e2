"""Build a sweep's loss-gap report (tables, CSV, plots, markdown) from run dirs, render it, and mirror it to W&B.

Files go to DIR/NAME/report/: report.md, gaps.csv, loss_curves.png, gap_vs_tokens.png, all written atomically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from asyncpipe.errors import UserError
from asyncpipe.report.groups import Grouping, classify, fmt_value, natural
from asyncpipe.report.load import COMPLETED, load_sweep, named_variants, read_manifest, sweep_label
from asyncpipe.report.tables import GroupTable, compute_cells, matched_values, variant_order
from asyncpipe.track.files import atomic_write_text

REPORT_DIR = "report"


@dataclass
class Report:
    """Everything a report shows; `cells` is the long-form table written to gaps.csv."""

    source: str  # the sweep dir(s) or W&B project/group the runs came from
    runs: pd.DataFrame  # one row per run: config axes, variant, status, flattened config
    curves: pd.DataFrame  # one row per evaluation: run, tokens, val_loss
    cells: pd.DataFrame  # one row per (table, optimizer, variant): n, mean, std, gap_to_sync, gap_closed_pct
    grouping: Grouping
    groups: list[GroupTable]
    warnings: list[str] = field(default_factory=list)  # runs shown apart, cut-off metrics, mixed versions
    out_dir: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)
    command: str = ""  # how to regenerate it
    sweeps: list[dict] = field(default_factory=list)  # the sources' sweep.json manifests (name, grid, variants, ...)

    @property
    def group_keys(self) -> list[str]:
        return self.grouping.group_keys


def assemble(
    runs: pd.DataFrame, curves: pd.DataFrame, source: str, out_dir: Path | None,
    named: list[str] | None = None, reference: str | None = None, command: str = "", sweeps: list[dict] | None = None,
    plots: bool = True,
) -> Report:
    """Tables from the frames, then (when out_dir is given) every report file (the plots only with `plots`)."""
    grouping = classify(list(zip(runs["run"], runs["config"], runs["optimizer"], runs["variant"], runs["variant_named"])))
    if reference is not None and reference not in set(runs["variant"]):
        raise UserError(f"--reference {reference!r} is not a column of this report; columns: "
                        + ", ".join(dict.fromkeys(runs["variant"])))
    named = named or (sorted(dict.fromkeys(runs["variant"]), key=natural) if runs["variant_named"].any() else None)
    cells, groups, warnings = compute_cells(runs, curves, grouping, named, reference)
    warnings += [f"run {r}: {n}" for r, n in zip(runs["run"], runs["note"]) if n]
    codes = runs["code"].astype(object).fillna("unrecorded") if "code" in runs else pd.Series(dtype=object)
    if codes.nunique() > 1:
        warnings.append(f"the runs come from {codes.nunique()} different code states (commit, dirty flag or library "
                        "versions; see Provenance): their differences may be the code's, not the settings'")
    report = Report(source, runs, curves, cells, grouping, groups, warnings, out_dir,
                    command=command or f"asyncpipe report {source}", sweeps=sweeps or [])  # fmt: skip
    if out_dir is not None:
        write_files(report, out_dir, plots)
    return report


def _source_order(runs: pd.DataFrame, named: list[str]) -> list[str]:
    """One source's columns in order: its sweep file's variant names, else sync, 1-step, 1-step+EF, others."""
    present = list(dict.fromkeys(runs["variant"]))
    return variant_order(present, named or None) if named else [v for v in variant_order(present) if v in present]


def build_report(
    sweep_dir: Path | Sequence[Path], out_dir: Path | None = None, baseline: Path | None = None,
    reference: str | None = None, plots: bool = True,
) -> Report:
    """The report of every run under `sweep_dir` (default out_dir: sweep_dir/report).

    Several sweep dirs (or a `baseline`) make one comparison: each sweep's columns are labelled `NAME:variant`
    (NAME from its sweep.json) and every gap is measured against the baseline's (else the first sweep's)
    reference column (its first named variant, else sync), paired by seed. `reference` names another column to
    measure the gaps against (e.g. `cpu_study:1-step`: PipeDream vs 2BW, same seed). `plots=False` writes the
    tables only (the plots take most of a report's time)."""
    dirs = [Path(sweep_dir)] if isinstance(sweep_dir, (str, Path)) else [Path(d) for d in sweep_dir]
    if not dirs:
        raise UserError("give at least one sweep directory")
    sources = list(dict.fromkeys(([Path(baseline)] if baseline is not None else []) + dirs))
    if out_dir is None:
        out_dir = dirs[0] / REPORT_DIR if len(sources) == 1 else sources[0].parent / (
            "report-" + "-vs-".join(sweep_label(d) for d in sources))
    out_dir = Path(out_dir)
    command = "asyncpipe report " + " ".join(map(str, dirs)) + (f" --baseline {baseline}" if baseline else "")
    command += f" --reference '{reference}'" if reference else ""
    manifests = [m for m in map(read_manifest, sources) if m]
    if len(sources) == 1:
        runs, curves = load_sweep(dirs[0], exclude=out_dir)
        return assemble(runs, curves, str(dirs[0]), out_dir, named_variants(dirs[0]), reference, command, manifests,
                        plots)
    labels: list[str] = []
    for d in sources:
        label = sweep_label(d)
        labels.append(label if label not in labels else f"{label}-{len(labels)}")
    parts, order = [], []
    for d, label in zip(sources, labels):
        runs, curves = load_sweep(d, exclude=out_dir, label=label)
        own = [v.removeprefix(f"{label}:") for v in runs["variant"]]
        named = named_variants(d)
        order += [f"{label}:{v}" for v in _source_order(runs.assign(variant=own), named)]
        parts.append((runs, curves))
    runs = pd.concat([p[0] for p in parts], ignore_index=True)
    curves = pd.concat([p[1] for p in parts], ignore_index=True)
    reference = reference or order[0]
    return assemble(runs, curves, " + ".join(map(str, sources)), out_dir, order, reference, command, manifests, plots)


def write_files(report: Report, out_dir: Path, plots: bool = True) -> None:
    from asyncpipe.report.plots import plot_gap_vs_tokens, plot_loss_curves  # matplotlib only when writing

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {name: out_dir / name for name in ("report.md", "gaps.csv")}
    atomic_write_text(files["gaps.csv"], report.cells.to_csv(index=False))
    order = list(dict.fromkeys(report.cells["variant"])) if len(report.cells) else []
    if plots:
        for plot, name in ((plot_loss_curves, "loss_curves.png"), (plot_gap_vs_tokens, "gap_vs_tokens.png")):
            for path in plot(report.runs, report.curves, report.groups, order, out_dir / name):
                files[path.name] = path
    report.files = files
    atomic_write_text(files["report.md"], to_markdown(report))


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
        "in this table evaluated at; each run's last val loss at or before it). Mean ± sample std (ddof=1) over "
        f"seeds; a gap is to the `{group.reference}` column, its ± the sample std of the per-seed differences to the "
        "same seed's run there. Diverged, failed and unfinished runs are counted, never averaged."
    )


def compared_values(report: Report) -> dict[str, float]:
    """Each run's compared val loss (at its table's matched token count)."""
    compared: dict[str, float] = {}
    for group in report.groups:
        compared.update(matched_values(report.runs[report.runs["run"].isin(group.runs)], report.curves)[1])
    return compared


def run_table(report: Report) -> pd.DataFrame:
    """One row per run with its compared val loss (blank when it was not compared)."""
    compared = compared_values(report)
    table = report.runs[["run", "optimizer", "variant", "seed", "status", "final_tokens"]].copy()
    for key in report.grouping.group_keys:
        table.insert(1, key, [fmt_value(report.grouping.value(r, key)) for r in table["run"]])
    table["compared_val_loss"] = [f"{compared[r]:.4f}" if r in compared else "" for r in table["run"]]
    return table.astype(object).where(table.notna(), "").set_index("run")


def provenance_table(report: Report) -> pd.DataFrame:
    codes = report.runs["code"].astype(object).fillna("unrecorded")
    table = pd.DataFrame({"code (commit; versions)": codes.values, "runs": 1}).groupby("code (commit; versions)").sum()
    return table


def paired_table(report: Report) -> pd.DataFrame:
    """For each `X+...` variant (EF): its run minus the same seed's X run, mean ± std over seeds."""
    cells = report.cells
    if cells.empty or not (cells["base_variant"] != "").any():
        return pd.DataFrame()
    rows = cells[cells["base_variant"] != ""]
    out = pd.DataFrame({
        "table": [", ".join(f"{k}={fmt_value(r[k])}" for k in report.group_keys) or "all" for _, r in rows.iterrows()],
        "optimizer": rows["optimizer"],
        "difference": rows["variant"] + " − " + rows["base_variant"],
        "mean (same seed)": [f"{v:+.4f}" if math.isfinite(v) else "—" for v in rows["diff_to_base"]],
        "std": [f"{v:.4f}" if math.isfinite(v) else "—" for v in rows["diff_to_base_std"]],
    })
    return out.set_index("table")


def to_markdown(report: Report) -> str:
    parts = [f"# Loss-gap report\n\nSource: `{report.source}` — {len(report.runs)} runs "
             f"({int((report.runs['status'] == COMPLETED).sum())} completed).\n",
             "\n".join(f"- {line}" for line in report.grouping.describe()) + "\n"]
    if report.warnings:
        parts.append("**Warnings**\n\n" + "\n".join(f"- {w}" for w in report.warnings) + "\n")
    for group in report.groups:
        parts += [f"## {group.title}\n", _matched_note(group) + "\n", _md_table(group.table) + "\n"]
    paired = paired_table(report)
    if not paired.empty:
        parts += ["## Paired differences\n", "A `X+...` variant's run minus the same seed's `X` run (e.g. EF's own "
                  "effect), mean and sample std over seeds.\n", _md_table(paired) + "\n"]
    parts.append("## Plots\n")
    if "loss_curves.png" in report.files:
        parts += [
            "Val loss (line with markers at the evaluations: mean over seeds; band: min–max over seeds) and train loss "
            "(light line: mean over seeds, EMA); the lower row zooms into the end of training. "
            "PDF versions beside the PNGs.\n",
            "![val and train loss vs tokens](loss_curves.png)\n",
            "Gap to the reference column, paired by seed: mean of the per-seed differences, error bars ±1 sample std.\n",
            "![loss gap to the reference vs tokens](gap_vs_tokens.png)\n",
        ]
    else:
        parts.append("Not drawn (`asyncpipe report --no-plots`).\n")
    parts += [
        "## Runs\n",
        _md_table(run_table(report)) + "\n",
        "## Provenance\n",
        "The code each run came from (its `provenance.json`: git commit, dirty flag, library versions).\n",
        _md_table(provenance_table(report)) + "\n",
        f"Long-form numbers (full precision): `gaps.csv`. Regenerate: `{report.command}`.\n",
    ]
    return "\n".join(parts)


def print_report(report: Report, stream: Any = None) -> None:
    """Print the terminal tables; off a terminal (a pipe, a log) wide enough that no header or cell is cut."""
    import sys

    from rich.console import Console
    from rich.measure import Measurement

    stream = stream or sys.stdout
    renderable = render_terminal(report)
    width = None
    if not stream.isatty():
        probe = Console(file=stream, width=10_000)
        width = max(100, *(Measurement.get(probe, probe.options, r).maximum for r in renderable.renderables
                           if not hasattr(r, "plain")))  # fmt: skip
    Console(file=stream, width=width).print(renderable)


def render_terminal(report: Report) -> Any:
    """A rich renderable: what was compared, warnings, then one table per group (matched tokens in the caption)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    items: list[Any] = [Text(line.replace("`", "")) for line in report.grouping.describe()]
    items += [Text(f"warning: {w}", style="yellow") for w in report.warnings]
    for group in report.groups:
        table = Table(title=group.title, caption=_matched_note(group).replace("**", "").replace("`", ""),
                      caption_justify="left")  # fmt: skip
        table.add_column("optimizer", style="bold", no_wrap=True)
        for column in group.table.columns:
            table.add_column(str(column), justify="right")
        for optimizer, row in group.table.iterrows():
            table.add_row(str(optimizer), *(str(v) for v in row))
        items.append(table)
    return Group(*items)
