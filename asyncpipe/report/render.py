"""A report as markdown (report.md) and on the terminal: the headline first (each optimizer's gap and their ratio,
asyncpipe.report.headline), the takeaways, then the tables, then the notes (what was compared and how), the
intervals, time to target, runs and provenance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from asyncpipe.report.groups import fmt_value
from asyncpipe.report.headline import headline
from asyncpipe.report.load import COMPLETED, accounting
from asyncpipe.report.paper import PAPER, SOURCE, table_lines
from asyncpipe.report.speedups import SPEEDUP_RULE
from asyncpipe.report.tables import GroupTable, matched_values
from asyncpipe.report.target import speedup_table, tokens_table
from asyncpipe.report.verdict import paper_basis, takeaway_lines

NOISE = (
    "Every ± and interval covers seed-to-seed variation only: a seed fixes the initialisation and the data "
    "order. It does not cover numerical differences between machines (another CPU model or thread count "
    "changes the last bits at step 2 and the runs drift apart after), so a run is deterministic given its seed "
    "on one machine only."
)
CONVENTION = (
    "Intervals are 95%, paired by seed over the seeds the compared columns share: a difference (a gap, "
    "an effect, method − EF) is the mean of the per-seed differences with a t-interval; a ratio (% of a gap "
    "closed, one optimizer's gap over another's, a token ratio) is the ratio of the means with Fieller's "
    "interval (every r for which the paired t-interval of numerator − r × denominator contains 0; "
    "'unbounded' when the denominator's own interval reaches 0). \"Not resolved\": the interval contains 0 "
    "(or 1x, or the stated target). The seeds that would resolve a claim: the smallest n at which the "
    "paired two-sided 5% t-test rejects 0 (or the target) with 80% power if the observed mean and spread "
    "were the truth."
)


def _cell(value: object) -> str:
    """A table cell's text on one line: a newline or a pipe (a run dir's name may hold either) would split the row."""
    return str(value).replace("\r", "\\r").replace("\n", "\\n").replace("|", "\\|")


def md_table(frame: pd.DataFrame) -> str:
    names = list(frame.index.names) if isinstance(frame.index, pd.MultiIndex) else [frame.index.name or ""]
    lines = [
        "| " + " | ".join([*map(_cell, names), *map(_cell, frame.columns)]) + " |",
        "|" + "---|" * (len(names) + len(frame.columns)),
    ]
    for idx, row in frame.iterrows():
        keys = idx if isinstance(idx, tuple) else (idx,)
        lines.append("| " + " | ".join([*map(_cell, keys), *(_cell(v) for v in row)]) + " |")
    return "\n".join(lines)


def matched_note(group: GroupTable) -> str:
    if group.matched_tokens is None:
        return "No completed run with a validation loss in this group."
    return (
        f"Final val loss compared at **{group.matched_tokens} tokens** (the last token count every completed run "
        "in this table evaluated at; each run's last val loss at or before it). Cells: mean ± sample std (ddof=1) "
        f"over seeds. A gap is to the `{group.reference}` column, paired by seed, with its 95% t-interval; % closed "
        "is a ratio of means with Fieller's interval. Diverged, failed and unfinished runs are counted, "
        "never averaged."
    )


def compared_values(report: Any) -> dict[str, float]:
    """Each run's compared val loss (at its table's matched token count)."""
    compared: dict[str, float] = {}
    for group in report.groups:
        compared.update(matched_values(report.runs[report.runs["run"].isin(group.runs)], report.curves)[1])
    return compared


def run_table(report: Any) -> pd.DataFrame:
    """One row per run with its compared val loss (blank when it was not compared)."""
    compared = compared_values(report)
    table = report.runs[["run", "optimizer", "variant", "seed", "status", "final_tokens"]].copy()
    for key in report.grouping.group_keys:
        table.insert(1, key, [fmt_value(report.grouping.value(r, key)) for r in table["run"]])
    table["compared_val_loss"] = [f"{compared[r]:.4f}" if r in compared else "" for r in table["run"]]
    epochs = pd.to_numeric(report.runs["epochs"], errors="coerce") if "epochs" in report.runs else None
    if epochs is not None and epochs.notna().any():  # recorded since issue 37: > 1 means the run repeated data
        table["epochs"] = [f"{e:.2f}" if pd.notna(e) else "" for e in epochs]
    if "branch_of" in report.runs and report.runs["branch_of"].notna().any():  # budget branches: their parent run
        table["branch of"] = [Path(str(b)).name if isinstance(b, str) else "" for b in report.runs["branch_of"]]
    return table.astype(object).where(table.notna(), "").set_index("run")


def provenance_table(report: Any) -> pd.DataFrame:
    codes = report.runs["code"].astype(object).fillna("unrecorded")
    table = pd.DataFrame({"code (commit; versions)": codes.values, "runs": 1}).groupby("code (commit; versions)").sum()
    table["dirty tree"] = [
        "yes: uncommitted changes" if "(dirty)" in c else ("unknown" if c == "unrecorded" else "no")
        for c in table.index
    ]
    return table


def claims_table(report: Any) -> pd.DataFrame:
    rows = [
        {
            "table": c.table,
            "optimizer": c.optimizer,
            "claim": c.label,
            "95% interval": c.shown(),
            "n": c.interval.n,
            "resolved": (c.note or "yes") + (f"; {c.versus}" if c.versus else ""),
        }
        for c in report.claims
    ]
    return pd.DataFrame(rows).set_index("table") if rows else pd.DataFrame()


def printed_takeaways(report: Any) -> list[str]:
    """The takeaways as printed: one short line per clause (asyncpipe.report.verdict.takeaway_lines), then which
    runs any comparison with the paper used."""
    basis = paper_basis(report.claims, {g.title: g.matched_tokens for g in report.groups})
    return [line for t in report.takeaways + basis for line in takeaway_lines(t)]


def dirty_note(report: Any) -> str:
    codes = report.runs["code"].astype(object).fillna("unrecorded")
    dirty = int(codes.str.contains("(dirty)", regex=False).sum())
    return (
        f"{dirty} of {len(codes)} runs came from a working tree with uncommitted changes (see Provenance)."
        if dirty
        else ""
    )


def runs_note(report: Any) -> str:
    """How many run dirs the report found, read and used, naming every one it skipped (never a silent drop)."""
    runs = report.runs
    return accounting(runs, int((runs["status"] == COMPLETED).sum())).capitalize()


def to_markdown(report: Any) -> str:
    parts = [f"# Loss-gap report\n\nSource: `{report.source}`. {runs_note(report)}\n"]
    glance = headline(report.claims)
    if glance or "glance.png" in report.files:
        parts.append("## At a glance\n\n" + "\n".join(f"- {line}" for line in glance) + "\n")
        if "glance.png" in report.files:
            parts.append(GLANCE_CAPTION + "\n\n![each optimizer's gap at a glance](glance.png)\n")
    if report.takeaways:
        parts.append(
            "## Takeaways\n\n"
            + "\n".join(line if line.startswith(" ") else f"- {line}" for line in printed_takeaways(report))
            + "\n"
        )
    for group in report.groups:
        parts += [f"## {group.title}\n", md_table(group.table) + "\n", matched_note(group) + "\n"]
    parts.append("## What was compared\n\n" + "\n".join(f"- {line}" for line in report.grouping.describe()) + "\n")
    parts.append(f"**What the ± covers.** {NOISE} {dirty_note(report)}\n")
    if report.warnings:
        parts.append("**Warnings**\n\n" + "\n".join(f"- {w}" for w in report.warnings) + "\n")
    claims = claims_table(report)
    if not claims.empty:
        parts += ["## Intervals\n", CONVENTION + "\n", md_table(claims) + "\n"]
    if report.tuning is not None:
        parts += [
            f"## Tuned against tuned: `{report.tuning.key}`\n",
            f"Each column at its own best `{report.tuning.key}`, {report.tuning.seeds_text()}: mean final val "
            "loss over the selection seeds per value (a value with a selection run that did not complete is "
            "'incomplete'), and the value chosen. Every other number in this report is from the measurement "
            "seeds only.\n",
            md_table(report.tuning.table.set_index("optimizer")) + "\n",
        ]
    if report.target == PAPER:
        parts += [
            "## Targets: the paper's own figures\n",
            f"Closures and gap ratios are judged against {SOURCE}, "
            "derived in code from its table (a closure is (1-step − EF) / (1-step − sync)):\n",
            "\n".join(f"- {line}" for line in table_lines()) + "\n",
        ]
    if report.ladders:
        parts += [
            "## Time to target\n",
            TARGET_RULE + "\n",
            md_table(tokens_table(report.ladders, report.bench)) + "\n",
            SPEEDUP_RULE + " Its columns, with each number apart: speedups.csv.\n",
            md_table(speedup_table(report.ladders, report.bench)) + "\n",
        ]
        if "verdict.png" in report.files:
            parts.append(VERDICT_CAPTION + "\n\n![net speed-up over the strongest synchronous schedule](verdict.png)\n")
        if "wallclock.png" in report.files:
            parts.append("![val loss vs modelled wall-clock](wallclock.png)\n")
    parts.append("## Plots\n")
    if "loss_curves.png" in report.files:
        parts += [
            "Val loss (line with markers at the evaluations: mean over seeds; band: min–max over seeds) and train loss "
            "(light line: mean over seeds, EMA); the lower row zooms into the end of training and holds every line; "
            "each row shares one y-range. PDF versions beside the PNGs.\n",
            "![val and train loss vs tokens](loss_curves.png)\n",
        ]
    if "gap_vs_tokens.png" in report.files:
        parts += [
            "Gap to the reference column, paired by seed: mean of the per-seed differences, error bars = the 95% "
            "t-interval (the intervals the text gives; none for one seed, drawn dotted); every panel of a row shares "
            "one y-axis, so gaps of different optimizers compare by eye; the zoomed row always shows 0.\n",
            "![loss gap to the reference vs tokens](gap_vs_tokens.png)\n",
        ]
    if "loss_curves.png" not in report.files:
        parts.append("Not drawn (`asyncpipe report --no-plots`).\n")
    parts += [
        "## Runs\n",
        md_table(run_table(report)) + "\n",
        "## Provenance\n",
        "The code each run came from (its `provenance.json`: git commit, dirty flag, library versions).\n",
        md_table(provenance_table(report)) + "\n",
        "Long-form numbers (full precision): `gaps.csv` (cells) and `intervals.csv` (every interval). "
        f"Regenerate: `{report.command}`.\n",
    ]
    return "\n".join(parts)


GLANCE_CAPTION = (
    "Each optimizer's final gap to the reference (the point: the mean over seeds; the error bar: the same "
    "95% interval as the text) and, with several budgets, the tokens each column needs to reach sync's "
    "final val loss."
)

VERDICT_CAPTION = (
    "The verdict figure: the table's net speed-up of each variant over the strongest synchronous "
    "schedule at each P and m (its `vs` column, else `vs 1F1B`), with its interval; filled markers are "
    "resolved (the interval excludes 1x), hollow ones are not."
)

TARGET_RULE = (
    "Target: each seed's sync run's final val loss. A variant run at several token budgets (same settings but "
    "`train.steps`) reaches it at the smallest budget whose final val loss is at or below it, interpolated linearly "
    "between that budget and the next smaller one; when its smallest budget already gets there, along that run's "
    "val curve; when no budget gets there, 'not reached within N tokens' (a lower bound). Token ratio: mean tokens "
    "needed over mean sync tokens, Fieller's interval over seeds."
)


def print_report(report: Any, stream: Any = None) -> None:
    """Print the terminal report; off a terminal (a pipe, a log) wide enough that no header or cell is cut."""
    import sys

    from rich.console import Console
    from rich.measure import Measurement

    stream = stream or sys.stdout
    renderable = render_terminal(report)
    width = None
    if not stream.isatty():
        probe = Console(file=stream, width=10_000)
        width = max(
            [
                100,
                *(
                    Measurement.get(probe, probe.options, r).maximum
                    for r in renderable.renderables
                    if not hasattr(r, "plain")
                ),
            ]
        )
    Console(file=stream, width=width).print(renderable)


def _rich_table(frame: pd.DataFrame, title: str = "", caption: str = "") -> Any:
    from rich.table import Table

    table = Table(title=title or None, caption=caption or None, caption_justify="left")
    names = list(frame.index.names) if isinstance(frame.index, pd.MultiIndex) else [frame.index.name or ""]
    for i, name in enumerate(names):
        table.add_column(str(name), style="bold" if i == 0 else None, no_wrap=True)
    for column in frame.columns:
        table.add_column(str(column), justify="right")
    for idx, row in frame.iterrows():
        keys = idx if isinstance(idx, tuple) else (idx,)
        table.add_row(*map(str, keys), *(str(v) for v in row))
    return table


def render_terminal(report: Any) -> Any:
    """A rich renderable: the takeaways, one table per group, then what was compared, the ± note and warnings."""
    from rich.console import Group
    from rich.text import Text

    items: list[Any] = [Text(line, style="bold cyan") for line in headline(report.claims)]
    items += [Text(line, style="bold" if not line.startswith(" ") else "") for line in printed_takeaways(report)]
    note = runs_note(report)
    items.append(Text(note, style="yellow" if "skipped" in note else ""))
    for group in report.groups:
        items.append(_rich_table(group.table, group.title, matched_note(group).replace("**", "").replace("`", "")))
    if report.ladders:
        items.append(_rich_table(tokens_table(report.ladders, report.bench), "Time to sync's final val loss"))
        items.append(_rich_table(speedup_table(report.ladders, report.bench), "Net wall-clock speed-up over sync"))
    items += [Text(line.replace("`", "")) for line in report.grouping.describe()]
    items += [Text(NOISE), *([Text(dirty_note(report))] if dirty_note(report) else [])]
    items += [Text(f"warning: {w}", style="yellow") for w in report.warnings]
    return Group(*items)
