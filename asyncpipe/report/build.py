"""Build a sweep's loss-gap report (tables, intervals, time to target, CSV, plots, markdown) from run dirs.

Files go to DIR/NAME/report/: report.md, gaps.csv, intervals.csv, glance.png (each optimizer's gap with its 95%
interval, and time to target), loss_curves.png, gap_vs_tokens.png and, when a delayed column can be timed to the
sync target, speedups.csv (every net speed-up with its interval, token ratio's and throughput's error combined),
wallclock.png (val loss vs modelled wall-clock) and verdict.png (the speed-up table's net speed-up over the strongest
synchronous schedule per P, m and variant); all written atomically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pandas as pd

from asyncpipe.errors import UserError
from asyncpipe.paths import writable_dir
from asyncpipe.report.claims import Claim
from asyncpipe.report.groups import Grouping, classify, natural
from asyncpipe.config.tuned import run_regime, tuned_regime
from asyncpipe.report.load import concat_runs, load_sweep, named_variants, read_manifest, sweep_label
from asyncpipe.report.merge import load_merged
from asyncpipe.report.paper import PAPER
from asyncpipe.report.render import to_markdown
from asyncpipe.report.speedups import speedup_cells
from asyncpipe.report.tables import GroupTable, compute_cells, variant_order
from asyncpipe.report.target import Ladder, ladders
from asyncpipe.report.throughput import load_bench
from asyncpipe.report.tuning import Tuning
from asyncpipe.report.tuning import best_of as best_of_runs
from asyncpipe.report.verdict import takeaways
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
    claims: list[Claim] = field(default_factory=list)  # every interval (intervals.csv)
    ladders: list[Ladder] = field(default_factory=list)  # time to target per delayed column
    bench: list[dict] = field(default_factory=list)  # `bench pipeline` results the throughput ratios come from
    takeaways: list[str] = field(default_factory=list)  # one sentence per optimizer, first in every output
    sweep_dirs: list[Path] = field(default_factory=list)
    wandb_message: str = ""  # what log_report_to_wandb did, for the console
    target: float | str | None = None  # what closures were judged against: a fraction, "paper", or None
    tuning: Tuning | None = None  # --best-of: what each column's value was chosen on, and which
    wallclock_at: tuple[int, int] | None = None  # --wallclock-at P,m: the wall-clock figure's depth (else each run's)

    @property
    def group_keys(self) -> list[str]:
        return self.grouping.group_keys


def assemble(
    runs: pd.DataFrame,
    curves: pd.DataFrame,
    source: str,
    out_dir: Path | None,
    named: list[str] | None = None,
    reference: str | None = None,
    command: str = "",
    sweeps: list[dict] | None = None,
    plots: bool = True,
    target: float | str | None = None,
    bench: list[dict] | None = None,
    best_of: str | None = None,
    select_seeds: Sequence[str] | None = None,
    wallclock_at: tuple[int, int] | None = None,
) -> Report:
    """Tables from the frames, then (when out_dir is given) every report file (the plots only with `plots`).
    `target`: the fraction of a gap a mitigation should close, or "paper" (each optimizer's closure in the paper's
    table, asyncpipe.report.paper), judged in the takeaways; `bench`: load_bench(); `best_of`: a swept key each
    column is reported at its own best value of (chosen on `select_seeds`, measured on the others:
    asyncpipe.report.tuning)."""
    tuning = None
    if best_of:
        runs, tuning = best_of_runs(runs, curves, best_of, select_seeds)
    grouping = classify(
        list(zip(runs["run"], runs["config"], runs["optimizer"], runs["variant"], runs["variant_named"]))
    )
    if reference is not None and reference not in set(runs["variant"]):
        raise UserError(
            f"--reference {reference!r} is not a column of this report; columns: "
            + ", ".join(dict.fromkeys(runs["variant"]))
        )
    named = named or (sorted(dict.fromkeys(runs["variant"]), key=natural) if runs["variant_named"].any() else None)
    cells, groups, warnings = compute_cells(runs, curves, grouping, named, reference, target)
    warnings += [f"run {r}: {n}" for r, n in zip(runs["run"], runs["note"]) if n]
    warnings += list(dict.fromkeys(n for notes in runs["revision_note"].fillna("") for n in notes.splitlines() if n))
    warnings += untuned_lr_warnings(runs) if best_of != "optimizer.lr" else []
    warnings += repeated_data_warnings(runs)
    codes = runs["code"].astype(object).fillna("unrecorded") if "code" in runs else pd.Series(dtype=object)
    if codes.nunique() > 1:
        warnings.append(
            f"the runs come from {codes.nunique()} different code states (commit, dirty flag or library "
            "versions; see Provenance): their differences may be the code's, not the settings'"
        )
    report = Report(
        source,
        runs,
        curves,
        cells,
        grouping,
        groups,
        warnings,
        out_dir,
        command=command or f"asyncpipe report {source}",
        sweeps=sweeps or [],
    )
    report.claims = [c for g in groups for c in g.claims]
    report.target = target
    report.bench = bench or []
    report.wallclock_at = wallclock_at
    # Only what answers "how much longer": several budgets, or a target reached (not a bare "≥ 1.00x").
    report.ladders = [lad for lad in ladders(runs, curves, grouping, groups) if len(lad.columns) > 1 or lad.reached]
    report.takeaways = takeaways(report.claims, report.ladders, report.bench, len(groups) > 1)
    report.tuning = tuning
    if tuning is not None:
        report.takeaways.insert(0, tuning.sentence())
    if out_dir is not None:
        write_files(report, out_dir, plots)
    return report


def repeated_data_warnings(runs: pd.DataFrame) -> list[str]:
    """One warning naming the runs that trained more than one epoch of their train split (summary `epochs` > 1):
    they saw data again, which a run of that length on enough data would not."""
    epochs = pd.to_numeric(runs["epochs"], errors="coerce")
    over = runs[epochs > 1]
    if over.empty:
        return []
    names = ", ".join(over["run"].head(5)) + (", ..." if len(over) > 5 else "")
    return [
        f"{len(over)} run(s) repeated data: up to {epochs.max():.2f} epochs of their train split ({names}); "
        "compare them with care, or train on a larger corpus (data=mix)"
    ]


def target_arg(target: float | str) -> str:
    """`--target` as typed: `paper`, or the fraction as a percentage."""
    return str(target) if target == PAPER else f"{float(target) * 100:g}"


def untuned_lr_warnings(runs: pd.DataFrame) -> list[str]:
    """One warning per (model, optimizer, lr) whose synchronous runs are compared at an lr that is not the tuned one
    (conf/tuned_lr.yaml, sync lr grid winners): a gap between optimizers at untuned lrs may be the lrs', not the
    optimizers'. Delayed runs are not judged by it: a study may tune each variant's lr (`--best-of`)."""
    out: list[str] = []
    if runs["optimizer"].nunique() < 2:  # an lr grid of one optimizer is not a comparison of optimizers
        return out
    sync = runs[runs["delay"] == 0] if "delay" in runs else runs
    for _, row in sync.dropna(subset=["lr"]).iterrows():
        model, opt, lr = str(row["model"]), str(row["optimizer"]), float(row["lr"])
        regime = run_regime(row["config"]) if isinstance(row.get("config"), dict) else {}
        found = tuned_regime(model, opt, **regime)
        if found is None:
            continue
        tuned = found.lrs[opt]
        if abs(lr - tuned) > 1e-9 * tuned:
            line = (
                f"{opt} on {model} ran at lr {lr:g}, not its tuned {tuned:g} (conf/tuned_lr.yaml): optimizers "
                "compared at untuned lrs may differ by their lrs"
            )
        elif regime and not found.fits(**regime):
            line = (
                f"{opt} on {model} ran at lr {lr:g}, tuned for {found.describe()}, not for these runs' "
                f"{regime['steps']} steps x {regime['tokens_per_step']} tokens on {regime['data']}"
            )
        else:
            continue
        if line not in out:
            out.append(line)
    return out


def _source_order(runs: pd.DataFrame, named: list[str]) -> list[str]:
    """One source's columns in order: its sweep file's variant names, else sync, 1-step, 1-step+EF, others."""
    present = list(dict.fromkeys(runs["variant"]))
    return variant_order(present, named or None) if named else [v for v in variant_order(present) if v in present]


def _same_length(base: pd.DataFrame, others: pd.DataFrame, baseline: Path) -> None:
    """A --baseline trains as many steps as some compared run: a gap between runs of other lengths is no gap. Delayed
    runs longer than the baseline are budget rungs (time to the baseline's loss, `report.target`), not gaps."""
    steps = lambda runs: {c.get("train.steps") for c in runs["config"]} if len(runs) else set()  # noqa: E731
    ours = steps(base)
    longest = max((int(s) for s in ours if s is not None), default=None)
    rung = lambda c, d: longest is not None and int(d or 0) > 0 and int(c.get("train.steps") or 0) > longest  # noqa: E731
    gaps = others[[not rung(c, d) for c, d in zip(others["config"], others["delay"])]] if len(others) else others
    theirs = steps(gaps)
    if ours and theirs and ours.isdisjoint(theirs):
        show = lambda s: "/".join(map(str, sorted(s, key=str)))  # noqa: E731
        raise UserError(
            f"--baseline {baseline} trains train.steps={show(ours)}, the compared runs "
            f"train.steps={show(theirs)}: runs of other lengths make no gap; compare runs of one length, "
            "or pass --other-length to put them side by side anyway"
        )


def build_report(
    sweep_dir: Path | Sequence[Path],
    out_dir: Path | None = None,
    baseline: Path | None = None,
    reference: str | None = None,
    plots: bool = True,
    merge: bool = False,
    target: float | str | None = None,
    bench: Sequence[Path] = (),
    best_of: str | None = None,
    select_seeds: Sequence[str] | None = None,
    other_length: bool = False,
    wallclock_at: tuple[int, int] | None = None,
) -> Report:
    """The report of every run under `sweep_dir` (default out_dir: sweep_dir/report).

    Several sweep dirs (or a `baseline`) make one comparison: each sweep's columns are labelled `NAME:variant`
    (NAME from its sweep.json) and every gap is measured against the baseline's (else the first sweep's)
    reference column (its first named variant, else sync), paired by seed. `reference` names another column to
    measure the gaps against (e.g. `cpu_study:1-step`: PipeDream vs 2BW, same seed). `plots=False` writes the
    tables only (the plots take most of a report's time). `merge`: runs of several sweeps that share a column
    name and every compared setting form one cell (seeds pooled; asyncpipe.report.merge). `target`: the fraction
    of a gap a mitigation should close, or "paper" (the paper's own closure per optimizer); `bench`: `bench
    pipeline` result files for the throughput ratios; `best_of`: a swept key (optimizer.lr) each column is reported
    at its own best value of, chosen on `select_seeds` (default: the lower half) and measured on the rest;
    `wallclock_at` (P, m): the wall-clock figure's throughputs at that depth instead of each run's own."""
    dirs = [Path(sweep_dir)] if isinstance(sweep_dir, (str, Path)) else [Path(d) for d in sweep_dir]
    if select_seeds and not best_of:
        raise UserError("--select-seeds chooses the seeds --best-of selects on; give --best-of KEY with it")
    if not dirs:
        raise UserError("give at least one sweep directory")
    sources = list(dict.fromkeys(([Path(baseline)] if baseline is not None else []) + dirs))
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(dirs, sources)
    command = regenerating_command(dirs, baseline, reference, merge, target, bench, best_of, select_seeds, wallclock_at)
    manifests = [m for m in map(read_manifest, sources) if m]
    extra = {
        "plots": plots,
        "target": target,
        "bench": load_bench(list(bench)),
        "best_of": best_of,
        "select_seeds": select_seeds,
        "wallclock_at": wallclock_at,
    }
    if merge:
        runs, curves, named = load_merged(sources, exclude=out_dir)
    elif len(sources) == 1:
        (runs, curves), named = load_sweep(dirs[0], exclude=out_dir), named_variants(dirs[0])
    else:
        runs, curves, named = load_compared(sources, out_dir, baseline, other_length)
        reference = reference or named[0]
    report = assemble(
        runs, curves, " + ".join(map(str, sources)), out_dir, named, reference, command, manifests, **extra
    )
    report.sweep_dirs = sources
    return report


def default_out_dir(dirs: list[Path], sources: list[Path]) -> Path:
    """DIR/NAME/report for one sweep; beside the first source, `report-A-vs-B`, for a comparison."""
    if len(sources) == 1:
        return dirs[0] / REPORT_DIR
    return sources[0].parent / ("report-" + "-vs-".join(sweep_label(d) for d in sources))


def regenerating_command(
    dirs: list[Path],
    baseline: Path | None,
    reference: str | None,
    merge: bool,
    target: float | str | None,
    bench: Sequence[Path],
    best_of: str | None,
    select_seeds: Sequence[str] | None,
    wallclock_at: tuple[int, int] | None,
) -> str:
    """The `asyncpipe report` command line that writes this report again (report.md shows it)."""
    command = "asyncpipe report " + " ".join(map(str, dirs)) + (f" --baseline {baseline}" if baseline else "")
    command += f" --reference '{reference}'" if reference else ""
    command += " --merge" if merge else ""
    command += f" --target {target_arg(target)}" if target is not None else ""
    command += "".join(f" --bench {b}" for b in bench)
    command += f" --best-of {best_of}" if best_of else ""
    command += f" --select-seeds {','.join(map(str, select_seeds))}" if best_of and select_seeds else ""
    command += f" --wallclock-at {wallclock_at[0]},{wallclock_at[1]}" if wallclock_at else ""
    return command


def load_compared(
    sources: list[Path], out_dir: Path, baseline: Path | None, other_length: bool
) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """Several sweeps side by side: their runs and curves, columns labelled `NAME:variant` (a repeated NAME gets its
    place appended), and the columns in order, each sweep's own order in turn. A `baseline` that trains another
    train.steps than the compared runs is refused unless `other_length`."""
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
    if baseline is not None and not other_length:
        _same_length(parts[0][0], concat_runs([p[0] for p in parts[1:]]), Path(baseline))
    runs = concat_runs([p[0] for p in parts])
    curves = pd.concat([p[1] for p in parts], ignore_index=True)
    return runs, curves, order


def write_files(report: Report, out_dir: Path, plots: bool = True) -> None:
    from asyncpipe.report.glance import plot_glance  # matplotlib only when writing
    from asyncpipe.report.plots import plot_gap_vs_tokens, plot_loss_curves
    from asyncpipe.report.verdict_figure import plot_verdict
    from asyncpipe.report.wallclock import plot_wallclock

    writable_dir(out_dir, "the report dir", "pass --out DIR to write the report elsewhere")  # a read-only sweep dir
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {name: out_dir / name for name in ("report.md", "gaps.csv", "intervals.csv")}
    atomic_write_text(files["gaps.csv"], report.cells.to_csv(index=False))
    atomic_write_text(files["intervals.csv"], pd.DataFrame([c.row() for c in report.claims]).to_csv(index=False))
    speedups = speedup_cells(report.ladders, report.bench) if report.ladders else None
    if speedups is not None:  # every net speed-up with its combined interval, in columns (asyncpipe.report.speedups)
        files["speedups.csv"] = out_dir / "speedups.csv"
        atomic_write_text(files["speedups.csv"], speedups.to_csv(index=False))
    order = list(dict.fromkeys(report.cells["variant"])) if len(report.cells) else []
    # Colours and markers go by place in this order: budget rungs (a ladder's longer columns) after every family's
    # own column, so two families never share a colour in the glance panel.
    rungs = {c for lad in report.ladders for c in lad.columns[1:]}
    order = [v for v in order if v not in rungs] + [v for v in order if v in rungs]
    if plots:
        if any(c.kind == "gap" for c in report.claims):
            for path in plot_glance(report.claims, report.ladders, order, out_dir / "glance.png"):
                files[path.name] = path
        for plot, name in ((plot_loss_curves, "loss_curves.png"), (plot_gap_vs_tokens, "gap_vs_tokens.png")):
            for path in plot(report.runs, report.curves, report.groups, order, out_dir / name):
                files[path.name] = path
        if report.ladders:
            for path in plot_wallclock(
                report.runs,
                report.curves,
                report.groups,
                report.ladders,
                report.bench,
                out_dir / "wallclock.png",
                at=report.wallclock_at,
                order=order,
            ):
                files[path.name] = path
            for path in plot_verdict(speedups, order, out_dir / "verdict.png"):  # the table's cells, as written
                files[path.name] = path
    report.files = files
    atomic_write_text(files["report.md"], to_markdown(report))
