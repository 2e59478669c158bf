"""EnsembleHead: shapes, initial weight, save/load and the checks against a mismatched model pair."""

import pytest
import torch

from diversed_ext.head import EnsembleHead

PAIR = {"target": "tiny-target", "draft": "tiny-draft"}


@pytest.mark.parametrize("hidden", [None, 16])
@pytest.mark.parametrize("init_weight", [0.3, 0.5, 1.0])
def test_initial_weight_everywhere(hidden, init_weight):
    head = EnsembleHead(12, 20, hidden=hidden, init_weight=init_weight)
    generator = torch.Generator().manual_seed(0)
    weights = head(torch.randn(3, 7, 12, generator=generator) * 50, torch.randn(3, 7, 20, generator=generator))
    assert weights.shape == (3, 7)
    torch.testing.assert_close(weights, torch.full((3, 7), init_weight), atol=2e-6, rtol=0)


def test_weights_stay_in_open_interval_and_depend_on_input():
    # Seeded: with torch's per-process random seed, a large draw once pushed a float32 sigmoid to exactly 1.0.
    torch.manual_seed(0)
    head = EnsembleHead(8, 8, hidden=8)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head.output.weight.copy_(torch.randn(head.output.weight.shape, generator=generator) * 2)
    weights = head(torch.randn(100, 8, generator=generator), torch.randn(100, 8, generator=generator))
    assert torch.all((weights > 0) & (weights < 1))
    assert weights.std() > 0.05


def test_gradient_reaches_every_parameter():
    head = EnsembleHead(6, 10, hidden=4)
    with torch.no_grad():
        head.output.weight.fill_(0.1)
    head(torch.randn(5, 6), torch.randn(5, 10)).sum().backward()
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in head.parameters())


def test_save_and_load_round_trip(tmp_path):
    head = EnsembleHead(6, 10, hidden=4, init_weight=0.7, pair=PAIR)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    head.save(str(tmp_path))
    loaded = EnsembleHead.load(str(tmp_path), pair=PAIR, draft_hidden=6, target_hidden=10)
    inputs = (torch.randn(4, 6), torch.randn(4, 10))
    torch.testing.assert_close(loaded(*inputs), head(*inputs), rtol=0, atol=0)
    assert loaded.config == head.config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.json", "head.safetensors"]
    # map_location places the whole head (the meta device holds no data, so any device but the CPU would tell).
    moved = EnsembleHead.load(str(tmp_path), map_location="meta")
    assert {parameter.device.type for parameter in moved.parameters()} == {"meta"}


@pytest.mark.parametrize("kwargs,pattern", [
    ({"pair": {"target": "other-model", "draft": "tiny-draft"}}, "trained for target"),
    ({"draft_hidden": 7}, "draft hidden size"),
    ({"target_hidden": 11}, "target hidden size"),
])
def test_load_refuses_mismatched_pair(tmp_path, kwargs, pattern):
    EnsembleHead(6, 10, pair=PAIR).save(str(tmp_path))
    with pytest.raises(ValueError, match=pattern):
        EnsembleHead.load(str(tmp_path), **kwargs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="init_weight"):
        EnsembleHead(4, 4, init_weight=0.0)
    with pytest.raises(ValueError, match="draft_hidden"):
        EnsembleHead(0, 4)
    with pytest.raises(ValueError, match="hidden"):
        EnsembleHead(4, 4, hidden=-2)
    head = EnsembleHead(4, 5)
    with pytest.raises(ValueError, match="draft_hidden_states"):
        head(torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(ValueError, match="agree"):
        head(torch.randn(2, 4), torch.randn(3, 5))


def test_load_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="head.json"):
        EnsembleHead.load(str(tmp_path / "nothing"))


def test_shipped_heads_load_by_name():
    from diversed_ext.head import DEFAULT_HEAD_DIR, DEFAULT_HEAD_NAME, load_head, resolve_head_path, shipped_heads

    names = shipped_heads()
    assert DEFAULT_HEAD_NAME in names
    assert resolve_head_path("default") == DEFAULT_HEAD_DIR == resolve_head_path(DEFAULT_HEAD_NAME)
    assert resolve_head_path("no-such-head") == "no-such-head"  # left for the loader to refuse, naming it
    for name in names:
        assert load_head(name).config.draft_hidden > 0
