"""Where a `cost.CostModel`'s figures come from: a calibration measured on this machine (one `asyncpipe bench
pipeline` result, real compute) or a device profile (a small YAML of stated, not measured, device figures).

Calibration (`from_bench`), on one variant of a bench file (1F1B by default), from its last job's per-instruction
seconds per stage (`seconds_by_op_per_stage`, `asyncpipe.engines.pipeline.clock.StageClock`):
- forward per micro-batch: the stage's ForwardPass seconds over its forwards (steps x m training forwards plus the
  2 x eval_batches of the job's evaluations at step 0 and at its last step); backward: BackwardPass over steps x m;
- per layer, with the file's ``layer_profile`` (each layer kind timed alone, `asyncpipe.bench.layer_profile`): each
  stage's measured pass = the engine's own seconds per pass (``chunk_s``) + k x its layers' seconds alone, k and
  ``chunk_s`` fitted over the stages, per forward and backward (so neither the embedding's share nor the engine's
  per-pass work is charged to the blocks); without one (older files): the blocks of stage 0 share its cost equally
  (the embedding, a table lookup, taken as free) and the head is what the last stage costs beyond its blocks at
  that block cost (floored at 0). A depth P then sums
  the layers the engine's cut gives each stage (`asyncpipe.partition`), so per-stage costs scale by blocks per
  stage, with the head on the last stage;
- optimizer step: (OptimizerStep + ReduceGrads - time blocked in the norm all-reduce) per step, summed over
  stages, per parameter (parameters per layer from `asyncpipe.plan.layer_shapes`); EF's extra work: the same for
  the file's 2bw_ef variant minus its 2bw variant (0 when the file has not both);
- p2p: 0, and the engine's overhead per instruction: the one value at which the calibration variant's replayed
  step equals its measured median step (bisection): the only fitted figure, and it carries the exchanges' cost.
Device profile (`from_profile`): forward seconds = FLOPs / (peak x an assumed efficiency), 2 x the active matmul
parameters per token + causal attention's 2 x seq x d_model, the head's 2 x d_model x vocab; backward = a stated
multiple; step and EF: bytes per parameter over memory bandwidth; p2p: a micro-batch's bf16 activation over the
link + its latency. Such a profile is labelled as stated, never as measured.
Stand-in compute (`from_standin`): two `bench pipeline --standin F,B` records' configured F and B per stage (1F1B
and 2BW at the smallest depth), plus what the engine measurably adds to each forward / backward, the measured
optimizer step, and two fitted figures: the overhead per instruction and the latency per exchange, fitted so that
both records' replayed steps equal their measured ones (1F1B's flush and 2BW's slack-free steady state put
different shares of exchanges on the critical path, so the two separate; one overhead alone, fitted on 1F1B,
over-priced the schedules without a flush by 5-9 %).
Per-layer stand-in compute (`from_standin_layers`, `pipeline.standin.profile`): each layer at its own stand-in
seconds (`asyncpipe.standin_costs`), the rest as above, fitted on records at their own cuts, so that any cut can be
predicted (`predict(..., cut=...)`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from asyncpipe.device_profile import PROFILE_DIR, PROFILE_KEYS, layer_seconds, load_profile  # noqa: F401 (re-exported)
from asyncpipe.errors import UserError
from asyncpipe.timelines.cost import CostModel, predict


def _config(overrides: list[str]) -> Any:
    from asyncpipe.config import compose

    return compose([o for o in overrides if not o.startswith(("engine=", "delay="))])


def _layers(cfg: Any) -> list:
    from asyncpipe.plan import layer_shapes

    return layer_shapes(cfg.model, int(cfg.model.vocab_size or cfg.tokenizer.vocab_size))


def _eval_batches(overrides: list[str]) -> int:
    for o in reversed(overrides):
        if o.startswith("train.eval_batches="):
            return int(o.split("=", 1)[1])
    return 1  # the bench's own default (`bench.pipeline.BENCH_DEFAULTS`)


def _update_s(v: dict, stage: int, steps: int) -> float:
    ops, blocked = v["seconds_by_op_per_stage"][stage], v["seconds_blocked_in_per_stage"][stage]
    return max(0.0, ops.get("OptimizerStep", 0.0) + ops.get("ReduceGrads", 0.0) - sum(blocked.values())) / steps


def _recomputed(variant: str, v: dict, stage: int, P: int, m: int, steps: int) -> int:
    """Backwards on ``stage`` that recomputed their forward first, over the record's last job: as the bench
    recorded it, else (older files) what the variant's schedule declares: paci-recompute's straddlers, and `paci`'s
    before its revision 2 (bench files without the count predate it)."""
    counts = v.get("recomputed_backwards_per_stage")
    if isinstance(counts, list) and len(counts) == P:
        return int(counts[stage])
    from asyncpipe.schedules import get, names

    base = variant.split("+")[0]
    if base not in names() or not (get(base).recompute or base == "paci"):
        return 0
    return (steps - 1) * min(P - 1 - stage, m)


def _scale_and_excess(measured: list[float], alone: list[float]) -> tuple[float, float]:
    """(k, c) with each stage's measured pass = c + k x its layers timed alone, least squares over the stages (c >= 0:
    through the origin where the fit wants less); one stage, or stages alike: c = 0."""
    n = len(measured)
    mean_l, mean_m = sum(alone) / n, sum(measured) / n
    var = sum((x - mean_l) ** 2 for x in alone)
    if n > 1 and var > 1e-12 * max(1.0, mean_l**2):
        k = sum((x - mean_l) * (y - mean_m) for x, y in zip(alone, measured)) / var
        c = mean_m - k * mean_l
        if c >= 0 and k > 0:
            return k, c
    return sum(x * y for x, y in zip(alone, measured)) / max(sum(x * x for x in alone), 1e-30), 0.0


def _split(record: dict, shapes: list, parts: list[int], fwd: list[float], bwd: list[float]) -> tuple[dict, tuple]:
    """Per layer kind (forward, backward) seconds, and the engine's own seconds per pass (``chunk_s``), from each
    stage's measured pass. With the file's ``layer_profile`` (each kind timed alone, `asyncpipe.bench.layer_profile`):
    a stage's pass = ``chunk_s`` + k x its layers alone, k and ``chunk_s`` fitted over the stages per pass. Without
    one (older files): stage 0's blocks share its time (the embedding free), the head is what the last stage costs
    beyond its blocks, and no per-pass term."""
    P = len(fwd)
    prof = record.get("layer_profile")
    if isinstance(prof, dict):
        out: dict = {kind: [0.0, 0.0] for kind in ("embedding", "block", "head")}
        excess = []
        for i, measured in enumerate((fwd, bwd)):
            alone = [sum(prof[x.kind][i] for x in shapes[parts[s] : parts[s + 1]]) for s in range(P)]
            k, c = _scale_and_excess(measured, alone)
            for kind in out:
                out[kind][i] = k * prof[kind][i]
            excess.append(c)
        return {kind: tuple(v) for kind, v in out.items()}, (excess[0], excess[1])
    blocks = [sum(x.kind == "block" for x in shapes[parts[s] : parts[s + 1]]) for s in range(P)]
    per_block = (fwd[0] / blocks[0], bwd[0] / blocks[0])
    head = (max(0.0, fwd[-1] - blocks[-1] * per_block[0]), max(0.0, bwd[-1] - blocks[-1] * per_block[1]))
    return {"embedding": (0.0, 0.0), "block": per_block, "head": head}, (0.0, 0.0)


def from_bench(record: dict, path: str = "", variant: str = "1f1b", fit: bool = True) -> CostModel:
    """A cost model calibrated on ``variant`` of one `bench pipeline` result (see the module docstring)."""
    from asyncpipe.partition import partition

    v = record.get("variants", {}).get(variant)
    if not isinstance(v, dict) or "seconds_by_op_per_stage" not in v:
        raise UserError(f"{path or 'bench result'}: no per-instruction timings for {variant} to calibrate on")
    P, m, steps = int(record["stages"]), int(record["micro_batches"]), int(record["steps_per_job"])
    cfg = _config(list(record.get("overrides", [])))
    shapes = _layers(cfg)
    cut = v.get("cut")  # the variant's `pipeline.cut` (records from before it ran the even cut)
    parts = partition(len(shapes), P, cut)
    forwards = steps * m + 2 * max(
        1, _eval_batches(list(record.get("overrides", []))) // max(1, record.get("data_parallel", 1))
    )
    fwd = [v["seconds_by_op_per_stage"][s].get("ForwardPass", 0.0) / forwards for s in range(P)]
    bwd = [v["seconds_by_op_per_stage"][s].get("BackwardPass", 0.0) / (steps * m) for s in range(P)]
    # A recomputing backward holds its forward's time: the replay adds it back (`simulate(recompute=...)`)
    bwd = [b - _recomputed(variant, v, s, P, m, steps) * f / (steps * m) for s, (f, b) in enumerate(zip(fwd, bwd))]
    cost, chunk_s = _split(record, shapes, parts, fwd, bwd)
    params = [x.params for x in shapes]
    total = sum(params)
    step_per_param = sum(_update_s(v, s, steps) for s in range(P)) / total
    ef_per_param, notes = 0.0, []
    variants = record["variants"]
    if all(isinstance(variants.get(k), dict) and "seconds_by_op_per_stage" in variants[k] for k in ("2bw", "2bw_ef")):
        extra = sum(_update_s(variants["2bw_ef"], s, steps) - _update_s(variants["2bw"], s, steps) for s in range(P))
        ef_per_param = max(0.0, extra / total)
    else:
        notes.append("EF's extra step work not measured in this file (taken as 0)")
    name = Path(path).name if path else "bench result"
    model = CostModel(
        label=f"measured: {name} ({record.get('model', '?')}, P={P}, m={m}, {variant})",
        measured=True,
        forward=[cost[x.kind][0] for x in shapes],
        backward=[cost[x.kind][1] for x in shapes],
        params=params,
        tokens_per_micro_batch=int(record["micro_batch_size"]) * int(record["seq_len"]),
        step_per_param=step_per_param,
        ef_per_param=ef_per_param,
        chunk_s=chunk_s,
        notes=tuple(notes),
    )
    schedule = variant.split("+")[0]  # a `bench pipeline --cuts` variant: schedule+cut
    return fit_overhead(model, schedule, P, m, float(v["step_time_s"]), cut) if fit else model


def fit_overhead(
    model: CostModel, schedule: str, P: int, m: int, measured_s: float, cut: Optional[list[int]] = None
) -> CostModel:
    """``model`` with the per-instruction overhead at which ``schedule``'s predicted step (at ``cut``) equals
    ``measured_s`` (0 when the replay alone already takes longer)."""

    def step(o: float) -> float:
        return predict(model.with_overhead(o), schedule, P, m, cut=cut).step_s

    if step(0.0) >= measured_s:
        return model.with_overhead(0.0)
    lo, hi = 0.0, measured_s / 10
    while step(hi) < measured_s:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < measured_s else (lo, mid)
    return model.with_overhead((lo + hi) / 2)


def from_profile(profile: dict, cfg: Any) -> CostModel:
    """A cost model of ``cfg``'s model and batch under a device profile (see the module docstring)."""
    m, t = cfg.model, cfg.train
    shapes = _layers(cfg)
    vocab = int(m.vocab_size or cfg.tokenizer.vocab_size)
    tokens = int(t.micro_batch_size) * int(t.seq_len)
    fwd, bwd = layer_seconds(profile, m, vocab, tokens, int(t.seq_len))
    bw = float(profile["memory_bytes_per_s"])
    measured = bool(profile["measured"])
    kind = "measured" if measured else "stated, not measured"
    return CostModel(
        label=f"device profile {profile['name']} ({kind}: {profile['note']})",
        measured=measured,
        forward=fwd,
        backward=bwd,
        params=[x.params for x in shapes],
        tokens_per_micro_batch=tokens,
        step_per_param=float(profile["step_bytes_per_param"]) / bw,
        ef_per_param=float(profile["ef_bytes_per_param"]) / bw,
        p2p_s=float(profile["p2p_latency_s"]) + tokens * m.d_model * 2 / float(profile["p2p_bytes_per_s"]),
        overhead_s=float(profile["overhead_s"]),
        allreduce_latency_s=float(profile["allreduce_latency_s"]),
        allreduce_bytes_per_s=float(profile["allreduce_bytes_per_s"]),
        link_bytes_per_s=float(profile["p2p_bytes_per_s"]),
    )


