"""`asyncpipe plan` against measured memory: real `engine=pipeline` runs on the CPU (fp32), each rank's peak
resident memory above its mark just before it builds its stage (Linux VmHWM, reset there; the engine's
`peak_mem_bytes`), next to the plan's per-stage total for the same config.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_memory.py            # measure, print a markdown table
    .venv/bin/python benchmarks/plan_memory.py --from-json                  # re-render the saved results

Each measured config runs in rank processes that have just trained a warm-up config (same model and stages,
micro-batch 2 x 32 tokens): what a process grows by once (shared-library code pages, allocator arenas,
communication buffers; about 120 MiB per rank here) is then behind the mark, as it is outside the CUDA
allocator's count on a GPU. glibc would keep freed blocks of a few hundred KiB in its heap (RSS that no tensor uses); the ranks run with
MALLOC_MMAP_THRESHOLD_=65536 so every tensor of 64 KiB or more is its own mapping, returned when freed, and the
resident set follows live tensors. Results: benchmarks/results/plan-memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "plan-memory.json"
COMMON = ["engine=pipeline", "device=cpu", "precision=fp32", "train.steps=3", "train.eval_every=3",
          "train.eval_batches=1", "train.micro_batches=4", "pipeline.threads=1", "run.dir=unused"]  # fmt: skip
CASES = [  # (label, overrides): activations large enough to matter next to the weights
    ("small 1F1B adamw", ["model=small", "pipeline.stages=2", "delay=0", "optimizer=adamw",
                          "train.micro_batch_size=16", "train.seq_len=256"]),
    ("small 2BW muon+EF", ["model=small", "pipeline.stages=2", "delay=1", "optimizer=muon_ef",
                           "train.micro_batch_size=16", "train.seq_len=256"]),
    ("mini 2BW muon+EF", ["model=mini", "pipeline.stages=2", "delay=1", "optimizer=muon_ef",
                             "train.micro_batch_size=16", "train.seq_len=256"]),
    ("moe_mini 2BW muon+EF", ["model=moe_mini", "pipeline.stages=2", "delay=1", "optimizer=muon_ef",
                              "train.micro_batch_size=16", "train.seq_len=256"]),
    ("small 2BW muon+EF, mb 1x32 (weights, optimizer, EF)", ["model=small", "pipeline.stages=2", "delay=1",
                                                               "optimizer=muon_ef", "train.micro_batch_size=1",
                                                               "train.seq_len=32"]),
]  # fmt: skip
MIB = 2**20


def measure() -> list[dict]:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the rank processes
    from asyncpipe.config import compose
    from asyncpipe.spawn import Job, launch
    from asyncpipe.plan import plan

    rows = []
    for label, overrides in CASES:
        cfg = compose(COMMON + overrides)
        pl = plan(cfg, gpu_mem_gib=80)
        warm = compose(COMMON + overrides + ["train.micro_batch_size=2", "train.seq_len=32"])
        _, result = launch([Job(warm, None, show_progress=False), Job(cfg, None, show_progress=False)], timeout_s=1800)
        measured = {st["stage"]: st["peak_mem_bytes"] for st in result["stages"] if st["replica"] == 0}
        for s in pl.stages:
            rows.append({
                "case": label, "overrides": overrides, "stage": s.stage, "plan_bytes": s.total,
                "plan_static_bytes": s.weights + s.grads + s.optimizer + s.ef, "plan_act_bytes": s.activations,
                "measured_bytes": measured[s.stage],
            })  # fmt: skip
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| config | stage | plan: static + activations (MiB) | plan total (MiB) | measured peak (MiB) | measured / plan |",
           "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        ratio = r["measured_bytes"] / r["plan_bytes"]
        out.append(
            f"| {r['case']} | {r['stage']} | {r['plan_static_bytes'] / MIB:.1f} + {r['plan_act_bytes'] / MIB:.1f} | "
            f"{r['plan_bytes'] / MIB:.1f} | {r['measured_bytes'] / MIB:.1f} | {ratio:.3f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-json", action="store_true", help="re-render benchmarks/results/plan-memory.json")
    args = ap.parse_args()
    if args.from_json:
        rows = json.loads(OUT.read_text())["rows"]
    else:
        rows = measure()
        OUT.parent.mkdir(parents=True, exist_ok=True)
        tmp = OUT.with_suffix(".tmp")
        tmp.write_text(json.dumps({"common": COMMON, "rows": rows}, indent=1))
        tmp.replace(OUT)
    print(table(rows))


if __name__ == "__main__":
    main()
