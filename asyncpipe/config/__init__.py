"""Typed configs: dataclass schemas, Hydra composition, validation with one-line errors. Never imports torch."""

from asyncpipe.config.compose import ConfigError, compose, conf_dir, group_options, to_yaml

__all__ = ["ConfigError", "compose", "conf_dir", "group_options", "to_yaml"]
