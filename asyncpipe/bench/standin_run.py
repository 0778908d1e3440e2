"""Stand-in compute over every schedule and micro-batch count in one launch (`benchmarks/standin_table.py`): the
driver above `asyncpipe.bench.pipeline` and `asyncpipe.bench.standin` (which the pipeline bench itself uses)."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from asyncpipe.bench.pipeline import check_jobs
from asyncpipe.bench.standin import stage_figures, standin_overrides, standin_record
from asyncpipe.errors import UserError


def bench_standin(
    overrides: Sequence[str],
    micro_batches: Sequence[int],
    schedules: Sequence[str],
    forward_s: float,
    backward_s: float,
    steps: int = 5,
    rounds: int = 1,
    skip: int = 1,
    log: Callable[[str], None] = print,
    cuts: Sequence[str] = (),
) -> dict[str, Any]:
    """Every schedule at every m on the stages ``overrides`` set, stand-in compute F, B (0, 0 where the overrides
    give a per-layer profile, `pipeline.standin.profile`), in ONE launch (a warm-up job, then ``rounds``
    alternating rounds): {"records": [...], "skipped": {"schedule m=M": why}}. A schedule that refuses an m
    (DualPipeV with m < 2P, 2BW with m < P) is skipped with its reason. ``cuts`` (`pipeline.cut` values): each
    schedule once per cut, its variant named ``schedule+cut``, side by side in the same rounds."""
    from asyncpipe.config import compose
    from asyncpipe.spawn import Job, launch

    if steps < 2 * skip + 1:
        raise UserError(
            f"--steps {steps} leaves no timed step after dropping {skip} at each end; use >= {2 * skip + 1}"
        )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    base = _base_overrides(overrides, forward_s, backward_s, steps)
    cfgs, skipped = _schedule_configs(base, micro_batches, schedules, cuts)
    P = next(iter(cfgs.values())).pipeline.stages
    warm_up = [*base, "delay=1", "pipeline.schedule=2bw", f"train.micro_batches={max(micro_batches)}"]
    warm = compose([*warm_up, "train.steps=2", "train.eval_every=2"])
    order = [key for _ in range(rounds) for key in cfgs]
    from asyncpipe.standin_costs import profile_of

    first = next(iter(cfgs.values()))
    what = f"profile {profile_of(first)}" if profile_of(first) else f"F={forward_s}, B={backward_s} s"
    log(
        f"bench standin: P={P}, {what}, m in {list(micro_batches)}, "
        f"{len(order)} jobs of {steps} steps" + "".join(f"\n  {k}: {v}" for k, v in skipped.items())
    )
    results = launch([Job(c, None, show_progress=False) for c in [warm, *[cfgs[k] for k in order]]])[1:]
    check_jobs("bench standin", [f"job {name} m={m}" for name, m in order], results, steps)
    records = _records(cfgs, order, results, P, skip, log)
    return {"records": records, "skipped": skipped}


def _base_overrides(overrides: Sequence[str], forward_s: float, backward_s: float, steps: int) -> list[str]:
    """What every job shares: the bench defaults, the caller's overrides, the stand-in F and B, the pipeline engine,
    ``steps`` steps and enough evaluation batches for a V schedule (>= 2P, evaluated after the timed steps)."""
    from asyncpipe.bench.pipeline import BENCH_DEFAULTS
    from asyncpipe.config import compose

    base = [
        *BENCH_DEFAULTS,
        *overrides,
        *standin_overrides(forward_s, backward_s),
        "engine=pipeline",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
    ]
    probe = compose([*base, "delay=0"]).pipeline
    return [*base, f"train.eval_batches={2 * probe.stages * probe.data_parallel}"]


def _schedule_configs(
    base: list[str], micro_batches: Sequence[int], schedules: Sequence[str], cuts: Sequence[str] = ()
) -> tuple[dict[tuple[str, int], Any], dict[str, str]]:
    """The config of every (schedule, m) that accepts that m, and why each one that refuses it is not run. Refuses,
    in one line, a request where none runs."""
    from asyncpipe.bench.pipeline import variants_of
    from asyncpipe.config import compose
    from asyncpipe.errors import ConfigError

    table = variants_of(schedules)
    if cuts:
        table = {f"{n}+{c}": [*over, f"pipeline.cut={c}"] for n, over in table.items() for c in cuts}
    cfgs: dict[tuple[str, int], Any] = {}
    skipped: dict[str, str] = {}
    for m in micro_batches:
        for name, over in table.items():
            try:
                cfgs[(name, m)] = compose([*base, *over, f"train.micro_batches={m}"])
            except (ConfigError, UserError) as err:
                skipped[f"{name} m={m}"] = f"not run: {err}"
    if not cfgs:
        raise UserError("no schedule runs at these micro-batch counts: " + "; ".join(skipped.values()))
    return cfgs, skipped


def _records(
    cfgs: dict[tuple[str, int], Any],
    order: list[tuple[str, int]],
    results: list,
    P: int,
    skip: int,
    log: Callable[[str], None],
) -> list[dict]:
    """One record per (schedule, m) over its rounds' jobs: its step time against the stand-in ideal, logged."""
    from asyncpipe.bench.pipeline_summary import job_stats
    from asyncpipe.partition import cut_blocks

    per: dict[tuple[str, int], list[dict]] = {}
    for key, r in zip(order, results):
        c = cfgs[key]
        tokens = c.train.micro_batch_size * c.train.micro_batches * c.pipeline.data_parallel * c.train.seq_len
        per.setdefault(key, []).append(job_stats(r, tokens, skip))
    records = []
    for (name, m), js in per.items():
        cfg = cfgs[(name, m)]
        F, B, chunks = stage_figures(cfg)  # F, B as configured, or a per-layer profile's under the cut
        rec = {"variant": name, **standin_record(cfg.pipeline.schedule, P, m, F, B, js, skip, chunks=chunks)}
        rec["cut"] = cut_blocks(cfg)
        log(
            f"  {name:9s} P={P} m={m:2d}: step {rec['step_time_s'] * 1e3:7.1f} ms, ideal {rec['ideal_step_s'] * 1e3:7.1f}"
            f" ms, fraction {rec['fraction_of_ideal']:.3f}"
        )
        records.append(rec)
    return records
