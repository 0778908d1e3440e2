"""End-to-end tokens/s of a simulator run eager against compiled (`train.compile`), in the CPU study's regime.

Each run is a fresh process, as a sweep's runs are: build the trainer, train ``--steps`` steps with the study's
evaluations (every 100 steps, 16 batches), all timed, compile included. The sequence is

    eager, compiled (cold: an empty inductor cache), compiled (warm: the cache the cold run filled), eager

so the warm comparison is measured in both orders (eager first and compiled first) within one invocation, and
the machine's load average is recorded around every run. ``--extrapolate N`` also states each run's time at N
steps as fixed cost (set-up, compile) + N x its steady step time, labelled as extrapolated.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_speed.py --steps 300 --extrapolate 1100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

STUDY = ["model=tiny", "data=shakespeare", "tokenizer=byte", "train.seq_len=128", "train.micro_batch_size=8",
         "train.micro_batches=4", "optimizer=adamw", "train.eval_every=100", "train.eval_batches=16",
         "tracker.wandb.mode=disabled"]  # fmt: skip


def one_run(mode: str, steps: int, model: str) -> dict:
    """This process: one run of ``steps`` steps, timed end to end (trainer set-up included)."""
    began = time.perf_counter()
    from asyncpipe.config import compose
    from asyncpipe.trainer import Trainer

    load = os.getloadavg()[0]
    cfg = compose([*STUDY, f"model={model}", f"train.steps={steps}", f"train.compile={mode == 'compiled'}"])
    trainer = Trainer(cfg)
    engine = trainer.engine
    times = []
    for step in range(1, steps + 1):
        times.append(engine.train_step().step_time)
        if step % cfg.train.eval_every == 0 or step == steps:
            trainer.evaluate()
    wall = time.perf_counter() - began
    steady = statistics.median(times[5:]) if len(times) > 10 else statistics.median(times)
    return {"mode": mode, "steps": steps, "wall_s": wall, "steady_step_s": steady, "first_step_s": times[0],
            "compile_s": engine.clock.compile_s, "tokens_per_s": engine.tokens_per_step * steps / wall,
            "load_before": load, "load_after": os.getloadavg()[0]}  # fmt: skip


def _child(mode: str, steps: int, model: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(steps), "--model", model],
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--extrapolate", type=int, default=None, help="also state each run's time at this many steps")
    ap.add_argument("--one", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.one, args.steps, args.model)))
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        for label, mode in (("eager A", "eager"), ("compiled cold", "compiled"), ("compiled warm", "compiled"),
                            ("eager B", "eager")):  # fmt: skip
            run = {"run": label, **_child(mode, args.steps, args.model, cache)}
            runs.append(run)
            print(f"{label:14s} {run['wall_s']:7.1f} s  {run['tokens_per_s']:8.0f} tok/s end to end  steady "
                  f"{run['steady_step_s'] * 1e3:6.1f} ms/step  compile {run['compile_s'] or 0:5.1f} s  "
                  f"load {run['load_before']:.2f} -> {run['load_after']:.2f}", flush=True)  # fmt: skip
    by = {r["run"]: r for r in runs}
    ratios = {"eager first (A / warm)": by["eager A"]["wall_s"] / by["compiled warm"]["wall_s"],
              "compiled first (B / warm)": by["eager B"]["wall_s"] / by["compiled warm"]["wall_s"],
              "cold, eager first (A / cold)": by["eager A"]["wall_s"] / by["compiled cold"]["wall_s"]}  # fmt: skip
    for name, r in ratios.items():
        print(f"end-to-end speed-up at {args.steps} steps, {name}: {r:.2f}x")
    from asyncpipe.track.provenance import cpu_model, git_state

    result = {"steps": args.steps, "model": args.model, "runs": runs, "speedup": ratios,
              "git": git_state(Path(__file__).parent), "cpu": cpu_model()}  # fmt: skip
    if args.extrapolate:
        n = args.extrapolate
        est = {r["run"]: r["wall_s"] - args.steps * r["steady_step_s"] + n * r["steady_step_s"] for r in runs}
        result["extrapolated_wall_s"] = est
        for name, a, b in (("eager first", "eager A", "compiled warm"), ("compiled first", "eager B", "compiled warm"),
                           ("cold", "eager A", "compiled cold")):  # fmt: skip
            print(f"extrapolated to {n} steps ({name}): eager {est[a]:.0f} s, compiled {est[b]:.0f} s, "
                  f"{est[a] / est[b]:.2f}x")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
