"""The numbers a report reads from a `bench pipeline` result file, checked before anything is written: every
count, ratio and time is a finite number in its range (a ratio "fast", 0 or -1 is one line naming the file and
the key, never a ZeroDivisionError or a negative speed-up), and each variant's paired per-round ratios."""

from __future__ import annotations

import math
from typing import Any

from asyncpipe.errors import UserError

COUNTS = ("stages", "micro_batches", "rounds", "steps_per_job", "micro_batch_size", "seq_len", "data_parallel")
POSITIVE = ("ratio_to_1f1b", "tokens_per_s", "step_time_s")  # per variant: finite and > 0
ROUNDS = ("ratio_to_1f1b_per_round", "tokens_per_s_per_round")  # per variant: lists of finite numbers > 0
POSITIVE_OPS = ("ForwardPass", "BackwardPass")  # a stage's forward and backward take time; other ops may take ~0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _refuse(path: str, key: str, value: Any, allowed: str) -> UserError:
    return UserError(
        f"--bench {path}: {key} = {value!r} {allowed} (a `bench pipeline` result file; re-run the "
        "bench or give another file)"
    )


def check(data: dict, path: str) -> None:
    """Refuse the file in one line at its first bad number (see the module docstring)."""
    for key in COUNTS:
        if key in data and not (isinstance(data[key], int) and not isinstance(data[key], bool) and data[key] >= 1):
            raise _refuse(path, key, data[key], "is not a whole number >= 1")
    if "optimizer" in data and not isinstance(data["optimizer"], str):
        raise _refuse(path, "optimizer", data["optimizer"], "is not an optimizer name")
    for name, v in data["variants"].items():
        if not isinstance(v, dict):
            continue
        where = f"variants.{name}"
        for key in POSITIVE:
            if key in v and not (_number(v[key]) and v[key] > 0):
                raise _refuse(path, f"{where}.{key}", v[key], "is not a finite positive number")
        for key in ROUNDS:
            if key not in v:
                continue
            if not isinstance(v[key], list):
                raise _refuse(path, f"{where}.{key}", v[key], "is not a list of finite positive numbers")
            for i, x in enumerate(v[key]):
                if not (_number(x) and x > 0):
                    raise _refuse(path, f"{where}.{key}[{i}]", x, "is not a finite positive number")
        _check_times(v, where, path)


def _check_times(v: dict, where: str, path: str) -> None:
    """The per-stage instruction seconds the cost model calibrates on: finite, >= 0, forward and backward > 0."""
    for key in ("seconds_by_op_per_stage", "seconds_blocked_in_per_stage"):
        stages = v.get(key)
        if stages is None:
            continue
        if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
            raise _refuse(path, f"{where}.{key}", stages, "is not a list of per-stage {instruction: seconds}")
        for i, ops in enumerate(stages):
            for op, t in ops.items():
                low = op in POSITIVE_OPS and key == "seconds_by_op_per_stage"
                if not (_number(t) and (t > 0 if low else t >= 0)):
                    allowed = "is not a finite positive time" if low else "is not a finite time >= 0"
                    raise _refuse(path, f"{where}.{key}[{i}].{op}", t, allowed)


def per_round(variants: dict, measured: dict[str, dict]) -> dict[str, list[float]]:
    """Each measured variant's per-round ratio to the same round's 1F1B: as the file records it, else from its
    tokens/s per round over 1F1B's (files that kept only those); absent where neither is there."""
    out: dict[str, list[float]] = {}
    ref = variants.get("1f1b") if isinstance(variants.get("1f1b"), dict) else {}
    base = ref.get("tokens_per_s_per_round")
    for name, v in measured.items():
        if isinstance(v.get("ratio_to_1f1b_per_round"), list):
            out[name] = [float(x) for x in v["ratio_to_1f1b_per_round"]]
        elif (
            isinstance(v.get("tokens_per_s_per_round"), list)
            and isinstance(base, list)
            and len(base) == len(v["tokens_per_s_per_round"])
        ):
            out[name] = [a / b for a, b in zip(v["tokens_per_s_per_round"], base)]
    return out


def busy(record: dict) -> str:
    """'at load L on N CPUs' when the file's 1-minute load before the bench exceeded its CPUs (other work shared the
    cores: its rounds' spread, and a cost model calibrated on it, carry that), else ''."""
    load, cpus = record.get("load_avg"), record.get("cpu_count")
    if not (isinstance(load, list) and load and _number(load[0]) and _number(cpus) and cpus > 0):
        return ""
    return f"at load {load[0]:.1f} on {cpus} CPUs" if load[0] > cpus else ""


def load_note(record: dict) -> str:
    """'; measured at load L on N CPUs' for a file measured on a busy machine (`busy`), else ''."""
    return f"; measured {busy(record)}" if busy(record) else ""
