"""Reading a traced run's `trace-rank{r}.json` files (`pipeline.trace=true`) for `asyncpipe schedule --trace`.

A run dir is untrusted input (copied from a cluster, a tarball, a collaborator): each trace file is read as a
regular file of bounded size, must hold a non-empty JSON list of op records with the fields the engine writes
(stage, op, micro_batch, start, end as finite numbers with end >= start), and the stages of replica 0 must be
0..P-1 once each, P matching the run's config.yaml when it names one. Anything else is one `UserError`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from asyncpipe.errors import UserError
from asyncpipe.track.files import UnreadableFile, load_untrusted_yaml, read_untrusted

MAX_TRACE_FILE = 256 << 20
OPS = ("ForwardPass", "BackwardPass", "OptimizerStep")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bad(path: Path, why: str) -> UserError:
    return UserError(f"{path} is not a trace asyncpipe wrote ({why}); record one with pipeline.trace=true")


def read_trace(path: Path) -> list[dict]:
    """One rank's op records, checked (see the module docstring)."""
    try:
        ops = json.loads(read_untrusted(path, MAX_TRACE_FILE))
    except UnreadableFile as exc:
        raise _bad(path, str(exc).removeprefix(str(path)).strip()) from None
    except (ValueError, RecursionError):
        raise _bad(path, "not valid JSON") from None
    if not isinstance(ops, list) or not ops:
        raise _bad(path, "empty" if ops == [] else f"a JSON {type(ops).__name__}, not a list of ops")
    for i, o in enumerate(ops):
        if not isinstance(o, dict):
            raise _bad(path, f"entry {i} is not an object")
        if not isinstance(o.get("stage"), int) or isinstance(o.get("stage"), bool) or o["stage"] < 0:
            raise _bad(path, f"entry {i} has no stage number")
        if o.get("stage") != ops[0]["stage"] or o.get("replica", 0) != ops[0].get("replica", 0):
            raise _bad(path, f"entry {i} is another rank's (stage {o.get('stage')}, not {ops[0]['stage']})")
        if not isinstance(o.get("op"), str) or not _number(o.get("start")) or not _number(o.get("end")):
            raise _bad(path, f"entry {i} lacks an op name or finite start/end times")
        if o["end"] < o["start"]:
            raise _bad(path, f"entry {i} ends before it starts")
        k = o.get("micro_batch")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)):
            raise _bad(path, f"entry {i} has micro_batch {k!r}")
        o.setdefault("micro_batch", None)
    return ops


def read_run_config(run_dir: Path) -> dict:
    """The run's config.yaml as a mapping ({} when there is none)."""
    path = Path(run_dir) / "config.yaml"
    try:
        config, _ = load_untrusted_yaml(read_untrusted(path), str(path))
    except FileNotFoundError:
        return {}
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a mapping of settings; the trace cannot be labelled")
    return config


def read_trace_dir(run_dir: Path, files: list[Path]) -> tuple[dict, dict[int, list[dict]]]:
    """(config, replica 0's ops per stage) of a traced run; the stages must be 0..P-1, as its config says."""
    config = read_run_config(run_dir)
    per_stage: dict[int, list[dict]] = {}
    for f in files:
        ops = read_trace(f)
        if ops[0].get("replica", 0) == 0:
            stage = ops[0]["stage"]
            if stage in per_stage:
                raise UserError(f"{run_dir}: two trace files hold stage {stage} of replica 0 (traces of two runs "
                                "mixed in one dir?); keep one run's trace-rank*.json")  # fmt: skip
            per_stage[stage] = ops
    if not per_stage:
        raise UserError(f"{run_dir}: no trace of replica 0; record one with pipeline.trace=true")
    pipeline = config.get("pipeline") if isinstance(config.get("pipeline"), dict) else {}
    stages = pipeline.get("stages")
    want = stages if isinstance(stages, int) and not isinstance(stages, bool) and stages > 0 else max(per_stage) + 1
    if sorted(per_stage) != list(range(want)):
        raise UserError(f"{run_dir}: the traces hold stages {sorted(per_stage)} but the run has {want} stage(s) "
                        "(a trace missing, or another run's); re-record with pipeline.trace=true")  # fmt: skip
    return config, per_stage
