"""What `bench pipeline` makes of its jobs' results: per variant its throughput, ratio to 1F1B (per round too),
idle and blocked time, memory per stage and where the time went; the schedule model's bubbles at the measured
cost ratio; 2BW's and PACI's targets. Also the measurements it needs besides the jobs (optimizer state bytes)."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe.bench import torch_pipelining as pt
from asyncpipe.partition import cut_blocks


@dataclass
class BenchPlan:
    """What a `bench pipeline` run will launch: the variants' configs, their order over the rounds, the shape."""

    cfgs: dict[str, DictConfig]  # variant (+compiled) -> its composed config
    order: list[str]  # the jobs after the warm-up: every variant once per round
    P: int
    m: int
    D: int
    train: Any  # the probe config's train node
    pipeline: Any  # and its pipeline node
    tokens_per_step: int
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> why it does not run

    @property
    def names(self) -> list[str]:
        return list(self.cfgs)


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
    own layers (two chunks in a V for DualPipeV) and optimizer, built as the engine builds them, after two steps
    have materialised the state. Reads the dataset's vocabulary: the bench's runs prepared the data."""
    import torch

    from asyncpipe.data import dataset_dir, load_manifest
    from asyncpipe.model import build_layers, stage_layers
    from asyncpipe.optim import build_optimizer
    from asyncpipe.runtime.device import vocab_size_for

    vocab = vocab_size_for(cfg.model, load_manifest(dataset_dir(cfg.data, cfg.tokenizer)))
    from asyncpipe.schedules import resolve

    v_shape = resolve(cfg).chunks == 2
    torch_schedule = cfg.pipeline.get("torch_schedule") is not None
    out = []
    for s in range(cfg.pipeline.stages):
        _, mine = stage_layers(cfg.model.n_layer + 2, cfg.pipeline.stages, s, v_shape, cut_blocks(cfg))
        mine = pt.layers_of(cfg, s) if torch_schedule else mine
        layers = build_layers(cfg.model, vocab, seed=cfg.seed, indices=mine)
        module = torch.nn.Sequential(*[layer for layer in layers if layer is not None])
        ef = cfg.compensation if cfg.compensation.name == "ef" else None  # EF's buffer counted apart; no other method
        opt = build_optimizer(module, cfg.optimizer, compensation=ef)
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


def job_stats(result: dict, tokens_per_step: int, skip: int) -> dict:
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
        "norm_wait_s": [statistics.median(h.get(f"stage{s}_norm_wait_s", 0.0) for h in steady) for s in stages],
        "stages": result.get("stages", []),
    }


def _compute(summaries: list[dict], stage: int) -> float:
    return next((x["compute_s"] for x in summaries if x.get("stage") == stage and x.get("replica", 0) == 0), 0.0)


def stage_cost_model(summaries: list[dict], P: int, m: int, steps: int, batches: int = 4) -> dict:
    """1F1B's and 2BW's step times replayed from the engine's own instruction streams at the measured per-stage
    costs (forward, backward per micro-batch; optimizer step and gradient reduction per batch, blocked time
    excluded) of one job: the ratio these unequal stages allow, to hold the measured ratio against."""
    from asyncpipe.schedules import get
    from asyncpipe.schedules.streams import stream
    from asyncpipe.timelines.timeline import simulate

    by_stage = {x["stage"]: x for x in summaries if x.get("replica", 0) == 0}
    ops = [by_stage.get(s, {}).get("seconds_by_op", {}) for s in range(P)]
    blocked = [sum(by_stage.get(s, {}).get("seconds_blocked_in", {}).values()) for s in range(P)]
    fwd = [o.get("ForwardPass", 0.0) / (steps * m) for o in ops]  # includes a few cheap evaluation forwards
    bwd = [o.get("BackwardPass", 0.0) / (steps * m) for o in ops]
    upd = [(o.get("OptimizerStep", 0.0) + o.get("ReduceGrads", 0.0) - w) / steps for o, w in zip(ops, blocked)]
    costs = {"forward": fwd, "backward": bwd, "step": upd}

    def per_batch(kind: str) -> float:
        runs = [
            simulate([stream(kind, m, P, s, n) for s in range(P)], collective_steps=True, **costs).makespan
            for n in (batches, batches + 1)
        ]
        return runs[1] - runs[0]

    t1, t2 = per_batch("1f1b"), per_batch("2bw-deferred") if get("2bw").fits(P, m) else float("nan")
    return {
        "forward_s": fwd,
        "backward_s": bwd,
        "step_s": upd,
        "step_time_1f1b_s": t1,
        "step_time_2bw_s": t2,
        "ratio_2bw_over_1f1b": t1 / t2,
        "fraction_of_ideal": t1 / t2 / ideal_speedup(P, m),
    }


def _standin_records(cfgs: dict, jobs: dict, P: int, m: int, skip: int) -> dict:
    """Each variant's stand-in record (`asyncpipe.bench.standin`): F, B per stage as configured, or a per-layer
    profile's per chunk under the variant's cut (`pipeline.standin.profile`)."""
    from asyncpipe.bench.standin import stage_figures, standin_record
    from asyncpipe.standin_costs import profile_of

    recs = []
    for n, js in jobs.items():
        F, B, chunks = stage_figures(cfgs[n])
        recs.append({"variant": n, **standin_record(cfgs[n].pipeline.schedule, P, m, F, B, js, skip, chunks=chunks)})
        recs[-1]["cut"] = cut_blocks(cfgs[n])
    cfg = next(iter(cfgs.values()))
    node = cfg.pipeline.standin
    out = {"forward_s": float(node.forward_s), "backward_s": float(node.backward_s), "records": recs}
    if profile_of(cfg):
        out.update(profile=profile_of(cfg), scale=float(node.get("scale", 1.0)))
    return out


def _stage_memory(summaries: list[dict], mem: list[dict], P: int) -> list[dict]:
    out = []
    for s in range(P):
        summ = next((x for x in summaries if x.get("stage") == s and x.get("replica", 0) == 0), {})
        peak, act = int(summ.get("peak_weight_bytes", 0)), int(summ.get("peak_activation_bytes", 0))
        opt_b, ef_b = mem[s]["optimizer_state_bytes"], mem[s]["ef_buffer_bytes"]
        out.append(
            {
                "param_mb": summ.get("param_bytes", 0) / 2**20,
                "peak_weight_mb": peak / 2**20,
                "weight_versions_peak": summ.get("weight_versions_peak", float("nan")),
                "optimizer_state_mb": opt_b / 2**20,
                "ef_buffer_mb": ef_b / 2**20,
                "peak_weight_plus_optimizer_mb": (peak + opt_b + ef_b) / 2**20,
                "peak_activation_mb": act / 2**20,
                "activation_mb_per_micro_batch": summ.get("activation_bytes_per_micro_batch", 0) / 2**20,
                # The whole process's peak resident memory since the stage was built (CUDA: allocator peak).
                "peak_process_mb": summ.get("peak_mem_bytes", -1) / 2**20,
            }
        )
    return out


def summarise(
    plan: BenchPlan,
    results: Sequence[dict],
    loads: tuple[list, list],
    overrides: Sequence[str],
    rounds: int,
    steps: int,
    skip: int,
    standin: Optional[tuple[float, float]] = None,
) -> dict:
    """The bench's record from its jobs' results (one per job of ``plan.order``) and the load before and after."""
    from asyncpipe.standin_costs import profile_of
    from asyncpipe.timelines.orders import bubble_table

    P, m, t, p = plan.P, plan.m, plan.train, plan.pipeline
    per_job = [(name, job_stats(r, plan.tokens_per_step, skip)) for name, r in zip(plan.order, results)]
    jobs = {n: [st for name, st in per_job if name == n] for n in plan.names}
    cfg = next(iter(plan.cfgs.values()))
    out: dict[str, Any] = {
        "bench": "pipeline",
        "model": cfg.model.name,
        "optimizer": cfg.optimizer.name,
        "ef": cfg.compensation.name == "ef",
        "stages": P,
        "micro_batches": m,
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "data_parallel": plan.D,
        "threads_per_process": p.threads,
        "tokens_per_step": plan.tokens_per_step,
        "rounds": rounds,
        "steps_per_job": steps,
        "steps_dropped_each_end": skip,
        "cpu_count": os.cpu_count(),
        "load_avg": loads[0],
        "load_avg_after": loads[1],
        "overrides": list(overrides),
        "skipped": plan.skipped,
    }
    # The schedule model's bubbles at this run's measured backward/forward cost ratio (2BW's stages, whole jobs).
    last_2bw = (jobs.get("2bw") or jobs[plan.names[0]])[-1]["stages"]
    fwd = sum(x.get("seconds_by_op", {}).get("ForwardPass", 0.0) for x in last_2bw)
    bwd = sum(x.get("seconds_by_op", {}).get("BackwardPass", 0.0) for x in last_2bw)
    b_over_f = bwd / fwd if fwd > 0 and bwd > 0 else 2.0
    analytic = bubble_table(P, m, 1.0, b_over_f)
    out["backward_over_forward"] = b_over_f
    out["analytic_bubble"] = analytic
    out["variants"] = variants = _variants(plan, jobs, analytic, b_over_f, steps)
    _ratios(variants, analytic)
    if standin or profile_of(cfg):
        out["standin"] = _standin_records(plan.cfgs, jobs, P, m, skip)
    if "2bw" in jobs:
        out["stage_cost_model"] = stage_cost_model(jobs["2bw"][-1]["stages"], P, m, steps)
    _targets(out, variants, P, m)
    return out


def _variants(plan: BenchPlan, jobs: dict, analytic: dict, b_over_f: float, steps: int) -> dict[str, dict]:
    """Per variant: its medians over the rounds, its memory per stage and where its last job's time went."""
    from asyncpipe.schedules import resolve

    P, m = plan.P, plan.m
    mem_cache: dict[tuple, list] = {}
    out: dict[str, dict] = {}
    for name in plan.names:
        js, cfg = jobs[name], plan.cfgs[name]
        key = (cfg.pipeline.schedule, cfg.pipeline.get("torch_schedule"), cfg.compensation.name == "ef")
        if key not in mem_cache:
            mem_cache[key] = optimizer_state_bytes(cfg)
        summaries = js[-1]["stages"]
        first = [x for x in summaries if x.get("replica", 0) == 0]
        base_name = name.split("+")[0]
        spec = resolve(cfg)
        # No flush: 2BW's steady state (paci-recompute's recomputed forwards are not in it); a flush: its own order's bubble.
        bub = (
            pt.analytic_bubble(base_name, P, m, b_over_f)
            if pt.is_torch(base_name)
            else analytic["2bw"]
            if not spec.flush
            else analytic.get(spec.orders or spec.name)
        )
        out[name] = {
            "schedule": pt.label(name) if pt.is_torch(name) else f"asyncpipe/DeepSpeed {base_name}",
            "cut": cut_blocks(cfg) if not pt.is_torch(base_name) else None,  # blocks per stage (a V: per chunk)
            "synchronous": pt.is_torch(base_name) or spec.flush,
            "tokens_per_s": statistics.median(j["tokens_per_s"] for j in js),
            "tokens_per_s_per_round": [j["tokens_per_s"] for j in js],
            "step_time_s": statistics.median(j["step_time_s"] for j in js),
            # Load on a shared machine only ever slows a step down: the fastest step is the least disturbed.
            "tokens_per_s_best_step": plan.tokens_per_step / min(j["min_step_time_s"] for j in js),
            "idle_frac_per_stage": [statistics.median(j["idle_frac"][s] for j in js) for s in range(P)],
            "norm_wait_ms_per_step": [1e3 * statistics.median(j["norm_wait_s"][s] for j in js) for s in range(P)],
            "analytic_bubble": bub,
            # Busy (not blocked) seconds per micro-batch and stage over whole jobs (evaluation and optimizer steps
            # included): the same work in every variant, so a gap between them is CPU contention, not schedule.
            "compute_s_per_micro_batch": [
                statistics.median(_compute(j["stages"], s) / (steps * m) for j in js) for s in range(P)
            ],
            "memory_per_stage": _stage_memory(summaries, mem_cache[key], P),
            # Where the time went in the last job of this variant (the profile behind a missed target).
            "seconds_by_op_per_stage": [x.get("seconds_by_op", {}) for x in first],
            "seconds_blocked_in_per_stage": [x.get("seconds_blocked_in", {}) for x in first],
            "compile_s_per_stage": [x.get("compile_s") for x in first],
            # Backwards whose forward was recomputed first (paci-recompute's straddlers): the cost model takes them out.
            "recomputed_backwards_per_stage": [x.get("recomputed_backwards", 0) for x in first],
            # What measured idle / wait / compute: host clocks (CPU, trace) or CUDA events (engines.pipeline.clock).
            "timing": sorted({x.get("timing", "host") for x in summaries}),
        }
    return out


