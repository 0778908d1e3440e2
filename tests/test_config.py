"""Config composition through Hydra's compose API: defaults, overrides, and one-line errors for user mistakes."""

from __future__ import annotations

from pathlib import Path

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
    assert cfg.optimizer.name == "muon" and cfg.compensation.name == "ef" and cfg.compensation.ef.lam == 1.0
    assert cfg.delay == 1 and cfg.train.steps == 7 and cfg.optimizer.lr == 0.01


def test_every_group_option_composes(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    tokenizer_json = tmp_path / "tokenizer.json"  # tokenizer=hf reads its vocabulary from a file at composition
    Tokenizer(models.WordLevel({"a": 0, "<|endoftext|>": 1}, unk_token="a")).save(str(tokenizer_json))
    for group in ("model", "optimizer", "tokenizer", "data", "launcher"):
        for option in group_options(group):
            overrides = [f"{group}={option}"]
            if group == "model" and option not in ("tiny", "small"):
                overrides.append("train.seq_len=64")
            if group == "tokenizer" and option == "hf":
                overrides.append(f"tokenizer.path={tokenizer_json}")
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
        (["optimizer=adamw_ef", "optimizer.ef.lam=-0.5"], "compensation.ef.lam=-0.5 must be >= 0 (optimizer.ef.lam is its alias)"),
        (["compensation=ef", "compensation.ef.lam=-0.5"], "compensation.ef.lam=-0.5 must be >= 0"),
        (["optimizer=adamw_ef", "compensation=dc", "delay=1"], "optimizer.ef.enabled=true (the *_ef presets) and compensation=dc: choose one"),
        (["train.seq_len=4096"], "train.seq_len=4096 exceeds model 'tiny' maximum of 256"),
        (["engine=pipeline", "delay=2"], "engine=pipeline supports delay 0 (1F1B) or 1 (2BW)"),
        (["engine=pipeline", "delay=1", "pipeline.stages=4", "train.micro_batches=2"], "2BW needs train.micro_batches >= pipeline.stages"),
        (["engine=pipeline", "pipeline.stages=5"], "pipeline.stages=5 exceeds the 4 transformer blocks"),
        (["engine=pipeline", "model=135m", "train.seq_len=64", "pipeline.schedule=paci-recompute"], "ties embeddings across stages under 1f1b, 2bw and paci only"),
        (["engine=warp"], "engine=warp is not allowed; choose one of: simulate, pipeline"),
        (["optimizer=muon", "optimizer.adjust_lr_fn=sqrt"], "optimizer.adjust_lr_fn=sqrt is not allowed"),
        (["optimizer=muon", "optimizer.ns_steps=0"], "optimizer.ns_steps=0 must be >= 1"),
        (["tracker.wandb.mode=sometimes"], "tracker.wandb.mode=sometimes is not allowed"),
        # settings that do nothing, or nothing useful (issue 28): each method's own checks, from its declaration
        (["compensation=weight_prediction", "delay=0"], "compensation=weight_prediction at delay=0 computes exactly the plain optimizer"),
        (["compensation=ef_adaptive", "delay=0"], "compensation=ef_adaptive at delay=0 computes exactly"),
        (["compensation=dc", "delay=0"], "compensation=dc at delay=0 computes exactly the plain optimizer"),
        (["compensation=stage_lr", "delay=0"], "compensation=stage_lr at delay=0 computes exactly"),
        (["compensation=stage_lr", "delay=1", "delay_profile=pipedream", "pipeline.stages=4", "compensation.stage_lr.power=1e6"],
         "compensation.stage_lr.power=1e+06 must be in [0, 4]"),
        (["compensation=update_averaging", "delay=1", "compensation.nag.gamma=1"], "compensation.nag.gamma=1.0 must be in [0, 1)"),
        (["compensation=basis_rotation", "delay=1", "optimizer=soap"], "optimizer=soap already runs Adam in a rotated eigenbasis"),
        (["compensation=ef_adaptive", "delay=1", "compensation.adaptive.lam_init=3"], "lam_init=3.0 is above lam_max=2.0"),
        (["compensation=weight_prediction", "delay=1", "compensation.prediction.horizon=1e6"], "horizon=1000000.0 must be in [0, 16]"),
        (["compensation=weight_prediction", "delay=1", "engine=pipeline"], "compensation=weight_prediction does not run in engine=pipeline"),
        (["compensation=ef", "delay=1", "compensation.ef.schedule=warmup"], "warmup_steps=0 must be >= 1 with schedule=warmup"),
        (["model=moe_tiny", "model.moe.capacity_factor=0.001"], "keeps at most 0.39% of each micro-batch's 512 x 2"),
        (["optimizer.weight_decay=300"], "decoupled decay multiplies every weight by 1 - lr x weight_decay <= 0"),
        (["optimizer=muon", "optimizer.muon_router=true"], "optimizer.muon_router=true does nothing: model 'tiny' is dense"),
        (["optimizer=muon", "optimizer.ns_steps=1000"], "optimizer.ns_steps=1000 must be >= 1 (and <= 100"),
        (["optimizer.name=lion"], "optimizer.name=lion is unknown; choose one of: adamw, muon, nadam, soap"),
        (["compensation.name=magic", "delay=1"], "compensation.name=magic is unknown; choose one of:"),
    ],
)
def test_user_mistakes_are_one_line_errors(overrides: list[str], needle: str) -> None:  # noqa: E501
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    message = str(err.value)
    assert "\n" not in message
    assert needle in message


