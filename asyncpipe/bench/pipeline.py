"""Pipeline throughput: every declared schedule the pipeline engine runs (`asyncpipe.schedules`: DeepSpeed's flushed
1F1B and DualPipeV, 2BW, PACI, and one registered from outside by import path) and 2BW + EF, on the same model,
data, stages and micro-batches, alternating job by job in one set of local processes after a warm-up.

Each schedule runs eager, compiled (`train.compile`; rows named `<schedule>+compiled`) or both; a compiled row's
ratios are to compiled 1F1B, and `compile_speedup` is its tokens/s over the eager row's, paired round by round.
Per schedule: tokens/s and their ratio to 1F1B against the schedule model's ideal (`asyncpipe.timelines.orders`
bubbles; (m+P-1)/m for 2BW), the idle fraction and norm all-reduce wait per stage, and per stage the peak
weight (versions), optimizer (+ EF) and activation memory; optionally the simulator bench beside it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe.bench import torch_pipelining as pt
from asyncpipe.bench.pipeline_format import MIN_ROUNDS, format_result, spread_note  # noqa: F401 (re-exported)
from asyncpipe.bench.pipeline_summary import BenchPlan, summarise
from asyncpipe.errors import Stopped, UserError

EF_VARIANT = {"2bw_ef": ["pipeline.schedule=2bw", "delay=1", "compensation=ef"]}  # a schedule + a method


def variants_of(names: Sequence[str]) -> dict[str, list[str]]:
    """Variant name -> overrides on top of the user's (every variant runs the same model, data, stages and
    micro-batches): a declared schedule by name or import path, ``all`` (every schedule the pipeline engine runs,
    2bw_ef and PyTorch's own, pt_*), 2bw_ef or a pt_* one. The schedule's own delay and, where it cannot clip globally, per-stage clipping."""
    from asyncpipe.schedules import get, schedules

    if list(names) == ["all"]:
        names = [s.name for s in schedules() if "pipeline" in s.engines] + list(EF_VARIANT) + list(pt.VARIANTS)
    out = {}
    for name in names:
        if name in EF_VARIANT or name in pt.VARIANTS:  # PyTorch's own schedules: `asyncpipe.bench.torch_pipelining`
            out[name] = {**EF_VARIANT, **pt.VARIANTS}[name]
            continue
        spec = get(name)
        if "pipeline" not in spec.engines:
            raise UserError(f"variant {name}: pipeline.schedule={spec.name} runs only in engine=simulate")
        out[name] = [f"pipeline.schedule={name}", f"delay={1 if spec.delay is None else spec.delay}"]
        out[name] += [] if "global" in spec.clip_modes else [f"pipeline.clip={spec.clip_modes[0]}"]
    return out


# Defaults a user override may replace: evaluation is a collective that would sit inside the timed window.
BENCH_DEFAULTS = ["train.eval_batches=1"]


def check_jobs(what: str, labels: Sequence[str], results: Sequence[dict], steps: int) -> None:
    """Every bench job ran all its steps, else: a stop signal (`Stopped`: one line, nothing written) or a failure."""
    from asyncpipe.errors import Stopped
    from asyncpipe.status import INTERRUPTED

    for label, r in zip(labels, results):
        if r.get("status") == INTERRUPTED:
            done = sum(x.get("status") == "completed" for x in results)
            raise Stopped(f"{what} stopped by a signal at {label}, {done} of {len(results)} jobs done; nothing written")
        if r.get("status") != "completed" or len(r.get("history", [])) < steps:
            raise RuntimeError(
                f"{what}: {label} ended {r.get('status', 'without a result')} after "
                f"{len(r.get('history', []))} of {steps} steps"
            )


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
    variants: Sequence[str] = ("all",),
    modes: Sequence[str] = ("eager",),
    standin: Optional[tuple[float, float]] = None,
    stop: Optional[Any] = None,
    cuts: Sequence[str] = (),
) -> dict:
    """Run warm-up, then ``rounds`` x ``variants`` jobs of ``steps`` steps each in one launch; medians.
    ``stop``: the caller's entered `StopRequest` (a signal before the launch: `Stopped`, nothing started).
    A variant that cannot run this configuration (DualPipeV with m < 2P) is reported with the reason.
    ``standin`` (F, B): stand-in compute (`asyncpipe.bench.standin`), its records under ``standin``.
    ``cuts`` (`pipeline.cut` values, e.g. even, balanced): every variant once per cut, named ``variant+cut``, in
    the same rounds; the result's ``cuts`` holds each schedule's balanced / even ratio beside the cost model's
    (`asyncpipe.bench.pipeline_cuts`)."""
    from asyncpipe.config import compose as default_compose

    compose = compose or default_compose
    if steps < 2 * skip + 1:
        raise UserError(
            f"--steps {steps} leaves no timed step after dropping {skip} at each end; use >= {2 * skip + 1}"
        )
    if rounds < 1:
        raise UserError(f"--rounds {rounds} must be >= 1 (alternating rounds of every schedule)")
    plan, warm = plan_bench(overrides, rounds, steps, warmup_steps, compose, variants, modes, standin, cuts)
    results, loads = run_bench(plan, warm, warmup_steps, rounds, steps, log, stop)
    out = summarise(plan, results, loads, overrides, rounds, steps, skip, standin)
    if "standin" not in out:  # real compute: how stage 0's time splits between its embedding and its blocks
        from asyncpipe.bench.layer_profile import layer_profile

        out["layer_profile"] = layer_profile(next(iter(plan.cfgs.values())), threads=plan.pipeline.threads)
    if cuts:
        from asyncpipe.bench.pipeline_cuts import cut_comparison

        out["cuts"] = cut_comparison(out, plan.cfgs, cuts)
    if simulator:
        out["simulator"] = simulator_result(overrides, simulator_rounds, log, compose, threads=plan.pipeline.threads)
        out.setdefault("targets", {})["simulator_delay1_le_1.10"] = (
            out["simulator"]["ratio_to_delay0"]["delay1"] <= 1.10
        )
    return out


def plan_bench(
    overrides: Sequence[str],
    rounds: int,
    steps: int,
    warmup_steps: int,
    compose: Callable[[list[str]], DictConfig],
    variants: Sequence[str],
    modes: Sequence[str],
    standin: Optional[tuple[float, float]],
    cuts: Sequence[str] = (),
) -> tuple[BenchPlan, DictConfig]:
    """Every variant's config (and why one that cannot run is skipped), their order over the rounds, and the
    warm-up job's config; with ``cuts``, one variant per (variant, cut), named ``variant+cut``."""
    from asyncpipe.bench.standin import standin_overrides
    from asyncpipe.errors import ConfigError
    from asyncpipe.plan import budgeted
    from asyncpipe.schedules import resolve

    import torch

    if not torch.cuda.is_available():  # else DeepSpeed warns "Setting accelerator to CPU" in the middle of the output
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    table = variants_of(variants)
    from asyncpipe.partition import CUTS

    if set(cuts) - set(CUTS) or len(set(cuts)) != len(cuts):
        raise UserError(f"--cuts {','.join(cuts)}: give distinct cuts among {', '.join(CUTS)} (e.g. even,balanced)")
    if "1f1b" not in table:
        raise UserError(f"variants must include 1f1b (the reference); got {', '.join(variants)}")
    if not modes or set(modes) - {"eager", "compiled"}:
        raise UserError(f"--compile {','.join(modes)}: give eager, compiled or both")
    fake = standin_overrides(*standin) if standin else []
    base = [*BENCH_DEFAULTS, *overrides, *fake, "engine=pipeline", f"train.steps={steps}", f"train.eval_every={steps}"]
    probe = compose([*base, "delay=1"])
    t, p = probe.train, probe.pipeline
    P, m, D = p.stages, t.micro_batches, p.data_parallel
    skipped: dict[str, str] = dict(pt.skip_reasons(list(table), base, compose, P, m, modes))
    eval_v = [f"train.eval_batches={max(t.eval_batches, 2 * P * D)}"]  # a V evaluates >= 2P micro-batches too
    cfgs = {}
    for n, over in table.items():
        if n in skipped:
            continue
        try:
            v_shape = resolve(compose([*base, *over])).chunks == 2
        except ConfigError as err:  # e.g. DualPipeV with m < 2P: said, not failed
            skipped[n] = f"not run: {err}"
            continue
        for mode in modes:
            for cut in cuts or [None]:
                at = [f"pipeline.cut={cut}"] if cut else []
                name = n + (f"+{cut}" if cut else "") + ("" if mode == "eager" else "+compiled")
                mine = [*base, *over, *at, *(eval_v if v_shape else []), f"train.compile={mode == 'compiled'}"]
                try:  # a balanced cut within pipeline.memory_gib: resolved once, as a run's
                    cfgs[name] = budgeted(compose(mine))
                except ConfigError as err:  # no cut of this schedule fits the budget: said, not failed
                    skipped[name] = f"not run: {err}"
    if not any(name.split("+")[0] == "1f1b" for name in cfgs):
        raise UserError(f"bench pipeline: the reference 1f1b cannot run: {next(iter(skipped.values()), '')}")
    warm_over = [
        *BENCH_DEFAULTS,
        *overrides,
        *fake,
        "engine=pipeline",
        "delay=1",
        f"train.steps={max(1, warmup_steps)}",
    ]
    try:
        warm = budgeted(compose(warm_over))
    except ConfigError:  # the warm-up is not timed: any cut will do
        warm = compose([*warm_over, "pipeline.memory_gib=null"])
    order = [name for _ in range(rounds) for name in cfgs]
    tokens_per_step = t.micro_batch_size * m * D * t.seq_len
    return BenchPlan(cfgs, order, P, m, D, t, p, tokens_per_step, skipped), warm


def run_bench(
    plan: BenchPlan,
    warm: DictConfig,
    warmup_steps: int,
    rounds: int,
    steps: int,
    log: Callable[[str], None],
    stop: Optional[Any],
) -> tuple[list[dict], tuple[list, list]]:
    """The warm-up and every job in one launch; (each job's result, the load average before and after)."""
    from asyncpipe.spawn import Job, launch

    order, cfg = plan.order, next(iter(plan.cfgs.values()))
    log(
        f"bench pipeline: model {cfg.model.name}, P={plan.P}, m={plan.m}, {plan.pipeline.threads} thread(s)/process, "
        f"warm-up {warmup_steps} steps, then {rounds} x {plan.names} of {steps} steps"
    )
    for name, why in plan.skipped.items():
        log(f"  {name}: {why}")

    def progress(job: int, rec: dict) -> None:
        name = "warm-up" if job == 0 else order[job - 1]
        if "step_time" in rec:
            ms = rec["step_time"] * 1e3
            log(f"  job {job} {name:9s} step {rec['step']}: {ms:8.1f} ms  {rec['tokens_per_s']:9.0f} tok/s")

    load_before = list(os.getloadavg())
    jobs = [Job(c, None, show_progress=False) for c in [warm, *[plan.cfgs[n] for n in order]]]
    if stop is not None and stop.requested:
        raise Stopped(f"bench pipeline stopped by {stop.signal_name} before its first job; nothing written")
    results = launch(jobs, on_step=progress, stopped=None if stop is None else stop.signal_name)[1:]
    load_after = list(os.getloadavg())
    check_jobs("bench pipeline", [f"job {i} ({name})" for i, name in enumerate(order, start=1)], results, steps)
    return results, (load_before, load_after)


def simulator_result(
    overrides: Sequence[str], rounds: int, log: Callable[[str], None], compose: Any, threads: int = 1
) -> dict:
    """The simulator bench (`asyncpipe.bench.simulator`) on the same overrides, at the pipeline's thread count."""
    import torch

    from asyncpipe.bench.simulator import BASIC, bench_simulator

    torch.set_num_threads(threads)  # the pipeline's processes run this many each: compare like with like
    keep = [
        o
        for o in overrides
        if not o.split("=", 1)[0].lstrip("+~").startswith(("engine", "delay", "pipeline.", "train.compile"))
    ]
    return bench_simulator(
        [*BENCH_DEFAULTS, *keep], rounds=rounds, steps_per_round=2, warmup=2, compose=compose, log=log, variants=BASIC
    )
