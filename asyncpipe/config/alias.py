"""Aliases and implied settings resolved once, at composition: after this nothing reads the aliased keys.

A named schedule implies what it declares (`apply_schedule_defaults`): ``pipeline.schedule=paci`` runs at PACI's
delay and clipping unless the user typed another value, which `config.validate` then refuses in one line.

``optimizer.ef.enabled=true`` (the ``adamw_ef`` / ``muon_ef`` presets, and that override in sweep files and old
run records) is ``compensation=ef`` with ``compensation.ef.lam = optimizer.ef.lam`` and a constant schedule; the
switch is then reset to its default, so a composed config names EF one way. Torch-free; works on a composed
`DictConfig` and on a run record's plain dict (`asyncpipe.report.load`, resume's check of a recorded config).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from asyncpipe.errors import ConfigError

EF_SWITCH = "optimizer.ef.enabled"


def _get(node: Any, key: str, default: Any = None) -> Any:
    return node.get(key, default) if hasattr(node, "get") else default


def uses_ef_alias(cfg: Any) -> bool:
    """True when ``cfg`` switches EF on through ``optimizer.ef.enabled``."""
    return str(_get(_get(_get(cfg, "optimizer"), "ef"), "enabled", False)).lower() == "true"


def resolve_ef_alias(cfg: Any, strict: bool = True) -> Any:
    """Rewrite ``optimizer.ef.enabled=true`` into ``compensation=ef`` in place (``cfg``: a DictConfig or a dict);
    returns ``cfg``. ``strict``: refuse the switch beside another compensation method (one line); a record
    (``strict=False``) keeps its method then."""
    if not uses_ef_alias(cfg):
        return cfg
    comp = _get(cfg, "compensation")
    name = _get(comp, "name", "none")
    if name not in (None, "none"):
        if strict:
            raise ConfigError(
                f"optimizer.ef.enabled=true (the *_ef presets) and compensation={name}: choose one "
                "(optimizer.ef.enabled=true is compensation=ef)"
            )
        return cfg
    ef = cfg["optimizer"]["ef"]
    lam = ef.get("lam", 1.0)
    if comp is None:
        cfg["compensation"] = comp = {}
    comp["name"] = "ef"
    if "_target_" in comp:
        comp["_target_"] = None
    node = comp.get("ef")
    if node is None:
        comp["ef"] = node = {}
    node["lam"] = lam
    node["schedule"] = "constant"
    node["warmup_steps"] = 0
    ef["enabled"] = False
    ef["lam"] = 1.0
    return cfg


def typed_keys(overrides: Sequence[str]) -> set[str]:
    """The dotted keys a list of Hydra overrides sets (``+key=v``, ``++key=v`` and ``~key`` included)."""
    return {item.partition("=")[0].lstrip("+~") for item in overrides}


def apply_schedule_defaults(cfg: Any, overrides: Sequence[str]) -> None:
    """Set, in place, what the named schedule declares (`asyncpipe.schedules.implied`: its delay, its clipping)
    where ``cfg`` contradicts it and the user did not type the key among ``overrides``."""
    from asyncpipe.schedules import implied

    typed = typed_keys(overrides)
    for key, value in implied(cfg).items():
        if key not in typed:
            OmegaConf.update(cfg, key, value, merge=True)
