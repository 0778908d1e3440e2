"""The cost model checked against the real engine, in one command: `asyncpipe bench pipeline` with real compute
(model small, P = 2, m = 2, 4, 8; 1F1B, DualPipeV, 2BW, 2BW + EF, PACI in one launch per m), then every variant's
measured step time against the cost model's prediction (`asyncpipe.timelines.cost`), calibrated once on 1F1B at
m = 4 (`cost_source.from_bench`), and a replay of the variant's own stage costs (from its last job, the one whose
per-instruction timings the file keeps) against that job's step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cost_table.py --measure --update-doc  # measure, then rewrite the doc
    .venv/bin/python benchmarks/cost_table.py --update-doc                               # re-compute from the saved files
    .venv/bin/python benchmarks/cost_table.py --standin RUN.json --update-doc            # + a stand-in run's records

The stand-in rows (`benchmarks/standin_table.py`'s JSON, saved as benchmarks/results/cost-standin.json): every record
predicted by `cost_source.from_standin`, calibrated on two records (1F1B and 2BW at P = 2, the largest m: an
overhead per instruction and a latency per exchange), beside the schedule's ideal step (free optimizer step and
messages) the record carries.

Raw results: benchmarks/results/cost-{model}-P{P}-m{m}.json; the table: benchmarks/results/cost-table.json, rendered
into docs/performance.md between its cost-table markers (tests/test_cost_model.py re-renders and compares).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TABLE = RESULTS / "cost-table.json"
STANDIN = RESULTS / "cost-standin.json"
STANDIN_START, STANDIN_END = "<!-- cost-standin-table:start -->", "<!-- cost-standin-table:end -->"
DOC = REPO / "docs" / "performance.md"
START, END = "<!-- cost-table:start -->", "<!-- cost-table:end -->"
VARIANTS = ["1f1b", "dualpipev", "2bw", "2bw_ef", "paci", "paci-recompute"]
MS = [2, 4, 8]
CALIBRATION_M = 4


def raw_path(model: str, P: int, m: int) -> Path:
    return RESULTS / f"cost-{model}-P{P}-m{m}.json"


def measure(model: str, P: int, rounds: int, steps: int) -> None:
    from asyncpipe.bench.pipeline import bench_pipeline, format_result
    from asyncpipe.track import atomic_write_json

    for m in MS:
        # eval_batches >= 2P: DualPipeV's own check (its evaluation runs two chunks per rank too)
        res = bench_pipeline([f"model={model}", f"pipeline.stages={P}", f"train.micro_batches={m}",
                              f"train.eval_batches={2 * P}"], rounds=rounds, steps=steps, variants=VARIANTS,
                             log=lambda msg: print(msg, file=sys.stderr))  # fmt: skip
        print(format_result(res), file=sys.stderr)
        atomic_write_json(raw_path(model, P, m), res)


def _schedule(variant: str) -> tuple[str, bool]:
    return ("2bw", True) if variant == "2bw_ef" else (variant, False)


def rows(model: str, P: int) -> dict:
    """Every measured variant of every m: measured and predicted step time and ratio to 1F1B, and the errors."""
    from asyncpipe.timelines.cost import predict
    from asyncpipe.timelines.cost_source import from_bench

    cal_path = raw_path(model, P, CALIBRATION_M)
    cal = from_bench(json.loads(cal_path.read_text()), cal_path.name)
    out = []
    for m in MS:
        path = raw_path(model, P, m)
        rec = json.loads(path.read_text())
        ref = predict(cal, "1f1b", P, m).step_s
        for name in [n for n in VARIANTS if n in rec["variants"]]:
            v = rec["variants"][name]
            sched, ef = _schedule(name)
            pred = predict(cal, sched, P, m, ef=ef).step_s
            own = from_bench(rec, path.name, variant=name, fit=False)
            replay = predict(own.with_overhead(cal.overhead_s), sched, P, m).step_s
            measured = float(v["step_time_s"])
            last = rec["tokens_per_step"] / v["tokens_per_s_per_round"][-1]  # the job whose stage timings are saved
            ratio = statistics.median(v["ratio_to_1f1b_per_round"])
            out.append({
                "m": m, "variant": name, "measured_step_s": measured, "predicted_step_s": pred,
                "error": pred / measured - 1, "measured_ratio": ratio, "predicted_ratio": ref / pred,
                "ratio_error": (ref / pred) / ratio - 1, "own_cost_step_s": replay, "last_job_step_s": last, "own_cost_error": replay / last - 1,
                "load": [rec["load_avg"][0], rec["load_avg_after"][0]], "rounds": rec["rounds"],
            })  # fmt: skip
    return {"model": model, "stages": P, "calibration": {
        "file": cal_path.name, "label": cal.label, "forward_s": cal.forward, "backward_s": cal.backward,
        "step_s_per_param": cal.step_per_param, "ef_s_per_param": cal.ef_per_param, "overhead_s": cal.overhead_s,
        "notes": list(cal.notes)}, "rows": out}  # fmt: skip


def standin_rows(run: dict, name: str) -> dict:
    """Every stand-in record against the cost model calibrated on 1F1B and 2BW at P = 2 (the largest m)."""
    from asyncpipe.timelines.cost import predict
    from asyncpipe.timelines.cost_source import from_standin, model_at, standin_calibration

    recs = run["records"]
    cal = standin_calibration(recs)
    fitted = from_standin(cal, 2, name)
    out = []
    for r in recs:
        model = model_at(fitted, r["stages"])
        pred = predict(model, r["schedule"], r["stages"], r["micro_batches"]).step_s
        out.append({"P": r["stages"], "m": r["micro_batches"], "schedule": r["schedule"],
                    "measured_step_s": r["step_time_s"], "rounds_s": r.get("step_time_s_per_round", []), "predicted_step_s": pred, "error": pred / r["step_time_s"] - 1,
                    "ideal_step_s": r["ideal_step_s"], "ideal_error": r["ideal_step_s"] / r["step_time_s"] - 1})  # fmt: skip
    model = fitted
    load = [float(run[k].split("load average:")[-1].split(",")[0]) for k in ("uptime_before", "uptime_after")]
    return {"label": model.label, "overhead_s": model.overhead_s, "p2p_s": model.p2p_s, "step_s": model.step_per_param * 2,
            "forward_s": run["forward_s"], "backward_s": run["backward_s"], "load": load,
            "provenance": f"commit {run.get('commit', '?')}{' (dirty)' if run.get('dirty') else ''}, "
                          f"measured {run.get('measured_at', '?')}", "rows": out}  # fmt: skip


def render_standin(st: dict) -> str:
    lines = ["| P | m | schedule | measured step ms | rounds ms | predicted ms | error | ideal ms | ideal's error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in st["rows"]:
        rounds = r.get("rounds_s") or []
        spread = f"{min(rounds) * 1e3:.1f}-{max(rounds) * 1e3:.1f}" if len(rounds) > 1 else "-"
        lines.append(f"| {r['P']} | {r['m']} | {r['schedule']} | {r['measured_step_s'] * 1e3:.1f} | {spread} "
                     f"| {r['predicted_step_s'] * 1e3:.1f} | {r['error']:+.1%} | {r['ideal_step_s'] * 1e3:.1f} "
                     f"| {r['ideal_error']:+.1%} |")  # fmt: skip
    within = sum(abs(r["error"]) <= 0.05 for r in st["rows"])
    ideal_within = sum(abs(r["ideal_error"]) <= 0.05 for r in st["rows"])
    worst = max(st["rows"], key=lambda r: abs(r["error"]))
    lines.append(
        f"\nStand-in F = {st['forward_s'] * 1e3:.0f} ms, B = {st['backward_s'] * 1e3:.0f} ms per stage and micro-batch; "
        f"calibration: {st['label']}: optimizer step {st['step_s'] * 1e3:.1f} ms per stage, engine overhead "
        f"{st['overhead_s'] * 1e3:.2f} ms per instruction and {st.get('p2p_s', 0.0) * 1e3:.2f} ms per exchange (both "
        f"fitted on those two records). Within 5 %: {within} of "
        f"{len(st['rows'])} (the ideal: {ideal_within}); worst {worst['schedule']} at P = {worst['P']}, m = {worst['m']} "
        f"({worst['error']:+.1%}). Load {st['load'][0]:.1f} → {st['load'][1]:.1f} on 2 cores; {st['provenance']}."
    )  # fmt: skip
    return "\n".join(lines)


def render(table: dict) -> str:
    """The doc's markdown table from cost-table.json (a pure function of it: the test re-renders it)."""
    cal = table["calibration"]
    lines = ["| m | schedule | measured step ms | predicted ms | error | x1F1B measured (median of rounds) "
             "| x1F1B predicted | error | own-cost replay ms (its job's step) | error | load 1 min before → after |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in table["rows"]:
        lines.append(
            f"| {r['m']} | {r['variant']} | {r['measured_step_s'] * 1e3:.0f} | {r['predicted_step_s'] * 1e3:.0f} "
            f"| {r['error']:+.1%} | {r['measured_ratio']:.3f} | {r['predicted_ratio']:.3f} | {r['ratio_error']:+.1%} "
            f"| {r['own_cost_step_s'] * 1e3:.0f} ({r['last_job_step_s'] * 1e3:.0f}) | {r['own_cost_error']:+.1%} | {r['load'][0]:.1f} → {r['load'][1]:.1f} |"
        )  # fmt: skip
    within = [r for r in table["rows"] if abs(r["error"]) <= 0.05]
    ratio_within = [r for r in table["rows"] if abs(r["ratio_error"]) <= 0.05]
    blocks = [x for x in cal["forward_s"][1:-1]]
    lines.append(
        f"\nCalibration: {cal['label']}: a block {blocks[0] * 1e3:.1f} ms forward, {cal['backward_s'][1] * 1e3:.1f} ms "
        f"backward per micro-batch, the head {cal['forward_s'][-1] * 1e3:.1f} / {cal['backward_s'][-1] * 1e3:.1f} ms, "
        f"the optimizer step {cal['step_s_per_param'] * 1e9:.2f} ns and EF's extra {cal['ef_s_per_param'] * 1e9:.2f} ns "
        f"per parameter, engine overhead {cal['overhead_s'] * 1e3:.2f} ms per instruction (fitted). Within 5 %: "
        f"{len(within)} of {len(table['rows'])} step times, {len(ratio_within)} of {len(table['rows'])} ratios to 1F1B."
        + "".join(f" {n}." for n in cal["notes"])
    )  # fmt: skip
    two = [r for r in table["rows"] if r["variant"] == "2bw"]
    lines.append("2BW's measured ratio to 1F1B: " + ", ".join(
        f"{r['measured_ratio']:.3f} at m = {r['m']} (ideal {(r['m'] + table['stages'] - 1) / r['m']:.3f})" for r in two) + ".")
    return "\n".join(lines)


def update_doc(text: str, start: str = START, end: str = END) -> None:
    doc = DOC.read_text()
    if start not in doc or end not in doc:
        raise SystemExit(f"{DOC} has no {start} ... {end} block")
    head, rest = doc.split(start, 1)
    DOC.write_text(head + start + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--measure", action="store_true", help="run the benches first (minutes)")
    ap.add_argument("--update-doc", action="store_true", help="rewrite docs/performance.md's cost tables")
    ap.add_argument("--standin", type=Path, help="a benchmarks/standin_table.py JSON to save and predict")
    args = ap.parse_args()
    if args.measure:
        measure(args.model, args.stages, args.rounds, args.steps)
    from asyncpipe.track import atomic_write_json

    table = rows(args.model, args.stages)
    if args.standin is not None:
        atomic_write_json(STANDIN, json.loads(args.standin.read_text()))
    if STANDIN.exists():
        table["standin"] = standin_rows(json.loads(STANDIN.read_text()), STANDIN.name)
    atomic_write_json(TABLE, table)
    text = render(table)
    print(text)
    if "standin" in table:
        print(render_standin(table["standin"]))
    if args.update_doc:
        update_doc(text)
        if "standin" in table:
            update_doc(render_standin(table["standin"]), STANDIN_START, STANDIN_END)


if __name__ == "__main__":
    main()
