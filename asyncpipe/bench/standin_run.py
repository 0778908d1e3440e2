"""Stand-in compute over every schedule and micro-batch count in one launch (`benchmarks/standin_table.py`): the
driver above `asyncpipe.bench.pipeline` and `asyncpipe.bench.standin` (which the pipeline bench itself uses)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from asyncpipe.bench.pipeline import check_jobs
from asyncpipe.bench.standin import standin_overrides, standin_record
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
) -> dict[str, Any]:
    """Every schedule at every m on the stages ``overrides`` set, stand-in compute F, B, in ONE launch (a warm-up
    job, then ``rounds`` alternating rounds): {"records": [...], "skipped": {"schedule m=M": why}}. A schedule
    that refuses an m (DualPipeV with m < 2P, 2BW with m < P) is skipped with its reason."""
    import os

    from asyncpipe.bench.pipeline import BENCH_DEFAULTS, variants_of
    from asyncpipe.bench.pipeline_summary import job_stats
    from asyncpipe.config import compose
    from asyncpipe.errors import ConfigError
    from asyncpipe.spawn import Job, launch

    if steps < 2 * skip + 1:
        raise UserError(
            f"--steps {steps} leaves no timed step after dropping {skip} at each end; use >= {2 * skip + 1}"
        )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    table = variants_of(schedules)
    base = [
        *BENCH_DEFAULTS,
        *overrides,
        *standin_overrides(forward_s, backward_s),
        "engine=pipeline",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
    ]
    probe = compose([*base, "delay=0"]).pipeline
    base.append(
        f"train.eval_batches={2 * probe.stages * probe.data_parallel}"
    )  # a V evaluates >= 2P (after the timed steps)
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
    first = next(iter(cfgs.values()))
    P = first.pipeline.stages
    warm = compose(
        [
            *base,
            "delay=1",
            "pipeline.schedule=2bw",
            f"train.micro_batches={max(micro_batches)}",
            "train.steps=2",
            "train.eval_every=2",
        ]
    )
    order = [key for _ in range(rounds) for key in cfgs]
    log(
        f"bench standin: P={P}, F={forward_s}, B={backward_s} s, m in {list(micro_batches)}, "
        f"{len(order)} jobs of {steps} steps" + "".join(f"\n  {k}: {v}" for k, v in skipped.items())
    )
    results = launch([Job(c, None, show_progress=False) for c in [warm, *[cfgs[k] for k in order]]])[1:]
    per: dict[tuple[str, int], list[dict]] = {}
    check_jobs("bench standin", [f"job {name} m={m}" for name, m in order], results, steps)
    for key, r in zip(order, results):
        c = cfgs[key]
        tokens = c.train.micro_batch_size * c.train.micro_batches * c.pipeline.data_parallel * c.train.seq_len
        per.setdefault(key, []).append(job_stats(r, tokens, skip))
    records = []
    for (name, m), js in per.items():
        rec = {
            "variant": name,
            **standin_record(cfgs[(name, m)].pipeline.schedule, P, m, forward_s, backward_s, js, skip),
        }
        log(
            f"  {name:9s} P={P} m={m:2d}: step {rec['step_time_s'] * 1e3:7.1f} ms, ideal {rec['ideal_step_s'] * 1e3:7.1f}"
            f" ms, fraction {rec['fraction_of_ideal']:.3f}"
        )
        records.append(rec)
    return {"records": records, "skipped": skipped}
