"""docs/extending.md, followed from outside the package: a researcher's own optimizer and own staleness mitigation,
each one module in their own package (a temporary directory on PYTHONPATH), used by import path without editing
asyncpipe: it trains 5 steps, `config show` lists its keys, `plan` counts its state, a bad value is one line and
exit 2. Also: an optimizer or method that declares no memory model is an error in the plan, never 0 bytes."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from helpers import asyncpipe, cli_env, read_metrics

# The guide's two examples, as a user would write them (docs/extending.md shows the same code).
LION = '''
"""Lion (Chen et al. 2023): sign of an interpolated momentum; one buffer per parameter."""
from dataclasses import dataclass

import torch

from asyncpipe.errors import ConfigError
from asyncpipe.optim.registry import decay_groups, trainable
from asyncpipe.registry import declare_optimizer


@dataclass
class LionConfig:
    lion_beta1: float = 0.9  # interpolation of momentum and gradient for the sign
    lion_beta2: float = 0.99  # momentum decay


def check(o, cfg):
    for key in ("lion_beta1", "lion_beta2"):
        if not 0 <= o[key] < 1:
            raise ConfigError(f"optimizer.{key}={o[key]} must be in [0, 1)")


def memory(cfg, shapes):
    return 4.0 * sum(s.params for s in shapes)  # the momentum, fp32


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m.mul(b1).add(p.grad, alpha=1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


@declare_optimizer("lion", memory=memory, config=LionConfig, check=check)
def build(module, cfg, hidden):
    groups = decay_groups(trainable(module), cfg.lr, cfg.weight_decay)
    return Lion(groups, cfg.lr, (cfg.lion_beta1, cfg.lion_beta2), cfg.weight_decay)
'''

DAMPED = '''
"""Damped EF: EF's correction scaled by damping in (0, 1]; u(t-1) plus the step's snapshot."""
from dataclasses import dataclass

from asyncpipe.errors import ConfigError
from asyncpipe.optim.compensation.ef import ErrorFeedback
from asyncpipe.registry import declare_method


@dataclass
class DampedConfig:
    damping: float = 0.5  # lambda of EF


def check(c, cfg):
    if not 0 < c.damping <= 1:
        raise ConfigError(f"compensation.damped.damping={c.damping} must be in (0, 1]")


@declare_method("damped_ef", buffers=2, fits_2bw=True, note="u(t-1)", key="damped", config=DampedConfig,
                check=check, needs_delay=True)
def build(optimizer, cfg, delays):
    return ErrorFeedback(optimizer, cfg.damped.damping)
'''

NO_MEMORY = '''
from asyncpipe.optim.compensation.registry import register


@register("forgetful", fits_2bw=True, note="declares no memory model")
def build(optimizer, cfg, delays):
    return optimizer
'''


FILL_DRAIN = '''
"""Fill-drain (GPipe): every forward of a batch, then every backward, then the step."""
from asyncpipe.schedules.gpipe import gpipe_stream
from asyncpipe.schedules.instructions import COMM, CommitP2P
from asyncpipe.schedules import ScheduleSpec, declare_schedule, uniform


def stream(m, P, stage, batches, start=0, defer_step=False):
    for cmd in gpipe_stream(m, P, stage, batches):
        batch = cmd.batch if hasattr(cmd, "batch") else cmd.micro_batch // m
        if batch >= start:  # a resumed run starts at batch `start`
            yield [cmd, CommitP2P()] if isinstance(cmd, COMM) else [cmd]  # each message posted at once


declare_schedule(ScheduleSpec(
    name="fill_drain", note="GPipe's fill-drain, a flush per batch", versions=uniform(0),
    weight_versions=lambda P, s: 1, in_flight=lambda P, m, s: [m], stream=stream, delay=0,
    stage_delay=lambda P, s, delay: 0,
))
'''


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("outside")
    pkg = root / "mylab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in (("lion", LION), ("damped", DAMPED), ("forgetful", NO_MEMORY), ("fill_drain", FILL_DRAIN)):
        (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    return cli_env(PYTHONPATH=path, ASYNCPIPE_DATA=os.environ["ASYNCPIPE_DATA"])


def _run(env: dict, *args: str):
    return asyncpipe(*args, env=env, timeout=600)


def _plan_gib(env: dict, column: str, *over: str) -> float:
    """Stage 0's value of ``column`` in `asyncpipe plan`'s table (one stage)."""
    out = _run(env, "plan", "pipeline.stages=1", *over)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = next(line.split() for line in lines if line.split()[:1] == ["stage"])
    row = next(line.split() for line in lines if line.split()[:1] == ["0"])
    return float(row[head.index(column)])


def _one_line_error(proc, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


TRAIN = ["train.steps=5", "train.eval_every=5", "train.eval_batches=2", "train.micro_batches=2",
         "train.micro_batch_size=4", "train.seq_len=32", "tracker.wandb.mode=disabled"]  # fmt: skip


def test_own_optimizer_by_import_path_trains_shows_and_plans(lab, tmp_path):
    run = tmp_path / "lion"
    proc = _run(lab, "train", "optimizer._target_=mylab.lion", "optimizer.lr=1e-3", "optimizer.lion_beta1=0.8",
                f"run.dir={run}", *TRAIN)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    losses = [m["train_loss"] for m in read_metrics(run) if "train_loss" in m]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert "| lion lr 0.001 |" in proc.stdout, proc.stdout
    recorded = (run / "config.yaml").read_text()
    assert "name: lion" in recorded and "_target_: mylab.lion" in recorded and "lion_beta1: 0.8" in recorded

    shown = _run(lab, "config", "show", "optimizer._target_=mylab.lion")
    assert shown.returncode == 0 and "lion_beta2: 0.99" in shown.stdout and "name: lion" in shown.stdout

    # Lion keeps one buffer per parameter: exactly half of AdamW's two
    lion = _plan_gib(lab, "optim", "model=1b", "optimizer._target_=mylab.lion")
    assert lion > 0 and lion == pytest.approx(_plan_gib(lab, "optim", "model=1b", "optimizer=adamw") / 2, rel=0.01)


def test_own_optimizer_bad_value_is_one_line(lab, tmp_path):
    _one_line_error(_run(lab, "train", "optimizer._target_=mylab.lion", "optimizer.lion_beta1=1.5",
                         f"run.dir={tmp_path / 'x'}", *TRAIN), "optimizer.lion_beta1=1.5 must be in [0, 1)")  # fmt: skip
    assert not (tmp_path / "x").exists()
    _one_line_error(_run(lab, "config", "show", "optimizer._target_=mylab.lion", "optimizer.lion_beta3=1"),
                    "lion_beta3")  # fmt: skip
    _one_line_error(_run(lab, "config", "show", "optimizer._target_=mylab.nowhere"), "cannot import mylab.nowhere")


def test_own_mitigation_by_import_path_trains_shows_and_plans(lab, tmp_path):
    run = tmp_path / "damped"
    proc = _run(lab, "train", "compensation._target_=mylab.damped", "compensation.damped.damping=0.7", "delay=1",
                f"run.dir={run}", *TRAIN)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len([m for m in read_metrics(run) if "train_loss" in m]) == 5
    assert "adamw + damped_ef" in proc.stdout
    shown = _run(lab, "config", "show", "compensation._target_=mylab.damped", "delay=1")
    assert "damping: 0.5" in shown.stdout and "name: damped_ef" in shown.stdout
    # the same two parameter-sized buffers as EF: u(t-1) and the step's snapshot
    damped = _plan_gib(lab, "EF/comp", "model=1b", "compensation._target_=mylab.damped", "delay=1")
    assert damped > 0 and damped == _plan_gib(lab, "EF/comp", "model=1b", "optimizer=adamw_ef", "delay=1")


def test_own_mitigation_checks_apply(lab, tmp_path):
    _one_line_error(_run(lab, "config", "show", "compensation._target_=mylab.damped", "delay=1",
                         "compensation.damped.damping=3"), "compensation.damped.damping=3.0 must be in (0, 1]")
    _one_line_error(_run(lab, "config", "show", "compensation._target_=mylab.damped", "delay=0"),
                    "at delay=0 computes exactly the plain optimizer")


def test_a_method_without_a_memory_model_is_an_error_in_the_plan(lab):
    _one_line_error(_run(lab, "plan", "compensation._target_=mylab.forgetful", "delay=1"),
                    "compensation=forgetful declares no memory model")


def test_an_optimizer_declared_without_a_memory_model_is_refused():
    from asyncpipe.optim.registry import register

    with pytest.raises(TypeError, match="declare its memory model"):
        register("nomem")


def test_own_schedule_by_import_path_trains_benches_plans_and_draws(lab, tmp_path):
    """A schedule in the researcher's package (`pipeline.schedule=mylab.fill_drain`): the pipeline engine runs its
    stream and trains exactly as 1F1B does (both synchronous: the same maths), `plan` holds m micro-batches in
    flight (1F1B: P - s), `bench pipeline` times it beside 1F1B, `schedule` draws it. No edit to asyncpipe."""
    runs = {}
    for name in ("mylab.fill_drain", "1f1b"):
        runs[name] = tmp_path / name
        proc = _run(lab, "train", "engine=pipeline", f"pipeline.schedule={name}", "delay=0", "pipeline.stages=2",
                    "pipeline.threads=1", "precision=fp32", "device=cpu", f"run.dir={runs[name]}", *TRAIN)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    mine, ref = ([m["train_loss"] for m in read_metrics(runs[n]) if "train_loss" in m] for n in runs)
    assert len(mine) == 5 and mine == pytest.approx(ref, rel=1e-5) and mine[-1] < mine[0]

    planned = _run(lab, "plan", "engine=pipeline", "pipeline.schedule=mylab.fill_drain", "delay=0", "pipeline.stages=2",
                   "train.micro_batches=4")  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    rows = [line.split() for line in planned.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    head = next(line.split() for line in planned.stdout.splitlines() if line.split()[:1] == ["stage"])
    assert [r[head.index("in-flight")] for r in rows] == ["4", "4"] and "FILL_DRAIN on 2 stages" in planned.stdout

    drawn = _run(lab, "schedule", "--schedule", "mylab.fill_drain", "--stages", "2", "--micro-batches", "3",
                 "--batches", "2", "--out", str(tmp_path / "draw"))  # fmt: skip
    assert drawn.returncode == 0, drawn.stderr
    assert "# mylab.fill_drain: P=2, m=3, 2 batches" in drawn.stdout and "F2" in drawn.stdout

    out = tmp_path / "bench.json"
    benched = _run(lab, "bench", "pipeline", "model=tiny", "pipeline.stages=2", "train.micro_batches=2",
                   "train.micro_batch_size=2", "train.seq_len=16", "--variants", "1f1b,mylab.fill_drain",
                   "--rounds", "1", "--steps", "3", "--warmup-steps", "1", "--no-simulator", "--out", str(out))
    assert benched.returncode == 0, benched.stderr
    import json

    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"1f1b", "mylab.fill_drain"}
    assert result["variants"]["mylab.fill_drain"]["tokens_per_s"] > 0


def test_the_guide_shows_the_schedule_the_test_runs():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = guide[guide.index("## 4. A pipeline schedule") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n\n")]
    assert code.strip() == textwrap.dedent(FILL_DRAIN).strip()
