"""Which schedule is fastest within the memory budget: for every declared schedule the pipeline engine runs, the
memory plan (`asyncpipe.plan`) beside the cost model's predicted step time and tokens/s
(`asyncpipe.timelines.cost`) under a device profile (a stated one by default, `conf/device_profile/`) or a
calibration measured on this machine (a `bench pipeline` JSON of the same model). `asyncpipe plan` prints it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from asyncpipe.errors import ConfigError, UserError

DEFAULT_PROFILE = "h100_assumed"
# A device profile's numbers: (smallest, whether the smallest itself is allowed, largest); finite, never bool
PROFILE_RANGES = {
    "matmul_flops": (0.0, False, math.inf),
    "efficiency": (0.0, False, 1.0),
    "backward_over_forward": (0.0, False, math.inf),
    "memory_bytes_per_s": (0.0, False, math.inf),
    "step_bytes_per_param": (0.0, True, math.inf),
    "ef_bytes_per_param": (0.0, True, math.inf),
    "p2p_bytes_per_s": (0.0, False, math.inf),
    "p2p_latency_s": (0.0, True, math.inf),
    "allreduce_bytes_per_s": (0.0, False, math.inf),
    "allreduce_latency_s": (0.0, True, math.inf),
    "overhead_s": (0.0, True, math.inf),
}


@dataclass
class Speed:
    schedule: str
    reason: str = ""  # why it cannot run this config (then nothing else is set)
    peak_gib: float = 0.0  # the largest stage's total
    fits: bool = False  # every stage within the budget, and the engine can run the batch
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    bubble: float = 0.0
    cut: tuple[int, ...] = ()  # blocks per stage (per chunk in a V), as the engine cuts (`pipeline.cut`)
    over_even: float = 1.0  # predicted tokens/s over the same schedule at the even cut
    cut_note: str = ""  # how the memory budget moved the balanced cut (`plan.cut_within`)


def schedule_overrides(name: str) -> list[str]:
    """What selects ``name`` on top of the user's overrides: the schedule, its delay, per-stage clipping where it
    cannot clip globally (as `bench pipeline` runs it)."""
    from asyncpipe.schedules import get

    spec = get(name)
    out = [f"pipeline.schedule={name}", f"delay={1 if spec.delay is None else spec.delay}"]
    return out + ([] if "global" in spec.clip_modes else [f"pipeline.clip={spec.clip_modes[0]}"])


def cost_model(cfg: Any, profile: str) -> Any:
    """The cost model of ``cfg``'s model: a device profile by name / YAML path, or a bench JSON measured here."""
    import json

    from asyncpipe.timelines.cost_source import from_bench, from_profile

    if profile.endswith(".json"):
        try:
            rec = json.loads(Path(profile).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"--profile {profile}: cannot read a bench pipeline result ({exc})") from None
        if not isinstance(rec, dict) or rec.get("model") != cfg.model.name:
            raise UserError(
                f"--profile {profile}: calibrated on model {rec.get('model') if isinstance(rec, dict) else '?'}"
                f", not model={cfg.model.name}; a measured calibration holds for its own model only"
            )
        return from_bench(rec, profile)
    return from_profile(checked_profile(profile), cfg)


def checked_profile(name_or_path: str) -> dict:
    """`cost_source.load_profile`'s profile with every value's type and range checked: a YAML that does not parse,
    a number that is not one, not finite or out of range (efficiency in (0, 1], rates > 0, the rest >= 0) is one
    `UserError` naming the file and the key, never a traceback or a prediction from nonsense."""
    from asyncpipe.timelines.cost_source import PROFILE_DIR, load_profile

    path = Path(name_or_path) if Path(name_or_path).suffix else PROFILE_DIR / f"{name_or_path}.yaml"
    try:
        data = load_profile(name_or_path)
    except UserError:
        raise
    except Exception as exc:  # the YAML parser's many error types: the file is not a YAML mapping
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"--profile {path}: not a readable YAML device profile ({first})") from None
    for key, (low, low_ok, high) in PROFILE_RANGES.items():
        v = data[key]
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not number or v < low or (v == low and not low_ok) or v > high:
            bound = f"{'>=' if low_ok else '>'} {low:g}" + (f" and <= {high:g}" if math.isfinite(high) else "")
            raise UserError(f"--profile {path}: {key} = {v!r} must be a finite number {bound}")
    for key, kind in (("name", str), ("note", str), ("measured", bool)):
        if not isinstance(data[key], kind):
            raise UserError(f"--profile {path}: {key} = {data[key]!r} must be a {kind.__name__}")
    return data


def run_model(cfg: Any, profile: str, cut: Sequence[int]) -> tuple[Any, dict]:
    """The cost model of the run ``cfg`` at its ``cut`` and what `cost.predict` needs besides (EF, clipping, a tied
    matrix split over stage 0 and P-1: the last stage steps a copy, and the two copies' all-reduce joins them)."""
    p, m = cfg.pipeline, cfg.model
    split = bool(m.tie_embeddings) and len(cut) == p.stages > 1
    copy = m.d_model * int(m.vocab_size or cfg.tokenizer.vocab_size) if split else 0
    how = dict(ef=cfg.compensation.name == "ef", clip=p.clip if cfg.train.grad_clip > 0 else "stage", tied=split)
    return with_tied_copy(cost_model(cfg, profile), copy), how