def calibration(paths: list[str], P: int = 2) -> Optional[tuple[str, dict]]:
    """The bench file (path, record) to calibrate on: one at P = ``P`` with 1F1B's per-instruction timings."""
    import json

    for p in paths:
        try:
            rec = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        v = rec.get("variants", {}).get("1f1b") if isinstance(rec, dict) else None
        if rec.get("stages") == P and isinstance(v, dict) and "seconds_by_op_per_stage" in v:
            return p, rec
    return None


def fit_overhead_latency(model: CostModel, calibration: list[tuple]) -> CostModel:
    """``model`` with the per-instruction overhead and per-exchange latency at which two calibration records'
    predicted steps equal their measured ones: ``calibration`` = [(schedule, P, m, measured step s[, cut])] x 2, one
    with a flush and one without (1F1B and 2BW), whose critical paths hold different shares of instructions and
    exchanges. A replayed step is piecewise linear in the two (seconds on the critical path per instruction and per
    exchange), so Newton's method with a finite-difference Jacobian solves the 2 x 2 system in a few replays. Where
    no non-negative pair fits both, the latency is 0 and the overhead fits the first record alone (`fit_overhead`)."""
    runs = [(c[0], c[1], c[2], c[3], c[4] if len(c) > 4 else None) for c in calibration]
    measured = [t for _, _, _, t, _ in runs]

    def residual(o: float, lat: float) -> list[float]:
        m = replace(model, overhead_s=o, p2p_s=lat)
        return [predict(m, s, P, mb, cut=cut).step_s - t for s, P, mb, t, cut in runs]

    o = lat = 0.0
    h = 1e-6 * max(measured)
    for _ in range(12):
        r = residual(o, lat)
        if max(abs(x) / t for x, t in zip(r, measured)) < 1e-6:
            break
        ro, rl = residual(o + h, lat), residual(o, lat + h)
        j = [[(ro[i] - r[i]) / h, (rl[i] - r[i]) / h] for i in range(2)]
        det = j[0][0] * j[1][1] - j[0][1] * j[1][0]
        if abs(det) < 1e-12:
            break
        o -= (j[1][1] * r[0] - j[0][1] * r[1]) / det
        lat -= (j[0][0] * r[1] - j[1][0] * r[0]) / det
        o, lat = max(o, 0.0), max(lat, 0.0)
    if lat > 0 and max(abs(x) / t for x, t in zip(residual(o, lat), measured)) < 1e-3:
        return replace(model, overhead_s=o, p2p_s=lat)
    s, P, mb, t, cut = runs[0]
    return fit_overhead(replace(model, p2p_s=0.0), s, P, mb, t, cut)


