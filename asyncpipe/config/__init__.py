"""Typed configs: dataclass schemas, Hydra composition, validation with one-line errors. Never imports torch."""

from asyncpipe.config.compose import compose, conf_dir, group_options, to_yaml
from asyncpipe.errors import ConfigError

__all__ = ["ConfigError", "compose", "conf_dir", "group_options", "to_yaml"]