def _ratios(variants: dict[str, dict], analytic: dict) -> None:
    """Each variant against the same mode's 1F1B (per round: paired), and a compiled one against its eager run."""
    for name, v in variants.items():
        ref = variants["1f1b" + name[len(name.split("+")[0]) :]]  # the same mode's 1F1B
        # Same work per batch: the ideal speed-up is the ratio of busy fractions, (1 - bubble) / (1 - 1F1B's bubble).
        ideal = (1 - v["analytic_bubble"]) / (1 - analytic["1f1b"]) if v["analytic_bubble"] is not None else None
        v["ratio_to_1f1b"] = v["tokens_per_s"] / ref["tokens_per_s"]
        # Paired within a round: jobs of the same round ran back to back under the same load.
        v["ratio_to_1f1b_per_round"] = [
            a / b for a, b in zip(v["tokens_per_s_per_round"], ref["tokens_per_s_per_round"])
        ]
        v["ratio_to_1f1b_best_step"] = v["tokens_per_s_best_step"] / ref["tokens_per_s_best_step"]
        v["ideal_ratio_to_1f1b"] = ideal
        v["fraction_of_ideal"] = v["ratio_to_1f1b"] / ideal if ideal else None
        eager = variants.get(name.split("+")[0])
        if name.endswith("+compiled") and eager is not None:
            per_round = [a / b for a, b in zip(v["tokens_per_s_per_round"], eager["tokens_per_s_per_round"])]
            v["compile_speedup"] = v["tokens_per_s"] / eager["tokens_per_s"]
            v["compile_speedup_per_round"] = per_round
            v["compile_speedup_within_spread"] = min(per_round) <= 1.0 <= max(per_round)


