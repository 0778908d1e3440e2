"""Pipeline throughput: DeepSpeed's flushed 1F1B (delay=0) against our 2BW engine (delay=1) on the same model,
stages and micro-batches, alternating job by job in one set of local processes after a warm-up.

Reports tokens/s of each, their ratio against the ideal (m+P-1)/m, the idle fraction per stage, and peak weight
+ optimizer (+ EF) memory per stage; optionally the simulator bench (delay=1 vs delay=0 step time) beside it.
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe.errors import UserError

VARIANTS = {"1f1b": 0, "2bw": 1}  # name -> delay
# Defaults a user override may replace: evaluation is a collective that would sit inside the timed window.
BENCH_DEFAULTS = ["train.eval_batches=1"]


def ideal_speedup(stages: int, micro_batches: int) -> float:
    """(m+P-1)/m: a flushed 1F1B batch lasts m+P-1 slots, a 2BW batch m slots, with equal-cost stages."""
    return (micro_batches + stages - 1) / micro_batches


def _tensor_bytes(obj: Any, seen: set) -> int:
    import torch

    if torch.is_tensor(obj):
        key = (obj.data_ptr(), obj.numel(), obj.dtype)
        if obj.numel() == 0 or key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def optimizer_state_bytes(cfg: DictConfig) -> list[dict[str, int]]:
    """Per stage: bytes of the optimizer's state tensors and of the EF buffer u(t-1), measured on the stage's
    own layers and optimizer (built as the engine builds them) after two steps have materialised the state."""
    import torch

    from asyncpipe.data import ensure_prepared, load_manifest
    from asyncpipe.model import build_layers, partition
    from asyncpipe.optim import build_optimizer
    from asyncpipe.train.runtime import vocab_size_for

    vocab = vocab_size_for(cfg.model, load_manifest(ensure_prepared(cfg.data, cfg.tokenizer)))
    parts = partition(cfg.model.n_layer + 2, cfg.pipeline.stages)
    out = []
    for s in range(cfg.pipeline.stages):
        layers = build_layers(cfg.model, vocab, seed=cfg.seed, indices=range(parts[s], parts[s + 1]))
        module = torch.nn.Sequential(*[layer for layer in layers if layer is not None])
        opt = build_optimizer(module, cfg.optimizer)
        for _ in range(2):
            for p in module.parameters():
                p.grad = torch.full_like(p, 1e-3)
            opt.step()
        state = opt.state_dict()
        seen: set = set()
        ef = _tensor_bytes(state.get("ef", {}), seen) if "ef" in state else 0
        inner = state["optimizer"] if "ef" in state else state
        out.append({"optimizer_state_bytes": _tensor_bytes(inner, seen), "ef_buffer_bytes": ef})
    return out


def _job_stats(result: dict, tokens_per_step: int, skip: int) -> dict:
    """Throughput and per-stage idle fraction of one job over its steady steps (``skip`` dropped at each end:
    the first pays for warm-up and allocation, the last for 2BW's drain and the final sync)."""
    hist = [h for h in result.get("history", []) if "step_time" in h]
    steady = hist[skip : len(hist) - skip] or hist
    total = sum(h["step_time"] for h in steady)
    keys = {k for h in steady for k in h if k.startswith("stage") and k.endswith("_idle_frac")}
    stages = sorted(int(k[len("stage") : -len("_idle_frac")]) for k in keys)
    return {
        "tokens_per_s": tokens_per_step * len(steady) / total if total > 0 else float("nan"),
        "step_time_s": total / len(steady) if steady else float("nan"),
        "min_step_time_s": min((h["step_time"] for h in steady), default=float("nan")),
        "steps_timed": len(steady),
        "idle_frac": [statistics.median(h[f"stage{s}_idle_frac"] for h in steady) for s in stages],
        "stages": result.get("stages", []),
    }


def _compute(summaries: list[dict], stage: int) -> float:
    return next((x["compute_s"] for x in summaries if x.get("stage") == stage and x.get("replica", 0) == 0), 0.0)


def bench_pipeline(
    overrides: Sequence[str],
    rounds: int = 3,
    steps: int = 6,
    warmup_steps: int = 3,
    skip: int = 1,
    simulator: bool = False,
    simulator_rounds: int = 3,
    log: Callable[[str], None] = print,
    compose: Optional[Callable[[list[str]], DictConfig]] = None,
) -> dict:
    """Run warm-up, then ``rounds`` x [1F1B, 2BW] jobs of ``steps`` steps each in one `launch_many`; medians."""
    from asyncpipe.config import compose as default_compose
    from asyncpipe.pipe.local import launch_many

    compose = compose or default_compose
    if steps < 2 * skip + 1:
        raise UserError(f"--steps {steps} leaves no timed step after dropping {skip} at each end;"
                        f" use >= {2 * skip + 1}")
    if rounds < 1:
        raise UserError(f"--rounds {rounds} must be >= 1 (alternating [1F1B, 2BW] rounds)")
    base = [*BENCH_DEFAULTS, *overrides, "engine=pipeline", f"train.steps={steps}", f"train.eval_every={steps}"]
    cfgs = {name: compose([*base, f"delay={d}"]) for name, d in VARIANTS.items()}
    warm = compose([*BENCH_DEFAULTS, *overrides, "engine=pipeline", "delay=1", f"train.steps={max(1, warmup_steps)}"])
    cfg = cfgs["2bw"]
    t, p = cfg.train, cfg.pipeline
    P, m = p.stages, t.micro_batches
    tokens_per_step = t.micro_batch_size * m * p.data_parallel * t.seq_len
    order = [name for _ in range(rounds) for name in VARIANTS]
    log(f"bench pipeline: model {cfg.model.name}, P={P}, m={m}, {p.threads} thread(s)/process, "
        f"warm-up {warmup_steps} steps, then {rounds} x {list(VARIANTS)} of {steps} steps")  # fmt: skip

    def progress(job: int, rec: dict) -> None:
        name = "warm-up" if job == 0 else order[job - 1]
        if "step_time" in rec:
            ms = rec["step_time"] * 1e3
            log(f"  job {job} {name:7s} step {rec['step']}: {ms:8.1f} ms  {rec['tokens_per_s']:9.0f} tok/s")

    results = launch_many([warm, *[cfgs[n] for n in order]], on_step=progress)[1:]
    per_job = [(name, _job_stats(r, tokens_per_step, skip)) for name, r in zip(order, results)]
    out: dict[str, Any] = {
        "bench": "pipeline",
        "model": cfg.model.name,
        "optimizer": cfg.optimizer.name,
        "ef": bool(cfg.optimizer.ef.enabled),
        "stages": P,
        "micro_batches": m,
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "data_parallel": p.data_parallel,
        "threads_per_process": p.threads,
        "tokens_per_step": tokens_per_step,
        "rounds": rounds,
        "steps_per_job": steps,
        "steps_dropped_each_end": skip,
        "cpu_count": os.cpu_count(),
        "load_avg": list(os.getloadavg()),
        "overrides": list(overrides),
    }
    variants: dict[str, dict] = {}
    mem = optimizer_state_bytes(cfg)
    for name in VARIANTS:
        jobs = [s for n, s in per_job if n == name]
        summaries = jobs[-1]["stages"]
        stage_mem = []
        for s in range(P):
            summ = next((x for x in summaries if x.get("stage") == s and x.get("replica", 0) == 0), {})
            peak = int(summ.get("peak_weight_bytes", 0))
            opt_b, ef_b = mem[s]["optimizer_state_bytes"], mem[s]["ef_buffer_bytes"]
            stage_mem.append({
                "param_mb": summ.get("param_bytes", 0) / 2**20, "peak_weight_mb": peak / 2**20,
                "weight_versions_peak": summ.get("weight_versions_peak", float("nan")),
                "optimizer_state_mb": opt_b / 2**20, "ef_buffer_mb": ef_b / 2**20,
                "peak_weight_plus_optimizer_mb": (peak + opt_b + ef_b) / 2**20,
            })  # fmt: skip
        variants[name] = {
            "tokens_per_s": statistics.median(j["tokens_per_s"] for j in jobs),
            "tokens_per_s_per_round": [j["tokens_per_s"] for j in jobs],
            "step_time_s": statistics.median(j["step_time_s"] for j in jobs),
            # Load on a shared machine only ever slows a step down: the fastest step is the least disturbed.
            "tokens_per_s_best_step": tokens_per_step / min(j["min_step_time_s"] for j in jobs),
            "idle_frac_per_stage": [statistics.median(j["idle_frac"][s] for j in jobs) for s in range(P)],
            # Busy (not blocked) seconds per micro-batch and stage over whole jobs (evaluation and optimizer steps
            # included): the same work in both variants, so a gap between them is CPU contention, not schedule.
            "compute_s_per_micro_batch": [statistics.median(_compute(j["stages"], s) / (steps * m) for j in jobs)
                                          for s in range(P)],
            "memory_per_stage": stage_mem,
            # Where the time went in the last job of this variant (the profile behind a missed target).
            "seconds_by_op_per_stage": [x.get("seconds_by_op", {}) for x in summaries if x.get("replica", 0) == 0],
            "seconds_blocked_in_per_stage": [x.get("seconds_blocked_in", {}) for x in summaries
                                             if x.get("replica", 0) == 0],
        }
    out["variants"] = variants
    paired = [b["tokens_per_s"] / a["tokens_per_s"] for (_, a), (_, b) in zip(per_job[0::2], per_job[1::2])]
    ratio = variants["2bw"]["tokens_per_s"] / variants["1f1b"]["tokens_per_s"]
    ideal = ideal_speedup(P, m)
    best = variants["2bw"]["tokens_per_s_best_step"] / variants["1f1b"]["tokens_per_s_best_step"]
    out.update({
        "ratio_2bw_over_1f1b": ratio, "ratio_per_round": paired, "ideal_ratio": ideal,
        "ratio_best_step": best, "fraction_of_ideal_best_step": best / ideal,
        "fraction_of_ideal": ratio / ideal, "ideal_idle_frac_1f1b": (P - 1) / (m + P - 1),
        "targets": {
            "ratio_ge_0.95_ideal": ratio >= 0.95 * ideal,
            "fastest_step_ratio_ge_0.95_ideal": best >= 0.95 * ideal,
            "weights_le_two_versions": all(x["weight_versions_peak"] <= 2.0 + 1e-9
                                           for x in variants["2bw"]["memory_per_stage"]),
        },
    })  # fmt: skip
    if simulator:
        out["simulator"] = simulator_result(overrides, simulator_rounds, log, compose, threads=p.threads)
        out["targets"]["simulator_delay1_le_1.10"] = out["simulator"]["ratio_to_delay0"]["delay1"] <= 1.10
    return out


def simulator_result(
    overrides: Sequence[str], rounds: int, log: Callable[[str], None], compose: Any, threads: int = 1
) -> dict:
    """The simulator bench (`asyncpipe.bench.simulator`) on the same overrides, at the pipeline's thread count."""
    import torch

    from asyncpipe.bench.simulator import BASIC, bench_simulator

    torch.set_num_threads(threads)  # the pipeline's processes run this many each: compare like with like
    keep = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith(("engine", "delay", "pipeline."))]
    return bench_simulator([*BENCH_DEFAULTS, *keep], rounds=rounds, steps_per_round=2, warmup=2, compose=compose,
                           log=log, variants=BASIC)


