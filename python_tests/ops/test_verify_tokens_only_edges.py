"""Edges of drafts without distributions (``draft_probs`` / ``draft_logits`` = None): targets one-hot at the draft or
without mass on either side of it, K = 0, V = 1, B = 0, all or none accepted, ids outside [0, V) with and without
checks, and the errors a caller's mistakes raise. Each case runs through both ops against their references, outputs
poisoned (conftest.py); tests that take `device` also run on CUDA (skipped where no GPU is visible).
"""

import pytest
import torch

import diversed_ext as dx
from helpers import assert_same, assert_verify_close, on_device, random_problem, tokens_only_case


def verify_both_ways(device, tokens, target_probs, weight, greedy=False, **kwargs):
    """Tokens-only verify on `target_probs` and verify_logits on their logarithms (the same law at temperature 1;
    greedy rows as temperature 0), each on `device` and checked against its reference; returns both native results."""
    logits = target_probs.log()
    probs_result = on_device(device, dx.verify, tokens, None, target_probs, weight, greedy=greedy, **kwargs)
    assert_same(probs_result, dx.verify_reference(tokens, None, target_probs, weight, greedy=greedy, **kwargs))
    kwargs["temperature"] = 0.0 if greedy is True else 1.0
    logits_result = on_device(device, dx.verify_logits, tokens, None, logits, weight, **kwargs)
    assert_verify_close(logits_result, dx.verify_logits_reference(tokens, None, logits, weight, **kwargs))
    return probs_result, logits_result


def random_targets(batch, num_positions, vocab, seed):
    return random_problem(batch, num_positions, vocab, seed=seed)[2]


@pytest.mark.parametrize("weight", [0.0, 0.1, 1 / 3, 0.7, 1.0])
def test_target_one_hot_at_the_draft_keeps_every_draft(weight, device):
    """p_i one-hot at x_i: nu_i(x_i) = w + (1 - w) rounds to exactly 1 in float32 for every w in [0, 1], so every
    draft is kept with accept_prob 1, and the bonus follows p_K."""
    batch, num_positions, vocab = 64, 3, 11
    generator = torch.Generator().manual_seed(int(weight * 100))
    tokens = torch.randint(0, vocab, (batch, num_positions), generator=generator)
    bonus = torch.randint(0, vocab, (batch, 1), generator=generator)
    target = torch.nn.functional.one_hot(torch.cat([tokens, bonus], 1), vocab).float()
    for result in verify_both_ways(device, tokens, target, weight, seed=3):
        assert torch.all(result.num_accepted == num_positions)
        assert torch.all(result.accept_prob == 1.0)
        assert torch.equal(result.tokens, torch.cat([tokens, bonus], 1))


def test_target_without_mass_off_the_draft_emits_the_draft(device):
    """p_0 zero off x_0 but p_0(x_0) = 0.5 (probabilities need not sum to 1): with w = 1 a uniform above 0.5 rejects
    x_0, the residual has no mass, and the fallback samples p_0 itself, which is x_0 again."""
    batch, vocab = 6, 9
    tokens = torch.tensor([[4, 1], [0, 2], [8, 8], [3, 3], [4, 0], [7, 5]])
    target = random_targets(batch, 2, vocab, seed=1)
    target[:, 0] = 0.5 * torch.nn.functional.one_hot(tokens[:, 0], vocab)
    uniforms = torch.tensor([0.75, 0.5, 0.999, 0.2, 0.0, 0.6], dtype=torch.float64).unsqueeze(1).repeat(1, 3)
    result = on_device(device, dx.verify, tokens, None, target, 1.0, uniforms=uniforms)
    assert_same(result, dx.verify_reference(tokens, None, target, 1.0, uniforms=uniforms))
    assert result.num_accepted[[0, 1, 2, 5]].tolist() == [0, 0, 0, 0]  # u >= nu = 0.5
    assert torch.all(result.tokens[:, 0] == tokens[:, 0])
    assert torch.all(result.accept_prob[:, 0] == 0.5)
    for weight in (1.0, 0.4):  # the same over Philox draws, from probabilities and from logits
        for outcome in verify_both_ways(device, tokens, target, weight, seed=9):
            assert torch.all(outcome.tokens[:, 0] == tokens[:, 0])


