"""The extension points: every optimizer and every staleness mitigation ("compensation method") declares itself
here, next to its update rule, and nothing else in the package keeps a list of them.

A declaration (`OptimizerSpec`, `MethodSpec`) carries the builder, the config dataclass of the keys the component
adds (its YAML fills them), its value checks (one-line `ConfigError`s) and its memory model (bytes of state it
keeps, from the planned tensor shapes). `config` builds the schema from the declarations and runs their checks,
`plan` sums their memory, `optim.build_optimizer` calls their builders.

Built-in components are the modules of `asyncpipe.optim` and `asyncpipe.optim.compensation` (found by walking
those packages, so adding one needs no list edited). Code outside the package is named by import path, Hydra's
`_target_` convention: ``optimizer._target_=mypkg.lion`` imports ``mypkg.lion``, whose `declare_optimizer`
decorator registers it (docs/extending.md). This module imports no torch; loading the built-ins does.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

from asyncpipe.errors import ConfigError, UserError

# Packages whose modules declare the built-in components (imported by name: this module stays torch-free).
BUILTIN_PACKAGES = ("asyncpipe.optim", "asyncpipe.optim.compensation")

Check = Callable[[Any, Any], None]  # (the component's own config node, the whole config) -> raise ConfigError
Memory = Callable[[Any, list], float]  # (the whole config, the stage's planned layer shapes) -> bytes


@dataclass(frozen=True)
class OptimizerSpec:
    """``optimizer.name=<name>``: ``build(module, cfg.optimizer, hidden) -> torch optimizer``."""

    name: str
    build: Callable[..., Any]
    memory: Memory  # bytes of optimizer state (fp32 buffers) for these layers
    config: Optional[type] = None  # dataclass of the keys it adds to `optimizer.*` (flat, shared by name)
    check: Optional[Check] = None
    module: str = ""
    revision: int = 1  # bumped when its update rule changes (asyncpipe.report.revisions keeps what each one was)


@dataclass(frozen=True)
class MethodSpec:
    """``compensation=<name>``: ``build(optimizer, cfg.compensation, delays) -> wrapped optimizer``."""

    name: str
    build: Callable[..., Any]
    buffers: int  # parameter-sized fp32 buffers it keeps, the step's snapshot included
    fits_2bw: bool  # runs inside engine=pipeline's 2BW (else simulator only)
    note: str  # what it keeps, or why it does not fit 2BW
    key: Optional[str] = None  # its settings' node, `compensation.<key>`
    config: Optional[type] = None  # dataclass of those settings
    check: Optional[Check] = None
    memory: Optional[Memory] = None  # bytes beyond `buffers` (e.g. Kronecker factors)
    needs_delay: bool = False  # True: at delay 0 it computes exactly the plain optimizer (refused there)
    module: str = ""
    revision: int = 1  # bumped when its update rule changes (asyncpipe.report.revisions keeps what each one was)


_OPTIMIZERS: dict[str, OptimizerSpec] = {}
_METHODS: dict[str, MethodSpec] = {}
_loaded = False


def _add(table: dict, spec: Any, kind: str) -> None:
    old = table.get(spec.name)
    if old is not None and old.module != spec.module:
        raise ValueError(f"{kind} {spec.name!r} is declared twice ({old.module} and {spec.module})")
    table[spec.name] = spec


def declare_optimizer(name: str, memory: Memory, config: Optional[type] = None, check: Optional[Check] = None,
                      revision: int = 1):  # fmt: skip
    """Decorator on a builder ``(module, cfg_optimizer, hidden) -> torch.optim.Optimizer``; ``revision``: which
    version of its update rule this is (1 until the rule changes; a run records it, a report never pools two)."""

    def wrap(build: Callable[..., Any]) -> Callable[..., Any]:
        _add(_OPTIMIZERS, OptimizerSpec(name, build, memory, config, check, build.__module__, revision), "optimizer")
        return build

    return wrap


def declare_method(name: str, *, buffers: int, fits_2bw: bool, note: str, key: Optional[str] = None,
                   config: Optional[type] = None, check: Optional[Check] = None, memory: Optional[Memory] = None,
                   needs_delay: bool = False, revision: int = 1):  # fmt: skip
    """Decorator on a builder ``(optimizer, cfg_compensation, delays) -> torch.optim.Optimizer``; ``revision``: which
    version of its rule this is (1 until the rule changes; a run records it, a report never pools two)."""

    if (key is None) != (config is None):
        given, missing = ("key=", "config=") if config is None else ("config=", "key=")
        raise UserError(f"declare_method({name!r}) has {given} without {missing}: a method's settings are the node "
                        "compensation.<key> that its config dataclass fills; declare both or neither")  # fmt: skip

    def wrap(build: Callable[..., Any]) -> Callable[..., Any]:
        spec = MethodSpec(name, build, buffers, fits_2bw, note, key, config, check, memory, needs_delay,
                          build.__module__, revision)
        _add(_METHODS, spec, "compensation")
        return build

    return wrap


def load_builtins() -> None:
    """Import every module of the built-in packages once (each declares what it defines)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for package in BUILTIN_PACKAGES:
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{package}.{info.name}")


