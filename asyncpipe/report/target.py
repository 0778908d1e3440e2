"""Time to target: how many tokens a delayed column needs to reach its sync reference's final val loss, and what
that makes of 2BW's throughput advantage in wall-clock.

A **ladder** is a delayed column and the columns that differ from it only in `train.steps` (the same run at a
longer token budget, each with its own schedule, e.g. `1-step+EF` and `1-step+EF(x1.5)`) and ran the same revision of
every rule (a recipe's older revision, `PACI@r1`, is a ladder of its own). Per seed, the target is
that seed's sync run's final val loss, and the tokens to reach it are read thus:
- the smallest budget whose final val loss is at or below the target, interpolated linearly (in tokens, on final
  val loss) between it and the next smaller budget, whose final loss is above the target;
- when the smallest budget already reaches it: along that run's val curve (linear between evaluations);
- when no budget reaches it: not reached within the largest budget's tokens (a lower bound).
Token ratio = mean tokens needed / mean sync tokens (ratio of means; Fieller's interval over seeds; a lower
bound when any seed did not reach the target). Net wall-clock speed-up = throughput ratio / token ratio, its
interval carrying the throughput's own error too (`asyncpipe.report.spread`; the long table:
`asyncpipe.report.speedups`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import pandas as pd

from asyncpipe.report.groups import Grouping
from asyncpipe.report.load import COMPLETED
from asyncpipe.report.speedups import ladder_speedup, net, points
from asyncpipe.report.spread import Spread, combine, exact
from asyncpipe.report.stats import Interval, fieller_ratio
from asyncpipe.report.throughput import Throughput, throughput

STEPS = "train.steps"


def along_curve(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """First token count at which the val curve (tokens, loss), linear between evaluations, is at or below target."""
    pts = sorted(points)
    for i, (t, loss) in enumerate(pts):
        if loss <= target:
            if i == 0:
                return float(t)
            t0, l0 = pts[i - 1]
            return t0 + (l0 - target) / (l0 - loss) * (t - t0)
    return None


def seed_tokens(
    target: float, budgets: Sequence[tuple[float, float]], first_curve: Sequence[tuple[float, float]] = ()
) -> tuple[float, bool]:
    """(tokens needed, reached) for one seed; budgets are (final tokens, final val loss) of each budget's run."""
    budgets = sorted(budgets)
    for i, (tokens, loss) in enumerate(budgets):
        if loss <= target:
            if i == 0:
                found = along_curve(first_curve, target) if len(first_curve) else None
                return (found if found is not None else float(tokens)), True
            t0, l0 = budgets[i - 1]
            return t0 + (l0 - target) / (l0 - loss) * (tokens - t0), True
    return float(budgets[-1][0]), False


def net_speedup(ratio: Interval | None, bound: float | None, thr: float, spread: Spread | None = None) -> str:
    """Throughput ratio / token ratio, with the interval combining the token ratio's and the throughput's
    (`spread`; None: the throughput taken as exact), or `≤` when the tokens are a lower bound."""
    return net(combine(ratio, bound, thr, spread or exact(thr, "")), ratio)


@dataclass
class Ladder:
    table: str
    optimizer: str
    columns: list[str]  # its columns, smallest budget first
    multiples: list[float]  # each column's tokens over sync's
    ef: bool
    stages: int
    micro_batches: int
    schedule: str = "2bw"  # the asynchronous schedule whose throughput it has: 2bw, or a paci recipe
    per_seed: dict[Any, tuple[float, bool, float]] = field(default_factory=dict)  # seed -> (tokens, reached, sync)
    ratio: Interval | None = None  # token ratio to sync, when every seed reached the target
    bound: float | None = None  # token ratio lower bound, when some seed did not

    @property
    def name(self) -> str:
        return self.columns[0] + (
            f" ({', '.join(f'{x:.2f}x' for x in self.multiples)} budgets)" if len(self.columns) > 1 else ""
        )

    @property
    def reached(self) -> int:
        return sum(r for _, r, _ in self.per_seed.values())

    def tokens_text(self) -> str:
        n = len(self.per_seed)
        if self.bound is not None:
            most = max(t for t, _, _ in self.per_seed.values())
            return f"≥ {self.bound:.2f}x (not reached by {n - self.reached} of {n} seeds within {most:,.0f} tokens)"
        return self.ratio.fmt(".2f", 1, "x") if self.ratio is not None else "—"

    def net(self, thr: Throughput) -> str:
        return net_speedup(self.ratio, self.bound, thr.vs_1f1b, thr.error())

    def throughput(self, bench: list[dict]) -> Throughput:
        """2BW's (2BW + EF's for an EF column) throughput over 1F1B at the ladder's own P and m, from the bench
        files of its own optimizer: the one number the takeaway, both time-to-target tables and the wall-clock plot
        use for this ladder."""
        return throughput(self.stages, self.micro_batches, bench, self.ef, self.schedule, self.optimizer)


