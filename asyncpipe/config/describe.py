"""The config as help text: each group's options (from `conf/`) and the main keys with their type, default and
one-line comment (read from the text of schema.py, so `asyncpipe train --help` stays fast and never drifts from
the schema). Imports nothing heavy.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from asyncpipe.config.compose import GROUPS, conf_dir, group_options

SCHEMA = Path(__file__).with_name("schema.py")
# The keys a new user reaches for first; `asyncpipe config show` prints every key.
MAIN_KEYS = (
    "delay",
    "delay_profile",
    "engine",
    "seed",
    "device",
    "precision",
    "optimizer.lr",
    "optimizer.weight_decay",
    "train.steps",
    "train.micro_batch_size",
    "train.micro_batches",
    "train.seq_len",
    "train.eval_every",
    "train.warmup_frac",
    "train.grad_clip",
    "pipeline.stages",
    "pipeline.data_parallel",
    "run.dir",
    "tracker.wandb.mode",
    "checkpoint.every",
    "resume",
)
_CLASS = re.compile(r"^class (\w+)")
_FIELD = re.compile(r"^    (\w+): ([^=#]+?)(?:\s*=\s*([^#]*?))?\s*(?:#\s*(.*))?$")


def _fields_in(path: Path) -> dict[str, dict[str, tuple[str, str, str]]]:
    """Per dataclass in the source file ``path``: field -> (type, default, comment), read from the source lines."""
    fields: dict[str, dict[str, tuple[str, str, str]]] = {}
    current = None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _CLASS.match(line)
        if m:
            current = fields.setdefault(m.group(1), {})
            continue
        m = _FIELD.match(line)
        if m and current is not None:
            kind, default, comment = m.group(2).strip(), (m.group(3) or "").strip(), (m.group(4) or "").strip()
            current[m.group(1)] = (kind, default, comment)
    return fields


def schema_fields() -> dict[str, tuple[str, str, str]]:
    """Every schema key -> (type, default, comment), dotted from the root `Config`, and each declared method's
    switch node ``optimizer.<key>.*`` (`asyncpipe.registry.Switch`), read from the module that declares it."""
    fields = _fields_in(SCHEMA)
    out: dict[str, tuple[str, str, str]] = {}

    def walk(cls: str, prefix: str) -> None:
        for name, (kind, default, comment) in fields.get(cls, {}).items():
            if kind in fields and kind != cls:
                walk(kind, f"{prefix}{name}.")
            else:
                out[f"{prefix}{name}"] = (kind, default, comment)

    walk("Config", "")
    for key, cls in switches():
        source = inspect.getsourcefile(cls)
        for name, field in (_fields_in(Path(source)).get(cls.__name__, {}) if source else {}).items():
            out[f"optimizer.{key}.{name}"] = field
    return out


def switches() -> list[tuple[str, type]]:
    """(key, dataclass) of every declared method's switch node ``optimizer.<key>``."""
    from asyncpipe import registry

    return [(m.switch.key, m.switch.config) for m in registry.methods() if m.switch is not None]


def main_keys() -> tuple[str, ...]:
    """`MAIN_KEYS` with each declared method switch's keys (``optimizer.<key>.*``) after the optimizer's."""
    import dataclasses

    at = MAIN_KEYS.index("optimizer.weight_decay") + 1
    extra = tuple(f"optimizer.{key}.{f.name}" for key, cls in switches() for f in dataclasses.fields(cls))
    return MAIN_KEYS[:at] + extra + MAIN_KEYS[at:]


def help_epilog(keys: tuple[str, ...] | None = None) -> str:
    """Help text: config groups and their options, then the main keys (click's \\b keeps the lines as they are)."""
    keys = main_keys() if keys is None else keys
    try:
        conf_dir()
    except Exception:  # no conf/ tree: help still works, without the lists
        return ""
    groups = "\n".join(f"{g}=  {', '.join(group_options(g))}" for g in GROUPS)
    fields = schema_fields()
    rows = []
    for key in keys:
        if key in fields:
            kind, default, comment = fields[key]
            shown = "" if not default or "field(" in default or default == "MISSING" or len(default) > 24 else default
            rows.append(f"{key}={shown.strip(chr(34))}  ({kind})" + (f"\n      {comment}" if comment else ""))
    return (
        "Config groups (GROUP=OPTION):\n\n\b\n"
        + groups
        + "\n\nMain keys (KEY=VALUE; every key: asyncpipe config show):\n\n\b\n"
        + "\n".join(rows)
    )


def schema_defaults() -> dict[str, Any]:
    """Every key of the base schema (`schema.Config`, without the keys optimizers and methods declare) that has a
    default, dotted, lists as tuples: what a run whose config.yaml predates a key ran with, and the defaults a
    reader of an older run's config falls back on. Imports the schema (OmegaConf), not torch."""
    import dataclasses
    import typing

    from asyncpipe.config.keys import flatten, frozen
    from asyncpipe.config.schema import Config

    out: dict[str, Any] = {}

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints.get(f.name)
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{f.name}.")
            elif f.default is not dataclasses.MISSING and f.default != "???":
                out[f"{prefix}{f.name}"] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                value = f.default_factory()  # type: ignore[misc]
                if isinstance(value, dict) and value:
                    out.update({f"{prefix}{f.name}.{k}": frozen(v) for k, v in flatten(value).items()})
                else:
                    out[f"{prefix}{f.name}"] = tuple(value) if isinstance(value, list) else value

    walk(Config, "")
    return {**out, **BEFORE_THE_KEY}


# Keys added with a default other than what runs before them did: what a record that lacks the key ran with.
BEFORE_THE_KEY: dict[str, Any] = {"pipeline.cut": "even"}  # before pipeline.cut, blocks were spread evenly
