"""The GPT family: preset sizes, partition rules, and init that does not depend on how the model is cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from asyncpipe.config.schema import ModelConfig
from asyncpipe.model import GPT, Block, build_layers, count_parameters, layer_of_param, lm_loss, partition

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
NOMINAL = {"135m": 135e6, "360m": 360e6, "1b": 1e9, "3b": 3e9, "10b": 10e9, "moe_10b": 10e9}


def preset(name: str):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / f"{name}.yaml"))


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_preset_parameter_count_matches_its_name(name: str) -> None:
    cfg = preset(name)
    with torch.device("meta"):
        n = count_parameters(GPT(cfg, cfg.vocab_size or 256))
    if name in ("tiny", "moe_tiny"):
        assert n <= 1_000_000
    elif name == "small":
        assert 5e6 <= n <= 20e6
    elif name == "mini":
        assert 1e6 <= n <= 5e6
    elif name == "moe_mini":
        assert 1e6 <= n <= 10e6
    else:
        assert abs(n - NOMINAL[name]) / NOMINAL[name] <= 0.05, f"{name}: {n / 1e6:.1f}M"


def test_layers_are_embedding_blocks_head_and_forward_shapes() -> None:
    cfg = preset("tiny")
    model = GPT(cfg, 256)
    assert len(model.layers) == cfg.n_layer + 2
    assert sum(isinstance(layer, Block) for layer in model.layers) == cfg.n_layer
    ids = torch.randint(0, 256, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 256)
    loss = lm_loss(logits, ids)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near-uniform at init


def test_init_is_identical_whole_or_built_per_stage() -> None:
    cfg = preset("tiny")
    whole = GPT(cfg, 256, seed=7)
    parts = partition(len(whole.layers), 2)
    for s in range(2):
        idx = range(parts[s], parts[s + 1])
        stage = build_layers(cfg, 256, seed=7, indices=idx)
        for i in idx:
            for (na, a), (nb, b) in zip(whole.layers[i].named_parameters(), stage[i].named_parameters()):
                assert na == nb and torch.equal(a, b)
    other = GPT(cfg, 256, seed=8)
    assert not torch.equal(whole.layers[1].q.weight, other.layers[1].q.weight)


def test_causal_attention_ignores_future_tokens() -> None:
    model = GPT(preset("tiny"), 256)
    a = torch.randint(0, 256, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 256
    assert torch.allclose(model(a)[0, :8], model(b)[0, :8], atol=1e-5)
    assert not torch.allclose(model(a)[0, 8:], model(b)[0, 8:])


def test_tied_embeddings_share_one_weight() -> None:
    cfg = preset("tiny")
    cfg.tie_embeddings = True
    model = GPT(cfg, 256)
    untied = GPT(preset("tiny"), 256)
    assert count_parameters(untied) - count_parameters(model) == 256 * cfg.d_model
    model(torch.randint(0, 256, (1, 4))).sum().backward()
    assert model.layers[0].weight.grad is not None


@pytest.mark.parametrize("total,stages,expected", [(6, 2, [0, 3, 6]), (6, 4, [0, 2, 3, 4, 6]), (10, 3, [0, 4, 7, 10])])
def test_partition_spreads_blocks_with_embedding_first_and_head_last(total, stages, expected) -> None:
    parts = partition(total, stages)
    assert parts == expected
    assert parts[0] == 0 and parts[-1] == total
    sizes = [parts[s + 1] - parts[s] for s in range(stages)]
    blocks = [sizes[0] - 1] + sizes[1:-1] + [sizes[-1] - 1] if stages > 1 else [sizes[0] - 2]
    assert max(blocks) - min(blocks) <= 1


def test_partition_refuses_more_stages_than_blocks() -> None:
    with pytest.raises(ValueError, match="need at least"):
        partition(4, 3)


def test_layer_of_param_reads_the_layer_index() -> None:
    names = [n for n, _ in GPT(preset("tiny"), 256).named_parameters()]
    assert layer_of_param(names[0]) == 0 and layer_of_param(names[-1]) == 5
