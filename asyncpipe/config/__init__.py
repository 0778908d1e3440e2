"""Typed configs: dataclass schemas, Hydra composition, validation with one-line errors. Never imports torch."""

from asyncpipe.config.compose import compose, conf_dir, group_options, to_yaml
from asyncpipe.config.tuned import at_tuned_lr, tuned_lr
from asyncpipe.errors import ConfigError

__all__ = ["ConfigError", "at_tuned_lr", "compose", "conf_dir", "group_options", "to_yaml", "tuned_lr"]