@pytest.mark.parametrize("weight", [1.0, 0.6, 0.0])
def test_target_without_mass_at_the_draft(weight, device):
    """p_0(x_0) = 0: the target forbids x_0, so whatever w every x_0 is rejected (accept_prob 0), and the correction,
    drawn from p_0 without x_0, is never x_0."""
    batch, vocab = 512, 13
    tokens, _, _ = random_problem(batch, 2, vocab, seed=4)
    target = random_targets(batch, 2, vocab, seed=5)
    target[torch.arange(batch), 0, tokens[:, 0]] = 0.0
    for result in verify_both_ways(device, tokens, target, weight, seed=6):
        assert torch.all(result.num_accepted == 0)
        assert torch.all(result.tokens[:, 0] != tokens[:, 0])
        assert torch.all(result.accept_prob[:, 0] == 0)
        assert torch.all(result.tokens[:, 1:] == -1)


def test_k_zero_emits_only_the_bonus(device):
    tokens = torch.zeros(5, 0, dtype=torch.int64)
    target = torch.nn.functional.one_hot(torch.tensor([[3], [0], [6], [6], [1]]), 7).float()
    for result in verify_both_ways(device, tokens, target, 0.5, seed=2):
        assert result.tokens.tolist() == [[3], [0], [6], [6], [1]]
        assert torch.all(result.num_accepted == 0) and result.accept_prob.shape == (5, 0)


def test_vocabulary_of_one(device):
    """V = 1: p = [1] everywhere, so every draft is kept and the bonus is 0; an id of 1 (unchecked) is rejected and
    its correction, drawn from p, is 0."""
    tokens = torch.zeros(4, 3, dtype=torch.int64)
    target = torch.ones(4, 4, 1)
    for result in verify_both_ways(device, tokens, target, torch.tensor([0.0, 0.3, 0.9, 1.0]), seed=1):
        assert torch.all(result.tokens == 0) and torch.all(result.num_accepted == 3)
    tokens[:, 1] = 1
    for result in verify_both_ways(device, tokens, target, 0.5, seed=1, check_inputs=False):
        assert result.tokens.tolist() == [[0, 0, -1, -1]] * 4 and result.accept_prob[:, 1].tolist() == [0.0] * 4


def test_empty_batch(device):
    tokens = torch.zeros(0, 3, dtype=torch.int64, device=device)
    target = torch.rand(0, 4, 10, device=device)
    for verifier in (dx.verify, dx.verify_logits):
        for check_inputs in (True, False):
            result = verifier(tokens, None, target, 0.5, seed=1, check_inputs=check_inputs)
            assert result.tokens.shape == (0, 4) and result.num_accepted.shape == (0,)
            assert result.accept_prob.shape == (0, 3) and result.tokens.device.type == torch.device(device).type


def test_zero_weight_keeps_every_draft(device):
    tokens, target, _, kwargs = tokens_only_case(16, 4, 50, seed=8)
    num_draft = kwargs["num_draft"]
    for result in verify_both_ways(device, tokens, target, 0.0, num_draft=num_draft, seed=3):
        assert torch.equal(result.num_accepted.long(), num_draft)
        drafted = torch.arange(4) < num_draft.unsqueeze(1)
        assert torch.equal(result.tokens[:, :4][drafted], tokens[drafted])
        assert torch.equal(result.accept_prob, drafted.float())


def test_none_accepted(device):
    """w = 1 and drafts where the target puts no mass: every row stops at position 0 with the target's only token."""
    target = torch.zeros(4, 4, 10)
    target[..., 2] = 1.0
    tokens = torch.tensor([[5, 2, 2], [0, 2, 2], [9, 2, 2], [3, 2, 2]])
    for result in verify_both_ways(device, tokens, target, 1.0, seed=2):
        assert torch.all(result.num_accepted == 0) and torch.all(result.accept_prob[:, 0] == 0)
        assert torch.all(result.tokens[:, 0] == 2) and torch.all(result.tokens[:, 1:] == -1)