def standin_calibration(
    records: list[dict], flushed: str = "1f1b", unflushed: str = "2bw", cut: Optional[str] = None
) -> list[dict]:
    """The stand-in records `from_standin` calibrates on: a schedule with a flush (1F1B, the reference) and one
    without (2BW), each at the smallest depth and its largest m; ``cut``: only variants run at that
    `pipeline.cut` (named ``schedule+cut``, `bench_standin(cuts=...)`)."""
    if cut is not None:
        records = [r for r in records if str(r.get("variant", "")).endswith(f"+{cut}")]
    if not records:
        raise UserError(f"stand-in calibration: no record at pipeline.cut={cut}")
    P = min(int(r["stages"]) for r in records)
    out = []
    for name in (flushed, unflushed):
        mine = [r for r in records if r["schedule"] == name and int(r["stages"]) == P]
        if not mine:
            raise UserError(f"stand-in calibration needs a {name} record at P = {P}")
        out.append(max(mine, key=lambda r: int(r["micro_batches"])))
    return out


def _engine_figures(calibration: list[dict]) -> tuple[tuple[float, float], float]:
    """What the engine measurably adds in stand-in records: per ForwardPass / BackwardPass over its wait (mean over
    the records), and the optimizer step + gradient reduction per stage less its norm wait (mean over stages)."""
    over = [r.get("overhead_s_per_instruction", {}) for r in calibration]
    excess = tuple(sum(float(o.get(k, 0.0)) for o in over) / len(over) for k in ("ForwardPass", "BackwardPass"))
    parts = [x for r in calibration for x in r["step_breakdown_s"]]
    update = sum(x["optimizer_step"] - x["norm_wait"] + x["reduce"] for x in parts) / len(parts)
    return (excess[0], excess[1]), update


