"""Statistical guarantees: emitted tokens follow nu, acceptance is 1 - w TV(p, q), w = 1 gives the target exactly.

Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is visible)."""

import pytest
import torch
from scipy.stats import chisquare

import diversed_ext as dx
from helpers import P_VALUE_FLOOR, chi_square_tokens_p_value, on_device

NUM_SAMPLES = 40_000


def fixed_pair(vocab=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    draft = (torch.randn(vocab, generator=generator) * 1.5).softmax(-1)
    target = (torch.randn(vocab, generator=generator) * 1.5).softmax(-1)
    return draft, target


def sample_first_token(verifier, draft, target, weight, num_positions=1, seed=123):
    """Draw NUM_SAMPLES drafts from q, verify them, and return (first emitted token, accepted count)."""
    vocab = draft.numel()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial(draft, NUM_SAMPLES * num_positions, replacement=True, generator=generator)
    tokens = tokens.reshape(NUM_SAMPLES, num_positions)
    draft_probs = draft.expand(NUM_SAMPLES, num_positions, vocab).contiguous()
    target_probs = target.expand(NUM_SAMPLES, num_positions + 1, vocab).contiguous()
    result = verifier(tokens, draft_probs, target_probs, weight, seed=seed)
    return result.tokens[:, 0], result.num_accepted


@pytest.mark.parametrize("verifier", [dx.verify, dx.verify_reference], ids=["native", "reference"])
@pytest.mark.parametrize("weight", [0.0, 0.3, 0.7, 1.0])
def test_emitted_token_follows_mixture(verifier, weight):
    draft, target = fixed_pair(seed=int(weight * 10))
    first, _ = sample_first_token(verifier, draft, target, weight)
    mixture = weight * target + (1 - weight) * draft
    assert chi_square_tokens_p_value(first, mixture) > P_VALUE_FLOOR


def test_weight_one_is_exactly_the_target_and_detects_a_wrong_law():
    draft, target = fixed_pair(seed=42)
    first, _ = sample_first_token(dx.verify, draft, target, 1.0)
    assert chi_square_tokens_p_value(first, target) > P_VALUE_FLOOR
    # The same samples must fail against the draft's law: the test has power.
    assert chi_square_tokens_p_value(first, draft) < 1e-10


@pytest.mark.parametrize("weight", [0.2, 0.5, 0.9, 1.0])
def test_acceptance_rate_is_one_minus_weighted_tv(weight):
    draft, target = fixed_pair(seed=7)
    _, accepted = sample_first_token(dx.verify, draft, target, weight)
    total_variation = 0.5 * (draft - target).abs().sum().item()
    expected = 1 - weight * total_variation
    observed = accepted.float().mean().item()
    standard_error = (expected * (1 - expected) / NUM_SAMPLES) ** 0.5
    assert abs(observed - expected) < 5 * standard_error + 1e-6


def test_zero_weight_accepts_every_draft():
    draft, target = fixed_pair(seed=3)
    _, accepted = sample_first_token(dx.verify, draft, target, 0.0, num_positions=4)
    assert torch.all(accepted == 4)


def test_bonus_token_follows_target_row():
    draft, target = fixed_pair(seed=5)
    vocab = draft.numel()
    tokens = torch.multinomial(draft, NUM_SAMPLES, replacement=True, generator=torch.Generator().manual_seed(1))
    result = dx.verify(tokens.reshape(-1, 1), draft.expand(NUM_SAMPLES, 1, vocab).contiguous(),
                       target.expand(NUM_SAMPLES, 2, vocab).contiguous(), 0.0, seed=9)
    assert chi_square_tokens_p_value(result.tokens[:, 1], target) > P_VALUE_FLOOR


def test_second_position_follows_mixture_given_first_accepted():
    draft, target = fixed_pair(seed=8)
    vocab = draft.numel()
    weight = 0.6
    generator = torch.Generator().manual_seed(4)
    tokens = torch.multinomial(draft, 2 * NUM_SAMPLES, replacement=True, generator=generator).reshape(-1, 2)
    result = dx.verify(tokens, draft.expand(NUM_SAMPLES, 2, vocab).contiguous(),
                       target.expand(NUM_SAMPLES, 3, vocab).contiguous(), weight, seed=10)
    reached_second = result.num_accepted >= 1
    mixture = weight * target + (1 - weight) * draft
    assert chi_square_tokens_p_value(result.tokens[reached_second, 1], mixture) > P_VALUE_FLOOR


def test_samples_follow_the_mixture_at_the_expected_rate(device):
    vocab, samples, weight = 10, 50_000, 0.3
    generator = torch.Generator().manual_seed(21)
    draft = (torch.randn(vocab, generator=generator) * 1.5).softmax(-1)
    target = (torch.randn(vocab, generator=generator) * 1.5).softmax(-1)
    tokens = torch.multinomial(draft, samples, replacement=True, generator=generator).reshape(-1, 1)
    result = on_device(device, dx.verify, tokens, draft.expand(samples, 1, vocab).contiguous(),
                       target.expand(samples, 2, vocab).contiguous(), weight, seed=8)
    counts = torch.bincount(result.tokens[:, 0], minlength=vocab).double()
    mixture = (weight * target + (1 - weight) * draft).double()
    assert chisquare(counts.numpy(), (mixture / mixture.sum() * samples).numpy()).pvalue > 1e-4
    acceptance = result.num_accepted.double().mean().item()
    expected = 1 - weight * 0.5 * (target - draft).abs().sum().item()
    assert abs(acceptance - expected) < 0.01
