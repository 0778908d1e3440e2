"""`asyncpipe sweep --dry-run`: a sweep's runs, their tokens and an estimated wall time, without launching.

The estimate uses the tokens/s that similar completed runs recorded (`summary.json`: tokens / wall_time) under
the sweeps' directory: the same model, engine, stages, optimizer, delay and EF when there are such runs, else
fewer of these. Runs `parallel` at a time are packed longest first. Never imports torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from asyncpipe.config.alias import uses_switch
from asyncpipe.config.keys import lookup

MAX_RECORDS = 400  # the most recent completed runs read for rates
# Features compared, most specific first; each estimate drops features from the end until runs match.
FEATURES = ("model.name", "engine", "pipeline.stages", "pipeline.data_parallel", "optimizer.name", "async", "ef")


def features(cfg: Any) -> dict[str, Any]:
    out = {k: lookup(cfg, k) for k in FEATURES if k not in ("async", "ef")}
    out["async"] = bool(lookup(cfg, "delay"))
    out["ef"] = lookup(cfg, "compensation.name") == "ef" or uses_switch(cfg)  # a record from before the alias
    if out["engine"] != "pipeline":
        out["pipeline.stages"] = None
    return out


def tokens_of(cfg: Any) -> int:
    """The tokens a run trains itself (a budget branch: its decay only, `asyncpipe.sweep.budgets.trained_steps`)."""
    from asyncpipe.sweep.budgets import trained_steps

    t = cfg.train
    return int(trained_steps(cfg) * t.micro_batch_size * t.micro_batches * t.seq_len * cfg.pipeline.data_parallel)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def recorded_rates(root: Path) -> list[tuple[dict, float]]:
    """(features, tokens/s) of the most recent completed runs under `root` (their files read as untrusted: one
    that is not a regular file, too large or of the wrong type is passed over)."""
    from asyncpipe.errors import UserError
    from asyncpipe.track.files import load_untrusted_yaml, read_json_object, read_untrusted

    if not Path(root).is_dir():
        return []
    summaries = sorted(Path(root).rglob("summary.json"), key=_mtime, reverse=True)
    out = []
    for path in summaries[:MAX_RECORDS]:
        try:
            summary = read_json_object(path)
            tokens, wall = summary.get("tokens"), summary.get("wall_time")
            if summary.get("status") != "completed" or not _positive(tokens) or not _positive(wall):
                continue
            if summary.get("branch_of") is not None:  # a budget branch's tokens include its parent's steps
                continue
            cfg, _ = load_untrusted_yaml(read_untrusted(path.parent / "config.yaml"), str(path.parent / "config.yaml"))
        except (OSError, UserError):
            continue
        if isinstance(cfg, dict):
            out.append((features(cfg), float(tokens) / float(wall)))
    return out


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def rate_for(cfg: Any, records: list[tuple[dict, float]]) -> tuple[Optional[float], str]:
    """Median tokens/s of the most similar recorded runs, and which runs those were."""
    want = features(cfg)
    for n in range(len(FEATURES), 1, -1):
        keys = FEATURES[:n]
        rates = [r for f, r in records if all(f.get(k) == want.get(k) for k in keys)]
        if rates:
            same = ", ".join(f"{k}={want[k]}" for k in keys if want[k] is not None)
            return statistics.median(rates), f"median of {len(rates)} run(s) with {same}"
    return None, "no recorded run of this model and engine"


@dataclass
class DryRun:
    rows: list[dict] = field(default_factory=list)  # name, overrides, tokens, seconds, basis, done
    parallel: int = 1

    @property
    def todo(self) -> list[dict]:
        return [r for r in self.rows if not r["done"]]

    def wall_seconds(self) -> Optional[float]:
        """Estimated time for the runs still to do, `parallel` at a time (longest first); None when unknown."""
        times = [r["seconds"] for r in self.todo]
        if any(t is None for t in times):
            return None
        slots = [0.0] * max(1, self.parallel)
        for t in sorted(times, reverse=True):
            slots[slots.index(min(slots))] += t
        return max(slots)


def dry_run(specs: Sequence[tuple[str, Sequence[str], Any, bool]], parallel: int, root: Path) -> DryRun:
    """specs: (run name, overrides, composed config, already completed) per run."""
    records = recorded_rates(root)
    result = DryRun(parallel=parallel)
    for name, overrides, cfg, done in specs:
        tokens = tokens_of(cfg)
        rate, basis = rate_for(cfg, records)
        result.rows.append(
            {
                "name": name,
                "overrides": " ".join(overrides),
                "tokens": tokens,
                "done": done,
                "seconds": tokens / rate if rate else None,
                "basis": basis,
            }
        )
    return result


def fmt_tokens(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return "unknown"
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def render(plan_name: str, result: DryRun) -> str:
    lines = [
        f"sweep {plan_name}: {len(result.rows)} runs ({len(result.todo)} to run, "
        f"{len(result.rows) - len(result.todo)} already completed), {result.parallel} at a time"
    ]
    width = max((len(r["name"]) for r in result.rows), default=3)
    for r in result.rows:
        state = "done" if r["done"] else fmt_seconds(r["seconds"])
        lines.append(f"  {r['name']:<{width}}  {fmt_tokens(r['tokens']):>6} tokens  {state:>9}  {r['overrides']}")
    total = sum(r["tokens"] for r in result.todo)
    bases = sorted({r["basis"] for r in result.todo})
    lines.append(
        f"tokens to train: {fmt_tokens(total)}; estimated wall time: {fmt_seconds(result.wall_seconds())} "
        "(training only, plus a few seconds of start-up per run)"
    )
    lines += [f"  rate: {b}" for b in bases]
    return "\n".join(lines)
