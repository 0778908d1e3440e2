"""The bench pipeline result as a table for a terminal: rows per schedule, ratios to 1F1B, and a flag on a ratio
from too few rounds or whose rounds' spread reaches 1."""

from __future__ import annotations

from asyncpipe.bench import torch_pipelining as pt
from asyncpipe.bench.pipeline_cuts import cut_lines

MIN_ROUNDS = 3  # fewer paired rounds than this have no spread worth the name: a ratio from them is flagged


def spread_note(per_round: list[float], null: float = 1.0) -> str:
    """Why a ratio measured over paired rounds is not a difference: too few rounds, or `null` (1.0: no difference)
    within the rounds' range; "" when the rounds resolve it."""
    if len(per_round) < MIN_ROUNDS:
        return f"{len(per_round)} round{'s' if len(per_round) != 1 else ''}: too few to judge (--rounds {MIN_ROUNDS}+)"
    lo, hi = min(per_round), max(per_round)
    if lo <= null <= hi:
        return f"{null:g} within the rounds' spread {lo:.3f}-{hi:.3f}: not a difference"
    return ""


def format_result(res: dict) -> str:
    """The human-readable lines of a `bench_pipeline` result: one row per schedule, then memory per stage. A ratio
    from fewer than MIN_ROUNDS rounds, or whose rounds' spread reaches 1.0, is flagged on its line."""
    v = res["variants"]
    w = max([10, *(len(n) for n in [*v, *res.get("skipped", {})])])  # the schedule column
    return "\n".join(
        [
            *_schedule_table(res, w),
            *_schedule_notes(v),
            *_ratio_lines(res),
            *_memory_lines(v, w),
            *_simulator_lines(res),
            *_standin_lines(res, w),
            *cut_lines(res),
        ]
    )


def _schedule_table(res: dict, w: int) -> list[str]:
    """The run's header, then one row per schedule (tokens/s, ratios, idle and waits per stage, per-round ratios
    with their flag) and one per skipped schedule with its reason."""
    v = res["variants"]
    P = res["stages"]
    lines = [
        f"model {res['model']}  P={P}  m={res['micro_batches']}  ({res['tokens_per_step']} tokens/step, "
        f"{res['threads_per_process']} thread/process, load {res['load_avg'][0]:.2f} -> "
        f"{res.get('load_avg_after', res['load_avg'])[0]:.2f} on {res['cpu_count']} CPUs; "
        f"schedule model at B/F = {res.get('backward_over_forward', 2.0):.2f})",
        f"{'schedule':{w}s} {'tok/s':>7s} {'x1F1B':>6s} {'ideal':>6s} {'frac':>6s}  {'bubble':>6s}  "
        f"{'idle/stage':{7 * P}s} {'norm-wait ms/stage':{max(18, 6 * P)}s} x1F1B per round  flag",
    ]
    for name, x in v.items():
        fmt = lambda y: "   n/a" if y is None else f"{y:6.3f}"  # noqa: E731
        idle = " ".join(f"{y:.3f}" for y in x["idle_frac_per_stage"])
        wait = " ".join(f"{y:5.1f}" for y in x["norm_wait_ms_per_step"])
        rounds = ", ".join(f"{y:.3f}" for y in x["ratio_to_1f1b_per_round"])
        ref = all(r == 1.0 for r in x["ratio_to_1f1b_per_round"])  # a reference itself: 1 by definition
        flag = "" if ref else spread_note(x["ratio_to_1f1b_per_round"])
        lines.append(
            f"{name:{w}s} {x['tokens_per_s']:7.0f} {x['ratio_to_1f1b']:6.3f} {fmt(x['ideal_ratio_to_1f1b'])} "
            f"{fmt(x['fraction_of_ideal'])}  {fmt(x['analytic_bubble'])}  {idle:{7 * P}s} "
            f"{wait:{max(18, 6 * P)}s} {rounds:15s}  {flag}".rstrip()
        )
    for name, why in res.get("skipped", {}).items():
        lines.append(f"{name:{w}s} {why}")
    return lines


def _schedule_notes(v: dict) -> list[str]:
    """Which rows are torch.distributed.pipelining's schedules, each compiled row's speed-up over eager, and how
    the idle and wait columns were timed."""
    lines = []
    torch_rows = [f"{n} = {x['schedule']}" for n, x in v.items() if "+" not in n and pt.is_torch(n)]
    if torch_rows:
        lines.append("torch.distributed.pipelining: " + ", ".join(torch_rows) + " (same model, cut, data, update)")
    for name, x in v.items():
        if "compile_speedup" in x:
            rounds = ", ".join(f"{y:.3f}" for y in x["compile_speedup_per_round"])
            note = " (within the rounds' spread: not a difference)" if x["compile_speedup_within_spread"] else ""
            lines.append(f"{name}: {x['compile_speedup']:.3f}x the eager tokens/s, per round {rounds}{note}")
    modes = sorted({m for x in v.values() for m in x.get("timing", [])})
    if modes:
        lines.append(
            f"idle, norm-wait and compute timed by: {', '.join(modes)} (host: perf_counter around each "
            "instruction, valid on CPU/gloo; cuda_events: the stage stream's view)"
        )
    return lines


