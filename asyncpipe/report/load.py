"""Runs into two frames: one row per run (config axes, status) and one row per evaluation (tokens, val_loss).

Sources are run directories on disk or (see wandb_source.py) runs read from the W&B API; both pass
through `run_record`, so everything after loading is the same code. A run dir's files are read, as untrusted
input, by `run_files`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Sequence

import pandas as pd

from asyncpipe.config.keys import lookup
from asyncpipe.errors import UserError
from asyncpipe.lr_schedule import LRSchedule
from asyncpipe.status import COMPLETED
from asyncpipe.report import revisions
from asyncpipe.report.groups import flat_config
from asyncpipe.paths import enclosing_run, separate_from_runs
from asyncpipe.report.run_files import code_of, read_config, read_metrics, read_provenance, read_summary
from asyncpipe.track.files import CONFIG_FILE, RETIRED, SWEEP_MANIFEST, read_json_object

# Frame column -> dotted key in the composed config.
AXES = {
    "model": "model.name",
    "data": "data.name",
    "tokenizer": "tokenizer.name",
    "optimizer": "optimizer.name",
    "ef": "optimizer.ef.enabled",
    "ef_lam": "optimizer.ef.lam",
    "compensation": "compensation.name",
    "lr": "optimizer.lr",
    "delay": "delay",
    "delay_profile": "delay_profile",
    "stages": "pipeline.stages",
    "engine": "engine",
    "seed": "seed",
}
RUN_COLUMNS = [
    "run",
    "path",
    *AXES,
    "variant",
    "variant_named",
    "sweep",
    "status",
    "final_tokens",
    "summary_val_loss",
    "note",
    "config",
    "train",
    "code",
    "epochs",
    "branch_of",
    "revision_note",
    "rule_revisions",
    "schedule",
]
CURVE_COLUMNS = ["run", "tokens", "val_loss"]


def variant_label(delay: Any, ef: Any, lam: Any, profile: Any, stages: Any, compensation: Any = None) -> str:
    """The table column a run belongs to: sync, 1-step, 1-step+EF, 1-step+dc, ... (EF strength shown when not 1;
    a staleness mitigation other than EF by its `compensation` name)."""
    delay = int(delay or 0)
    if delay == 0:
        label = "sync"
    elif profile == "pipedream":  # stage s is delayed P-1-s steps: the depth names the setting
        label = f"pipedream(P={stages})"
    else:
        label = f"{delay}-step"
    if ef:
        label += "+EF"
        if lam is not None and float(lam) != 1.0:
            label += f"(lam={float(lam):g})"
    if compensation not in (None, "none", "ef"):
        label += f"+{compensation}"
    return label


def normalize_status(summary: dict | None) -> str:
    """completed, diverged, failed, or unfinished (no summary, or still marked running)."""
    status = (summary or {}).get("status")
    if status in (None, "running"):
        return "unfinished"
    return str(status)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == value and abs(value) != float("inf")


def run_record(
    name: str, path: str, config: dict, summary: dict | None, metrics: Iterable[dict], note: str = ""
) -> tuple[dict, list[dict]]:
    """One run's row and its evaluation rows (only records with both tokens and a finite val_loss).

    The column is the sweep file's variant name (`run.variant`) when the run has one, else named from its delay
    settings; `config` holds the whole flattened config, which asyncpipe.report.groups compares."""
    row: dict[str, Any] = {"run": name, "path": path, "note": note, "sweep": "", "revision_note": ""}
    row["rule_revisions"] = ""  # an older revision's rules, named (`name_revisions`)
    for column, dotted in AXES.items():
        row[column] = lookup(config, dotted)
    if row["compensation"] == "ef":  # compensation=ef is the EF of the *_ef optimizer presets
        row["ef"], row["ef_lam"] = True, lookup(config, "compensation.ef.lam")
    row["ef"] = bool(row["ef"])
    row["delay"] = int(row["delay"] or 0)
    named = lookup(config, "run.variant")
    row["variant_named"] = named is not None
    row["variant"] = (
        str(named)
        if named is not None
        else variant_label(
            row["delay"], row["ef"], row["ef_lam"], row["delay_profile"], row["stages"], row["compensation"]
        )
    )
    row["config"] = flat_config(config)
    row["schedule"] = str(row["config"].get("pipeline.schedule") or "auto")  # by today's name: `name_revisions`
    if row["engine"] != "pipeline":
        # Simulated: the stage count only matters through delay_profile=pipedream, which the variant names;
        # keeping it would split sync runs from the async runs they are compared with.
        row["stages"] = None
    curve, train, last_tokens = [], [], None
    for rec in metrics:
        tokens = rec.get("tokens")
        if tokens is None:
            continue
        last_tokens = tokens
        val, loss = rec.get("val_loss"), rec.get("train_loss")
        if _finite(val):
            curve.append({"run": name, "tokens": int(tokens), "val_loss": float(val)})
        if _finite(loss):
            train.append((int(tokens), float(loss)))
    row["train"] = train  # (tokens, train loss) per step, for the plots
    status = normalize_status(summary)
    if status == COMPLETED and not curve:
        status = "no val loss"
    row["status"] = status
    row["final_tokens"] = (summary or {}).get("tokens", last_tokens)
    row["summary_val_loss"] = (summary or {}).get("final_val_loss")
    row["epochs"] = (summary or {}).get("epochs")  # passes over the train split (records before issue 37: none)
    row["branch_of"], why = exact_branch(config, summary or {})  # a budget branch's parent run dir
    if why:
        row["note"] = "; ".join(n for n in (row["note"], why) if n)
    return row, curve


def exact_branch(config: dict, summary: dict) -> tuple[str | None, str]:
    """(the parent run dir, "") of a budget branch whose record shows it exact: started at or before its own decay
    start and its parent's (`trainer.Trainer.branch`); else (None, why it is not labelled a branch, or "")."""
    parent, step = summary.get("branch_of"), summary.get("branch_step")
    if parent is None:
        return None, ""
    try:
        train = dict(config.get("train") or {})
        schedule = LRSchedule.of(SimpleNamespace(**train))
        parents = summary.get("branch_parent_steps")
        at = min(schedule.decay_start, schedule.at_steps(parents).decay_start if parents is not None else step)
        exact = isinstance(parent, str) and type(step) is int and 0 <= step <= at
    except (UserError, TypeError, ValueError, AttributeError):
        exact = False
    if exact:
        return parent, ""
    return (
        None,
        f"recorded as a branch of {parent!s:.200} from step {step!s:.20}, not at or before a decay start: "
        "not shown as a branch",
    )