def _final(curves: pd.DataFrame, run: str) -> tuple[float, float, list[tuple[float, float]]] | None:
    own = curves[curves["run"] == run].sort_values("tokens")
    if own.empty:
        return None
    return float(own["tokens"].iloc[-1]), float(own["val_loss"].iloc[-1]), list(zip(own["tokens"], own["val_loss"]))


def ladders(runs: pd.DataFrame, curves: pd.DataFrame, grouping: Grouping, groups: list) -> list[Ladder]:
    """Every delayed column's ladder in every table whose reference column is synchronous."""
    out = []
    for group in groups:
        done = runs[(runs["status"] == COMPLETED) & runs["run"].isin(group.runs)]
        for optimizer, opt_runs in done.groupby("optimizer", sort=False):
            ref = opt_runs[opt_runs["variant"] == group.reference]
            if ref.empty or int(ref["delay"].iloc[0]) != 0:
                continue
            sync = {s: _final(curves, r) for s, r in zip(ref["seed"], ref["run"])}
            keyed: dict[str, list[str]] = {}
            for variant, cell in opt_runs[opt_runs["delay"] > 0].groupby("variant", sort=False):
                keyed.setdefault(_family_key(cell.iloc[0], grouping), []).append(variant)
            for columns in keyed.values():
                out.append(_ladder(group, str(optimizer), opt_runs, curves, columns, sync))
    return [lad for lad in out if lad is not None]


def _family_key(run: Any, grouping: Grouping) -> str:
    """What the columns of one ladder share: every compared setting but `train.steps`, and the revisions of the
    rules they ran (`load.name_revisions`), so runs of an older rule (`PACI@r1`, the recompute recipe) form their
    own ladder beside today's, as their cells stand apart, even where every setting is equal."""
    rules = run.get("rule_revisions")
    settings = sorted((k, repr(v)) for k, v in grouping.values[run["run"]].items() if k != STEPS)
    return repr((rules if isinstance(rules, str) else "", settings))


def _ladder(
    group: Any, optimizer: str, opt_runs: pd.DataFrame, curves: pd.DataFrame, columns: list[str], sync: dict
) -> Ladder | None:
    finals = {
        v: {s: _final(curves, r) for s, r in zip(c["seed"], c["run"])}
        for v, c in opt_runs[opt_runs["variant"].isin(columns)].groupby("variant")
    }
    ends = {v: max(f[0] for f in fs.values() if f) for v, fs in finals.items() if any(fs.values())}
    columns = sorted(ends, key=ends.get)
    sync_end = [f[0] for f in sync.values() if f]
    if not columns or not sync_end:
        return None
    first = opt_runs[opt_runs["variant"] == columns[0]].iloc[0]
    cfg = first["config"] or {}
    lad = Ladder(
        group.title,
        optimizer,
        columns,
        [ends[v] / max(sync_end) for v in columns],
        bool(first["ef"]),
        int(cfg.get("pipeline.stages") or 2),
        int(cfg.get("train.micro_batches") or 1),
        _async_schedule(first),
    )
    for seed, ref in sync.items():
        budgets = [finals[v][seed] for v in columns if finals[v].get(seed)]
        if ref is None or not budgets:
            continue
        tokens, reached = seed_tokens(ref[1], [b[:2] for b in budgets], budgets[0][2])
        lad.per_seed[seed] = (tokens, reached, ref[0])
    if not lad.per_seed:
        return None
    tokens = [t for t, _, _ in lad.per_seed.values()]
    base = [s for _, _, s in lad.per_seed.values()]
    if lad.reached == len(lad.per_seed):
        lad.ratio = fieller_ratio(tokens, base)
    else:
        lad.bound = sum(tokens) / sum(base)
    return lad


def _async_schedule(run: Any) -> str:
    """The asynchronous schedule whose throughput a run's time is judged by: a PACI recipe by its name today (a
    record of paci revision 1 is paci-recompute: `asyncpipe.report.revisions`), else 2BW's."""
    name = str(run.get("schedule") or "")
    return name if name.startswith("paci") else "2bw"


