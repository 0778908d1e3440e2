"""2BW's throughput over the synchronous schedules at a pipeline depth P and m micro-batches: measured, from
`asyncpipe bench pipeline` result files (JSON; `stages`, `micro_batches`, `variants.NAME.ratio_to_1f1b`), modelled
(the cost model, `asyncpipe.timelines.cost`, calibrated on such a file's per-instruction stage timings at P = 2),
or the analytic ideal (m+P-1)/m (a flushed 1F1B batch lasts m+P-1 slots, a 2BW batch m) when neither exists.

Rule: a file measured at this P and m; else the file at this P with the nearest m (labelled with its m); else, at
a depth no file covers, the cost model's 2BW (2BW + EF) over 1F1B at this P and m, calibrated on a P = 2 file's
1F1B (labelled "modelled" with that file), and its strongest sync schedule the faster of the model's 1F1B and
DualPipeV (where it can run: m >= 2P and 2P blocks; named "DualPipeV (modelled)"); else the ideal. Measured, the
strongest sync schedule is the fastest of the measured synchronous variants in that file: DeepSpeed's
1F1B and DualPipeV, and PyTorch's own schedules (``pt_*``, `torch.distributed.pipelining`) where the file has them
(a variant's ``synchronous`` flag says so; files written before it carry none: then 1F1B and DualPipeV).

Optimizer: a bench file times one optimizer's step (its ``optimizer``). A column's throughput comes from the files
that timed its own optimizer (measured, or the model calibrated on them); only where no file did, from the others,
and its source says so ("muon: no bench file timed it, adamw's step"). Each figure carries its error
(`asyncpipe.report.spread`): the paired rounds' spread where measured, the model's validated band where modelled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from asyncpipe.errors import UserError
from asyncpipe.report.bench_file import busy, check, load_note, per_round
from asyncpipe.report.spread import Spread, exact, modelled_spread, paired_over, rounds_spread
from asyncpipe.schedules import get as schedule_named

GRID = [(P, k * P) for P in (2, 4, 8) for k in (1, 2, 4)]  # P = 2, 4, 8 and m = P, 2P, 4P


def sync_schedules() -> list[str]:
    """The synchronous variants of a bench file without ``synchronous`` flags: the declared schedules that flush
    every batch (`asyncpipe.schedules`, torch-free)."""
    from asyncpipe import schedules

    return [s.name for s in schedules.schedules() if s.flush]


def ideal_ratio(stages: int, micro_batches: int) -> float:
    return (micro_batches + stages - 1) / micro_batches


@dataclass(frozen=True)
class Throughput:
    stages: int
    micro_batches: int
    vs_1f1b: float  # 2BW (or 2BW + EF) tokens/s over 1F1B's
    vs_best_sync: float | None  # over the fastest measured (or modelled) sync schedule; None for the ideal
    best_sync: str  # its name
    source: str  # "measured, 2bw (FILE)", "measured at m=M, 2bw_ef (FILE)", "modelled, 2bw (...)", "ideal (m+P-1)/m"
    best_sync_label: str = ""  # what it runs, as the bench file names it ("PyTorch ScheduleZBVZeroBubble"), or
    # "DualPipeV (modelled)" / "1F1B (modelled)"
    spread: Spread | None = None  # vs_1f1b's interval (None: exact)
    best_spread: Spread | None = None  # vs_best_sync's interval
    note: str = ""  # the bench files used timed another optimizer's step than the column's: said so

    def error(self, best: bool = False) -> Spread:
        """The interval of vs_1f1b (of vs_best_sync when `best`), an exact one for the analytic ideal."""
        own = self.best_spread if best else self.spread
        value = self.vs_best_sync if best and self.vs_best_sync is not None else self.vs_1f1b
        return own if own is not None else exact(value, self.kind)

    @property
    def kind(self) -> str:
        """The label every figure drawn from it carries: `measured`, `measured at m=M`, `modelled` or `ideal (m+P-1)/m`."""
        return self.source.split(",")[0]


def load_bench(paths: Sequence[Path]) -> list[dict]:
    """The bench pipeline results in `paths`, each checked for the fields the report reads (one-line errors)."""
    out = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise UserError(f"--bench {path}: cannot read it ({exc.strerror or exc})") from None
        except ValueError:
            raise UserError(f"--bench {path}: not JSON (give a result file of `asyncpipe bench pipeline`)") from None
        variants = data.get("variants") if isinstance(data, dict) else None
        if (
            not isinstance(variants, dict)
            or "2bw" not in variants
            or not all(isinstance(data.get(k), int) for k in ("stages", "micro_batches"))
        ):
            raise UserError(
                f"--bench {path}: not a `bench pipeline` result (needs stages, micro_batches and a "
                "measured 2bw variant)"
            )
        check(data, str(path))
        measured = {k: v for k, v in variants.items() if isinstance(v, dict) and "ratio_to_1f1b" in v}
        flagged = any("synchronous" in v for v in measured.values())
        sync = [
            k
            for k, v in measured.items()
            if "+" not in k  # eager rows: the 2BW ratios read are eager too
            and (v.get("synchronous") is True if flagged else k in sync_schedules())
        ]
        out.append(
            {
                "path": str(path),
                "P": data["stages"],
                "m": data["micro_batches"],
                "sync": sync,
                "record": data,
                "optimizer": data.get("optimizer"),
                "rounds": per_round(variants, measured),
                "labels": {k: str(v.get("schedule", k)) for k, v in measured.items()},
                "ratios": {k: float(v["ratio_to_1f1b"]) for k, v in measured.items()},
            }
        )
    return out


def for_optimizer(bench: list[dict], optimizer: str | None) -> tuple[list[dict], str]:
    """The bench files that timed `optimizer`'s step (a record's `adamw@r1` is adamw), and a note when none did and
    the others stand in; every file when `optimizer` is None."""
    if optimizer is None or not bench:
        return bench, ""
    name = str(optimizer).split("@")[0]
    own = [b for b in bench if b.get("optimizer") == name]
    if own:
        return own, ""
    timed = sorted({str(b["optimizer"]) for b in bench if b.get("optimizer")})
    if not timed:
        return bench, f"{name}: the bench files do not record which optimizer's step they timed"
    return bench, f"{name}: no bench file timed it, {' / '.join(timed)}'s step"


def throughput(
    stages: int,
    micro_batches: int,
    bench: list[dict],
    ef: bool = False,
    schedule: str = "2bw",
    optimizer: str | None = None,
) -> Throughput:
    """The asynchronous ``schedule``'s (2BW's, or PACI's; + EF's when `ef` and measured) throughput ratio at (P, m),
    from the bench files of `optimizer` (`for_optimizer`); see the module docstring. A bench file without that
    schedule does not count as measuring it."""
    bench, note = for_optimizer(bench, optimizer)
    same_p = [b for b in bench if b["P"] == stages and schedule in b["ratios"]]
    if same_p:
        b = min(same_p, key=lambda b: (abs(b["m"] - micro_batches), -b["m"]))
        name = f"{schedule}_ef" if ef and f"{schedule}_ef" in b["ratios"] else schedule
        ratio = b["ratios"][name]
        syncs = {k: b["ratios"][k] for k in b.get("sync", sync_schedules()) if k in b["ratios"]}
        best = max(syncs, key=syncs.get) if syncs else "1f1b"
        at = "" if b["m"] == micro_batches else f" at m={b['m']}"
        where = f"measured{at}, {name} ({Path(b['path']).name}){load_note(b.get('record', {}))}" + (
            f"; {note}" if note else ""
        )
        rounds = b.get("rounds", {})
        over_best = ratio / syncs[best] if syncs else None
        best_rounds = paired_over(rounds.get(name), rounds.get(best)) if best != "1f1b" else rounds.get(name)
        spread_best = rounds_spread(best_rounds, over_best, f"measured{at}") if over_best else None
        return Throughput(
            stages,
            micro_batches,
            ratio,
            over_best,
            best,
            where,
            b.get("labels", {}).get(best, best),
            rounds_spread(rounds.get(name), ratio, f"measured{at}"),
            spread_best,
            note,
        )
    modelled = modelled_ratio(stages, micro_batches, bench, ef, schedule)
    if modelled is not None:
        value, where, sync = modelled
        best, over_1f1b = sync if sync is not None and sync[1] > 1.0 else ("1f1b", 1.0)
        where += f"; {note}" if note else ""
        label = f"{schedule_named(best).label} (modelled)"
        spreads = [modelled_spread(value, "1f1b"), modelled_spread(value / over_1f1b, best)]
        loaded = busy(calibration(bench)["record"])  # type: ignore[index]
        if loaded:  # the band was validated on calibrations measured on a quiet machine: it says nothing here
            spreads = [Spread(math.nan, math.nan, f"modelled, no validated band (calibrated {loaded})")] * 2
        return Throughput(stages, micro_batches, value, value / over_1f1b, best, where, label, *spreads, note)
    return Throughput(stages, micro_batches, ideal_ratio(stages, micro_batches), None, "1f1b", "ideal (m+P-1)/m")


_MODELS: dict[str, object] = {}  # calibrations already made, by file
# Ratios already modelled, by (file, schedule, P, m, ef): a report asks for each cell's several times (its tables,
# takeaways and wall-clock columns), and each answer replays whole timelines (the v5 ttt report: 81 asks, 21 distinct).
_RATIOS: dict[tuple, tuple[float, tuple[str, float] | None] | None] = {}


def modelled_ratio(
    stages: int, micro_batches: int, bench: list[dict], ef: bool = False, schedule: str = "2bw"
) -> tuple[float, str, tuple[str, float] | None] | None:
    """(``schedule``'s (+ EF's) modelled throughput over 1F1B, its source label, ("dualpipev", DualPipeV's modelled
    throughput over 1F1B) or None where the model cannot run DualPipeV here: m < 2P or fewer than 2P blocks), from
    the model calibrated on `calibration(bench)` (most micro-batches: the most work per timed instruction); None
    when no file has 1F1B's per-instruction timings or the model cannot run this P (too few blocks)."""
    b = calibration(bench)
    if micro_batches < stages or b is None:
        return None
    rec = b["record"]
    key = (b["path"], schedule, stages, micro_batches, ef)
    if key not in _RATIOS:
        _RATIOS[key] = _model(b, rec, schedule, stages, micro_batches, ef)
    if _RATIOS[key] is None:
        return None
    value, sync = _RATIOS[key]
    name = f"{schedule}_ef" if ef else schedule
    return (
        value,
        (
            f"modelled, {name} (cost model calibrated on {Path(b['path']).name}: 1F1B at P=2, "
            f"m={b['m']}, {rec.get('model', '?')}{load_note(rec)})"
        ),
        sync,
    )


