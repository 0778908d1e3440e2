"""Where the `conf/` tree lives (a leaf module: compose and the tuned-lr table both read it)."""

from __future__ import annotations

import os
from pathlib import Path

from asyncpipe.errors import ConfigError


def conf_dir() -> Path:
    """The `conf/` tree: $ASYNCPIPE_CONF, else the one beside the package (repo checkout / editable install)."""
    env = os.environ.get("ASYNCPIPE_CONF")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "conf"
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"no config tree at {path} (set ASYNCPIPE_CONF to the directory holding config.yaml)")
    return path
