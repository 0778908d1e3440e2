"""Reading a traced run's `trace-rank{r}.json` files (`pipeline.trace=true`) into the `Timeline` that
`asyncpipe schedule --trace` draws (`trace_timeline`).

A run dir is untrusted input (copied from a cluster, a tarball, a collaborator): each trace file is read as a
regular file of bounded size, must hold a non-empty JSON list of op records with the fields the engine writes
(stage, op, micro_batch, start, end as finite numbers with end >= start), and the stages of replica 0 must be
0..P-1 once each, P matching the run's config.yaml when it names one. Anything else is one `UserError`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from asyncpipe.config.keys import lookup
from asyncpipe.errors import UserError
from asyncpipe.track.files import CONFIG_FILE, UnreadableFile, load_untrusted_yaml, read_untrusted

MAX_TRACE_FILE = 256 << 20


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
    path = Path(run_dir) / CONFIG_FILE
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
                raise UserError(
                    f"{run_dir}: two trace files hold stage {stage} of replica 0 (traces of two runs "
                    "mixed in one dir?); keep one run's trace-rank*.json"
                )
            per_stage[stage] = ops
    if not per_stage:
        raise UserError(f"{run_dir}: no trace of replica 0; record one with pipeline.trace=true")
    pipeline = config.get("pipeline") if isinstance(config.get("pipeline"), dict) else {}
    stages = pipeline.get("stages")
    want = stages if isinstance(stages, int) and not isinstance(stages, bool) and stages > 0 else max(per_stage) + 1
    if sorted(per_stage) != list(range(want)):
        raise UserError(
            f"{run_dir}: the traces hold stages {sorted(per_stage)} but the run has {want} stage(s) "
            "(a trace missing, or another run's); re-record with pipeline.trace=true"
        )
    return config, per_stage


def eval_forwards(config: dict) -> tuple[int, int, int, int]:
    """(eval forwards per evaluation, eval_every, steps, micro_batches) from a run's config.yaml (as a dict); a key
    the record lacks takes its schema default (`config.describe.schema_defaults`)."""
    from asyncpipe.config.describe import schema_defaults

    defaults = schema_defaults()

    def get(key: str) -> int:
        value = lookup(config, key)
        return int(defaults[key] if value is None else value)

    n, d = get("train.eval_batches"), get("pipeline.data_parallel")
    if d < 1:
        raise ValueError(f"pipeline.data_parallel is {d}")
    per_eval = n // d if n % d == 0 else n  # each replica's share (engines.pipeline.adapter)
    return per_eval, get("train.eval_every"), get("train.steps"), get("train.micro_batches")


def label_ops(ops: list[dict], config: dict) -> list[tuple[str, Optional[int], float, float]]:
    """(kind, micro-batch, start, end) of one rank's compute ops; evaluation forwards become ``eval``.

    2BW's training instructions carry their micro-batch, DeepSpeed's (1F1B, evaluation) only a buffer, so
    1F1B ops are numbered by walking the run's known order: one evaluation, then per step m forwards and m
    backwards up to its optimizer step, and an evaluation after every eval_every-th and the last step."""
    per_eval, every, steps, m = eval_forwards(config)
    by_number = all(o["micro_batch"] is None for o in ops if o["op"] in ("ForwardPass", "BackwardPass"))
    out: list[tuple[str, Optional[int], float, float]] = []
    evals_left, step, nf, nb = per_eval, 0, 0, 0
    for o in ops:
        name, k = o["op"], o["micro_batch"]
        if name == "ForwardPass":
            if (by_number and evals_left > 0) or (not by_number and k is None):
                evals_left -= 1
                out.append(("eval", None, o["start"], o["end"]))
                continue
            out.append(("forward", nf if by_number else k, o["start"], o["end"]))
            nf += 1
        elif name == "BackwardPass":
            out.append(("backward", nb if by_number else k, o["start"], o["end"]))
            nb += 1
        elif name == "OptimizerStep":
            out.append(("step", None, o["start"], o["end"]))
            step += 1
            if by_number and (step % every == 0 or step == steps):
                evals_left = per_eval
    return out


def trace_timeline(run_dir: Path) -> Any:
    """A `Timeline` of a real run from its ``trace-rank{r}.json`` files (replica 0 of every stage), times in
    seconds from the first recorded instruction; waiting on communication shows as idle."""
    from asyncpipe.timelines.timeline import Event, Timeline

    files = sorted(Path(run_dir).glob("trace-rank*.json"))
    if not files:
        raise UserError(f"no trace-rank*.json in {run_dir}; run with pipeline.trace=true to record one")
    config, per_stage = read_trace_dir(Path(run_dir), files)  # untrusted files: checked, one line if not a trace
    t0 = min(o["start"] for ops in per_stage.values() for o in ops)
    events, busy = [], [0.0] * (max(per_stage) + 1)
    try:
        labelled = {s: label_ops(ops, config) for s, ops in per_stage.items()}
    except (TypeError, ValueError, AttributeError) as exc:  # config.yaml settings of the wrong type
        raise UserError(f"{run_dir}/{CONFIG_FILE} cannot label the trace ({exc})") from None
    for s, ops in sorted(per_stage.items()):
        for kind, k, a, e in labelled[s]:
            events.append(Event(s, kind, k, a - t0, e - t0))
            busy[s] += e - a
    makespan = max(ev.end for ev in events) if events else 0.0
    return Timeline(events, makespan, busy)
