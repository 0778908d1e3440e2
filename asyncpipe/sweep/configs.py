"""Every run's composed config in a sweep, each composed when first read. Runs whose overrides differ only in
keys that no interpolation reads and no config group depends on (`asyncpipe.config.compose.PLAIN_KEYS`: a seed
range, each run's own dir and W&B group) form a group: its first run is composed and validated in full, the others
have only those values checked. What the sweep reads of a run but those keys (its model, steps, launcher, device)
comes from its group's first run (`template`), so a 500-seed dry run composes one config, not 500."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from omegaconf import DictConfig

from asyncpipe.errors import UserError


class RunConfigs(Mapping[str, DictConfig]):
    """Run name -> its exact composed config (composed on first read, then kept)."""

    def __init__(self) -> None:
        from asyncpipe.config.compose import PLAIN_KEYS, Composer

        self._plain_keys, self._composer = PLAIN_KEYS, Composer()
        self._overrides: dict[str, list[str]] = {}
        self._first: dict[tuple, str] = {}  # a group's overrides but its plain values -> its first run
        self._group: dict[str, str] = {}  # run -> its group's first run
        self._composed: dict[str, DictConfig] = {}
        self._parser: Any = None

    def add(self, name: str, overrides: Sequence[str]) -> DictConfig:
        """Register a run and check it: the first of its group is composed and validated (`ConfigError`); another
        has its plain values checked (`UserError`). Returns its group's first config."""
        from asyncpipe.session.rundir import check_seed

        self._overrides[name] = list(overrides)
        plain, rest = self._split(overrides)
        key = (rest, tuple(sorted(plain)))
        first = self._first.get(key) if plain is not None else None
        if first is None:
            self._first.setdefault(key, name)
            self._group[name] = name
            self._composed[name] = self._composer.compose(overrides)
            check_seed(self._composed[name])
            return self._composed[name]
        self._group[name] = first
        check_seed({"seed": plain.get("seed", self[first].get("seed"))})
        if "run.dir" in plain and not str(plain["run.dir"]).strip():
            raise UserError("run.dir is empty; give the run its own directory, e.g. run.dir=runs/NAME")
        return self[first]

    def _split(self, overrides: Sequence[str]) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
        """(the plain `key=value`s parsed as Hydra parses them, the other overrides); None: compose it in full."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self._parser = self._parser or OverridesParser.create()
        plain: dict[str, Any] = {}
        rest = []
        for item in overrides:
            key = item.partition("=")[0]
            if key not in self._plain_keys:
                rest.append(item)
                continue
            try:
                parsed = self._parser.parse_override(item)
            except Exception:  # Hydra's grammar error: the full composition words it
                return None, tuple(overrides)
            if parsed.is_sweep_override() or parsed.is_add() or parsed.is_delete():
                return None, tuple(overrides)
            plain[key] = parsed.value()
        return plain, tuple(rest)

    def template(self, name: str) -> DictConfig:
        """The config of ``name``'s group's first run: everything of ``name``'s but the plain keys' values."""
        return self[self._group[name]]

    def groups(self) -> list[tuple[DictConfig, int]]:
        """(each group's first config, how many runs the group has)."""
        sizes: dict[str, int] = {}
        for first in self._group.values():
            sizes[first] = sizes.get(first, 0) + 1
        return [(self[first], n) for first, n in sizes.items()]

    def __getitem__(self, name: str) -> DictConfig:
        if name not in self._composed:
            if name not in self._overrides:
                raise KeyError(name)
            self._composed[name] = self._composer.compose(self._overrides[name])
        return self._composed[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._overrides)

    def __len__(self) -> int:
        return len(self._overrides)