def speedup_table(ladders_: list[Ladder], bench: list[dict]) -> pd.DataFrame:
    """Rows: P, m (the grid and each run's own); 2BW's throughput (per optimizer whose step the bench files timed,
    when they timed several) and the strongest sync schedule; per ladder its net wall-clock speed-up over 1F1B (and
    over the strongest sync schedule where that is another), the combined interval, then the throughput and its
    source (`measured, N rounds`, `modelled, ±x%`, ideal). The same numbers, in columns: `speedups.speedup_cells`."""
    rows = []
    timed = sorted({str(b.get("optimizer")) for b in bench if b.get("optimizer")})
    for P, m in points(ladders_):
        row: dict[str, Any] = {"P": P, "m": m}
        for opt in timed if len(timed) > 1 else [None]:
            plain = throughput(P, m, bench, optimizer=opt)
            step = f" ({opt}'s step)" if opt else ""
            row[f"2BW / 1F1B throughput{step}"] = f"{_with_spread(plain.vs_1f1b, plain.error())} ({plain.source})"
            if plain.vs_best_sync is not None:  # the fastest synchronous schedule the bench file measured, named
                over = f"{plain.vs_1f1b / plain.vs_best_sync:.3f}"
                row[f"strongest sync schedule (x1F1B){step}"] = f"{plain.best_sync} = {plain.best_sync_label}, {over}"
        for lad in ladders_:
            thr = throughput(P, m, bench, lad.ef, lad.schedule, lad.optimizer)
            label = f"{lad.optimizer} {lad.columns[0]}"
            sp, spread = ladder_speedup(lad, thr)
            row[f"{label} vs 1F1B"] = f"{net(sp, lad.ratio)} ({thr.vs_1f1b:.3f}, {spread.how})"
            if thr.vs_best_sync is not None and thr.best_sync != "1f1b":
                sp, spread = ladder_speedup(lad, thr, best=True)
                row[f"{label} vs {thr.best_sync}"] = f"{net(sp, lad.ratio)} ({thr.vs_best_sync:.3f}, {spread.how})"
        rows.append(row)
    return pd.DataFrame(rows).fillna("—").set_index(["P", "m"])


def _with_spread(value: float, spread: Spread) -> str:
    """`1.433 [1.107, 1.735]`, or the value alone where it has no interval (the ideal; one round)."""
    if not spread.known or spread.lo == spread.hi:
        return f"{value:.3f}"
    return f"{value:.3f} [{spread.lo:.3f}, {spread.hi:.3f}]"


def tokens_table(ladders_: list[Ladder], bench: list[dict]) -> pd.DataFrame:
    """One row per ladder: seeds that reached the target, the token ratio, and the net speed-up at the ladder's own
    P and m with the throughput the takeaway uses (measured where a bench file covers it, else ideal)."""
    rows = []
    for lad in ladders_:
        thr = lad.throughput(bench)
        rows.append(
            {
                "table": lad.table,
                "optimizer": lad.optimizer,
                "variant (budgets)": lad.name,
                "seeds reached": f"{lad.reached}/{len(lad.per_seed)}",
                "tokens to sync's final val loss, / sync's": lad.tokens_text(),
                "net speed-up at its P, m": f"{lad.net(thr)} (P={lad.stages}, m={lad.micro_batches}: "
                f"{thr.vs_1f1b:.3f}x throughput, {thr.error().how})",
            }
        )
    return pd.DataFrame(rows).set_index("table") if rows else pd.DataFrame()


def phrase(lad: Ladder, bench: list[dict]) -> str:
    """The takeaway's time-to-target clause, from the net speed-up's combined interval (token ratio and throughput)
    at the run's own P and m."""
    thr = lad.throughput(bench)
    sp, spread = ladder_speedup(lad, thr)
    where = f"at P={lad.stages}, m={lad.micro_batches} ({thr.vs_1f1b:.2f}x throughput, {spread.how})"
    if lad.bound is not None:
        top = f" ({sp.hi:.2f}x at the throughput's high end)" if math.isfinite(sp.hi) and sp.hi > sp.value else ""
        return (
            f"{lad.columns[0]} does not reach sync's loss within {max(lad.multiples):.2f}x its tokens "
            f"({len(lad.per_seed) - lad.reached} of {len(lad.per_seed)} seeds), so {where} it is at most "
            f"{sp.value:.2f}x sync's speed{top}" + _versus_strongest(thr, lad)
        )
    iv = lad.ratio
    if iv is None or not iv.known:
        return ""
    said = net(sp, iv)
    if sp.direction == "faster":
        return f"{where} {lad.name} reaches sync's loss {said} sooner in wall-clock" + _versus_strongest(thr, lad)
    if sp.direction == "slower":
        return f"{where} {lad.name} reaches sync's loss later (net speed-up {said})" + _versus_strongest(thr, lad)
    return f"{where} {lad.name}'s net speed-up {said} is not resolved" + _versus_strongest(thr, lad)


def _versus_strongest(thr: Throughput, lad: Ladder) -> str:
    """The net speed-up against the strongest synchronous schedule the bench file measured (or, at a modelled depth,
    the cost model's faster of 1F1B and DualPipeV), named (PyTorch's own schedules included), when that is not 1F1B
    itself (then the clause before already said it)."""
    if thr.vs_best_sync is None or thr.best_sync == "1f1b":
        return ""
    who = f"the strongest synchronous schedule measured, {thr.best_sync} ({thr.best_sync_label})"
    if thr.kind == "modelled":
        who = f"the cost model's strongest synchronous schedule, {thr.best_sync_label}"
    sp, _ = ladder_speedup(lad, thr, best=True)
    return f"; against {who}: {net(sp, lad.ratio)}" + ("" if sp.bounded or sp.resolved else " (not resolved)")
