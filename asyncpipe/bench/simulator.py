"""Simulator overhead: step time of delay=k, plain and with every staleness mitigation (`compensation=`), against
delay=0, measured side by side in one run, eager and compiled (`train.compile`), with the extra memory each
variant keeps.

The variants (and modes) are interleaved round by round after a warm-up, so machine noise hits all of them
alike; the reported figure is the median step time per variant and its ratio to the synchronous baseline of the
same mode. A ratio is only a finding when it lies outside its measured spread: the spread of a ratio a/b is
[q1(a)/q3(b), q3(a)/q1(b)] over the timed steps (quartiles), and `within_spread` says when 1.0 lies inside it.
The machine's load average is recorded before and after. Extra memory is what a variant holds beyond the model
and the optimizer's own state: the delay's stale weight copies plus the mitigation's persistent buffers
(`asyncpipe.optim.compensation.extra_bytes`), read after the measurement.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Sequence

from omegaconf import DictConfig

from asyncpipe.errors import Stopped, UserError
from asyncpipe.runtime.signals import StopRequest

BASIC = {
    "delay0": ["delay=0"],
    "delay1": ["delay=1"],
    "delay1_ef": ["delay=1", "compensation=ef"],
}
MODES = ("eager", "compiled")
# Keys every variant sets itself: a user override of them would be silently replaced.
_VARIANT_KEYS = ("compensation", "optimizer.ef.enabled", "train.compile")


def all_variants(delay: int = 1) -> dict[str, list[str]]:
    """delay0, delay{k}, delay{k}_ef, then delay{k}_<method> for every other registered mitigation."""
    from asyncpipe.optim.compensation import available

    methods = [m for m in available() if m not in ("none", "ef")]
    k = f"delay={delay}"
    return {
        "delay0": ["delay=0"],
        f"delay{delay}": [k],
        f"delay{delay}_ef": [k, "compensation=ef"],
        **{f"delay{delay}_{m}": [k, f"compensation={m}"] for m in methods},
    }


def split_delay(overrides: Sequence[str]) -> tuple[list[str], int]:
    """(the overrides without `delay=`, the delay of the delayed variants). Refuses, in one line, a `delay=` that
    is not a whole number >= 1 and any key the variants set themselves."""
    rest, delay = [], 1
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key == "delay":
            if not value.isdigit() or int(value) < 1:
                raise UserError(
                    f"bench simulator: {o} — the delayed variants need delay >= 1 (delay 0 is the "
                    "baseline every variant is compared with)"
                )
            delay = int(value)
        elif key == "delay_profile" or key.startswith(_VARIANT_KEYS):
            raise UserError(
                f"bench simulator: {o} would be replaced by the variants (each sets delay, compensation "
                "and EF itself; --compile picks eager/compiled); drop it"
            )
        else:
            rest.append(o)
    return rest, delay


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def ratio_spread(a: list[float], b: list[float]) -> tuple[float, float]:
    """[q1(a)/q3(b), q3(a)/q1(b)]: the range the ratio of medians could take under the measured step noise."""
    (a1, a3), (b1, b3) = _quartiles(a), _quartiles(b)
    return a1 / b3, a3 / b1


def bench_simulator(
    overrides: Sequence[str],
    rounds: int = 5,
    steps_per_round: int = 4,
    warmup: int = 3,
    compose: Callable[[list[str]], DictConfig] | None = None,
    log: Callable[[str], None] = print,
    variants: dict[str, list[str]] | None = None,
    modes: Sequence[str] = ("eager",),
) -> dict:
    """Median step time of each variant (default: `all_variants`) in each mode, its ratio to delay=0 of the same
    mode and its spread, the compiled/eager speed-up per variant, compile seconds and the extra memory."""
    from asyncpipe.config import compose as default_compose

    compose = compose or default_compose
    if not modes or any(m not in MODES for m in modes):
        raise UserError(f"bench simulator: modes {', '.join(modes) or '(none)'} must come from {', '.join(MODES)}")
    overrides, delay = split_delay(overrides)
    chosen = variants or all_variants(delay)
    with StopRequest() as stop:  # a stop signal between steps: one line, nothing written (`errors.Stopped`)
        return _bench(overrides, delay, chosen, rounds, steps_per_round, warmup, compose, log, modes, stop)


def _bench(
    overrides: list[str],
    delay: int,
    chosen: dict[str, list[str]],
    rounds: int,
    steps_per_round: int,
    warmup: int,
    compose: Callable[[list[str]], DictConfig],
    log: Callable[[str], None],
    modes: Sequence[str],
    stop: StopRequest,
) -> dict:
    import torch

    from asyncpipe.optim.compensation import extra_bytes

    def check(where: str) -> None:
        if stop.requested:
            raise Stopped(f"bench simulator stopped by {stop.signal_name} {where}; nothing written")

    load_before = list(os.getloadavg())
    trainers, compile_s = _set_up(overrides, chosen, modes, compose, check)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    times = _time_rounds(trainers, rounds, steps_per_round, warmup, log, check)
    any_trainer = next(iter(trainers.values()))
    out: dict = {
        "bench": "simulator",
        "model": any_trainer.cfg.model.name,
        "optimizer": any_trainer.cfg.optimizer.name,
        "delay": delay,
        "modes": list(modes),
        "tokens_per_step": any_trainer.tokens_per_step,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg": load_before,
        "load_avg_after": list(os.getloadavg()),
        "samples_per_variant": rounds * steps_per_round,
        "param_bytes": sum(p.numel() * p.element_size() for p in any_trainer.params),
        **_ratios(times, compile_s, chosen, modes),
    }
    out["extra_bytes"] = {
        n: t.delayed.extra_bytes + extra_bytes(t.optimizer) for (n, m), t in trainers.items() if m == modes[0]
    }
    return out


def _set_up(
    overrides: list[str],
    chosen: dict[str, list[str]],
    modes: Sequence[str],
    compose: Callable[[list[str]], DictConfig],
    check: Callable[[str], None],
) -> tuple[dict[tuple[str, str], Any], dict[tuple[str, str], float]]:
    """One trainer per (variant, mode), each past its first step: the trainers and that first step's seconds
    (allocation, and compiling in compiled mode)."""
    from asyncpipe.trainer import Trainer

    trainers, compile_s = {}, {}
    for mode in modes:
        for name, extra in chosen.items():
            check(f"while setting up {name}")
            cfg = compose([*overrides, *extra, "train.steps=1000000", f"train.compile={mode == 'compiled'}"])
            trainer = Trainer(cfg).engine
            began = time.perf_counter()
            trainer.train_step()
            compile_s[(name, mode)] = time.perf_counter() - began
            trainers[(name, mode)] = trainer
    return trainers, compile_s


def _time_rounds(
    trainers: dict[tuple[str, str], Any],
    rounds: int,
    steps_per_round: int,
    warmup: int,
    log: Callable[[str], None],
    check: Callable[[str], None],
) -> dict[tuple[str, str], list[float]]:
    """The rest of the warm-up, then ``rounds`` rounds of ``steps_per_round`` timed steps of every trainer in
    turn: the seconds of each step per (variant, mode)."""
    for trainer in trainers.values():
        for _ in range(warmup - 1):
            trainer.train_step()
    times: dict[tuple, list[float]] = {key: [] for key in trainers}
    for r in range(rounds):
        for key, trainer in trainers.items():
            check(f"in round {r + 1} of {rounds}")
            for _ in range(steps_per_round):
                start = time.perf_counter()
                trainer.train_step()
                times[key].append(time.perf_counter() - start)
        log(
            f"round {r + 1}/{rounds}: "
            + ", ".join(
                f"{n}{'' if m == 'eager' else '+c'} {statistics.median(t) * 1e3:.1f} ms" for (n, m), t in times.items()
            )
        )
    return times


def _ratios(
    times: dict[tuple[str, str], list[float]],
    compile_s: dict[tuple[str, str], float],
    chosen: dict[str, list[str]],
    modes: Sequence[str],
) -> dict:
    """Per mode: each variant's median step, its ratio to delay0 with the ratio's spread, its first step; with both
    modes, the compiled speed-up per variant and its spread."""
    out: dict = {}
    for mode in modes:
        prefix = "" if mode == "eager" else "compiled_"
        base = times[("delay0", mode)]
        spread = {n: ratio_spread(times[(n, mode)], base) for n in chosen}
        out[f"{prefix}median_step_s"] = {n: statistics.median(times[(n, mode)]) for n in chosen}
        out[f"{prefix}ratio_to_delay0"] = {
            n: statistics.median(times[(n, mode)]) / statistics.median(base) for n in chosen
        }
        out[f"{prefix}ratio_spread"] = {n: list(s) for n, s in spread.items()}
        out[f"{prefix}within_spread"] = {n: s[0] <= 1.0 <= s[1] for n, s in spread.items()}
        out[f"{prefix}first_step_s"] = {n: compile_s[(n, mode)] for n in chosen}
    if set(MODES) <= set(modes):  # compiled speed-up: eager step time over compiled, per variant
        out["compile_speedup"] = {n: out["median_step_s"][n] / out["compiled_median_step_s"][n] for n in chosen}
        spread = {n: ratio_spread(times[(n, "eager")], times[(n, "compiled")]) for n in chosen}
        out["compile_speedup_spread"] = {n: list(s) for n, s in spread.items()}
        out["compile_speedup_within_spread"] = {n: s[0] <= 1.0 <= s[1] for n, s in spread.items()}
    return out


def format_result(res: dict) -> str:
    """One line per variant: ms/step and the ratio to delay=0 per mode (marked ~ when within the measured
    spread), the compiled speed-up, extra memory; the load first."""
    load = f"load {res['load_avg'][0]:.2f} -> {res['load_avg_after'][0]:.2f} on {res['cpu_count']} CPUs"
    lines = [
        f"bench simulator: model {res['model']}, {res['optimizer']}, delayed variants at delay {res['delay']}, "
        f"{res['threads']} thread(s), {res['samples_per_variant']} timed steps per variant; {load}",
        "(~ : within the measured spread of step times, not a difference)",
    ]
    params_mb = res["param_bytes"] / 2**20
    for name in res["extra_bytes"]:
        cols = []
        for mode in res["modes"]:
            p = "" if mode == "eager" else "compiled_"
            mark = "~" if res[f"{p}within_spread"][name] and name != "delay0" else " "  # delay0: the baseline itself
            cols.append(
                f"{mode} {res[f'{p}median_step_s'][name] * 1e3:8.1f} ms x{res[f'{p}ratio_to_delay0'][name]:.3f}{mark}"
            )
        if "compile_speedup" in res:
            mark = "~" if res["compile_speedup_within_spread"][name] else " "
            cols.append(
                f"compiled {res['compile_speedup'][name]:.2f}x faster{mark} "
                f"(first step {res['compiled_first_step_s'][name]:.1f} s)"
            )
        extra = res["extra_bytes"][name] / 2**20
        lines.append(f"{name:26s} " + "  ".join(cols) + f"  +{extra:.2f} MiB ({extra / params_mb:.2f}x params)")
    if res["samples_per_variant"] < 4:
        lines.append(
            f"only {res['samples_per_variant']} timed step(s) per variant: no spread to speak of; use more --rounds"
        )
    return "\n".join(lines)
