"""Tied embeddings' wait in the stand-in mode: the same model tied and untied, 1F1B, 2BW and PACI at P = 4, m = 8
(stand-in F = 20 ms, B = 40 ms per stage and micro-batch), one launch each, against the cost model calibrated on the
UNTIED run's 1F1B and 2BW (`cost_source.from_standin`) and predicting with and without the tied pair's all-reduce
(`cost.predict(tied=...)`: PACI's last stage waits each batch for stage 0's half of the tied gradient).

    OMP_NUM_THREADS=1 nice -n -10 .venv/bin/python benchmarks/tied_table.py          # measure, write, print
    .venv/bin/python benchmarks/tied_table.py --from-json                             # re-print the saved JSON

Results: benchmarks/results/tied-standin.json ({"runs": {"tied": record, "untied": record}, commit, dirty}).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
JSON = REPO / "benchmarks" / "results" / "tied-standin.json"
P, M, STANDIN = 4, 8, (0.02, 0.04)
OVERRIDES = [
    "model=tiny",
    "model.n_layer=8",
    f"pipeline.stages={P}",
    f"train.micro_batches={M}",
    "train.micro_batch_size=1",
    "train.seq_len=16",
]


def measure(rounds: int, steps: int) -> dict:
    from asyncpipe.bench.pipeline import bench_pipeline

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()

    out = {"commit": git("rev-parse", "HEAD")[:12], "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    out["runs"] = {
        name: bench_pipeline(
            [*OVERRIDES, f"model.tie_embeddings={tie}"],
            rounds=rounds,
            steps=steps,
            variants=["1f1b", "2bw", "paci"],
            standin=STANDIN,
            log=lambda s: print(s, file=sys.stderr),
        )
        for name, tie in (("untied", "false"), ("tied", "true"))
    }
    return out


def table(res: dict) -> list[dict]:
    """Every record against the model calibrated on the untied run: predicted untied and tied, and the error of the
    prediction that matches the run."""
    from asyncpipe.timelines.cost import predict
    from asyncpipe.timelines.cost_source import from_standin, standin_calibration

    model = from_standin(standin_calibration(res["runs"]["untied"]["standin"]["records"]), P, "the untied run")
    rows = []
    for name, run in res["runs"].items():
        for r in run["standin"]["records"]:
            clip = "stage" if r["schedule"] == "paci" else None
            free, tied = (predict(model, r["schedule"], P, M, clip=clip, tied=t).step_s for t in (False, True))
            mine = tied if name == "tied" else free
            rows.append(
                {
                    "run": name,
                    "schedule": r["schedule"],
                    "measured_s": r["step_time_s"],
                    "untied_model_s": free,
                    "tied_model_s": tied,
                    "error": mine / r["step_time_s"] - 1,
                }
            )
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| run | schedule | measured ms | model untied ms | model tied ms | error of its model |",
        "|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['run']} | {x['schedule']} | {x['measured_s'] * 1e3:.1f} | {x['untied_model_s'] * 1e3:.1f} | "
            f"{x['tied_model_s'] * 1e3:.1f} | {x['error']:+.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-json", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    if args.from_json:
        res = json.loads(JSON.read_text())
    else:
        res = measure(args.rounds, args.steps)
        tmp = JSON.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        tmp.replace(JSON)
    print(render(table(res)))
    print(f"calibration: the untied run's 1F1B and 2BW; commit {res['commit']}{' (dirty)' if res['dirty'] else ''}")


if __name__ == "__main__":
    main()
