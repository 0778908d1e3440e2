"""The model preset a stand-in profile names is read over the schema's `ModelConfig`: a key the preset's YAML leaves
out takes the schema's default (one source of defaults), and a preset that is not a model config is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncpipe import standin_costs
from asyncpipe.config.schema import ModelConfig, MoEConfig
from asyncpipe.errors import UserError

SHAPE = {"n_layer": 4, "d_model": 64, "n_head": 4, "d_ff": 96, "max_seq_len": 256}
STANDIN = {"name": "t", "vocab_size": 512, "micro_batch_size": 2, "seq_len": 128, "device_profile": "h100_assumed"}


def _seconds(model_dir: Path, monkeypatch: pytest.MonkeyPatch, name: str, preset: dict) -> dict:
    (model_dir / f"{name}.yaml").write_text(OmegaConf.to_yaml({"name": name, **preset}))
    monkeypatch.setattr(standin_costs, "MODEL_DIR", model_dir)
    return standin_costs.profile_seconds({**STANDIN, "model": name})


def test_a_key_the_preset_leaves_out_takes_the_schemas_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, moe = ModelConfig(name="x"), MoEConfig()
    stated = {"n_kv_head": model.n_kv_head, "tie_embeddings": model.tie_embeddings}
    for extra in ({}, {"moe": {"experts": 4}}):
        full = {**SHAPE, **stated, **extra}
        if extra:
            full["moe"] = {**extra["moe"], "top_k": moe.top_k, "d_expert": moe.d_expert, "shared_expert": False}
        left_out = _seconds(tmp_path, monkeypatch, "left_out", {**SHAPE, **extra})
        assert left_out == _seconds(tmp_path, monkeypatch, "full", full)
    # the defaults matter to the price: a stated top-1 MoE costs less per block than the schema's top-k
    assert moe.top_k > 1
    top1 = _seconds(tmp_path, monkeypatch, "top1", {**SHAPE, "moe": {"experts": 4, "top_k": 1}})
    assert top1["block"][0] < left_out["block"][0]


def test_a_preset_that_is_not_a_model_config_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError) as err:
        _seconds(tmp_path, monkeypatch, "typo", {**SHAPE, "n_layers": 4})
    assert "n_layers" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="model nope is not a preset; one of: typo$"):
        standin_costs.profile_seconds({**STANDIN, "model": "nope"})
    (tmp_path / "broken.yaml").write_text("name: broken\nn_layer: [4\n")
    with pytest.raises(UserError, match="broken.yaml does not read as a model config"):
        standin_costs.profile_seconds({**STANDIN, "model": "broken"})
