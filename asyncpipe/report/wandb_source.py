"""Read a sweep's runs back from the W&B API (config, `tokens`/`val_loss` history, summary status) as report frames."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from asyncpipe.errors import UserError
from asyncpipe.report.build import Report, assemble
from asyncpipe.report.load import frames, run_record
from asyncpipe.status import COMPLETED, FAILED

# W&B run states -> our summary status, for runs whose summary has no `status` (e.g. killed before finish()).
_STATE_STATUS = {"finished": COMPLETED, "crashed": FAILED, "failed": FAILED, "killed": FAILED, "running": None}


def _plain_config(config: dict) -> dict:
    """Nested plain config from W&B's form: values may be wrapped as {"value": x}, keys may be dotted."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if str(key).startswith("_"):
            continue
        if isinstance(value, dict) and set(value) <= {"value", "desc"} and "value" in value:
            value = value["value"]
        if isinstance(value, dict):
            value = _plain_config(value)
        node = out
        *parents, leaf = str(key).split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def frames_from_wandb_runs(runs: Iterable[Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The report frames from W&B public-API runs (anything with .config, .summary, .state, .scan_history)."""
    records = []
    for run in runs:
        if getattr(run, "job_type", None) == "report":  # the group's report run is not a training run
            continue
        config = _plain_config(dict(run.config))
        if "model" not in config:
            continue
        summary = {k: v for k, v in dict(run.summary).items() if not str(k).startswith("_")}
        if "status" not in summary:
            summary["status"] = _STATE_STATUS.get(getattr(run, "state", None), FAILED)
            if summary["status"] is None:
                summary = None
        # Evaluations, then every step's train loss (for the plots); run_record takes what each row holds.
        history = [*run.scan_history(keys=["tokens", "val_loss"]), *run.scan_history(keys=["tokens", "train_loss"])]
        name = getattr(run, "name", None) or run.id
        records.append(run_record(name, getattr(run, "url", "") or "", config, summary, history))
    return frames(records)


def build_report_from_wandb(entity_project: str, group: str, out_dir: Path, api: Any = None) -> Report:
    """The report of W&B group `group` in `entity/project`, written to out_dir (`api` defaults to wandb.Api())."""
    if entity_project.count("/") != 1:
        raise UserError(f"W&B source {entity_project!r} must be ENTITY/PROJECT")
    try:
        if api is None:
            import wandb

            api = wandb.Api(timeout=30)
        runs = list(api.runs(entity_project, filters={"group": group}))
        run_frame, curves = frames_from_wandb_runs(runs)
    except UserError:
        raise
    except Exception as exc:  # network, auth, or a project that does not exist
        raise UserError(f"could not read group {group!r} of {entity_project} from W&B: {exc}") from None
    if run_frame.empty:
        raise UserError(f"no runs found under W&B {entity_project} group {group!r}")
    return assemble(run_frame, curves, f"wandb:{entity_project}/{group}", Path(out_dir))