def test_capacity_that_keeps_most_tokens_and_ef_at_delay_0_are_accepted() -> None:
    assert compose(["model=moe_tiny", "model.moe.capacity_factor=0.05"]).model.moe.capacity_factor == 0.05  # 5% kept
    assert compose(["optimizer=adamw_ef", "delay=0"]).compensation.name == "ef"  # EF extrapolates even without delay


def test_default_lr_is_the_models_tuned_value_and_an_explicit_lr_wins() -> None:
    from asyncpipe.config import tuned_lr

    for name in ("adamw", "muon", "soap", "nadam"):
        assert compose([f"optimizer={name}"]).optimizer.lr == tuned_lr("tiny", name)
    study = {"data": "shakespeare", "steps": 1100, "tokens_per_step": 4096}
    assert (tuned_lr("tiny", "adamw", **study), tuned_lr("tiny", "muon", **study)) == (0.016, 0.02)  # v3's winners
    default = {"data": "hamlet", "steps": 100, "tokens_per_step": 2048}
    assert (tuned_lr("tiny", "adamw", **default), tuned_lr("tiny", "muon", **default)) == (5e-3, 0.08)  # issue 41's
    study_cfg = compose(["data=shakespeare", "train.steps=1100", "train.seq_len=128", "optimizer=muon"])
    assert study_cfg.optimizer.lr == 0.02
    assert compose(["optimizer=muon", "optimizer.lr=0.5"]).optimizer.lr == 0.5
    assert compose(["model=135m", "train.seq_len=64"]).optimizer.lr == tuned_lr("135m", "adamw") == 6e-4
    assert tuned_lr("small", "adamw") is None and compose(["model=small"]).optimizer.lr == 1e-3  # no table entry


def test_a_tuned_lr_used_outside_its_regime_is_said_in_one_line() -> None:
    """Issue 41: the default lr is the one tuned for the run's regime (data, steps, tokens per step within 2x);
    taken from another regime (the nearest), `regime_warning` says which and what this run is."""
    from asyncpipe.config.tuned import regime_warning

    assert regime_warning(compose([])) is None and regime_warning(compose(["train.steps=150"])) is None
    far = regime_warning(compose(["train.steps=1000"]))
    assert far == ("warning: optimizer.lr=0.005 is adamw's tuned lr on tiny for 100 steps x 2048 tokens on hamlet, not "
                   "for this run's 1000 steps x 2048 tokens on hamlet (conf/tuned_lr.yaml): set optimizer.lr, or tune "
                   "it for this regime")  # fmt: skip
    soap = regime_warning(compose(["optimizer=soap"]))  # not tuned on Hamlet: the study's lr, said so
    assert soap is not None and "for 1100 steps x 4096 tokens on shakespeare" in soap
    assert regime_warning(compose(["train.steps=1000", "optimizer.lr=0.004"])) is None  # an lr of one's own
    assert regime_warning(compose(["model=135m", "train.seq_len=64"])) is None  # the literature's, for any data


def test_ef_override_and_preset_are_the_one_ef_method() -> None:
    from asyncpipe.registry import describe

    preset = compose(["optimizer=muon_ef", "delay=1"])
    override = compose(["optimizer=muon", "optimizer.ef.enabled=true", "optimizer.ef.lam=0.5", "delay=1"])
    explicit = compose(["optimizer=muon", "compensation=ef", "delay=1"])
    for cfg, lam in ((preset, 1.0), (override, 0.5), (explicit, 1.0)):
        comp = cfg.compensation  # the switch is an alias, resolved at composition; nothing reads it after
        assert not cfg.optimizer.ef.enabled and cfg.optimizer.ef.lam == 1.0
        assert (comp.name, comp.ef.lam, comp.ef.schedule) == ("ef", lam, "constant")
        assert describe(cfg) == f"muon + EF(lam={lam:g})" and "-muon_ef-d1" in cfg.run.dir
    assert "-adamw+dc-d1" in compose(["compensation=dc", "delay=1"]).run.dir


def test_every_method_declares_its_memory_and_every_optimizer_its_state() -> None:
    from asyncpipe.registry import methods, optimizers

    assert {m.name for m in methods()} >= {"none", "ef", "ef_adaptive", "dc", "stage_lr", "update_averaging",
                                           "basis_rotation", "weight_prediction"}  # fmt: skip
    assert all(m.buffers is not None for m in methods()), [m.name for m in methods() if m.buffers is None]
    assert {o.name for o in optimizers()} >= {"adamw", "muon", "nadam", "soap"} and all(o.memory for o in optimizers())
    pipedream = ["delay=1", "delay_profile=pipedream", "pipeline.stages=4", "compensation=stage_lr"]
    assert compose(pipedream).compensation.stage_lr.run_steps == 100  # accepted where k reaches 3
