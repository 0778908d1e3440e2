"""Where a training step's time goes, eager against compiled (`train.compile`): the ceiling on what compiling can buy.

torch.compile fuses the elementwise work (norms, RoPE, SiLU, the loss, their backwards) into generated kernels; the
matrix multiplications and the attention kernel stay calls into ATen in both modes. So the eager step's time in
those calls bounds the speed-up: even a compiler that made everything else free could not beat

    eager step / (matmul + attention of the eager step)

Every round is a fresh process in the CPU study's regime (its STUDY overrides) measuring four modes: the simulator
eager and compiled, and a bare loop eager and compiled (the yardstick issue 29 quotes: the same model,
initialisation, data and micro-batches, `torch.optim.AdamW`, per micro-batch ``lm_loss(model(x), y)`` compiled with
`torch.compile` as one function and its backward, then the optimizer step; no delayed weights, clipping,
compensation, metrics or run directory). Each mode takes 5 warm-up steps (the compiled ones compile there, from the
inductor cache when warm); then the modes take their ``--steps`` timed steps in turn, one step each, so they share
the machine's state (this VM's speed drifts within and between processes: the ratios within a round are the paired
figures, the rounds show the spread); the median is each mode's step time. Last, 5 steps of each under
torch.profiler, whose self CPU time per operator is split into matmul (aten::mm, addmm, bmm), attention (the SDPA
kernels, forward and backward) and the rest. Simulator / bare step time says what asyncpipe itself costs per mode.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_profile.py --rounds 5  # ~5 min with a warm cache
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_profile.py --model small --steps 12
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_speed import STUDY  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # compile-profile-{model}.json
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm")
MODES = ("eager", "compiled", "bare eager", "bare compiled")
TOKEN_DIMS = ("train.seq_len", "train.micro_batch_size", "train.micro_batches")  # their product: tokens per step
PROFILED_STEPS = 5


def _kind(op: str) -> str:
    if op in MATMUL:
        return "matmul"
    if op.startswith(("aten::_scaled_dot_product", "aten::_flash_attention")):
        return "attention"
    return "rest"


def _bare_step(engine, compiled: bool):
    """A plain PyTorch training step over the simulator's own data and model shape (see the module docstring)."""
    import torch

    from asyncpipe.model.gpt import GPT, lm_loss

    cfg = engine.cfg
    model = GPT(cfg.model, engine.vocab_size, seed=cfg.seed)
    lr, decay = float(cfg.optimizer.lr), float(cfg.optimizer.weight_decay)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=decay)

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(model(x), y)

    fn = torch.compile(forward_loss, dynamic=False) if compiled else forward_loss
    m, state = cfg.train.micro_batches, {"step": 0}

    def step() -> None:
        for j in range(m):
            x, y = engine.train_data.get(state["step"] * m + j)
            (fn(x, y) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1

    return step


def _stepper(mode: str, model: str):
    """A function running one training step of ``mode`` and returning its wall time in seconds."""
    import time

    from asyncpipe.config import compose
    from asyncpipe.trainer import Trainer

    compiled = mode.endswith("compiled")
    cfg = compose([*STUDY, f"model={model}", "train.steps=1100",
                   f"train.compile={compiled and not mode.startswith('bare')}"])  # fmt: skip
    engine = Trainer(cfg).engine
    if not mode.startswith("bare"):
        return lambda: engine.train_step().step_time
    bare = _bare_step(engine, compiled)

    def step() -> float:
        began = time.perf_counter()
        bare()
        return time.perf_counter() - began

    return step


def one_round(steps: int, model: str) -> list[dict]:
    """This process: every mode's step time, their timed steps taken in turn (one step of each mode, then the
    next), so each mode sees the same machine; then each mode's profile split, in ms per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    steppers = {mode: _stepper(mode, model) for mode in MODES}
    for step in steppers.values():
        for _ in range(5):  # warm-up; the compiled modes compile here
            step()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(steps):
        for mode, step in steppers.items():
            times[mode].append(step())
    runs = []
    for mode, step in steppers.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_STEPS):
                step()
        split = {"matmul": 0.0, "attention": 0.0, "rest": 0.0}
        for event in prof.key_averages():
            split[_kind(event.key)] += event.self_cpu_time_total / 1e3 / PROFILED_STEPS  # us -> ms per step
        runs.append({"mode": mode, "step_ms": statistics.median(times[mode]) * 1e3, "profiled_ms": split,
                     "threads": torch.get_num_threads(), "load": os.getloadavg()[0]})  # fmt: skip
    return runs


def table(models: tuple[str, ...] = ("tiny", "small")) -> str:
    """The markdown table of the committed profiles (docs/performance.md holds it; a test re-renders it)."""
    head = ("| model | eager step (tok/s) | compiled step (tok/s) | compiled speed-up, per round | ceiling | "
            "bare loop's compiled speed-up | simulator / bare loop step, eager | the same, compiled | measured at |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for model in models:
        bench = json.loads((RESULTS / f"compile-profile-{model}.json").read_text())
        tokens = math.prod(int(o.split("=")[1]) for o in STUDY if o.split("=")[0] in TOKEN_DIMS)
        step = {mode: statistics.median(r["step_ms"] for r in bench["runs"] if r["mode"] == mode) for mode in MODES}

        def per_round(key: str) -> str:
            return ", ".join(f"{r[key]:.2f}x" for r in bench["rounds"])

        lines.append(f"| {model} | {step['eager']:.0f} ms ({tokens / step['eager'] * 1e3:.0f}) | "
                     f"{step['compiled']:.0f} ms ({tokens / step['compiled'] * 1e3:.0f}) | {per_round('speedup')} | "
                     f"{per_round('ceiling')} | {per_round('bare_speedup')} | {per_round('over_bare_eager')} | "
                     f"{per_round('over_bare_compiled')} | {bench['git']['commit'][:7]} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per mode (their median is the step time)")
    ap.add_argument("--rounds", type=int, default=3, help="this many fresh processes, each measuring every mode")
    ap.add_argument("--model", default="tiny", help="model preset (conf/model), in the study's regime otherwise")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/compile-profile-{model}.json")
    ap.add_argument("--table", action="store_true", help="print the committed profiles' table (no measuring)")
    ap.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.table:
        print(table())
        return 0
    if args.one_round:
        print(json.dumps(one_round(args.steps, args.model)))
        return 0
    from asyncpipe.track.files import atomic_write_json
    from asyncpipe.track.provenance import cpu_model, git_state

    runs, rounds = [], []
    for round_ in range(1, args.rounds + 1):
        command = [sys.executable, __file__, "--one-round", "--steps", str(args.steps), "--model", args.model]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        pair = {}
        for run in json.loads(out.stdout.strip().splitlines()[-1]):
            pair[run["mode"]] = run = {"round": round_, **run}
            runs.append(run)
            p = run["profiled_ms"]
            print(f"round {round_} {run['mode']:13s} {run['step_ms']:6.1f} ms/step; profiled: matmul "
                  f"{p['matmul']:6.1f}, attention {p['attention']:6.1f}, rest {p['rest']:6.1f} ms  "
                  f"(load {run['load']:.2f})", flush=True)  # fmt: skip
        ms = {mode: run["step_ms"] for mode, run in pair.items()}
        e, c = pair["eager"]["profiled_ms"], pair["compiled"]["profiled_ms"]
        rounds.append({"speedup": ms["eager"] / ms["compiled"],
                       "ceiling": sum(e.values()) / (e["matmul"] + e["attention"]),
                       "aten_share_compiled": (c["matmul"] + c["attention"]) / sum(c.values()),
                       "bare_speedup": ms["bare eager"] / ms["bare compiled"],
                       "over_bare_eager": ms["eager"] / ms["bare eager"],
                       "over_bare_compiled": ms["compiled"] / ms["bare compiled"]})  # fmt: skip
    result = {"model": args.model, "steps": args.steps, "runs": runs, "rounds": rounds,
              "git": git_state(Path(__file__).parent), "cpu": cpu_model()}  # fmt: skip
    for key, text in (("speedup", "compiled / eager step time"), ("ceiling", "ceiling (all but matmul and attention "
                      "free)"), ("aten_share_compiled", "matmul + attention share of a compiled step"),
                      ("bare_speedup", "bare loop: eager / compiled step time"),
                      ("over_bare_eager", "simulator / bare loop step time, eager"),
                      ("over_bare_compiled", "simulator / bare loop step time, compiled")):  # fmt: skip
        values = [r[key] for r in rounds]
        shown = [f"{v:.0%}" if key == "aten_share_compiled" else f"{v:.2f}x" for v in values]
        print(f"{text}: {', '.join(shown)} (per round)")
    out_path = args.out or RESULTS / f"compile-profile-{args.model}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_path, result)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