def _fitted(model: CostModel, calibration: list[dict], cuts: bool = False) -> CostModel:
    """`fit_overhead_latency` on stand-in records (at each record's own cut with ``cuts``)."""
    runs = [
        (str(r["schedule"]), int(r["stages"]), int(r["micro_batches"]), float(r["step_time_s"]))
        + ((r.get("cut"),) if cuts else ())
        for r in calibration
    ]
    return fit_overhead_latency(model, runs)


def from_standin(calibration: list[dict], stages: int, path: str = "") -> CostModel:
    """A cost model of stand-in compute (`bench pipeline --standin F,B`: each stage's forward and backward padded
    to F and B per micro-batch, a V's chunk to half) at ``stages`` ranks, from two stand-in records at one depth
    (1F1B and 2BW, `standin_calibration`): 2P blocks of F/2 and B/2 (so a stage, or a V's chunk pair, waits F
    and B) plus the engine's measured excess per ForwardPass / BackwardPass; the optimizer step + gradient
    reduction per stage less its norm wait (`step_breakdown_s`, mean over stages and both records); the
    per-instruction overhead and the per-exchange latency fitted to the two records' measured steps
    (`fit_overhead_latency`). Labelled measured."""
    first = calibration[0]
    F, B = float(first["forward_s"]), float(first["backward_s"])
    excess, update = _engine_figures(calibration)
    name = Path(path).name if path else "stand-in records"
    used = ", ".join(f"{r['schedule']} at P={r['stages']}, m={r['micro_batches']}" for r in calibration)
    model = CostModel(
        label=f"measured: {name} (stand-in F={F:g} s, B={B:g} s; {used})",
        measured=True,
        forward=[0.0, (F + excess[0]) / 2, (F + excess[0]) / 2, 0.0],
        backward=[0.0, (B + excess[1]) / 2, (B + excess[1]) / 2, 0.0],
        params=[0, 1, 1, 0],
        tokens_per_micro_batch=1,
        step_per_param=update / 2,
    )
    return model_at(_fitted(model_at(model, int(first["stages"])), calibration), stages)


