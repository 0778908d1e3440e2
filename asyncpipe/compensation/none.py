"""``compensation=none``: the plain optimizer, unwrapped (no staleness correction, no memory)."""

from __future__ import annotations

from typing import Any

from asyncpipe.registry import declare_method


@declare_method("none", fits_2bw=True, note="no extra memory", buffers=0)
def build_none(optimizer: Any, cfg: Any, delays: Any) -> Any:
    return optimizer
