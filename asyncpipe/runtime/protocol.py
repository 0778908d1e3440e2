"""What the trainer (`asyncpipe.trainer.Trainer`) and an engine say to each other: the `Engine` protocol, the
`Setup` the trainer builds once and hands to the engine, and the per-step `Agreement`. Both engines
(`asyncpipe.engines.simulator.SimulatorEngine`, `asyncpipe.engines.pipeline.adapter.PipelineEngineAdapter`) implement
`Engine`; neither builds a device, a process group, the data or the validation set itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

Log = Callable[[str], None]


@dataclass
class Setup:
    """What the trainer built for this process, once: its place in the run, its device and the prepared data."""

    rank: int
    world: int
    local_rank: int
    device: Any  # torch.device, from `asyncpipe.runtime.device.pick_device`
    data_dir: Path  # prepared by rank 0 (`asyncpipe.data.ensure_prepared`); the others waited for it
    vocab_size: int
    log: Log  # rank 0's log; a no-op elsewhere
    train_tokens: int = 0  # tokens of the prepared train split (one epoch)


@dataclass
class Agreement:
    """What every rank knows at a step: a stop was asked for on some rank, and the agreed train loss of step
    ``loss_step`` (None: no loss known yet)."""

    stop: bool = False
    loss: Optional[float] = None
    loss_step: int = 0


class Engine(Protocol):
    """How steps are computed; the trainer owns everything else (set-up, the loop, evaluation cadence,
    checkpoints, the record). Five things, collective where marked:

    - one step: ``train_step(sync)`` (``sync``: its update lands now; an engine may defer otherwise);
    - evaluation: ``evaluate(batches)`` (collective) on the batches the trainer built from ``val_share(n)``,
      the indices of the first ``n`` validation batches this rank evaluates; the val loss, meaningful on rank 0;
    - checkpoint state: ``state_dict()`` / ``load_state_dict(state)`` (with ``step``, optimizer steps done);
    - what is in flight: ``settle()`` applies what is pending, ``records(synced)`` hands rank 0 the metrics of
      the steps finished so far;
    - agreement: ``agree(stop)`` (collective, once per step; may answer one step late) and ``finish()``
      (collective: the last agreement and the engine's extra summary fields).
    """

    rank: int
    world: int
    step: int
    tokens_per_step: int
    comm: Any  # `asyncpipe.dist.Comm`: barrier / gather over the engine's control group

    def describe(self) -> str: ...  # the run's one-line description, printed first

    # ``sync``: the weights are read at this cut (evaluation, checkpoint); ``save``: a checkpoint is written at it
    def train_step(self, sync: bool, save: bool = False) -> Any: ...

    def val_share(self, n: int) -> list[int]: ...

    def evaluate(self, batches: list) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def settle(self) -> None: ...

    def records(self, synced: bool) -> list[dict]: ...

    def agree(self, stop: bool) -> Agreement: ...

    def finish(self) -> tuple[Agreement, dict]: ...
