"""Aliases and implied settings resolved once, at composition: after this nothing reads the aliased keys.

A named schedule implies what it declares (`apply_schedule_defaults`): ``pipeline.schedule=paci`` runs at PACI's
delay and clipping unless the user typed another value, which `config.validate` then refuses in one line.

A method's older switch (`asyncpipe.registry.Switch`, declared in the method's module),
``optimizer.<key>.enabled=true`` as an optimizer preset, a sweep file or an old run record writes it, is
``compensation=<method>`` with the settings the switch carries; the switch is then reset to its defaults, so a
composed config names the method one way. Torch-free; works on a composed `DictConfig` and on a run record's plain
dict (`asyncpipe.report.load`, resume's check of a recorded config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from omegaconf import OmegaConf

from asyncpipe.errors import ConfigError
from asyncpipe.registry import MethodSpec, methods


def _get(node: Any, key: str, default: Any = None) -> Any:
    return node.get(key, default) if hasattr(node, "get") else default


def switched_on(cfg: Any) -> Optional[MethodSpec]:
    """The method whose declared switch ``cfg`` turns on (``optimizer.<key>.enabled=true``), else None."""
    optimizer = _get(cfg, "optimizer")
    for method in methods():
        switch = method.switch
        if switch is not None and str(_get(_get(optimizer, switch.key), "enabled", False)).lower() == "true":
            return method
    return None


def uses_switch(cfg: Any) -> bool:
    """True when ``cfg`` turns a method on through its declared switch (the switch is not resolved yet)."""
    return switched_on(cfg) is not None


def resolve_switch(cfg: Any, strict: bool = True) -> Any:
    """Rewrite a declared switch that ``cfg`` turns on into ``compensation=<method>`` in place (``cfg``: a
    DictConfig or a dict); returns ``cfg``. ``strict``: refuse the switch beside another compensation method (one
    line); a record (``strict=False``) keeps its method then."""
    method = switched_on(cfg)
    if method is None or method.switch is None:
        return cfg
    switch = method.switch
    comp = _get(cfg, "compensation")
    name = _get(comp, "name", "none")
    if name not in (None, "none"):
        if strict:
            on = f"optimizer.{switch.key}.enabled=true"
            raise ConfigError(
                f"{on} ({switch.origin}) and compensation={name}: choose one ({on} is compensation={method.name})"
            )
        return cfg
    node = cfg["optimizer"][switch.key]
    settings = switch.settings(node)
    if comp is None:
        cfg["compensation"] = comp = {}
    comp["name"] = method.name
    if "_target_" in comp:
        comp["_target_"] = None
    if method.key is not None:
        if comp.get(method.key) is None:
            comp[method.key] = {}
        for key, value in settings.items():
            comp[method.key][key] = value
    for f in dataclasses.fields(switch.config):
        node[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
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
