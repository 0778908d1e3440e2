"""Where a training step's time goes, eager against compiled (`train.compile`): the ceiling on what compiling can buy.

torch.compile fuses the elementwise work (norms, RoPE, SiLU, the loss, their backwards) into generated kernels; the
matrix multiplications and the attention kernel stay calls into ATen in both modes. So the eager step's time in
those calls bounds the speed-up: even a compiler that made everything else free could not beat

    eager step / (matmul + attention of the eager step)

Each mode runs in a fresh process (as `compile_speed.py`), eager then compiled, ``--rounds`` times (this VM's
speed drifts between processes, so the rounds show the spread), in the CPU study's regime (its STUDY overrides): build
the trainer, 5 warm-up steps (the compiled run compiles there, from the inductor cache when warm), ``--steps``
timed steps (their median is the step time), then 5 steps under torch.profiler, whose self CPU time per operator
is split into matmul (aten::mm, addmm, bmm), attention (the SDPA kernels, forward and backward) and the rest.

Each round also runs a bare loop the same way, eager and compiled (the yardstick issue 29 quotes): the same model,
initialisation, data and micro-batches, `torch.optim.AdamW`, and per micro-batch ``lm_loss(model(x), y)`` (compiled
with `torch.compile` as one function) and its backward, then the optimizer step: no delayed weights, clipping,
compensation, metrics or run directory. Simulator / bare step time says what asyncpipe itself costs in each mode.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_profile.py            # ~4 min with a warm cache
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_speed import STUDY  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "compile-profile-tiny.json"
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm")
MODES = ("eager", "compiled", "bare eager", "bare compiled")
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
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg.optimizer.lr), weight_decay=float(cfg.optimizer.weight_decay))

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


def one_mode(mode: str, steps: int) -> dict:
    """This process: the step time of one mode and its profile split, in ms per step."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from asyncpipe.config import compose
    from asyncpipe.trainer import Trainer

    compiled = mode.endswith("compiled")
    cfg = compose([*STUDY, "train.steps=1100", f"train.compile={compiled and not mode.startswith('bare')}"])
    engine = Trainer(cfg).engine
    if mode.startswith("bare"):
        bare = _bare_step(engine, compiled)

        def step() -> float:
            began = time.perf_counter()
            bare()
            return time.perf_counter() - began
    else:

        def step() -> float:
            return engine.train_step().step_time

    for _ in range(5):
        step()
    step_s = statistics.median(step() for _ in range(steps))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
    split = {"matmul": 0.0, "attention": 0.0, "rest": 0.0}
    for event in prof.key_averages():
        split[_kind(event.key)] += event.self_cpu_time_total / 1e3 / PROFILED_STEPS  # us -> ms per step
    return {"mode": mode, "step_ms": step_s * 1e3, "profiled_ms": split, "threads": torch.get_num_threads(),
            "load": os.getloadavg()[0]}  # fmt: skip


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per mode (their median is the step time)")
    ap.add_argument("--rounds", type=int, default=3, help="eager then compiled, each a fresh process, this many times")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_mode(args.one, args.steps)))
        return 0
    from asyncpipe.track.files import atomic_write_json
    from asyncpipe.track.provenance import cpu_model, git_state

    runs, rounds = [], []
    for round_ in range(1, args.rounds + 1):
        pair = {}
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            pair[mode] = run = {"round": round_, **json.loads(out.stdout.strip().splitlines()[-1])}
            runs.append(run)
            p = run["profiled_ms"]
            print(f"round {round_} {mode:13s} {run['step_ms']:6.1f} ms/step; profiled: matmul {p['matmul']:6.1f}, "
                  f"attention {p['attention']:6.1f}, rest {p['rest']:6.1f} ms  (load {run['load']:.2f})", flush=True)
        ms = {mode: run["step_ms"] for mode, run in pair.items()}
        e, c = pair["eager"]["profiled_ms"], pair["compiled"]["profiled_ms"]
        rounds.append({"speedup": ms["eager"] / ms["compiled"],
                       "ceiling": sum(e.values()) / (e["matmul"] + e["attention"]),
                       "aten_share_compiled": (c["matmul"] + c["attention"]) / sum(c.values()),
                       "bare_speedup": ms["bare eager"] / ms["bare compiled"],
                       "over_bare_eager": ms["eager"] / ms["bare eager"],
                       "over_bare_compiled": ms["compiled"] / ms["bare compiled"]})  # fmt: skip
    result = {"runs": runs, "rounds": rounds, "git": git_state(Path(__file__).parent), "cpu": cpu_model()}
    for key, text in (("speedup", "compiled / eager step time"), ("ceiling", "ceiling (all but matmul and attention "
                      "free)"), ("aten_share_compiled", "matmul + attention share of a compiled step"),
                      ("bare_speedup", "bare loop: eager / compiled step time"),
                      ("over_bare_eager", "simulator / bare loop step time, eager"),
                      ("over_bare_compiled", "simulator / bare loop step time, compiled")):  # fmt: skip
        values = [r[key] for r in rounds]
        shown = [f"{v:.0%}" if key == "aten_share_compiled" else f"{v:.2f}x" for v in values]
        print(f"{text}: {', '.join(shown)} (per round)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
