"""Log a report to W&B as a `report` run of the sweep's group, with its own config (the sweeps' grids, fixed
overrides and variants, how the report grouped the runs) and its own tags (`report`, `sweep:NAME`), never a
training run's (so filtering the project by optimizer or delay never finds the report run).

W&B's own files go beside the report folder, never inside it: OUT.wandb/ for --out OUT (the default OUT,
DIR/NAME/report, puts them inside the sweep dir, where `asyncpipe sync DIR/NAME` uploads an offline run)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from asyncpipe.report.build import Report

TRACKER_PREFIX = "tracker.wandb."


def report_run_config(report: Report) -> dict:
    """The report run's config: W&B settings from the runs, and what the report compared."""
    flat = report.runs["config"].iloc[0] if len(report.runs) else {}
    wandb = {k.removeprefix(TRACKER_PREFIX): v for k, v in flat.items() if k.startswith(TRACKER_PREFIX)}
    names = [str(m.get("name")) for m in report.sweeps if m.get("name")] or [str(wandb.get("group") or "sweep")]
    wandb["tags"] = ["report", *(f"sweep:{n}" for n in names)]
    wandb.setdefault("group", names[0])
    g = report.grouping
    return {
        "tracker": {"wandb": wandb},
        "report": {
            "source": report.source,
            "sweeps": [
                {k: m.get(k) for k in ("name", "base_overrides", "grid", "variants", "per")} for m in report.sweeps
            ],
            "group_keys": g.group_keys,
            "variant_keys": g.variant_keys,
            "row_keys": g.row_keys,
            "tables": [t.title for t in report.groups],
            "runs": len(report.runs),
            "completed": int((report.runs["status"] == "completed").sum()),
        },
    }


def wandb_dir(out_dir: Path) -> Path:
    """Where a report's W&B run files go: beside the report folder, never inside it."""
    return out_dir.parent / f"{out_dir.name}.wandb"


def log_report_to_wandb(report: Report, cfg_like: Any = None) -> bool:
    """Best effort: log the gap table and plots to a `report` run in the W&B group; True when something was logged,
    and then `report.wandb_message` says what was written (an online run, or an offline run to upload).
    `cfg_like` defaults to `report_run_config(report)`."""
    from asyncpipe.track.wandb_mirror import WandbMirror, config_value

    if report.out_dir is None or not report.files:
        return False
    cfg_like = cfg_like if cfg_like is not None else report_run_config(report)
    group = config_value(cfg_like, "tracker.wandb.group")
    where = wandb_dir(report.out_dir)
    mirror = WandbMirror(cfg_like, where, rank=0, name=f"{group or 'sweep'}-report", job_type="report")
    if not mirror.active:
        return False
    cells = report.cells.astype(object).where(report.cells.notna(), None)
    rows = [[None if isinstance(v, float) and math.isnan(v) else v for v in row] for row in cells.values.tolist()]
    mirror.log_table("loss_gaps", list(map(str, cells.columns)), rows)
    mirror.log_images({name.removesuffix(".png"): path for name, path in report.files.items() if name.endswith(".png")})
    mirror.log_files([p for name, p in report.files.items() if not name.endswith(".png")])
    ok = mirror.active
    mirror.finish()
    if ok:
        report.wandb_message = (
            f"wrote an offline W&B run of the report to {where} (upload: asyncpipe sync {where})"
            if mirror.mode == "offline"
            else f"logged the report to W&B (run files: {where})"
        )
    return ok