def test_out_of_range_ids_without_checks_are_rejected(device):
    """Unchecked ids outside [0, V) have no mass: rejected even with w = 0 (accept_prob 0), the correction drawn from
    all of p (here one-hot at 3; a greedy row takes argmax nu = argmax w p), and ids past num_draft are ignored."""
    batch, vocab = 5, 9
    tokens, target, _, _ = tokens_only_case(batch, 2, vocab, seed=9)
    tokens[:, 0] = torch.tensor([-1, vocab, 1000, -(2**40), 2**40])
    target[:, 0] = torch.nn.functional.one_hot(torch.tensor(3), vocab)
    for greedy, weight in ((False, 0.0), (False, 0.5), (True, 0.5)):
        for result in verify_both_ways(device, tokens, target, weight, greedy=greedy, seed=1, check_inputs=False):
            assert torch.all(result.num_accepted == 0) and torch.all(result.accept_prob[:, 0] == 0)
            assert torch.all(result.tokens[:, 0] == 3)
    tokens, target, _, _ = tokens_only_case(batch, 2, vocab, seed=10)
    tokens[:, 1] = -7
    for result in verify_both_ways(device, tokens, target, 0.0, num_draft=torch.ones(batch, dtype=torch.int64),
                                   seed=1):
        assert torch.all(result.num_accepted == 1) and torch.all(result.accept_prob[:, 1] == 0)


def test_out_of_range_ids_with_checks_name_draft_tokens():
    tokens, target, _, _ = tokens_only_case(3, 3, 10, seed=11)
    for bad in (-3, 10):
        wrong = tokens.clone()
        wrong[1, 1] = bad
        for verifier, reference, rows in ((dx.verify, dx.verify_reference, target),
                                          (dx.verify_logits, dx.verify_logits_reference, target.log())):
            for call in (verifier, reference):
                with pytest.raises(ValueError, match=rf"draft_tokens.*{bad}"):
                    call(wrong, None, rows, 0.5, seed=0)


def test_structural_mistakes_raise():
    """draft_tokens must be [B, K] with K from the target, which needs K + 1 >= 1 positions; checked or not."""
    target = torch.rand(2, 4, 10)
    for verifier, name in ((dx.verify, "target_probs"), (dx.verify_logits, "target_logits")):
        for check_inputs in (True, False):
            for tokens in (torch.zeros(2, 4), torch.zeros(2), torch.zeros(3, 3), torch.zeros(2, 3, 1),
                           torch.zeros(2, 2)):
                with pytest.raises(ValueError, match="draft_tokens"):
                    verifier(tokens.long(), None, target, 0.5, check_inputs=check_inputs)
            with pytest.raises(ValueError, match=rf"{name}.*K\+1 >= 1"):
                verifier(torch.zeros(2, 0, dtype=torch.int64), None, target[:, :0], 0.5, check_inputs=check_inputs)
            with pytest.raises(TypeError, match="draft_tokens"):
                verifier(torch.zeros(2, 3), None, target, 0.5, check_inputs=check_inputs)


@pytest.mark.parametrize("bad", ["NaN", "+inf", "all -inf"])
def test_bad_target_logits_with_checks_name_target_logits(bad, device):
    """A NaN, +inf or all -inf row the verifier reads raises (on the CPU from the kernel's own flags)."""
    tokens, target, _, _ = tokens_only_case(3, 3, 20, seed=12)
    logits = target.log()
    num_draft = torch.tensor([3, 1, 2])
    row = logits[1, 1]  # row 1's bonus row
    if bad == "all -inf":
        row.fill_(float("-inf"))
    else:
        row[7] = float("nan") if bad == "NaN" else float("inf")
    with pytest.raises(ValueError, match=rf"target_logits.*{'-inf' if bad == 'all -inf' else bad.lstrip('+')}"):
        on_device(device, dx.verify_logits, tokens, None, logits, 0.5, num_draft=num_draft, seed=0)


# ---------------------------------------------------------------------------------------------- batch invariance