def frames(records: list[tuple[dict, list[dict]]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    runs = pd.DataFrame([r for r, _ in records], columns=RUN_COLUMNS)
    curves = pd.DataFrame([c for _, cs in records for c in cs], columns=CURVE_COLUMNS)
    return runs, curves.astype({"tokens": "int64", "val_loss": "float64"})


@dataclass
class Skipped:
    """A run dir a report found but did not read, and why (one line)."""

    run: str
    path: str
    reason: str

    def line(self) -> str:
        return f"skipped run {self.run}: {self.reason}"


def _is_run_dir(path: Path) -> bool:
    return os.path.lexists(path / CONFIG_FILE)


def _walk_runs(root: Path, exclude: Path | None) -> tuple[list[Path], list[tuple[Path, Path]]]:
    """(outermost run dirs under `root`, (nested run dir, the run holding it) pairs), each sorted. Symlinked
    directories are not followed (a link loop in a copied tree must not hang a report); wandb/ folders and the
    sweep's .retired/ attempts are not runs of the sweep."""
    found: list[Path] = []
    nested: list[tuple[Path, Path]] = []
    for dirpath, dirs, _files in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirs[:] = sorted(d for d in dirs if d not in ("wandb", RETIRED))
        if exclude is not None and (here == exclude or exclude in here.parents):
            dirs[:] = []
            continue
        if not _is_run_dir(here):
            continue
        holder = next((r for r in found if r in here.parents), None)
        if holder is None:
            found.append(here)
        else:
            nested.append((here, holder))
    return sorted(found), sorted(nested)


def load_run_dir(run: Path, name: str) -> tuple[dict, list[dict]]:
    """One run's row and evaluation rows; a file that cannot be trusted is a `UserError` naming it and why."""
    config, summary = read_config(run), read_summary(run)
    metrics, note = read_metrics(run)
    row, curve = run_record(name, str(run), config, summary, metrics, note)
    prov = read_provenance(run)
    row["code"] = code_of(prov)
    name_revisions(row, prov)
    return row, curve


def name_revisions(row: dict, prov: dict | None) -> None:
    """A run that ran an optimizer, compensation or schedule rule other than today's revision gets it in its names
    (`1-step+stage_lr@r1`, `adamw@r1`), so its cell is never pooled with, or read as, today's rule; the warning that
    says what that revision was goes to `revision_note`, and the rules so named (`schedule paci@r1`) to
    `rule_revisions`, the identity a budget ladder keeps apart too (`asyncpipe.report.target`)."""
    method = "ef" if row["ef"] else str(row["compensation"] or "none")
    schedule = str(row["schedule"])
    notes, tags = [], []
    for kind, name, column in (
        ("compensation", method, "variant"),
        ("optimizer", str(row["optimizer"]), "optimizer"),
        ("schedule", schedule, "variant"),
    ):
        tag, note = revisions.suffix(kind, name, prov)
        if tag:
            row[column] = f"{row[column]}{tag}"
            notes.append(note)
            tags.append(f"{kind} {name}{tag}")
    row["revision_note"] = "\n".join(notes)  # one line per rule
    row["rule_revisions"] = ", ".join(tags)
    row["schedule"] = revisions.today_name("schedule", schedule, prov)  # what today's code calls what it ran


def named_variants(root: Path) -> list[str]:
    """The variant names of the sweep manifests under `root` (itself included), in file order. The first is the
    gaps' reference: a folder holding several sweeps puts `sync` first when one names it (else the reference
    would be whichever sweep's first variant sorts first)."""
    names: list[str] = []
    manifests = sorted(root.rglob(SWEEP_MANIFEST))
    for path in manifests:
        try:
            variants = read_json_object(path).get("variants")
        except (OSError, UserError):
            continue  # `sweep status` names a damaged manifest; a report reads the runs themselves
        names.extend(str(v) for v in (variants if isinstance(variants, dict) else {}) if str(v) not in names)
    if len(manifests) > 1 and "sync" in names:
        names.remove("sync")
        names.insert(0, "sync")
    return names


def read_manifest(sweep_dir: Path) -> dict | None:
    """The sweep.json of a sweep dir, or None."""
    try:
        return read_json_object(Path(sweep_dir) / SWEEP_MANIFEST)
    except (OSError, UserError):
        return None


def sweep_label(sweep_dir: Path) -> str:
    """A sweep's name: its manifest's `name`, else the directory's name."""
    name = (read_manifest(sweep_dir) or {}).get("name")
    return str(name) if name else Path(sweep_dir).resolve().name


@dataclass
class Loaded:
    """What a report read from one sweep dir: the frames, how many run dirs it found, and those it skipped."""

    runs: pd.DataFrame
    curves: pd.DataFrame
    found: int
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def read(self) -> int:
        return self.found - len(self.skipped)

    def summary(self) -> str:
        """`found N run dirs, read M` (+ `, skipped K: ...`), the line a report states before its tables."""
        text = f"found {self.found} run dir(s), read {self.read}"
        return text + (f", skipped {len(self.skipped)} (see below)" if self.skipped else "")


def check_out_dir(out: Path, what: str = "--out") -> None:
    """Report files never go into a run dir (they would mix with the run's record and hide it from reports)."""
    separate_from_runs(out, what)


def load_runs(sweep_dir: Path, exclude: Path | None = None, label: str | None = None) -> Loaded:
    """Every run dir under `sweep_dir` (which may itself be a single run dir), each read as untrusted input: a run
    whose files cannot be trusted (not a regular file, too large, not UTF-8, wrong JSON/YAML types, non-finite
    numbers) is skipped and named with its reason, and the others are read. With a `label` (several sweeps in one
    report) run names and columns are prefixed `label/` and `label:`. `exclude` is the report's output dir: it may
    not lie inside a run dir other than `sweep_dir` itself (one line, before anything is written)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise UserError(f"{sweep_dir} is not a directory; pass a sweep directory (DIR/NAME) or a run directory")
    if exclude is not None and enclosing_run(exclude) != Path(os.path.abspath(sweep_dir)):
        check_out_dir(Path(exclude))  # the report of one run may go into that run's dir (report RUN's default)
    runs, nested = _walk_runs(sweep_dir, exclude)
    if not runs:
        raise UserError(f"no runs found under {sweep_dir} (a run is a directory containing {CONFIG_FILE})")
    name_of = lambda run: str(run.relative_to(sweep_dir)) if run != sweep_dir else run.name  # noqa: E731
    records, skipped = [], []
    for run in runs:
        try:
            records.append(load_run_dir(run, name_of(run)))
        except UserError as exc:
            skipped.append(Skipped(name_of(run), str(run), str(exc)))
        except (ValueError, TypeError) as exc:  # a setting of a type no run writes (e.g. delay: abc)
            skipped.append(
                Skipped(name_of(run), str(run), f"{run / CONFIG_FILE}: a setting has the wrong type ({exc})")
            )
    for run, holder in nested:
        skipped.append(
            Skipped(
                name_of(run),
                str(run),
                f"it lies inside run dir {name_of(holder)}; a run dir inside "
                "another run's is not read (move it out to report it)",
            )
        )
    if label:
        for row, curve in records:
            row["run"], row["sweep"], row["variant"] = f"{label}/{row['run']}", label, f"{label}:{row['variant']}"
            row["variant_named"] = True  # columns of several sweeps are named by their sweep
            for point in curve:
                point["run"] = row["run"]
        for skip in skipped:
            skip.run = f"{label}/{skip.run}"
    if not records:
        raise UserError(f"none of the {len(runs)} run(s) under {sweep_dir} can be read; first: {skipped[0].reason}")
    frame, curves = frames(records)
    return Loaded(frame, curves, len(runs) + len(nested), skipped)


def load_sweep(
    sweep_dir: Path, exclude: Path | None = None, label: str | None = None, *, say: Callable[[str], None] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`load_runs` as (runs, curves) frames; the runs frame carries `attrs["found"]` (run dirs found) and
    `attrs["skipped"]` (`Skipped` records: run, path, reason) for the report to state. When runs were skipped
    they are also said, one line each after the counts, through `say` (default: stderr), so that no caller can
    lose a run silently; a caller that shows them itself passes `say=lambda line: None`."""
    loaded = load_runs(sweep_dir, exclude, label)
    if loaded.skipped:
        tell = say or (lambda line: print(line, file=sys.stderr, flush=True))
        tell(f"report: {sweep_dir}: {loaded.summary()}")
        for skip in loaded.skipped:
            tell(f"  {skip.line()}")
    loaded.runs.attrs["found"] = loaded.found
    loaded.runs.attrs["skipped"] = list(loaded.skipped)
    return loaded.runs, loaded.curves


def concat_runs(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Several `load_sweep` run frames as one, keeping what each loader found and skipped (pd.concat drops attrs)."""
    out = pd.concat(list(frames), ignore_index=True)
    out.attrs["found"] = sum(int(f.attrs.get("found", len(f))) for f in frames)
    out.attrs["skipped"] = [skip for f in frames for skip in f.attrs.get("skipped", [])]
    return out


def accounting(runs: pd.DataFrame, used: int) -> str:
    """`found N run dirs, read M, used K` and one clause per skipped run: the line every report states."""
    skipped = skipped_of(runs)
    found = int(runs.attrs.get("found", len(runs) + len(skipped)))
    text = f"found {found} run dir(s), read {found - len(skipped)}, used {used} in the tables"
    if skipped:
        text += "; skipped " + "; ".join(f"{s.run} ({s.reason})" for s in skipped)
    return text + "."


def skipped_of(runs: pd.DataFrame) -> list[Skipped]:
    """The runs a `load_sweep` frame's loader skipped (empty for frames from elsewhere, e.g. W&B)."""
    return list(runs.attrs.get("skipped", []))