def calibration(bench: list[dict]) -> dict | None:
    """The bench file the cost model is calibrated on: at P = 2 with 1F1B's per-instruction timings, measured at a
    load within its CPUs where one is (the model's validation was), then the most micro-batches."""
    usable = [
        b
        for b in bench
        if b["P"] == 2
        and isinstance((b.get("record") or {}).get("variants", {}).get("1f1b"), dict)
        and "seconds_by_op_per_stage" in b["record"]["variants"]["1f1b"]
    ]
    return min(usable, key=lambda b: (bool(load_note(b["record"])), -b["m"]), default=None)


def _model(
    b: dict, rec: dict, schedule: str, stages: int, micro_batches: int, ef: bool
) -> tuple[float, tuple[str, float] | None] | None:
    """``schedule``'s (+ EF's) ratio over 1F1B and DualPipeV's (or None where the model cannot run it) under the
    cost model calibrated on `b`; None where the model cannot run ``schedule`` at this P and m."""
    from asyncpipe.errors import UserError as Refused
    from asyncpipe.timelines.cost import ratio
    from asyncpipe.timelines.cost_source import from_bench

    try:
        model = _MODELS.get(b["path"]) or from_bench(rec, b["path"])
        _MODELS[b["path"]] = model
        value = ratio(model, schedule, "1f1b", stages, micro_batches, ef=ef)  # type: ignore[arg-type]
    except Refused:
        return None
    try:
        sync: tuple[str, float] | None = ("dualpipev", ratio(model, "dualpipev", "1f1b", stages, micro_batches))  # type: ignore[arg-type]
    except Refused:  # m < 2P, or fewer blocks than DualPipeV's 2P chunks
        sync = None
    return value, sync
