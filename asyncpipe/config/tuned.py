"""The tuned learning rates: conf/tuned_lr.yaml, ``{model preset: [regime, ...]}`` where a regime says what its lrs
were tuned for (data, optimizer steps, tokens per step) and holds ``{optimizer: peak lr}``. The optimizer YAMLs
read it as their default ``optimizer.lr`` (resolver ``tuned_lr``): the lr of the regime that fits the run (same
data, steps and tokens per step within a factor FIT of the tuned ones), else of the nearest one, and then
`regime_warning` says so in one line. Torch- and compose-free, so a report can ask whether optimizers were
compared at their tuned lrs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from omegaconf import OmegaConf

TABLE = "tuned_lr.yaml"
FIT = 2.0  # a run within this factor of a regime's steps and tokens per step, on its data, is in that regime


@dataclass(frozen=True)
class Regime:
    """What a row of the table was tuned for, and its lrs."""

    data: Optional[str]  # None: taken from the literature, for any data
    steps: Optional[int]
    tokens_per_step: Optional[int]
    lrs: dict[str, float]
    source: str = ""

    def describe(self) -> str:
        if self.steps is None:
            return self.source or "the literature"
        return f"{self.steps} steps x {self.tokens_per_step} tokens on {self.data}"

    def fits(self, data: Optional[str], steps: Optional[int], tokens_per_step: Optional[int]) -> bool:
        if self.steps is None or data is None:  # literature values, or a caller that does not say its regime
            return True
        return data == self.data and _within(steps, self.steps) and _within(tokens_per_step, self.tokens_per_step)

    def distance(self, data: Optional[str], steps: Optional[int], tokens: Optional[int]) -> float:
        own = [(steps, self.steps), (tokens, self.tokens_per_step)]
        far = sum(abs(math.log(a / b)) for a, b in own if a and b)
        return far + (0.0 if data is None or data == self.data else 100.0)


def _within(a: Optional[int], b: Optional[int]) -> bool:
    return a is None or b is None or (a > 0 and b > 0 and 1 / FIT <= a / b <= FIT)


def regimes(model_name: str) -> list[Regime]:
    """The table's regimes for ``model_name`` (a bare ``{optimizer: lr}`` entry is one regime, for any data)."""
    from asyncpipe.config.tree import conf_dir

    path = conf_dir() / TABLE
    if not path.is_file():
        return []
    entry = _table(str(path), path.stat().st_mtime_ns).get(str(model_name))
    if not entry:
        return []
    if isinstance(entry, dict):
        return [Regime(None, None, None, {k: float(v) for k, v in entry.items()})]
    return [
        Regime(
            r.get("data"),
            r.get("steps"),
            r.get("tokens_per_step"),
            {k: float(v) for k, v in (r.get("lr") or {}).items()},
            r.get("source", ""),
        )
        for r in entry
    ]


@lru_cache(maxsize=4)
def _table(path: str, mtime_ns: int) -> dict:
    """The table's YAML, read once per version of the file (a 500-run sweep asks once per run). Read only."""
    return OmegaConf.to_container(OmegaConf.load(path))


def tuned_regime(
    model_name: str,
    optimizer_name: str,
    data: Optional[str] = None,
    steps: Optional[int] = None,
    tokens_per_step: Optional[int] = None,
) -> Optional[Regime]:
    """The regime whose lr a run gets: one that fits it, else the nearest (same data first); None without one."""
    own = [r for r in regimes(model_name) if str(optimizer_name) in r.lrs]
    if not own:
        return None
    fitting = [r for r in own if r.fits(data, steps, tokens_per_step)]
    return min(fitting or own, key=lambda r: r.distance(data, steps, tokens_per_step))


def tuned_lr(
    model_name: str,
    optimizer_name: str,
    data: Optional[str] = None,
    steps: Optional[int] = None,
    tokens_per_step: Optional[int] = None,
) -> Optional[float]:
    """The tuned peak lr of ``optimizer_name`` on the preset ``model_name`` for that regime (None when the table has
    no entry: the optimizer then runs at its YAML's fallback, which nobody tuned for this model)."""
    regime = tuned_regime(model_name, optimizer_name, data, steps, tokens_per_step)
    return None if regime is None else regime.lrs[str(optimizer_name)]


def at_tuned_lr(model_name: str, optimizer_name: str, lr: float, rtol: float = 1e-9, **regime: Any) -> bool:
    """Whether ``lr`` is the tuned value (a report warns when optimizers are compared at other lrs)."""
    tuned = tuned_lr(model_name, optimizer_name, **regime)
    return tuned is not None and abs(lr - tuned) <= rtol * tuned


def run_regime(cfg: Any) -> dict[str, Any]:
    """``data``, ``steps``, ``tokens_per_step`` of a composed config or of a run's flattened dotted-key dict (a key
    it lacks is None)."""
    get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: OmegaConf.select(cfg, k))
    sizes = [get(k) for k in ("train.micro_batch_size", "train.micro_batches", "train.seq_len")]
    tokens = math.prod(int(x) for x in sizes) * int(get("pipeline.data_parallel") or 1) if all(sizes) else None
    steps = get("train.steps")
    return {"data": get("data.name"), "steps": int(steps) if steps else None, "tokens_per_step": tokens}


def default_lr(model_name: str, optimizer_name: str, fallback: Any, *, _root_: Any = None) -> float:
    """The ``tuned_lr`` resolver of the optimizer YAMLs: the tuned value for the run's regime, else the fallback."""
    regime = run_regime(_root_) if _root_ is not None else {}
    tuned = tuned_lr(model_name, optimizer_name, **regime)
    return float(fallback) if tuned is None else tuned


def regime_warning(cfg: Any) -> Optional[str]:
    """One line when the run's optimizer.lr is a tuned lr taken outside the regime it was tuned for; else None."""
    name, model = str(cfg.optimizer.name), str(cfg.model.name)
    regime = run_regime(cfg)
    found = tuned_regime(model, name, **regime)
    if (
        found is None
        or found.fits(**regime)
        or abs(float(cfg.optimizer.lr) - found.lrs[name]) > 1e-12 * found.lrs[name]
    ):
        return None
    return (
        f"warning: optimizer.lr={found.lrs[name]:g} is {name}'s tuned lr on {model} for {found.describe()}, not for "
        f"this run's {regime['steps']} steps x {regime['tokens_per_step']} tokens on {regime['data']} "
        f"(conf/tuned_lr.yaml): set optimizer.lr, or tune it for this regime"
    )
