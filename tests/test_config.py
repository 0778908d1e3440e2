"""Config composition through Hydra's compose API: defaults, overrides, and one-line errors for user mistakes."""

from __future__ import annotations

import pytest

from asyncpipe.optim.registry import available
from asyncpipe.config import ConfigError, compose, group_options


def test_default_config_is_the_embedded_tiny_hamlet_run() -> None:
    cfg = compose([])
    assert (cfg.model.name, cfg.data.name, cfg.tokenizer.name) == ("tiny", "hamlet", "byte")
    assert cfg.delay == 0 and cfg.engine == "simulate"
    assert cfg.train.warmup_frac == 0.1 and cfg.train.min_lr_frac == 0.1
    assert cfg.train.grad_clip == 1.0 and cfg.optimizer.weight_decay == 0.1
    assert cfg.run.dir.startswith("runs/")


def test_overrides_follow_hydra_grammar_and_types() -> None:
    cfg = compose(["model=small", "optimizer=muon_ef", "delay=1", "train.steps=7", "optimizer.lr=0.01"])
    assert cfg.model.name == "small" and cfg.model.n_layer == 8
    assert cfg.optimizer.name == "muon" and cfg.optimizer.ef.enabled and cfg.optimizer.ef.lam == 1.0
    assert cfg.delay == 1 and cfg.train.steps == 7 and cfg.optimizer.lr == 0.01


def test_every_group_option_composes() -> None:
    for group in ("model", "optimizer", "tokenizer", "data", "launcher"):
        for option in group_options(group):
            overrides = [f"{group}={option}"]
            if group == "model" and option not in ("tiny", "small"):
                overrides.append("train.seq_len=64")
            name = compose(overrides)[group].name
            # a preset (adamw_ef, muon_ef, nag) names the declared optimizer it configures
            assert name in (option, option.removesuffix("_ef")) or (group == "optimizer" and name in available())


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model=nope"], "unknown model 'nope'; choose one of: 10b, 135m, 1b, 360m, 3b, mini, moe_10b, moe_mini, moe_tiny, small, tiny"),
        (["optimizer=sgdx"], "unknown optimizer 'sgdx'"),
        (["train.stepz=3"], "unknown config key 'train.stepz'"),
        (["train.steps=abc"], "'abc' for 'train.steps' is not a valid int"),
        (["delay=-1"], "delay=-1 must be >= 0"),
        (["optimizer.lr=0"], "optimizer.lr=0.0 must be > 0"),
        (["optimizer.ef.lam=-0.5"], "optimizer.ef.lam=-0.5 must be >= 0"),
        (["train.seq_len=4096"], "train.seq_len=4096 exceeds model 'tiny' maximum of 256"),
        (["engine=pipeline", "delay=2"], "engine=pipeline supports delay 0 (1F1B) or 1 (2BW)"),
        (["engine=pipeline", "delay=1", "pipeline.stages=4", "train.micro_batches=2"], "2BW needs train.micro_batches >= pipeline.stages"),
        (["engine=pipeline", "pipeline.stages=5"], "pipeline.stages=5 exceeds the 4 transformer blocks"),
        (["engine=pipeline", "model=135m", "train.seq_len=64"], "needs untied embeddings"),
        (["engine=warp"], "engine=warp is not allowed; choose one of: simulate, pipeline"),
        (["optimizer=muon", "optimizer.adjust_lr_fn=sqrt"], "optimizer.adjust_lr_fn=sqrt is not allowed"),
        (["optimizer=muon", "optimizer.ns_steps=0"], "optimizer.ns_steps=0 must be >= 1"),
        (["tracker.wandb.mode=sometimes"], "tracker.wandb.mode=sometimes is not allowed"),
    ],
)
def test_user_mistakes_are_one_line_errors(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    message = str(err.value)
    assert "\n" not in message
    assert needle in message
