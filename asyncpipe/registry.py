"""The extension points: every optimizer and every staleness mitigation ("compensation method") declares itself
here, in one module of its own, and nothing else in the package keeps a list of them.

A declaration (`OptimizerSpec`, `MethodSpec`) carries the builder, the config dataclass of the keys the component
adds (its YAML fills them), its value checks (one-line `ConfigError`s) and its memory model (bytes of state it
keeps, from the planned tensor shapes). `config` builds the schema from the declarations and runs their checks,
`plan` sums their memory, `optim.build_optimizer` calls their builders. A method also declares whatever else names
it outside its module: its run-name label and tag, an older switch that spells it (`Switch`, resolved by
`asyncpipe.config.alias`) and the key older checkpoints' fingerprints name it by (`asyncpipe.runtime.checkpoint`).

Built-in components are the modules of `asyncpipe.optimizers` and `asyncpipe.compensation` (found by walking those
packages, so adding one needs no list edited). Those modules import no torch: `config`, `plan` and `report` read
them in processes that never train. A builder imports torch when it is called, or is named by import path
(``build="module:function"``, resolved when a run builds the component): a method's update rule, a
`torch.optim.Optimizer` subclass, lives in `asyncpipe.optim.compensation` and its declaration names its builder
there. The registry and the built-in methods' declarations are one layer (it walks their package, they import it
to declare themselves); it names the builders on the torch side and never calls them: `resolve` imports one and its
caller, `asyncpipe.optim`, calls it. Code outside the package is named by import path, Hydra's `_target_` convention:
``optimizer._target_=mypkg.lion`` imports ``mypkg.lion``, whose `declare_optimizer` decorator registers it
(docs/extending.md); such a module may import torch itself. This module imports no torch.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional, Union

from asyncpipe.errors import ConfigError, UserError

# Packages whose modules declare the built-in components (imported by name: this module stays torch-free).
BUILTIN_PACKAGES = ("asyncpipe.optimizers", "asyncpipe.compensation")

Check = Callable[[Any, Any], None]  # (the component's own config node, the whole config) -> raise ConfigError
Memory = Callable[[Any, list], float]  # (the whole config, the stage's planned layer shapes) -> bytes
Builder = Union[Callable[..., Any], str]  # the builder, or "module:function" naming it (imported when called)


@dataclass(frozen=True)
class OptimizerSpec:
    """``optimizer.name=<name>``: ``resolve(builder)(module, cfg.optimizer, hidden) -> torch optimizer``."""

    name: str
    builder: Builder
    memory: Memory  # bytes of optimizer state (fp32 buffers) for these layers
    config: Optional[type] = None  # dataclass of the keys it adds to `optimizer.*` (flat, shared by name)
    check: Optional[Check] = None
    module: str = ""
    revision: int = 1  # bumped when its update rule changes (asyncpipe.report.revisions keeps what each one was)


@dataclass(frozen=True)
class Switch:
    """An older spelling of a method: ``optimizer.<key>.enabled=true`` (an optimizer preset's switch, as sweep files
    and run records still write it) is ``compensation=<the method>``, its settings node filled by ``settings``."""

    key: str  # the switch's node, optimizer.<key>
    config: type  # the node's dataclass: ``enabled`` plus what the switch carries (the schema adds it to optimizer.*)
    settings: Callable[[Any], dict]  # the switch's node -> the values it sets in compensation.<the method's key>
    origin: str  # where the switch is written, for messages (e.g. an optimizer preset family)


@dataclass(frozen=True)
class MethodSpec:
    """``compensation=<name>``: ``resolve(builder)(optimizer, cfg.compensation, delays) -> wrapped optimizer``."""

    name: str
    builder: Builder
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
    label: Optional[Callable[[Any], str]] = None  # (cfg.compensation) -> how `describe` names it; None: its name
    tag: Optional[str] = None  # what follows the optimizer in a default run dir name; None: "+<name>"
    switch: Optional[Switch] = None  # an older switch that spells this method (resolved at composition)
    fingerprint_key: Optional[str] = None  # checkpoints name it {key: True} (every run records key: whether it runs
    # this method) in place of {"compensation": name}; older checkpoints must keep matching


_OPTIMIZERS: dict[str, OptimizerSpec] = {}
_METHODS: dict[str, MethodSpec] = {}
_loaded = False


def resolve(builder: Builder) -> Any:
    """``builder`` itself, or the object a ``"module:name"`` path names (a builder, a schedule's engine class),
    imported now; one line if it is not there. The caller, which builds the component, calls what it returns: the
    registry never calls up into the torch side it names."""
    if not isinstance(builder, str):
        return builder
    module, _, name = builder.partition(":")
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise UserError(f"cannot load {builder}: {exc}; is it on PYTHONPATH?") from None
    if not name or not hasattr(found, name):
        raise UserError(f"cannot load {builder}: {module} has no {name or 'name after the colon'} ('module:function')")
    return getattr(found, name)


def _add(table: dict, spec: Any, kind: str) -> None:
    old = table.get(spec.name)
    if old is not None and old.module != spec.module:
        raise UserError(
            f"{kind} {spec.name!r} is already declared by {old.module}; {spec.module} must declare its {kind} "
            "under another name"
        )
    table[spec.name] = spec


def _caller() -> str:
    """The module that called the `declare_*` function calling this (a declaration made by a statement)."""
    return str(sys._getframe(2).f_globals.get("__name__", ""))


def declare_optimizer(
    name: str,
    memory: Memory,
    config: Optional[type] = None,
    check: Optional[Check] = None,
    revision: int = 1,
    build: Optional[str] = None,
) -> Any:
    """Declare the optimizer ``name``. As a decorator on its builder ``(module, cfg_optimizer, hidden) ->
    torch.optim.Optimizer``; or, with ``build="module:function"``, as a statement naming a builder that is imported
    only when a run builds the optimizer (a torch-free declaration). ``revision``: which version of its update rule
    this is (1 until the rule changes; a run records it, a report never pools two)."""
    if build is not None:
        spec = OptimizerSpec(name, build, memory, config, check, _caller(), revision)
        _add(_OPTIMIZERS, spec, "optimizer")
        return spec

    def wrap(builder: Callable[..., Any]) -> Callable[..., Any]:
        _add(
            _OPTIMIZERS, OptimizerSpec(name, builder, memory, config, check, builder.__module__, revision), "optimizer"
        )
        return builder

    return wrap


def declare_method(
    name: str,
    *,
    buffers: int,
    fits_2bw: bool,
    note: str,
    key: Optional[str] = None,
    config: Optional[type] = None,
    check: Optional[Check] = None,
    memory: Optional[Memory] = None,
    needs_delay: bool = False,
    revision: int = 1,
    build: Optional[str] = None,
    label: Optional[Callable[[Any], str]] = None,
    tag: Optional[str] = None,
    switch: Optional[Switch] = None,
    fingerprint_key: Optional[str] = None,
) -> Any:
    """Declare the compensation method ``name``. As a decorator on its builder ``(optimizer, cfg_compensation,
    delays) -> torch.optim.Optimizer``; or, with ``build="module:function"``, as a statement naming a builder that is
    imported only when a run builds the method (the built-ins' declarations, torch-free, name their rules in
    `asyncpipe.optim.compensation` so). ``revision``: which version of its rule this is (1 until the rule changes;
    a run records it, a report never pools two). ``label``, ``tag``: how a run's description and its default run
    dir name it (e.g. ``muon + X(lam=1)``, ``muon_x``). ``switch``, ``fingerprint_key``: how older configs and
    checkpoints name it (`Switch`, `MethodSpec`)."""

    if (key is None) != (config is None):
        given, missing = ("key=", "config=") if config is None else ("config=", "key=")
        raise UserError(
            f"declare_method({name!r}) has {given} without {missing}: a method's settings are the node "
            "compensation.<key> that its config dataclass fills; declare both or neither"
        )

    def spec(builder: Builder, module: str) -> MethodSpec:
        return MethodSpec(
            name,
            builder,
            buffers,
            fits_2bw,
            note,
            key,
            config,
            check,
            memory,
            needs_delay,
            module,
            revision,
            label,
            tag,
            switch,
            fingerprint_key,
        )

    if build is not None:
        declared = spec(build, _caller())
        _add(_METHODS, declared, "compensation")
        return declared

    def wrap(builder: Callable[..., Any]) -> Callable[..., Any]:
        _add(_METHODS, spec(builder, builder.__module__), "compensation")
        return builder

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
    import_named(target.split(":", 1)[0], f"{what}._target_={target}")


def import_named(module: str, what: str) -> None:
    """Import a user's ``module`` (named by ``what``, e.g. ``pipeline.schedule=pkg.mod``); whatever fails in it is
    one line naming the module and the error (its own `UserError`s pass through as they are)."""
    try:
        importlib.import_module(module)
    except UserError:
        raise
    except ImportError as exc:
        raise UserError(f"{what}: cannot import {module} ({exc}); is it on PYTHONPATH?") from None
    except BaseException as exc:  # SyntaxError, a RuntimeError or a SystemExit at import: all the module's own
        if isinstance(exc, KeyboardInterrupt):
            raise
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise UserError(f"{what}: importing {module} failed ({error})") from None


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
            raise UserError(
                f"{what}._target_={target} declares {len(found)} {what}s with asyncpipe.registry.{kind}; "
                "it must declare exactly one"
            )
        return found[0]
    spec = table.get(name)
    if spec is None:
        raise ConfigError(
            f"{what}.name={name} is unknown; choose one of: {', '.join(sorted(table))} "
            f"(or name your own module with {what}._target_=pkg.module)"
        )
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
    """The optimizer and the compensation method a composed config runs (a method's `Switch` was resolved into
    ``compensation=<method>`` at composition: `asyncpipe.config.alias`)."""
    comp = cfg.compensation
    return optimizer_spec(cfg.optimizer.name, target_of(cfg.optimizer)), method_spec(comp.name, target_of(comp))


def describe(cfg: Any) -> str:
    """What a run optimises with, for its log line, plan and run dir: ``adamw``, ``adamw + dc``, or the method's
    declared label (``muon + X(lam=1)``)."""
    o, c = cfg.optimizer, cfg.compensation
    if c.name == "none":
        return o.name
    spec = method_spec(c.name, target_of(c))
    return f"{o.name} + {spec.label(c) if spec.label is not None else c.name}"


def run_tag(optimizer: str, compensation: str) -> str:
    """The optimizer part of a default run dir name (OmegaConf resolver): ``adamw``, ``adamw+dc``, or the optimizer
    followed by the method's declared tag (``muon_x``)."""
    if compensation in ("none", "", None):
        return optimizer
    load_builtins()
    spec = _METHODS.get(compensation)  # a method named by _target_ may not be loaded yet: the plain form
    return f"{optimizer}{spec.tag}" if spec is not None and spec.tag is not None else f"{optimizer}+{compensation}"


def names(specs: Iterable[Any]) -> list[str]:
    return sorted(s.name for s in specs)
