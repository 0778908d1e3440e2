"""The stand-in table of docs/performance.md in one command: the real pipeline engine with stand-in compute
(`asyncpipe.bench.standin`: every forward / backward padded to F / B seconds per stage and micro-batch) for
1F1B, 2BW, DualPipeV and PACI (both recipes) at P = 2, 4, 8 and m = P, 2P, 4P, one launch per P; each schedule's measured step
against its own ideal, and what the engine adds per instruction.

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python benchmarks/standin_table.py               # measure, print
    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python benchmarks/standin_table.py --update-doc  # ... and rewrite the doc
    # 2BW at 4x the stand-in times (does the engine's loss scale with compute?): the doc's second table
    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python benchmarks/standin_table.py --standin 0.08,0.16 --stages 2,4 \
        --schedules 2bw --steps 6 --out benchmarks/results/standin-2bw-x4.json --section standin-x4 --update-doc
    # ... and at 10x (0.2,0.4 --stages 2,4,8; --out benchmarks/results/standin-2bw-x10.json --section standin-x10): the doc's third
    .venv/bin/python benchmarks/standin_table.py --from-json [--update-doc]                 # re-render the saved JSON

Results: benchmarks/results/standin.json ({"records": [...], "skipped", machine, load, commit}; the record
schema is `asyncpipe.bench.standin`'s docstring). The model is tiny with max(4, 2P) blocks (about two per stage,
and the 2P chunks DualPipeV needs), micro-batch 1 x 16 tokens: its real ops are a few ms, padded to F, B.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
JSON = REPO / "benchmarks" / "results" / "standin.json"
DOC = REPO / "docs" / "performance.md"
SCHEDULES = ["1f1b", "2bw", "dualpipev", "paci", "paci-recompute"]


def _sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def measure(stages: list[int], forward_s: float, backward_s: float, steps: int, rounds: int,
            schedules: list[str] = SCHEDULES) -> dict:  # fmt: skip
    from asyncpipe.bench.standin_run import bench_standin

    out: dict = {"forward_s": forward_s, "backward_s": backward_s, "steps_per_job": steps, "rounds": rounds,
                 "records": [], "skipped": {}, "cpu": _cpu(), "cpu_count": os.cpu_count(),
                 "commit": _sh("git", "rev-parse", "HEAD")[:12], "dirty": bool(_sh("git", "status", "--porcelain", "--untracked-files=no")),
                 "uptime_before": _sh("uptime")}  # fmt: skip
    for P in stages:
        over = ["model=tiny", f"model.n_layer={max(4, 2 * P)}", f"pipeline.stages={P}", "train.micro_batch_size=1",
                "train.seq_len=16"]  # fmt: skip
        res = bench_standin(over, [P, 2 * P, 4 * P], schedules, forward_s, backward_s, steps=steps, rounds=rounds,
                            log=lambda msg: print(msg, file=sys.stderr))  # fmt: skip
        out["records"] += res["records"]
        out["skipped"].update({f"P={P} {k}": v for k, v in res["skipped"].items()})
    out["uptime_after"] = _sh("uptime")
    out["measured_at"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return out


def _load(uptime: str) -> str:
    return ",".join(uptime.split("load average:")[-1].strip().split(",")[:2]).replace(" ", "")


def render(res: dict) -> str:
    """The doc's section body: the main table, PACI against 2BW at m = P, and the provenance line."""
    recs = sorted(res["records"], key=lambda r: (r["stages"], r["micro_batches"], SCHEDULES.index(r["schedule"])))
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    lines = [
        f"Measured: {res['measured_at']}, commit {res['commit']}{' (dirty)' if res['dirty'] else ''}, "
        f"{res['cpu']} ({res['cpu_count']} cores), load {_load(res['uptime_before'])} before, "
        f"{_load(res['uptime_after'])} after; F = {ms(res['forward_s'])} ms, B = {ms(res['backward_s'])} ms per stage "
        f"and micro-batch, {res['steps_per_job']} steps per job (first and last not timed), {res['rounds']} round(s), "
        "host timing (`benchmarks/standin_table.py`).",
        "",
        "| schedule | P | m | ideal ms | measured ms | fraction of ideal (best step) | tokens/s "
        "| F / B overhead ms per instr. | p2p wait ms/step | engine ms/step | opt. step ms/step (norm wait) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        o = r["overhead_s_per_instruction"]
        bd = r["step_breakdown_s"]
        # Per stage and steady step: waiting on p2p, and the engine's own work (all but the stand-in and p2p).
        own = [b["wall"] - b["standin"] - b["comm"] for b in bd]
        span = lambda xs: f"{ms(min(xs))}-{ms(max(xs))}"  # noqa: E731
        lines.append(
            f"| {r['schedule']} | {r['stages']} | {r['micro_batches']} | {ms(r['ideal_step_s'])} | {ms(r['step_time_s'])} "
            f"| {r['fraction_of_ideal']:.3f} ({r['fraction_of_ideal_best_step']:.3f}) | {r['tokens_per_s']:.0f} "
            f"| {ms(o['ForwardPass'])} / {ms(o['BackwardPass'])} | {span([b['comm'] for b in bd])} | {span(own)} "
            f"| {span([b['optimizer_step'] for b in bd])} ({span([b['norm_wait'] for b in bd])}) |"
        )
    rows = []
    by = {(r["schedule"], r["stages"], r["micro_batches"]): r for r in recs}
    ver = lambda r: "/".join(f"{v:.0f}" for v in r["weight_versions_peak"]) if r else "-"  # noqa: E731
    per_2bw = lambda r, two: f"{r['tokens_per_s'] / two['tokens_per_s']:.3f}" if r else "-"  # noqa: E731
    for P in sorted({r["stages"] for r in recs}):
        two, one = by.get(("2bw", P, P)), by.get(("1f1b", P, P))
        paci, rec = by.get(("paci", P, P)), by.get(("paci-recompute", P, P))
        if two is None or one is None or (paci is None and rec is None):
            continue
        tokens = f"{paci['tokens_per_s']:.0f}" if paci else "-"
        rows.append(f"| {P} | {two['tokens_per_s']:.0f} | {tokens} | "
                    f"{per_2bw(paci, two)} | {per_2bw(rec, two)} | {ver(two)} | {ver(paci or rec)} | {ver(one)} |")
    if rows:
        lines += ["", "PACI against 2BW at m = P (stand-in, same run): tokens/s, and weight versions held per stage "
                  "(peak weight bytes over one copy). paci: a straddler back-propagates through its own graph on the "
                  "stepped weights; paci-recompute: it re-runs its forward first.", "",
                  "| P | 2BW tokens/s | PACI tokens/s | PACI / 2BW | paci-recompute / 2BW | 2BW versions | PACI versions "
                  "| 1F1B versions |", "|---|---|---|---|---|---|---|---|", *rows]  # fmt: skip
    if res["skipped"]:
        lines += ["", "Not run: " + "; ".join(f"{k} ({v.split(': ', 1)[-1]})" for k, v in sorted(res["skipped"].items()))]
    return "\n".join(lines)


def markers(section: str) -> tuple[str, str]:
    return f"<!-- {section}:start -->", f"<!-- {section}:end -->"


def update_doc(body: str, section: str = "standin-table") -> None:
    start, end = markers(section)
    text = DOC.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{DOC} has no {start} ... {end} section")
    head, rest = text.split(start, 1)
    DOC.write_text(head + start + "\n" + body + "\n" + end + rest.split(end, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-json", action="store_true", help="re-render benchmarks/results/standin.json")
    ap.add_argument("--update-doc", action="store_true", help="rewrite docs/performance.md's stand-in section")
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--standin", default="0.02,0.04", help="F,B seconds per stage and micro-batch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--section", default="standin-table", help="the doc's <!-- SECTION:start/end --> markers")
    a = ap.parse_args()
    if a.from_json:
        res = json.loads(a.out.read_text())
    else:
        from asyncpipe.bench.standin import parse_standin

        res = measure([int(x) for x in a.stages.split(",")], *parse_standin(a.standin), a.steps, a.rounds,
                      a.schedules.split(","))  # fmt: skip
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
        print(f"wrote {a.out}", file=sys.stderr)
    body = render(res)
    print(body)
    if a.update_doc:
        update_doc(body, a.section)


if __name__ == "__main__":
    main()
