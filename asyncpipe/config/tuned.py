"""The tuned learning rates: conf/tuned_lr.yaml, ``{model preset: {optimizer: peak lr}}`` with each value's source,
which the optimizer YAMLs read as their default ``optimizer.lr`` (resolver ``tuned_lr``). Torch- and compose-free,
so a report can ask whether optimizers were compared at their tuned lrs."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import OmegaConf

TABLE = "tuned_lr.yaml"


def tuned_lr(model_name: str, optimizer_name: str) -> Optional[float]:
    """The tuned peak lr of ``optimizer_name`` on the preset ``model_name``; None when the table has no entry
    (the optimizer then runs at its YAML's fallback, which nobody tuned for this model)."""
    from asyncpipe.config.tree import conf_dir

    path = conf_dir() / TABLE
    if not path.is_file():
        return None
    value = (OmegaConf.load(path).get(str(model_name)) or {}).get(str(optimizer_name))
    return None if value is None else float(value)


def at_tuned_lr(model_name: str, optimizer_name: str, lr: float, rtol: float = 1e-9) -> bool:
    """Whether ``lr`` is the tuned value (a report warns when optimizers are compared at other lrs)."""
    tuned = tuned_lr(model_name, optimizer_name)
    return tuned is not None and abs(lr - tuned) <= rtol * tuned


def default_lr(model_name: str, optimizer_name: str, fallback: Any) -> float:
    """The ``tuned_lr`` resolver of the optimizer YAMLs: the tuned value, else the YAML's fallback."""
    tuned = tuned_lr(model_name, optimizer_name)
    return float(fallback) if tuned is None else tuned
