"""Runs into two frames: one row per run (config axes, status) and one row per evaluation (tokens, val_loss).

Sources are run directories on disk or (see wandb_source.py) runs read from the W&B API; both pass
through `run_record`, so everything after loading is the same code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import yaml

from asyncpipe.errors import UserError
from asyncpipe.status import COMPLETED
from asyncpipe.report.groups import flatten
from asyncpipe.track.files import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, parse_metrics_lines
from asyncpipe.track.provenance import PROVENANCE_FILE

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
RUN_COLUMNS = ["run", "path", *AXES, "variant", "variant_named", "sweep", "status", "final_tokens", "summary_val_loss",
               "note", "config", "train", "code"]
CURVE_COLUMNS = ["run", "tokens", "val_loss"]
MANIFEST = "sweep.json"
RETIRED = ".retired"  # failed attempts a sweep moved aside (--retry-failed): not runs of the sweep


def lookup(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


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
    row: dict[str, Any] = {"run": name, "path": path, "note": note, "sweep": ""}
    for column, dotted in AXES.items():
        row[column] = lookup(config, dotted)
    if row["compensation"] == "ef":  # compensation=ef is the EF of the *_ef optimizer presets
        row["ef"], row["ef_lam"] = True, lookup(config, "compensation.ef.lam")
    row["ef"] = bool(row["ef"])
    row["delay"] = int(row["delay"] or 0)
    named = lookup(config, "run.variant")
    row["variant_named"] = named is not None
    row["variant"] = str(named) if named is not None else variant_label(
        row["delay"], row["ef"], row["ef_lam"], row["delay_profile"], row["stages"], row["compensation"]
    )
    row["config"] = flatten(config)
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
    return row, curve


def frames(records: list[tuple[dict, list[dict]]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    runs = pd.DataFrame([r for r, _ in records], columns=RUN_COLUMNS)
    curves = pd.DataFrame([c for _, cs in records for c in cs], columns=CURVE_COLUMNS)
    return runs, curves.astype({"tokens": "int64", "val_loss": "float64"})


def find_run_dirs(root: Path, exclude: Path | None = None) -> list[Path]:
    """Directories under `root` holding a config.yaml, outermost only (checkpoint copies inside a run are not runs)."""
    found: list[Path] = []
    for cfg in sorted(root.rglob(CONFIG_FILE)):
        run = cfg.parent
        if "wandb" in run.relative_to(root).parts or RETIRED in run.relative_to(root).parts:
            continue
        if exclude is not None and (run == exclude or exclude in run.parents):
            continue
        if any(prev == run or prev in run.parents for prev in found):
            continue
        found.append(run)
    return found


def load_run_dir(run: Path, name: str) -> tuple[dict, list[dict]]:
    try:
        config = yaml.safe_load((run / CONFIG_FILE).read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{run / CONFIG_FILE} is not valid YAML ({type(exc).__name__}); fix or remove that run") from None
    summary = None
    if (run / SUMMARY_FILE).exists():
        try:
            summary = json.loads((run / SUMMARY_FILE).read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            summary = None  # a torn summary means the run did not finish cleanly: count it as unfinished
    metrics, note = [], ""
    if (run / METRICS_FILE).exists():
        text = (run / METRICS_FILE).read_text(encoding="utf-8")
        metrics = parse_metrics_lines(text, str(run / METRICS_FILE))
        if text.strip() and not text.endswith("\n") and len(metrics) < len([x for x in text.split("\n") if x.strip()]):
            note = f"last line of {METRICS_FILE} is cut off (a crash mid-write): ignored, the {len(metrics)} lines before it are used"
    row, curve = run_record(name, str(run), config, summary, metrics, note)
    row["code"] = code_of(run)
    return row, curve


def code_of(run: Path) -> str:
    """The code a run came from, from its provenance.json: `commit[ (dirty)]; package versions`, or "unrecorded"."""
    try:
        prov = json.loads((run / PROVENANCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unrecorded"
    git = prov.get("git") or {}
    commit = (git.get("commit") or "no git")[:10] + (" (dirty)" if git.get("dirty") else "")
    versions = ", ".join(f"{k} {v}" for k, v in (prov.get("versions") or {}).items() if v and k != "asyncpipe")
    return f"{commit}; asyncpipe {(prov.get('versions') or {}).get('asyncpipe')}; {versions}"


def named_variants(root: Path) -> list[str]:
    """The variant names of the sweep manifests under `root` (itself included), in file order. The first is the
    gaps' reference: a folder holding several sweeps puts `sync` first when one names it (else the reference
    would be whichever sweep's first variant sorts first)."""
    names: list[str] = []
    manifests = sorted(root.rglob(MANIFEST))
    for path in manifests:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        names.extend(v for v in (data.get("variants") or {}) if v not in names)
    if len(manifests) > 1 and "sync" in names:
        names.remove("sync")
        names.insert(0, "sync")
    return names


def read_manifest(sweep_dir: Path) -> dict | None:
    """The sweep.json of a sweep dir, or None."""
    try:
        data = json.loads((Path(sweep_dir) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def sweep_label(sweep_dir: Path) -> str:
    """A sweep's name: its manifest's `name`, else the directory's name."""
    name = (read_manifest(sweep_dir) or {}).get("name")
    return str(name) if name else Path(sweep_dir).resolve().name


def load_sweep(sweep_dir: Path, exclude: Path | None = None, label: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Frames for every run dir under `sweep_dir` (which may itself be a single run dir). With a `label` (several
    sweeps in one report) run names and columns are prefixed `label/` and `label:`."""
    if not sweep_dir.is_dir():
        raise UserError(f"{sweep_dir} is not a directory; pass a sweep directory (DIR/NAME) or a run directory")
    runs = find_run_dirs(sweep_dir, exclude)
    if not runs:
        raise UserError(f"no runs found under {sweep_dir} (a run is a directory containing {CONFIG_FILE})")
    records = [load_run_dir(run, str(run.relative_to(sweep_dir)) if run != sweep_dir else run.name) for run in runs]
    if label:
        for row, curve in records:
            row["run"], row["sweep"], row["variant"] = f"{label}/{row['run']}", label, f"{label}:{row['variant']}"
            row["variant_named"] = True  # columns of several sweeps are named by their sweep
            for point in curve:
                point["run"] = row["run"]
    return frames(records)
