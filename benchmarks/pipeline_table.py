"""The schedule table of docs/performance.md in one command: `asyncpipe bench pipeline` (1F1B, DualPipeV, 2BW,
2BW + EF in one launch) for each m, then one markdown table with the machine and its load next to the numbers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_table.py              # measure m = 2, 4, 8 and print
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_table.py --update-doc # ... and rewrite the doc's table
    .venv/bin/python benchmarks/pipeline_table.py --from-json                    # re-render the saved results

Results go to benchmarks/results/pipeline-{model}-P{P}-m{m}.json (the simulator bench rides with m=4).

With --torch it measures DeepSpeed's 1F1B and DualPipeV and our 2BW beside PyTorch's own schedules
(`torch.distributed.pipelining`, the ``pt_*`` variants) and renders the doc's second table
(benchmarks/results/pipeline-torch-{model}-P{P}-m{m}.json; no simulator bench):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_table.py --torch --update-doc
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "performance.md"
START, END = "<!-- pipeline-table:start -->", "<!-- pipeline-table:end -->"
PAPER_START, PAPER_END = "<!-- schedule-table:start -->", "<!-- schedule-table:end -->"
ORDER = ["1f1b", "dualpipev", "2bw", "2bw_ef"]
TORCH_ORDER = ["1f1b", "dualpipev", "2bw", "pt_1f1b", "pt_interleaved1f1b", "pt_loopedbfs", "pt_interleavedzb",
               "pt_zbv", "pt_dualpipev"]  # fmt: skip
TORCH_START, TORCH_END = "<!-- torch-table:start -->", "<!-- torch-table:end -->"
PAPER = [(2, 2), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32), (16, 64)]  # (P, m), most beyond 2 cores


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def measure(model: str, stages: int, ms: list[int], rounds: int, steps: int, extra: list[str],
            simulator: bool = True, order: list[str] = ORDER, prefix: str = "pipeline") -> list[dict]:  # fmt: skip
    from asyncpipe.bench.pipeline import bench_pipeline, format_result

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = []
    for m in ms:
        before = _uptime()
        # eval_batches >= 2P: DualPipeV's own check (its evaluation runs two chunks per rank); the bench's default
        # of one evaluation batch would skip it
        res = bench_pipeline([f"model={model}", f"pipeline.stages={stages}", f"train.micro_batches={m}",
                              f"train.eval_batches={2 * stages}", *extra],
                             rounds=rounds, steps=steps, warmup_steps=3, simulator=simulator and m == 4, variants=order,
                             log=lambda msg: print(msg, file=sys.stderr))  # fmt: skip
        res["uptime_before"], res["uptime_after"] = before, _uptime()
        res["measured_at"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        res["cpu"] = _cpu()
        print(format_result(res), file=sys.stderr)
        (RESULTS / f"{prefix}-{model}-P{stages}-m{m}.json").write_text(json.dumps(res, indent=1))
        out.append(res)
    return out


def _load(uptime: str) -> str:
    return ",".join(uptime.split("load average:")[-1].strip().split(",")[:2]).replace(" ", "")


def _join(mem: list[dict], key: str, fmt: str) -> str:
    return " / ".join(format(y[key], fmt) for y in mem)


def table(results: list[dict], order: list[str] = ORDER) -> str:
    """One markdown table over every m and schedule of a list of `bench_pipeline` results (+ simulator lines)."""
    head = ("| m | schedule | tok/s | ×1F1B (per round) | ×1F1B fastest steps | ideal ×1F1B | fraction of ideal "
            "| bubble analytic "
            "| idle/stage measured | norm wait ms/step/stage | weight versions | weights+opt(+EF) MB/stage "
            "| activations peak MB/stage | load 1/5 min before → after |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    rows = []
    for r in results:
        load = f"{_load(r.get('uptime_before', ''))} → {_load(r.get('uptime_after', ''))}"
        for name in [n for n in order if n in r["variants"] or n in r.get("skipped", {})]:
            if name in r.get("skipped", {}):
                rows.append(f"| {r['micro_batches']} | {name} | {r['skipped'][name]} | | | | | | | | | | | {load} |")
                continue
            x = r["variants"][name]
            per_round = ", ".join(f"{y:.3f}" for y in x["ratio_to_1f1b_per_round"])
            mem = x["memory_per_stage"]
            frac = x["fraction_of_ideal"]
            rows.append(
                f"| {r['micro_batches']} | {name} | {x['tokens_per_s']:.0f} | {x['ratio_to_1f1b']:.3f} ({per_round}) "
                f"| {x['ratio_to_1f1b_best_step']:.3f} | {x['ideal_ratio_to_1f1b']:.3f} | {'**' if name == '2bw' else ''}{frac:.3f}"
                f"{'**' if name == '2bw' else ''} | {x['analytic_bubble']:.3f} "
                f"| {' / '.join(f'{y:.3f}' for y in x['idle_frac_per_stage'])} "
                f"| {' / '.join(f'{y:.1f}' for y in x['norm_wait_ms_per_step'])} "
                f"| {_join(mem, 'weight_versions_peak', '.0f')} | {_join(mem, 'peak_weight_plus_optimizer_mb', '.1f')} "
                f"| {_join(mem, 'peak_activation_mb', '.1f')} | {load} |"
            )  # fmt: skip
    lines = [head, *rows]
    first = results[0] if results else {}
    if first:
        lines.append(f"\nModel `{first['model']}`, P={first['stages']}, micro-batch {first['micro_batch_size']} x "
                     f"{first['seq_len']} tokens, {first['threads_per_process']} thread/process, {first['rounds']} "
                     f"rounds x {first['steps_per_job']} steps per schedule ({first['steps_dropped_each_end']} "
                     f"dropped at each end), schedule model at the measured backward/forward cost ratio "
                     + ", ".join(f"{r.get('backward_over_forward', 2.0):.2f} (m={r['micro_batches']})" for r in results)
                     + f"; {first.get('cpu', '?')}, {first['cpu_count']} CPUs (the load column says what else ran); measured "
                     f"{first.get('measured_at', '?')}.")  # fmt: skip
    if order is TORCH_ORDER and results:
        lines.append("\n" + strongest(results))
    for r in results:
        if "simulator" in r:
            sim = r["simulator"]
            lines.append(
                f"\nSimulator (model `{sim['model']}`, m={r['micro_batches']}, {sim['threads']} thread): "
                + ", ".join(f"{n} {sim['median_step_s'][n] * 1e3:.0f} ms/step (x{x:.3f})"
                            for n, x in sim["ratio_to_delay0"].items())  # fmt: skip
                + f"; load {_load(r.get('uptime_after', ''))}."
            )
    return "\n".join(lines)


def strongest(results: list[dict]) -> str:
    """Per m, the strongest synchronous schedule by the report's own rule (`asyncpipe.report.throughput`: the
    fastest variant flagged synchronous) and 2BW over it; then the spread of every paired per-round ratio."""
    from asyncpipe.report.throughput import throughput

    parts = []
    for r in results:
        P, m = r["stages"], r["micro_batches"]
        v = r["variants"]
        sync = [k for k, x in v.items() if x.get("synchronous") and "+" not in k]
        bench = [{"path": f"m{m}", "P": P, "m": m, "sync": sync, "labels": {k: x["schedule"] for k, x in v.items()},
                  "ratios": {k: x["ratio_to_1f1b"] for k, x in v.items()}}]  # fmt: skip
        thr = throughput(P, m, bench)
        parts.append(f"m={m}: {thr.best_sync} ({thr.best_sync_label}) {thr.vs_1f1b / thr.vs_best_sync:.3f}x 1F1B, "
                     f"2BW {thr.vs_1f1b:.3f}x 1F1B = {thr.vs_best_sync:.3f}x it")  # fmt: skip
    rounds = [y for r in results for n, x in r["variants"].items() if n != "1f1b" for y in x["ratio_to_1f1b_per_round"]]
    loads = [float(_load(r.get(k, "")).split(",")[0]) for r in results for k in ("uptime_before", "uptime_after")]
    return ("Strongest synchronous schedule by median tokens/s (the report's rule): " + "; ".join(parts) + ". "
            f"Every paired per-round ratio to 1F1B in this table lies in {min(rounds):.3f}-{max(rounds):.3f}, "
            f"at 1-minute load averages {min(loads):.2f}-{max(loads):.2f} on {results[0]['cpu_count']} CPUs.")


def paper_table(backward: float = 2.0) -> str:
    """Bubbles of every schedule from its own rules (`asyncpipe.timelines.orders.bubble_table`) at F=1, B=``backward``."""
    from asyncpipe.timelines.orders import bubble_table

    names = ["1f1b", "zb-h1", "interleaved-1f1b", "dualpipev", "2bw", "2bw-run"]
    lines = ["| P | m | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for P, m in PAPER:
        b = bubble_table(P, m, 1.0, backward)
        lines.append(f"| {P} | {m} | " + " | ".join("n/a" if b[n] is None else f"{b[n]:.3f}" for n in names) + " |")
    return "\n".join(lines) + (f"\n\nF = 1, B = {backward:g} (zb-h1: B and W {backward / 2:g} each), optimizer step "
                               "free; 2bw-run: a 3-batch run with its one fill and drain.")


def _replace(doc: str, start: str, end: str, text: str) -> str:
    if start not in doc or end not in doc:
        raise SystemExit(f"{DOC} has no {start} ... {end} block to replace")
    before, rest = doc.split(start, 1)
    return before + start + "\n" + text + "\n" + end + rest.split(end, 1)[1]


def update_doc(text: str, torch: bool = False) -> None:
    if torch:
        DOC.write_text(_replace(DOC.read_text(), TORCH_START, TORCH_END, text))
        return
    doc = _replace(DOC.read_text(), START, END, text)
    DOC.write_text(_replace(doc, PAPER_START, PAPER_END, paper_table()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-simulator", action="store_true", help="skip the simulator bench (it rides with m=4)")
    ap.add_argument("--from-json", action="store_true", help="render benchmarks/results/ instead of measuring")
    ap.add_argument("--update-doc", action="store_true", help=f"rewrite the table block in {DOC.name}")
    ap.add_argument("--torch", action="store_true", help="PyTorch's own schedules beside ours (the second table)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    order, prefix = (TORCH_ORDER, "pipeline-torch") if a.torch else (ORDER, "pipeline")
    if a.from_json:
        paths = [RESULTS / f"{prefix}-{a.model}-P{a.stages}-m{m}.json" for m in a.m]
        results = [json.loads(p.read_text()) for p in paths if p.exists()]
    else:
        results = measure(a.model, a.stages, a.m, a.rounds, a.steps, a.overrides,
                          simulator=not a.no_simulator and not a.torch, order=order, prefix=prefix)
    text = table(results, order)
    print(text)
    if a.update_doc:
        update_doc(text, a.torch)
        print(f"updated {DOC}", file=sys.stderr)


if __name__ == "__main__":
    main()
