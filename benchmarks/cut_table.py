"""Balanced against even stage cuts, measured in one run: the real pipeline engine with per-layer stand-in compute
(`pipeline.standin.profile`, `asyncpipe.standin_costs`: every layer waits its own seconds, model 360m's under the
stated h100_assumed profile, times a scale, so the head waits about four blocks' time) on the tiny model with 360m's
32 blocks (its real ops a few ms, far below the waits), 1F1B and 2BW (and any other schedule asked for) at
``pipeline.cut=even`` and ``balanced`` side by side in the same rounds, at P = 2, 4, 8 and m = 2P, one launch per P.

Each record is set against the cost model (`asyncpipe.timelines.cost.predict` at the record's own cut), calibrated
once, on 1F1B and 2BW at the smallest P at the even cut (`cost_source.from_standin_layers`): every balanced record
and every record at a larger P is predicted out of sample. Printed: per P and schedule, the measured step at each
cut, balanced / even (median of the rounds' step ratios, and their spread), the predicted ratio and the errors.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/cut_table.py                  # measure (~6 min), print
    .venv/bin/python benchmarks/cut_table.py --from-json                                   # re-render the saved JSON

Results: benchmarks/results/cut-standin.json ({"records": [...] (`asyncpipe.bench.standin` records, each with its
``variant`` schedule+cut and ``cut``), "rows", "ratios", "calibration", machine, load, commit}).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
JSON = REPO / "benchmarks" / "results" / "cut-standin.json"
CUTS = ["even", "balanced"]


def overrides(P: int, profile: str, scale: float) -> list[str]:
    """The model and stand-in every job of depth P runs: tiny at 32 blocks, one 16-token sequence per micro-batch."""
    return [
        "model=tiny",
        "model.n_layer=32",
        f"pipeline.stages={P}",
        "train.micro_batch_size=1",
        "train.seq_len=16",
        f"pipeline.standin.profile={profile}",
        f"pipeline.standin.scale={scale}",
    ]


def measure(stages: list[int], schedules: list[str], profile: str, scale: float, steps: int, rounds: int) -> dict:
    from standin_table import _cpu, _sh

    from asyncpipe.bench.standin_run import bench_standin

    out: dict = {
        "profile": profile,
        "scale": scale,
        "steps_per_job": steps,
        "rounds": rounds,
        "records": [],
        "skipped": {},
        "cpu": _cpu(),
        "cpu_count": os.cpu_count(),
        "commit": _sh("git", "rev-parse", "HEAD")[:12],
        "dirty": bool(_sh("git", "status", "--porcelain", "--untracked-files=no")),
        "uptime_before": _sh("uptime"),
    }
    for P in stages:
        res = bench_standin(
            overrides(P, profile, scale),
            [2 * P],
            schedules,
            0.0,
            0.0,
            steps=steps,
            rounds=rounds,
            log=lambda msg: print(msg, file=sys.stderr),
            cuts=CUTS,
        )
        out["records"] += res["records"]
        out["skipped"].update({f"P={P} {k}": v for k, v in res["skipped"].items()})
        print(f"P={P} done: {_sh('uptime')}", file=sys.stderr)
    out["uptime_after"] = _sh("uptime")
    out["measured_at"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return out


def table(res: dict) -> dict:
    """Every record against the cost model calibrated at the smallest P's even cut; balanced / even per P and
    schedule, measured (the median of the rounds' paired step ratios) and predicted."""
    from asyncpipe.config import compose
    from asyncpipe.timelines.cost import predict
    from asyncpipe.timelines.cost_source import from_standin_layers, standin_calibration

    recs = res["records"]
    cal = standin_calibration(recs, cut=CUTS[0])
    P0 = int(cal[0]["stages"])
    cfg = compose([*overrides(P0, res["profile"], res["scale"]), "engine=pipeline"])
    model = from_standin_layers(cal, cfg, JSON.name)
    rows = []
    for r in recs:
        pred = predict(model, r["schedule"], r["stages"], r["micro_batches"], cut=r["cut"]).step_s
        rows.append(
            {
                "P": r["stages"],
                "m": r["micro_batches"],
                "schedule": r["schedule"],
                "cut_name": r["variant"].split("+")[-1],
                "cut": r["cut"],
                "measured_step_s": r["step_time_s"],
                "rounds_s": r["step_time_s_per_round"],
                "predicted_step_s": pred,
                "error": pred / r["step_time_s"] - 1,
                "ideal_step_s": r["ideal_step_s"],
                "calibration": any(r is c for c in cal),
            }
        )
    by = {(x["P"], x["schedule"], x["cut_name"]): x for x in rows}
    ratios = []
    for (P, sched, cut), bal in by.items():
        even = by.get((P, sched, CUTS[0]))
        if cut == CUTS[0] or even is None:
            continue
        per_round = [e / b for e, b in zip(even["rounds_s"], bal["rounds_s"])]
        measured = statistics.median(per_round)
        predicted = even["predicted_step_s"] / bal["predicted_step_s"]
        ratios.append(
            {
                "P": P,
                "schedule": sched,
                "over": f"{cut}/{CUTS[0]}",
                "measured": measured,
                "per_round": per_round,
                "predicted": predicted,
                "error": predicted / measured - 1,
            }
        )
    return {
        "label": model.label,
        "overhead_s": model.overhead_s,
        "p2p_s": model.p2p_s,
        "chunk_s": list(model.chunk_s),
        "block_s": [model.forward[1], model.backward[1]],
        "head_s": [model.forward[-1], model.backward[-1]],
        "rows": rows,
        "ratios": ratios,
    }


def _load(uptime: str) -> str:
    return ",".join(uptime.split("load average:")[-1].strip().split(",")[:2]).replace(" ", "")


def render(res: dict, tab: dict) -> str:
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    lines = [
        f"Measured: {res['measured_at']}, commit {res['commit']}{' (dirty)' if res['dirty'] else ''}, {res['cpu']} "
        f"({res['cpu_count']} cores), load {_load(res['uptime_before'])} before, {_load(res['uptime_after'])} after; "
        f"per-layer stand-in {res['profile']} x {res['scale']:g} (a block {ms(tab['block_s'][0])} / "
        f"{ms(tab['block_s'][1])} ms, the head {ms(tab['head_s'][0])} / {ms(tab['head_s'][1])} ms forward / backward), "
        f"{res['steps_per_job']} steps per job (first and last not timed), {res['rounds']} round(s) "
        "(`benchmarks/cut_table.py`).",
        "",
        "| P | m | schedule | cut | blocks per stage | measured ms | rounds ms | predicted ms | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(tab["rows"], key=lambda r: (r["P"], r["schedule"], CUTS.index(r["cut_name"]))):
        rounds = f"{ms(min(r['rounds_s']))}-{ms(max(r['rounds_s']))}" if len(r["rounds_s"]) > 1 else "-"
        mark = " (calibration)" if r["calibration"] else ""
        lines.append(
            f"| {r['P']} | {r['m']} | {r['schedule']} | {r['cut_name']} | {','.join(map(str, r['cut']))} "
            f"| {ms(r['measured_step_s'])} | {rounds} | {ms(r['predicted_step_s'])} | {r['error']:+.1%}{mark} |"
        )
    lines += ["", "| P | schedule | balanced / even measured (rounds) | predicted | error |", "|---|---|---|---|---|"]
    for x in sorted(tab["ratios"], key=lambda x: (x["P"], x["schedule"])):
        spread = f"{min(x['per_round']):.3f}-{max(x['per_round']):.3f}"
        lines.append(
            f"| {x['P']} | {x['schedule']} | {x['measured']:.3f} ({spread}) | {x['predicted']:.3f} "
            f"| {x['error']:+.1%} |"
        )
    lines += [
        "",
        f"Cost model: {tab['label']}: engine overhead {ms(tab['overhead_s'])} ms per instruction and "
        f"{ms(tab['p2p_s'])} ms per exchange (fitted), {ms(tab['chunk_s'][0])} / {ms(tab['chunk_s'][1])} ms per "
        "forward / backward pass beyond its wait (measured).",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-json", action="store_true", help="re-render benchmarks/results/cut-standin.json")
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--schedules", default="1f1b,2bw")
    ap.add_argument("--profile", default="360m_h100", help="a stand-in profile (conf/standin/)")
    ap.add_argument("--scale", type=float, default=10.0, help="the profile's seconds times this")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=JSON)
    a = ap.parse_args()
    if a.from_json:
        res = json.loads(a.out.read_text())
    else:
        from asyncpipe.track import atomic_write_json

        stages = [int(x) for x in a.stages.split(",")]
        res = measure(stages, a.schedules.split(","), a.profile, a.scale, a.steps, a.rounds)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(a.out, res)  # the measurement first: --from-json redraws it if the table fails
        res["table"] = table(res)
        atomic_write_json(a.out, res)
        print(f"wrote {a.out}", file=sys.stderr)
    print(render(res, res.get("table") or table(res)))


if __name__ == "__main__":
    main()
