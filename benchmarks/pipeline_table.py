"""The 2BW vs 1F1B table of docs/performance.md in one command: `asyncpipe bench pipeline` for each m, then a
markdown table with the machine load next to the numbers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_table.py              # measure m = 2, 4, 8 and print
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_table.py --update-doc # ... and rewrite the doc's table
    .venv/bin/python benchmarks/pipeline_table.py --from-json                    # re-render the saved results

Results go to benchmarks/results/pipeline-{model}-P{P}-m{m}.json (the simulator bench rides with m=4).
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


def measure(model: str, stages: int, ms: list[int], rounds: int, steps: int, extra: list[str]) -> list[dict]:
    from asyncpipe.bench.pipeline import bench_pipeline, format_result

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = []
    for m in ms:
        before = _uptime()
        res = bench_pipeline([f"model={model}", f"pipeline.stages={stages}", f"train.micro_batches={m}", *extra],
                             rounds=rounds, steps=steps, warmup_steps=3, simulator=(m == 4),
                             log=lambda msg: print(msg, file=sys.stderr))  # fmt: skip
        res["uptime_before"], res["uptime_after"] = before, _uptime()
        res["measured_at"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        res["cpu"] = _cpu()
        print(format_result(res), file=sys.stderr)
        (RESULTS / f"pipeline-{model}-P{stages}-m{m}.json").write_text(json.dumps(res, indent=1))
        out.append(res)
    return out


def table(results: list[dict]) -> str:
    """The markdown table (and the simulator line) of a list of `bench_pipeline` results."""
    head = ("| m | 1F1B tok/s | 2BW tok/s | 2BW/1F1B | ideal (m+P-1)/m | fraction of ideal | fastest-step ratio "
            "(fraction) | idle/stage 1F1B | idle/stage 2BW | busy ms/micro-batch/stage 1F1B → 2BW "
            "| 2BW weights+opt MB/stage (versions) | load (1/5 min) before → after |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    rows = []
    for r in results:
        v = r["variants"]
        idle = {n: " / ".join(f"{x:.3f}" for x in v[n]["idle_frac_per_stage"]) for n in v}
        busy = {n: " / ".join(f"{x * 1e3:.0f}" for x in v[n]["compute_s_per_micro_batch"]) for n in v}
        mem = " / ".join(f"{x['peak_weight_plus_optimizer_mb']:.1f} ({x['weight_versions_peak']:.0f})"
                         for x in v["2bw"]["memory_per_stage"])  # fmt: skip
        load = lambda u: u.split("load average:")[-1].strip().split(",")[:2]  # noqa: E731
        rows.append(
            f"| {r['micro_batches']} | {v['1f1b']['tokens_per_s']:.0f} | {v['2bw']['tokens_per_s']:.0f} "
            f"| {r['ratio_2bw_over_1f1b']:.3f} | {r['ideal_ratio']:.3f} | **{r['fraction_of_ideal']:.3f}** "
            f"| {r['ratio_best_step']:.3f} ({r['fraction_of_ideal_best_step']:.3f}) "
            f"| {idle['1f1b']} | {idle['2bw']} | {busy['1f1b']} → {busy['2bw']} | {mem} "
            f"| {','.join(load(r.get('uptime_before', '')))} → {','.join(load(r.get('uptime_after', '')))} |"
        )
    lines = [head, *rows]
    first = results[0] if results else {}
    if first:
        lines.append(f"\nModel `{first['model']}`, P={first['stages']}, micro-batch {first['micro_batch_size']} x "
                     f"{first['seq_len']} tokens, {first['threads_per_process']} thread/process, {first['rounds']} "
                     f"rounds x {first['steps_per_job']} steps per variant ({first['steps_dropped_each_end']} "
                     f"dropped at each end); {first.get('cpu', '?')}, {first['cpu_count']} CPUs; measured "
                     f"{first.get('measured_at', '?')}.")  # fmt: skip
    for r in results:
        if "simulator" in r:
            sim = r["simulator"]
            lines.append(
                f"\nSimulator (model `{sim['model']}`, m={r['micro_batches']}, {sim['threads']} thread): "
                + ", ".join(f"{n} {sim['median_step_s'][n] * 1e3:.0f} ms/step (x{x:.3f})"
                            for n, x in sim["ratio_to_delay0"].items())  # fmt: skip
                + f"; load {','.join(r.get('uptime_after', '').split('load average:')[-1].split(',')[:2])}."
            )
    return "\n".join(lines)


def update_doc(text: str) -> None:
    doc = DOC.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {START} ... {END} block to replace")
    before, rest = doc.split(START, 1)
    DOC.write_text(before + START + "\n" + text + "\n" + END + rest.split(END, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--from-json", action="store_true", help="render benchmarks/results/ instead of measuring")
    ap.add_argument("--update-doc", action="store_true", help=f"rewrite the table block in {DOC.name}")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.from_json:
        paths = [RESULTS / f"pipeline-{a.model}-P{a.stages}-m{m}.json" for m in a.m]
        results = [json.loads(p.read_text()) for p in paths if p.exists()]
    else:
        results = measure(a.model, a.stages, a.m, a.rounds, a.steps, a.overrides)
    text = table(results)
    print(text)
    if a.update_doc:
        update_doc(text)
        print(f"updated {DOC}", file=sys.stderr)


if __name__ == "__main__":
    main()