def _targets(out: dict, variants: dict[str, dict], P: int, m: int) -> None:
    """2BW's ratio to 1F1B against the ideal, and PACI's memory and speed against 1F1B's and 2BW's."""
    ideal = ideal_speedup(P, m)
    if "2bw" in variants:
        v2 = variants["2bw"]
        out.update(
            {
                "ratio_2bw_over_1f1b": v2["ratio_to_1f1b"],
                "ratio_per_round": v2["ratio_to_1f1b_per_round"],
                "ideal_ratio": ideal,
                "ratio_best_step": v2["ratio_to_1f1b_best_step"],
                "fraction_of_ideal_best_step": v2["ratio_to_1f1b_best_step"] / ideal,
                "fraction_of_ideal": v2["ratio_to_1f1b"] / ideal,
                "ideal_idle_frac_1f1b": (P - 1) / (m + P - 1),
                "targets": {
                    "ratio_ge_0.95_ideal": v2["ratio_to_1f1b"] >= 0.95 * ideal,
                    "fastest_step_ratio_ge_0.95_ideal": v2["ratio_to_1f1b_best_step"] >= 0.95 * ideal,
                    "weights_le_two_versions": all(
                        x["weight_versions_peak"] <= 2.0 + 1e-9 for x in v2["memory_per_stage"]
                    ),
                },
            }
        )
    if "paci" in variants:
        vp, one = variants["paci"], variants.get("1f1b")
        weights = lambda v: [x["peak_weight_mb"] for x in v["memory_per_stage"]]  # noqa: E731
        out.setdefault("targets", {}).update(
            {
                "paci_weights_equal_1f1b": one is not None and weights(vp) == weights(one),
                "paci_tokens_per_s_ge_2bw": "2bw" in variants and vp["tokens_per_s"] >= variants["2bw"]["tokens_per_s"],
            }
        )