def _ratio_lines(res: dict) -> list[str]:
    """2BW over 1F1B against its ideal, EF's cost over plain 2BW, and the ratio the measured stage costs allow."""
    v = res["variants"]
    lines = []
    if "fraction_of_ideal" in res:
        flag = spread_note(res["ratio_per_round"])
        lines.append(
            f"2bw/1f1b {res['ratio_2bw_over_1f1b']:.3f}  ideal (m+P-1)/m {res['ideal_ratio']:.3f}  "
            f"fraction of ideal {res['fraction_of_ideal']:.3f}  (fastest steps: {res['ratio_best_step']:.3f}"
            f" = {res['fraction_of_ideal_best_step']:.3f} of ideal)" + (f"  [{flag}]" if flag else "")
        )
    if "2bw" in v and "2bw_ef" in v:
        per = [a / b for a, b in zip(v["2bw_ef"]["tokens_per_s_per_round"], v["2bw"]["tokens_per_s_per_round"])]
        cost = 1 - v["2bw_ef"]["tokens_per_s"] / v["2bw"]["tokens_per_s"]
        flag = spread_note(per)
        lines.append(
            f"EF's cost: 2bw_ef / 2bw tokens/s {1 - cost:.3f} ({cost:.1%} slower), per round "
            + ", ".join(f"{y:.3f}" for y in per)
            + (f"  [{flag}]" if flag else "")
        )
    if "stage_cost_model" in res:
        c = res["stage_cost_model"]
        ms = lambda xs: "/".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731
        lines.append(
            f"at the measured stage costs (F {ms(c['forward_s'])}, B {ms(c['backward_s'])}, step "
            f"{ms(c['step_s'])} ms per stage) the schedules allow 2bw/1f1b {c['ratio_2bw_over_1f1b']:.3f} "
            f"= {c['fraction_of_ideal']:.3f} of (m+P-1)/m"
        )
    return lines


def _memory_lines(v: dict, w: int) -> list[str]:
    """Memory per stage of each schedule: weight versions, optimizer state, EF buffer, activations."""
    lines = [
        "memory per stage, MB: weights peak (versions) + optimizer + EF = total; activations peak (per micro-batch)"
    ]
    for name, x in v.items():
        per = "  |  ".join(
            f"{mm['peak_weight_mb']:.1f} ({mm['weight_versions_peak']:.0f}) + {mm['optimizer_state_mb']:.1f}"
            f" + {mm['ef_buffer_mb']:.1f} = {mm['peak_weight_plus_optimizer_mb']:.1f}; act "
            f"{mm['peak_activation_mb']:.1f} ({mm['activation_mb_per_micro_batch']:.1f})"
            for mm in x["memory_per_stage"]
        )
        lines.append(f"  {name:{w}s} {per}")
    return lines


def _simulator_lines(res: dict) -> list[str]:
    """The simulator's step time per variant beside the pipeline's, when the result carries one."""
    if "simulator" not in res:
        return []
    sim = res["simulator"]
    return [
        "simulator "
        + ", ".join(f"{n} {sim['median_step_s'][n] * 1e3:.1f} ms (x{r:.3f})" for n, r in sim["ratio_to_delay0"].items())
    ]


def _standin_lines(res: dict, w: int) -> list[str]:
    """Stand-in compute: each schedule's step time against its own ideal at the configured F, B."""
    if "standin" not in res:
        return []
    sd = res["standin"]
    what = (
        f"stand-in profile {sd['profile']} x {sd['scale']:g} (each layer its own F, B)"
        if sd.get("profile")
        else f"stand-in F {sd['forward_s'] * 1e3:.1f} ms, B {sd['backward_s'] * 1e3:.1f} ms per stage and micro-batch"
    )
    header = f"{what}: step ms (ideal ms) = fraction of ideal (best step)"
    lines = [header]
    for r in sd["records"]:
        frac = (
            "n/a"
            if r["fraction_of_ideal"] is None
            else (f"{r['fraction_of_ideal']:.3f} ({r['fraction_of_ideal_best_step']:.3f})")
        )
        ideal = "n/a" if r["ideal_step_s"] is None else f"{r['ideal_step_s'] * 1e3:.1f}"
        lines.append(f"  {r['variant']:{w}s} {r['step_time_s'] * 1e3:8.1f} ({ideal}) = {frac}")
    return lines
