"""Simulator overhead: step time of delay=1, plain and with every staleness mitigation (`compensation=`), against
delay=0, measured side by side in one run, with the extra memory each variant keeps.

The variants are interleaved round by round after a warm-up, so machine noise hits all of them alike; the
reported figure is the median step time per variant and its ratio to the synchronous baseline. Extra memory is
what a variant holds beyond the model and the optimizer's own state: the delay's stale weight copies plus the
mitigation's persistent buffers (`asyncpipe.optim.compensation.extra_bytes`), read after the measurement.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

from omegaconf import DictConfig

BASIC = {
    "delay0": ["delay=0"],
    "delay1": ["delay=1"],
    "delay1_ef": ["delay=1", "optimizer.ef.enabled=true"],
}


def all_variants() -> dict[str, list[str]]:
    """delay0, delay1, delay1_ef, then delay1_<method> for every other registered mitigation."""
    from asyncpipe.optim.compensation import available

    methods = [m for m in available() if m not in ("none", "ef")]
    return {**BASIC, **{f"delay1_{m}": ["delay=1", f"compensation={m}"] for m in methods}}


def bench_simulator(
    overrides: Sequence[str],
    rounds: int = 5,
    steps_per_round: int = 4,
    warmup: int = 3,
    compose: Callable[[list[str]], DictConfig] | None = None,
    log: Callable[[str], None] = print,
    variants: dict[str, list[str]] | None = None,
) -> dict:
    """Median step time of each variant (default: `all_variants`), its ratio to delay=0 and its extra memory."""
    import torch

    from asyncpipe.config import compose as default_compose
    from asyncpipe.train.loop import Trainer

    compose = compose or default_compose
    from asyncpipe.optim.compensation import extra_bytes

    trainers = {}
    for name, extra in (variants or all_variants()).items():
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
    any_trainer = next(iter(trainers.values()))
    any_cfg = any_trainer.cfg
    return {
        "bench": "simulator",
        "model": any_cfg.model.name,
        "optimizer": any_cfg.optimizer.name,
        "tokens_per_step": next(iter(trainers.values())).tokens_per_step,
        "threads": torch.get_num_threads(),
        "median_step_s": {n: statistics.median(t) for n, t in times.items()},
        "ratio_to_delay0": {n: statistics.median(t) / base for n, t in times.items()},
        "samples_per_variant": rounds * steps_per_round,
        "extra_bytes": {n: t.delayed.extra_bytes + extra_bytes(t.optimizer) for n, t in trainers.items()},
        "param_bytes": sum(p.numel() * p.element_size() for p in any_trainer.params),
    }