def modelled(
    overrides: Sequence[str], profile: str = DEFAULT_PROFILE, batches: int = 3, max_drawn: int = 1024
) -> tuple[str, Any]:
    """`asyncpipe schedule OVERRIDES`: the cost model's timeline of the run the overrides describe (its schedule, P,
    m and D, the cut `plan` gives it, tied or not) over ``batches`` (>= 2) batches, and a title naming the costs.
    More than ``max_drawn`` stages x micro-batches x batches: one line (a bigger drawing takes minutes)."""
    from asyncpipe.config import compose
    from asyncpipe.plan import plan
    from asyncpipe.schedules import resolve
    from asyncpipe.timelines.cost import predict

    cfg = compose([*overrides, "engine=pipeline"])
    spec, p, t = resolve(cfg), cfg.pipeline, cfg.train
    if batches < 2 or p.stages * t.micro_batches * batches > max_drawn:
        raise UserError(
            f"--batches {batches}: draw 2 or more, and at most {max_drawn} stages x micro-batches x batches "
            f"({p.stages} x {t.micro_batches} x {batches} here)"
        )
    cut = plan(cfg).cut
    model, how = run_model(cfg, profile, cut)
    pred = predict(model, spec.name, p.stages, t.micro_batches, p.data_parallel, **how, cut=cut, batches=batches - 1)
    title = (
        f"{spec.name}: model {cfg.model.name}, P={p.stages}, m={t.micro_batches}, cut {','.join(map(str, cut))}, "
        f"{batches} batches; step {pred.step_s * 1e3:.1f} ms under {model.label.split(' (')[0]}"
    )
    return title, pred.timeline


def with_tied_copy(model: Any, copy: int) -> Any:
    """``model`` (a `timelines.cost.CostModel`) with the parameters of a tied embedding's copy (`engines.pipeline.tied`)
    on the head, so the stage that holds the head steps them too."""
    from dataclasses import replace

    return replace(model, params=[*model.params[:-1], model.params[-1] + copy]) if copy else model


def speeds(overrides: Sequence[str], gpu_mem_gib: float, profile: str = DEFAULT_PROFILE) -> tuple[list[Speed], str]:
    """Per schedule (in declaration order) its memory and predicted speed; and the cost model's label. A profile
    that cannot be read, or a calibration of another model, is one `UserError` before any row."""
    from asyncpipe.config import compose
    from asyncpipe.plan import GIB, plan
    from asyncpipe.schedules import schedules
    from asyncpipe.timelines.cost import predict

    out, label = [], ""
    base = compose(list(overrides))  # as `plan` composed it (a schedule the engine refuses is said per row)
    cost_model(base, profile)  # the user's mistake, said once
    p = base.pipeline  # evaluation enters neither memory nor speed: enough of it for a V's check (2P per replica)
    evals = f"train.eval_batches={max(int(base.train.eval_batches), 2 * p.stages * p.data_parallel)}"
    for spec in [s for s in schedules() if "pipeline" in s.engines]:
        try:
            cfg = compose([*overrides, "engine=pipeline", evals, *schedule_overrides(spec.name)])
            pl = plan(cfg, gpu_mem_gib)
            p, t = cfg.pipeline, cfg.train
            cut = pl.cut  # the plan's: balanced within the budget (`plan.cut_within`), as the run would cut
            model, how = run_model(cfg, profile, cut)
            pred = predict(model, spec.name, p.stages, t.micro_batches, p.data_parallel, **how, cut=cut)
            even = predict(model, spec.name, p.stages, t.micro_batches, p.data_parallel, **how)
        except (ConfigError, UserError) as err:
            out.append(Speed(spec.name, reason=str(err).split("\n")[0]))
            continue
        label = model.label
        peak = max(s.total for s in pl.stages) / GIB
        out.append(
            Speed(
                spec.name,
                "",
                peak,
                pl.ok,
                pred.step_s,
                pred.tokens_per_s(model.tokens_per_micro_batch),
                pred.bubble,
                tuple(cut),
                even.step_s / pred.step_s,
                pl.cut_note,
            )
        )
    return out, label


def fastest(rows: list[Speed]) -> Optional[Speed]:
    fit = [r for r in rows if not r.reason and r.fits]
    return max(fit, key=lambda r: r.tokens_per_s) if fit else None


def render(rows: list[Speed], gpu_mem_gib: float, label: str) -> str:
    lines = [
        f"schedules under the cost model ({label or 'no schedule could run'}):",
        f"  {'schedule':10s} {'peak GiB':>9s} {'fits':>4s} {'step ms':>10s} {'tokens/s':>12s} {'bubble':>6s} "
        f"{'x even':>6s}  cut (blocks per stage; a V: per chunk)",
    ]
    for r in rows:
        if r.reason:
            lines.append(f"  {r.schedule:10s} cannot run: {r.reason}")
            continue
        lines.append(
            f"  {r.schedule:10s} {r.peak_gib:9.1f} {'yes' if r.fits else 'NO':>4s} {r.step_s * 1e3:10.1f} "
            f"{r.tokens_per_s:12,.0f} {r.bubble:6.3f} {r.over_even:6.3f}  {','.join(map(str, r.cut))}"
        )
    lines += [f"  {r.schedule}: {r.cut_note}" for r in rows if r.cut_note]
    best = fastest(rows)
    if best is None:
        lines.append(f"fastest within {gpu_mem_gib:g} GiB: none fits")
    else:
        lines.append(
            f"fastest within {gpu_mem_gib:g} GiB: {best.schedule}, {best.tokens_per_s:,.0f} tokens/s predicted "
            f"({best.step_s * 1e3:.1f} ms per step)"
        )
    return "\n".join(lines)
