"""How much two computing ranks slow each other on this machine: a diagnostic for the real-compute cut bench.

The cost model prices a stage's pass at what it measured in the calibrating run and assumes stages do not slow
each other (one device per stage). On a CPU host the ranks share cores' caches and memory bandwidth: a cut that keeps
both ranks busy at once (balanced) runs each pass slower than the even cut, where the head's stage mostly computes
alone. This times one layer's forward + backward (`asyncpipe.bench.layer_profile`, `model=small` at BPE 20,480, the
cut bench's micro-batch) in one process alone, then in two processes started together, one thread each.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/contention.py [--out benchmarks/results/contention.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OVERRIDES = [
    "model=small",
    "tokenizer=bpe",
    "tokenizer.vocab_size=20480",
    "train.micro_batch_size=4",
    "train.seq_len=256",
]


def _time(barrier, reps: int, queue) -> None:
    from asyncpipe.bench.layer_profile import layer_profile
    from asyncpipe.config import compose

    cfg = compose(OVERRIDES)
    if barrier is not None:
        barrier.wait()
    runs = [layer_profile(cfg, threads=1, reps=reps) for _ in range(3)]
    queue.put({k: [statistics.median(r[k][i] for r in runs) for i in (0, 1)] for k in ("embedding", "block", "head")})


def _run(n: int, reps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(n)
    procs = [ctx.Process(target=_time, args=(barrier, reps, queue)) for _ in range(n)]
    for p in procs:
        p.start()
    out = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    alone = _run(1, args.reps)[0]
    together = _run(2, args.reps)
    res = {
        "overrides": OVERRIDES,
        "cpu_count": os.cpu_count(),
        "load_avg": list(os.getloadavg()),
        "alone": alone,
        "together": together,
    }
    print("| layer | alone fwd+bwd ms | two at once, each ms | slowdown |")
    print("|---|---|---|---|")
    for k in ("embedding", "block", "head"):
        a = sum(alone[k])
        t = [sum(x[k]) for x in together]
        print(f"| {k} | {a * 1e3:.1f} | {', '.join(f'{x * 1e3:.1f}' for x in t)} | {statistics.mean(t) / a:.3f}x |")
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
