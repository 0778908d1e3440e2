"""`bench pipeline --cuts even,balanced`: every schedule at each stage cut (`pipeline.cut`) side by side in the same
rounds, and what the result says about the cut: per schedule, its tokens/s at each later cut over the first (the
median, and paired round by round), and each (schedule, cut)'s measured step beside the cost model's prediction at
that cut (`asyncpipe.timelines.cost.predict(cut=...)`). The cost model is calibrated on this run's variants at the
first cut only, so the other cuts' predictions are out of sample:
- per-layer stand-in compute (`pipeline.standin.profile`): `cost_source.from_standin_layers` on 1F1B and 2BW;
- per-stage stand-in (`--standin F,B`): `cost_source.from_standin` on 1F1B and 2BW (a stage waits F and B
  whatever its layers, so a cut changes only the real ops there);
- real compute: `cost_source.from_bench` on 1F1B (blocks and head from its per-stage timings at its cut)."""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

from asyncpipe.bench import torch_pipelining as pt
from asyncpipe.errors import UserError


def cost_model(res: dict, cfgs: dict, first: str) -> tuple[Optional[Any], str]:
    """The cost model this run calibrates at the cut ``first`` (see the module docstring), or (None, why not)."""
    from asyncpipe.standin_costs import profile_of
    from asyncpipe.timelines.cost_source import from_bench, from_standin, from_standin_layers, standin_calibration

    cfg = cfgs.get(f"1f1b+{first}")
    if cfg is None:
        return None, f"no eager 1f1b at cut {first} to calibrate on"
    try:
        if "standin" in res:
            cal = standin_calibration(res["standin"]["records"], cut=first)
            if profile_of(cfg):
                return from_standin_layers(cal, cfg, "this run"), ""
            return from_standin(cal, int(res["stages"]), "this run"), ""
        return from_bench(res, "this run", variant=f"1f1b+{first}"), ""
    except UserError as err:
        return None, str(err)


def _predicted(model: Any, cfg: Any, cut: list[int], P: int, m: int, D: int) -> float:
    from asyncpipe.timelines.cost import predict

    p, t = cfg.pipeline, cfg.train
    clip = p.clip if t.grad_clip > 0 else "stage"
    ef, tied = cfg.compensation.name == "ef", bool(cfg.model.tie_embeddings)
    return predict(model, p.schedule, P, m, D, ef=ef, clip=clip, cut=cut, tied=tied).step_s


def cut_comparison(res: dict, cfgs: dict, cuts: Sequence[str]) -> dict[str, Any]:
    """The ``cuts`` section of a `bench pipeline --cuts` result (see the module docstring): ``model`` (its label,
    or why none), ``variants`` (per variant: cut, measured and predicted step, error) and ``ratios`` (per schedule
    and later cut: measured over the first cut, per round, at the best step, predicted, and the error)."""
    first = cuts[0]
    model, why = cost_model(res, cfgs, first)
    P, m, D = int(res["stages"]), int(res["micro_batches"]), int(res["data_parallel"])
    variants: dict[str, dict] = {}
    for name, v in res["variants"].items():
        base, _, rest = name.partition("+")
        cut_name = rest.split("+")[0]
        if pt.is_torch(base) or cut_name not in cuts:
            continue
        pred = _predicted(model, cfgs[name], v["cut"], P, m, D) if model is not None else None
        variants[name] = {
            "variant": base,
            "cut_name": cut_name,
            "cut": v["cut"],
            "measured_step_s": v["step_time_s"],
            "predicted_step_s": pred,
            "error": None if pred is None else pred / v["step_time_s"] - 1,
        }
    ratios: dict[str, dict] = {}
    for name, x in variants.items():
        ref_name = name.replace(f"+{x['cut_name']}", f"+{first}", 1)
        ref = variants.get(ref_name)
        if x["cut_name"] == first or ref is None:
            continue
        mine, theirs = res["variants"][name], res["variants"][ref_name]
        measured = mine["tokens_per_s"] / theirs["tokens_per_s"]
        pred = None if x["predicted_step_s"] is None else ref["predicted_step_s"] / x["predicted_step_s"]
        ratios[f"{x['variant']} {x['cut_name']}/{first}"] = {
            "variant": x["variant"],
            "over": f"{x['cut_name']}/{first}",
            "measured": measured,
            "per_round": [a / b for a, b in zip(mine["tokens_per_s_per_round"], theirs["tokens_per_s_per_round"])],
            "best_step": mine["tokens_per_s_best_step"] / theirs["tokens_per_s_best_step"],
            "predicted": pred,
            "error": None if pred is None else pred / measured - 1,
        }
    label = model.label if model is not None else f"no cost model: {why}"
    return {"calibrated_on": first, "model": label, "variants": variants, "ratios": ratios}


def cut_lines(res: dict) -> list[str]:
    """The printed summary of a result's ``cuts`` section: each ratio with its rounds' spread and the model's."""
    if "cuts" not in res:
        return []
    c = res["cuts"]
    pct = lambda x: "n/a" if x is None else f"{x:+.1%}"  # noqa: E731
    lines = [f"stage cuts (cost model: {c['model']}; calibrated at cut {c['calibrated_on']}):"]
    for r in c["ratios"].values():
        rounds = r["per_round"]
        spread = f"{min(rounds):.3f}-{max(rounds):.3f}" if rounds else "-"
        pred = "n/a" if r["predicted"] is None else f"{r['predicted']:.3f}"
        lines.append(
            f"  {r['variant']:10s} {r['over']}: {r['measured']:.3f}x (rounds {spread}, median "
            f"{statistics.median(rounds) if rounds else float('nan'):.3f}), predicted {pred}x ({pct(r['error'])})"
        )
    for name, v in c["variants"].items():
        pred = "n/a" if v["predicted_step_s"] is None else f"{v['predicted_step_s'] * 1e3:.1f}"
        lines.append(
            f"  {name:22s} cut {','.join(map(str, v['cut']))}: step {v['measured_step_s'] * 1e3:.1f} ms, "
            f"predicted {pred} ms ({pct(v['error'])})"
        )
    return lines
