"""Closed-form validation of heads and coefficients (research/validation.py and ``diversed validate``): static points
lie on their own line (and KL curve), the token-by-token loss minimiser lies on or above the line (below the curve
with the KL term), token files round-trip, and the command runs end to end on a tiny pair."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext import cli  # noqa: E402
from diversed_ext.head import DISTRIBUTION_FEATURES, EnsembleHead  # noqa: E402
from diversed_ext.research import validation  # noqa: E402
from diversed_ext.research.objective import KL_GRID_POINTS  # noqa: E402
from diversed_ext.research.teacher_forcing import TokenBatch  # noqa: E402
from helpers import commands_use, gsm8k_file, refuse_models  # noqa: E402


def synthetic_tokens(prompts=12, length=20, seed=0) -> TokenBatch:
    generator = torch.Generator().manual_seed(seed)
    total_variation = torch.rand(prompts, length, generator=generator)
    # G mostly negative and loosely tied to TV, as on real pairs
    gap = -3 * total_variation * torch.rand(prompts, length, generator=generator) * 2
    # KL(nu_w || p) near its convex shape, c (1 - w)^2, with a curvature c loosely tied to TV
    curvature = total_variation * torch.rand(prompts, length, generator=generator) * 4
    grid = torch.linspace(0, 1, KL_GRID_POINTS)
    return TokenBatch(draft_hidden=torch.randn(prompts, length, 4, generator=generator),
                      target_hidden=torch.randn(prompts, length, 6, generator=generator),
                      target_logprob=torch.zeros(prompts, length), draft_logprob=torch.zeros(prompts, length),
                      total_variation=total_variation, mask=torch.ones(prompts, length, dtype=torch.bool),
                      fidelity_gap=gap,
                      distributions=torch.rand(prompts, length, len(DISTRIBUTION_FEATURES), generator=generator),
                      kl_table=curvature.unsqueeze(-1) * (1 - grid) ** 2)


def test_sd_and_static_points():
    tokens = synthetic_tokens()
    sd = validation.static_point(1.0, tokens)
    torch.testing.assert_close(torch.tensor(sd.acceptance), 1 - tokens.total_variation.mean(-1))
    assert sd.fidelity_change == [0.0] * 12 and sd.label == "sd"
    for weight in (0.0, 0.3, 0.8):
        gap, _ = validation.gap_to_static_line(validation.static_point(weight, tokens), tokens)
        assert abs(gap) < 1e-6  # a static ensemble lies on the static line
        kl_gap, _ = validation.gap_to_static_line(validation.static_point(weight, tokens), tokens, "kl")
        assert abs(kl_gap) < 1e-6  # and on the static curve of KL
    assert sd.kl == [0.0] * 12
    torch.testing.assert_close(torch.tensor(validation.static_point(0.0, tokens).kl), tokens.kl_table[..., 0].mean(-1))


@pytest.mark.parametrize("coef", [0.5, 1.0, 2.0, 4.0])
def test_loss_minimiser_lies_above_the_static_line(coef):
    tokens = synthetic_tokens(seed=int(coef * 10))
    row = validation.point_row(validation.rule_point(coef, 1.0, tokens), tokens)
    assert row["gap"] > 0.05  # per token it trades acceptance for fidelity where that is cheapest
    weights = torch.tensor(validation.rule_point(coef, 1.0, tokens).weight)
    assert torch.all((weights >= 0) & (weights <= 1))


@pytest.mark.parametrize("coef", [0.5, 1.0, 2.0])
def test_kl_minimiser_lies_below_the_static_curve(coef):
    """With only acceptance and KL in the loss, the per-token minimiser spends its draft weight where KL is cheapest
    for the acceptance it buys: less KL than the static ensemble of the same acceptance, on weights of the grid."""
    tokens = synthetic_tokens(seed=int(coef * 10))
    point = validation.rule_point(coef, 0.0, tokens, expected_kl_coef=1.0)
    row = validation.point_row(point, tokens)
    assert point.label == f"rule lambda={coef:g} kappa=1"
    assert row["kl_below"] > 0.01 and 0.05 < row["mean_weight"] < 0.95, row
    # each token's weight is the grid's minimiser of lambda w TV + kappa c (1 - w)^2 (up to the grid's step)
    best = (1 - coef * tokens.total_variation / (2 * tokens.kl_table[..., 0].clamp_min(1e-9))).clamp(0, 1)
    weights = torch.tensor(point.weight)
    torch.testing.assert_close(weights, best.mean(-1), atol=1 / (KL_GRID_POINTS - 1), rtol=0)


def test_more_acceptance_weight_means_more_acceptance():
    tokens = synthetic_tokens()
    acceptances = [validation.point_row(validation.rule_point(coef, 1.0, tokens), tokens)["acceptance"]
                   for coef in (0.5, 1, 2, 4, 8)]
    assert acceptances == sorted(acceptances) and acceptances[-1] > acceptances[0]


def test_head_point_reads_features_and_masks_padding():
    tokens = synthetic_tokens(prompts=3, length=5)
    tokens.mask[1, 3:] = False
    tokens.total_variation[1, 3:] = 100.0  # padding: must not count
    head = EnsembleHead(4, 6, features=["total_variation"], use_hidden=False, init_weight=0.25)
    point = validation.head_point("head", head, tokens)
    torch.testing.assert_close(torch.tensor(point.weight), torch.full((3,), 0.25))
    assert point.acceptance[1] == pytest.approx(1 - 0.25 * float(tokens.total_variation[1, :3].mean()), abs=1e-6)


def test_tokens_round_trip(tmp_path):
    tokens = synthetic_tokens(prompts=2, length=3)
    path = str(tmp_path / "tokens.safetensors")
    validation.save_tokens(tokens, path)
    loaded = validation.load_tokens(path)
    for field in dataclasses.fields(TokenBatch):
        assert torch.equal(getattr(loaded, field.name), getattr(tokens, field.name))
    from safetensors.torch import save_file
    save_file({"mask": tokens.mask}, path)
    with pytest.raises(ValueError, match="lacks"):
        validation.load_tokens(path)


def test_cli_validate_end_to_end(experiment_pair, tmp_path, monkeypatch, capsys):
    target, draft, tokenizer = experiment_pair
    commands_use(monkeypatch, (target, draft, tokenizer))
    data = gsm8k_file(tmp_path / "gsm8k.jsonl", 4)
    head = tmp_path / "head"
    EnsembleHead(16, 16, features=DISTRIBUTION_FEATURES, init_weight=0.7).save(str(head))
    tokens = tmp_path / "tokens.safetensors"
    argv = ["validate", "--data", str(data), "--skip", "1", "--max-new-tokens", "6", "--tokens", str(tokens),
            "--acceptance-coef", "1", "--head", str(head)]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert "3 held-out prompts" in first and "| sd |" in first and "| rule lambda=1 |" in first
    assert "| KL to the target | KL below the static curve |" in first
    assert f"| {head} | 0.700 |" in first and tokens.is_file()
    assert cli.main(argv) == 0  # the second run reads the token file: the same table
    assert capsys.readouterr().out == first
    assert cli.main(["validate", "--data", str(data), "--skip", "9"]) == 2
    assert "--skip" in capsys.readouterr().err
    tokens.write_bytes(b"not a safetensors file")  # a damaged token file: one line naming it, exit status 2
    assert cli.main(argv) == 2
    assert f"--tokens {tokens}" in capsys.readouterr().err


def test_a_token_file_is_reused_only_under_the_settings_it_was_sampled_with(experiment_pair, tmp_path, monkeypatch,
                                                                           capsys):
    """--tokens reads an existing file only where every flag that decides its contexts is as when it was sampled:
    one that differs is named, before any model loads; a file that records no settings is refused."""
    commands_use(monkeypatch, experiment_pair)
    data = gsm8k_file(tmp_path / "gsm8k.jsonl", 4)
    tokens = tmp_path / "tokens.safetensors"
    argv = ["validate", "--data", data, "--limit", "2", "--max-new-tokens", "4", "--tokens", str(tokens)]
    assert cli.main(argv) == 0
    assert validation.recorded_token_settings(str(tokens))["limit"] == 2
    assert cli.main([*argv, "--batch-size", "1"]) == 0  # the batch size leaves each prompt's tokens as they are
    capsys.readouterr()
    refuse_models(monkeypatch)
    other = gsm8k_file(tmp_path / "other.jsonl", 4)
    for changed, expected in [(["--limit", "3"], "--limit 2 (now 3)"), (["--skip", "1"], "--skip 0 (now 1)"),
                              (["--temperature", "0.5"], "--temperature 1.0 (now 0.5)"),
                              (["--weight", "0.9"], "--weight 0.5 (now 0.9)"),
                              (["--max-new-tokens", "16"], "--max-new-tokens 4 (now 16)"),
                              (["--seed", "3"], "--seed 0 (now 3)"),
                              (["--data", other], "--data gsm8k.jsonl (now other.jsonl)")]:
        assert cli.main([*argv, *changed]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"diversed: --tokens {tokens}: sampled with {expected}; ") and "\n" not in error
    validation.save_tokens(validation.load_tokens(str(tokens)), str(tokens))  # as written before settings were
    assert cli.main(argv) == 2
    assert "records no settings it was sampled under" in capsys.readouterr().err