def load_target(target: str, what: str) -> None:
    """Import the module a ``_target_`` names (``pkg.module`` or ``pkg.module:builder``); one line if it fails."""
    module = target.split(":", 1)[0]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise UserError(f"{what}._target_={target}: cannot import {module} ({exc}); is it on PYTHONPATH?") from None


def _declared_in(table: dict, target: str) -> list:
    module = target.split(":", 1)[0]
    return [s for s in table.values() if s.module == module or s.module.startswith(module + ".")]


def optimizers() -> list[OptimizerSpec]:
    load_builtins()
    return list(_OPTIMIZERS.values())


def methods() -> list[MethodSpec]:
    load_builtins()
    return list(_METHODS.values())


def _one(table: dict, name: str, target: Optional[str], what: str) -> Any:
    load_builtins()
    if target:
        load_target(target, what)
        found = _declared_in(table, target)
        if len(found) != 1:
            kind = "declare_optimizer" if what == "optimizer" else "declare_method"
            raise UserError(f"{what}._target_={target} declares {len(found)} {what}s with asyncpipe.registry.{kind}; "
                            "it must declare exactly one")  # fmt: skip
        return found[0]
    spec = table.get(name)
    if spec is None:
        raise ConfigError(f"{what}.name={name} is unknown; choose one of: {', '.join(sorted(table))} "
                          f"(or name your own module with {what}._target_=pkg.module)")  # fmt: skip
    return spec


def optimizer_spec(name: str, target: Optional[str] = None) -> OptimizerSpec:
    """The optimizer ``name`` (or the one module ``target`` declares); unknown: one line."""
    return _one(_OPTIMIZERS, name, target, "optimizer")


def method_spec(name: str, target: Optional[str] = None) -> MethodSpec:
    """The compensation method ``name`` (or the one module ``target`` declares); unknown: one line."""
    return _one(_METHODS, name, target, "compensation")


def target_of(node: Any) -> Optional[str]:
    """A config node's ``_target_`` (None when unset or absent)."""
    if node is None:
        return None
    value = node.get("_target_") if hasattr(node, "get") else getattr(node, "_target_", None)
    return str(value) if value else None


def of_config(cfg: Any) -> tuple[OptimizerSpec, MethodSpec]:
    """The optimizer and the compensation method a composed config runs (`optimizer.ef.enabled`, the *_ef presets'
    switch, was resolved into ``compensation=ef`` at composition: `asyncpipe.config.alias`)."""
    comp = cfg.compensation
    return optimizer_spec(cfg.optimizer.name, target_of(cfg.optimizer)), method_spec(comp.name, target_of(comp))


def revisions(cfg: Any) -> dict[str, dict[str, Any]]:
    """What a run records of its code's rules (provenance.json "revisions"): the optimizer's, the effective
    compensation method's and the pipeline schedule's name and declared revision."""
    from asyncpipe.schedules import resolve

    opt, method = of_config(cfg)
    schedule = resolve(cfg)
    return {"optimizer": {"name": opt.name, "revision": opt.revision},
            "compensation": {"name": method.name, "revision": method.revision},
            "schedule": {"name": schedule.name, "revision": schedule.revision}}


def describe(cfg: Any) -> str:
    """What a run optimises with, for its log line, plan and run dir: ``muon + EF(lam=1.0)``, ``adamw + dc``."""
    o, c = cfg.optimizer, cfg.compensation
    if c.name == "ef":
        return f"{o.name} + EF(lam={c.ef.lam:g})"
    return o.name if c.name == "none" else f"{o.name} + {c.name}"


def run_tag(optimizer: str, compensation: str) -> str:
    """The optimizer part of a default run dir name: ``muon_ef`` (EF, as the *_ef presets name it), ``adamw+dc``,
    ``adamw`` (OmegaConf resolver)."""
    if compensation == "ef":
        return f"{optimizer}_ef"
    return optimizer if compensation in ("none", "", None) else f"{optimizer}+{compensation}"


def names(specs: Iterable[Any]) -> list[str]:
    return sorted(s.name for s in specs)
