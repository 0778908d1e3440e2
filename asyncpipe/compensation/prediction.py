"""``compensation=weight_prediction``: the forward and backward of a delayed step run on weights extrapolated k steps
ahead along the observed weight velocity (SpecTrain; PipeMare); its settings, value checks and memory, and why it
does not fit 2BW. The rule: `asyncpipe.optim.compensation.prediction`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.registry import declare_method


@dataclass
class PredictionCompensation:
    beta: float = 0.0  # EMA of the observed weight velocity (0 = the last step's change, SpecTrain-style)
    horizon: float = 1.0  # extrapolate horizon * k steps ahead (1 = exactly the delay)


def check_prediction(c: Any, cfg: Any) -> None:
    if not 0 <= c.beta < 1:
        raise ConfigError(f"compensation.prediction.beta={c.beta} must be in [0, 1)")
    if not 0 <= c.horizon <= 16:
        raise ConfigError(
            f"compensation.prediction.horizon={c.horizon} must be in [0, 16] (steps of k ahead; 1 = "
            "exactly the delay, 0 = no prediction)"
        )


declare_method(
    "weight_prediction",
    build="asyncpipe.optim.compensation.prediction:build_prediction",
    fits_2bw=False,
    note="the predicted weights are a third weight version per batch in flight beyond 2BW's two, plus W(t-k-1)",
    buffers=3,
    key="prediction",
    config=PredictionCompensation,
    check=check_prediction,
    needs_delay=True,
)
