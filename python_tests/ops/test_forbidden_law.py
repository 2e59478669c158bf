"""The law of the emitted token where the target forbids part of the vocabulary: the restricted mixture

    nu' = w p + (1 - w) (q 1_S + q(not S) r),   S = {p > 0} (the support), r = norm(max(0, p - q)),

which is what verifying a forbidden draft with w = 1 gives: the draft's mass on forbidden tokens moves to the residual,
and nothing forbidden is ever emitted. nu' = nu wherever S covers q's support. Chi-square tests with fixed seeds, with
power checks against the unrestricted nu. Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is
visible)."""

import pytest
import torch

import diversed_ext as dx
from helpers import P_VALUE_FLOOR, chi_square_tokens_p_value, on_device

NUM_SAMPLES = 40_000
FORBIDDEN = [1, 4]  # of V = 7


def constrained_pair():
    """(q, p): a draft with mass everywhere, most on tokens 1 and 4, which the target forbids."""
    draft = torch.tensor([0.1, 0.3, 0.05, 0.1, 0.25, 0.1, 0.1])
    target = torch.tensor([0.3, 0.0, 0.2, 0.05, 0.0, 0.15, 0.3])
    return draft, target


def restricted_mixture(draft, target, weight):
    """nu' for a float weight (see the module docstring)."""
    support = target > 0
    residual = (target - draft).clamp_min(0)
    residual = residual / residual.sum()
    draft_part = torch.where(support, draft, 0.0) + draft[~support].sum() * residual
    return weight * target + (1 - weight) * draft_part


def emitted_first_tokens(device, verifier, draft, target, weight, from_logits=False, tokens_only=False, seed=7):
    """NUM_SAMPLES drafts of one position, drawn from q, verified on `device`; the first emitted tokens."""
    vocab = draft.numel()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial(draft, NUM_SAMPLES, replacement=True, generator=generator).unsqueeze(1)
    draft_rows = draft.expand(NUM_SAMPLES, 1, vocab).contiguous()
    target_rows = target.expand(NUM_SAMPLES, 2, vocab).contiguous()
    if from_logits:
        draft_rows, target_rows = draft_rows.log(), target_rows.log()
    result = on_device(device, verifier, tokens, None if tokens_only else draft_rows, target_rows, weight, seed=seed)
    return result.tokens[:, 0]


@pytest.mark.parametrize("verifier", [dx.verify, dx.verify_reference, dx.verify_logits, dx.verify_logits_reference],
                         ids=["native", "reference", "native_logits", "reference_logits"])
@pytest.mark.parametrize("weight", [0.0, 0.5, 0.8])
def test_emitted_token_follows_the_restricted_mixture(verifier, weight, device):
    draft, target = constrained_pair()
    from_logits = verifier in (dx.verify_logits, dx.verify_logits_reference)
    first = emitted_first_tokens(device, verifier, draft, target, weight, from_logits=from_logits)
    assert not torch.isin(first, torch.tensor(FORBIDDEN)).any()
    assert chi_square_tokens_p_value(first, restricted_mixture(draft, target, weight)) > P_VALUE_FLOOR
    # Power: the same samples fail against the mixture that keeps the draft's forbidden mass in place.
    unrestricted = weight * target + (1 - weight) * torch.where(target > 0, draft, 0.0)
    assert chi_square_tokens_p_value(first, unrestricted / unrestricted.sum()) < 1e-10


def test_per_token_weights_follow_each_positions_restricted_mixture(device):
    """Per-token weights [B, K]: rows of weight 0 and rows of weight 0.6 in one call, each row's first token by its
    own weight's nu'."""
    draft, target = constrained_pair()
    vocab = draft.numel()
    generator = torch.Generator().manual_seed(3)
    tokens = torch.multinomial(draft, NUM_SAMPLES, replacement=True, generator=generator).unsqueeze(1)
    weight = torch.where(torch.arange(NUM_SAMPLES) % 2 == 0, 0.0, 0.6).unsqueeze(1)
    result = on_device(device, dx.verify, tokens, draft.expand(NUM_SAMPLES, 1, vocab).contiguous(),
                       target.expand(NUM_SAMPLES, 2, vocab).contiguous(), weight, seed=5)
    for parity, w in ((0, 0.0), (1, 0.6)):
        first = result.tokens[parity::2, 0]
        assert chi_square_tokens_p_value(first, restricted_mixture(draft, target, w)) > P_VALUE_FLOOR


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_tokens_only_drafts_follow_the_restricted_mixture(weight, device):
    """q one-hot at each draft x, the drafts drawn from a proposal r: given x, an allowed x gives w p + (1 - w) at x
    and a forbidden one gives p, so the first token follows w p + (1 - w) (r 1_S + r(not S) p)."""
    proposal, target = constrained_pair()
    first = emitted_first_tokens(device, dx.verify, proposal, target, weight, tokens_only=True)
    support = target > 0
    kept = torch.where(support, proposal, 0.0)
    expected = weight * target + (1 - weight) * (kept + proposal[~support].sum() * target)
    assert chi_square_tokens_p_value(first, expected) > P_VALUE_FLOOR


def test_restricted_mixture_is_the_mixture_where_the_support_covers_the_draft():
    """nu' = nu when q puts no mass where p has none: the rule changes nothing for unconstrained rows."""
    draft, target = constrained_pair()
    draft = torch.where(target > 0, draft, 0.0)
    draft = draft / draft.sum()
    for weight in (0.0, 0.4, 1.0):
        torch.testing.assert_close(restricted_mixture(draft, target, weight), weight * target + (1 - weight) * draft)
    first = emitted_first_tokens("cpu", dx.verify, draft, target, 0.3)
    assert chi_square_tokens_p_value(first, 0.3 * target + 0.7 * draft) > P_VALUE_FLOOR


@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0])
def test_acceptance_on_a_constrained_row(weight, device):
    """The acceptance rate the rule leaves: 1 - w TV(p, q) - (1 - w) q(not S)."""
    draft, target = constrained_pair()
    generator = torch.Generator().manual_seed(11)
    tokens = torch.multinomial(draft, NUM_SAMPLES, replacement=True, generator=generator).unsqueeze(1)
    vocab = draft.numel()
    result = on_device(device, dx.verify, tokens, draft.expand(NUM_SAMPLES, 1, vocab).contiguous(),
                       target.expand(NUM_SAMPLES, 2, vocab).contiguous(), weight, seed=2)
    total_variation = 0.5 * (draft - target).abs().sum().item()
    expected = 1 - weight * total_variation - (1 - weight) * draft[target == 0].sum().item()
    observed = result.num_accepted.double().mean().item()
    assert abs(observed - expected) < 5 * (expected * (1 - expected) / NUM_SAMPLES) ** 0.5 + 1e-6