def format_result(res: dict) -> str:
    """The human-readable lines of a `bench_pipeline` result."""
    v = res["variants"]
    lines = [f"model {res['model']}  P={res['stages']}  m={res['micro_batches']}  "
             f"({res['tokens_per_step']} tokens/step, {res['threads_per_process']} thread/process, "
             f"load {res['load_avg'][0]:.2f} on {res['cpu_count']} CPUs)"]  # fmt: skip
    for name in VARIANTS:
        idle = " ".join(f"{x:.3f}" for x in v[name]["idle_frac_per_stage"])
        busy = " ".join(f"{x * 1e3:.0f}" for x in v[name]["compute_s_per_micro_batch"])
        lines.append(f"{name:5s} {v[name]['tokens_per_s']:9.0f} tok/s  {v[name]['step_time_s'] * 1e3:8.1f} ms/step  "
                     f"idle per stage {idle}  busy ms/micro-batch per stage {busy}")  # fmt: skip
    lines.append(f"2bw/1f1b {res['ratio_2bw_over_1f1b']:.3f}  ideal (m+P-1)/m {res['ideal_ratio']:.3f}  "
                 f"fraction of ideal {res['fraction_of_ideal']:.3f}  (per round: "
                 + ", ".join(f"{r:.3f}" for r in res["ratio_per_round"]) + f"; fastest steps: "
                 f"{res['ratio_best_step']:.3f} = {res['fraction_of_ideal_best_step']:.3f} of ideal)")
    for s, mem in enumerate(v["2bw"]["memory_per_stage"]):
        lines.append(f"stage {s}: params {mem['param_mb']:.2f} MB, 2bw peak weights {mem['peak_weight_mb']:.2f} MB "
                     f"({mem['weight_versions_peak']:.2f} versions), optimizer {mem['optimizer_state_mb']:.2f} MB, "
                     f"EF {mem['ef_buffer_mb']:.2f} MB, "
                     f"total {mem['peak_weight_plus_optimizer_mb']:.2f} MB")  # fmt: skip
    if "simulator" in res:
        sim = res["simulator"]
        lines.append("simulator " + ", ".join(f"{n} {sim['median_step_s'][n] * 1e3:.1f} ms (x{r:.3f})"
                                                for n, r in sim["ratio_to_delay0"].items()))  # fmt: skip
    return "\n".join(lines)