def model_at(model: CostModel, stages: int) -> CostModel:
    """A stand-in cost model (`from_standin`) re-cut for ``stages`` ranks: 2P blocks of the same per-block costs,
    the fitted overhead and latency kept."""
    f, b = model.forward[1], model.backward[1]
    n = 2 * stages
    return replace(model, forward=[0.0] + [f] * n + [0.0], backward=[0.0] + [b] * n + [0.0], params=[0] + [1] * n + [0])


def from_standin_layers(calibration: list[dict], cfg: Any, path: str = "") -> CostModel:
    """A cost model of per-layer stand-in compute (`pipeline.standin.profile`, `asyncpipe.standin_costs`: every
    layer of ``cfg``'s model waits its own seconds, a chunk their sum under its cut) from stand-in records of that
    run (1F1B and 2BW, `standin_calibration`, each carrying its ``cut``): each layer at its stand-in seconds, every
    chunk's pass plus the engine's measured excess (``chunk_s``), the measured optimizer step spread over the
    model's real parameters, and the overhead per instruction and latency per exchange fitted to the records'
    steps at their own cuts. Predicts any P and cut of the same model and profile (`predict(..., cut=...)`)."""
    from asyncpipe.standin_costs import layer_costs, profile_of

    costs = layer_costs(cfg)
    if costs is None:
        raise UserError("from_standin_layers: the run has no pipeline.standin.profile")
    excess, update = _engine_figures(calibration)
    params = [x.params for x in _layers(cfg)]
    P = int(calibration[0]["stages"])
    name = Path(path).name if path else "stand-in records"
    used = ", ".join(f"{r['schedule']} at P={r['stages']}, m={r['micro_batches']}" for r in calibration)
    scale = float(cfg.pipeline.standin.get("scale", 1.0))
    model = CostModel(
        label=f"measured: {name} (per-layer stand-in {profile_of(cfg)} x {scale:g}; {used})",
        measured=True,
        forward=list(costs[0]),
        backward=list(costs[1]),
        params=params,
        tokens_per_micro_batch=int(cfg.train.micro_batch_size) * int(cfg.train.seq_len),
        step_per_param=update * P / sum(params),
        chunk_s=excess,
    )
    return _fitted(model, calibration, cuts=True)
