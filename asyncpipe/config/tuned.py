"""The tuned learning rates: each model preset's table ``lr: {optimizer: value}`` (conf/model/<name>.yaml), which
the optimizer YAMLs read as their default ``optimizer.lr``. Torch-free and compose-free, for reports."""

from __future__ import annotations

from typing import Optional

from omegaconf import OmegaConf

from asyncpipe.config.compose import conf_dir


def tuned_lr(model_name: str, optimizer_name: str) -> Optional[float]:
    """The tuned peak lr of ``optimizer_name`` on the preset ``model_name``; None when the preset has no entry
    for it (the optimizer then runs at its own YAML's fallback, which nobody tuned for this model)."""
    path = conf_dir() / "model" / f"{model_name}.yaml"
    if not path.is_file():
        return None
    table = OmegaConf.load(path).get("lr") or {}
    value = table.get(optimizer_name)
    return None if value is None else float(value)


def at_tuned_lr(model_name: str, optimizer_name: str, lr: float, rtol: float = 1e-9) -> bool:
    """Whether ``lr`` is the tuned value (a report warns when optimizers are compared at other lrs)."""
    tuned = tuned_lr(model_name, optimizer_name)
    return tuned is not None and abs(lr - tuned) <= rtol * tuned
