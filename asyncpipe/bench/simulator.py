"""Simulator overhead: step time of delay=1 (with and without EF) against delay=0, measured side by side.

The variants are interleaved round by round after a warm-up, so machine noise hits all of them alike; the
reported figure is the median step time per variant and its ratio to the synchronous baseline.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

from omegaconf import DictConfig

VARIANTS = {
    "delay0": ["delay=0"],
    "delay1": ["delay=1"],
    "delay1_ef": ["delay=1", "optimizer.ef.enabled=true"],
}


def bench_simulator(
    overrides: Sequence[str],
    rounds: int = 5,
    steps_per_round: int = 4,
    warmup: int = 3,
    compose: Callable[[list[str]], DictConfig] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Median step time of each variant and its ratio to delay=0."""
    import torch

    from asyncpipe.config import compose as default_compose
    from asyncpipe.train.loop import Trainer

    compose = compose or default_compose
    trainers = {}
    for name, extra in VARIANTS.items():
        cfg = compose([*overrides, *extra, "train.steps=1000000"])
        trainers[name] = Trainer(cfg)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.train_step()
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for r in range(rounds):
        for name, trainer in trainers.items():
            for _ in range(steps_per_round):
                start = time.perf_counter()
                trainer.train_step()
                times[name].append(time.perf_counter() - start)
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.1f} ms" for n, t in times.items()))
    base = statistics.median(times["delay0"])
    any_cfg = next(iter(trainers.values())).cfg
    return {
        "bench": "simulator",
        "model": any_cfg.model.name,
        "optimizer": any_cfg.optimizer.name,
        "tokens_per_step": next(iter(trainers.values())).tokens_per_step,
        "threads": torch.get_num_threads(),
        "median_step_s": {n: statistics.median(t) for n, t in times.items()},
        "ratio_to_delay0": {n: statistics.median(t) / base for n, t in times.items()},
        "samples_per_variant": rounds * steps_per_round,
    }
