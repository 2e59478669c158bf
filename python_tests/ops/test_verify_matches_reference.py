"""The fused CPU kernel equals the pure-PyTorch reference on identical uniforms, edges included.

Tests that take `device` also run the kernel on CUDA (skipped where no GPU is visible) against the same CPU reference;
random batches on CUDA are compared with the CPU kernel in test_cuda_vs_cpu.py instead."""

import pytest
import torch

import diversed_ext as dx
from helpers import DTYPES, assert_same, on_device, random_problem


def both(*args, device="cpu", **kwargs):
    """The native kernel on `device` (its result brought back to the CPU) and the reference on the CPU."""
    return on_device(device, dx.verify, *args, **kwargs), dx.verify_reference(*args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 7, 33, 257, 8195, 20011])
@pytest.mark.parametrize("num_positions", [0, 1, 4])
def test_random_batches(dtype, vocab, num_positions):
    batch = 6
    tokens, draft, target = random_problem(batch, num_positions, vocab, seed=vocab + num_positions, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    uniforms = torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64)
    weight = torch.rand(batch, num_positions, generator=generator)
    num_draft = torch.randint(0, num_positions + 1, (batch,), generator=generator)
    greedy = torch.tensor([False, True, False, False, True, False])
    assert_same(*both(tokens, draft, target, weight, num_draft=num_draft, greedy=greedy, uniforms=uniforms))


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_scalar_and_per_row_weights(weight):
    tokens, draft, target = random_problem(8, 4, 100, seed=3)
    uniforms = torch.rand(8, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert_same(*both(tokens, draft, target, weight, uniforms=uniforms))
    per_row = torch.linspace(0, 1, 8)
    assert_same(*both(tokens, draft, target, per_row, uniforms=uniforms))


def test_seeded_draws_match_reference():
    tokens, draft, target = random_problem(16, 4, 300, seed=4)
    for seed in (0, 7, 2**40 + 3, -5):
        assert_same(*both(tokens, draft, target, 0.5, seed=seed, offset=11))
    seeds = torch.arange(16, dtype=torch.int64) * 1000003
    assert_same(*both(tokens, draft, target, 0.5, seed=seeds, offset=2))


def test_all_accepted_with_zero_weight(device):
    tokens, draft, target = random_problem(32, 6, 50, seed=5)
    native, reference = both(tokens, draft, target, 0.0, seed=1, device=device)
    assert_same(native, reference)
    assert torch.all(native.num_accepted == 6)
    assert torch.equal(native.tokens[:, :6], tokens)
    assert torch.all(native.accept_prob == 1.0)


def test_none_accepted(device):
    # Drafts where the target puts no mass and w = 1: every first draft is rejected.
    vocab = 10
    draft = torch.full((4, 3, vocab), 1.0 / vocab)
    target = torch.zeros(4, 4, vocab)
    target[..., 0] = 1.0
    tokens = torch.full((4, 3), 5)
    native, reference = both(tokens, draft, target, 1.0, seed=2, device=device)
    assert_same(native, reference)
    assert torch.all(native.num_accepted == 0)
    assert torch.all(native.tokens[:, 0] == 0)  # the residual max(0, p - q) only has token 0
    assert torch.all(native.tokens[:, 1:] == -1)


def test_zero_residual_falls_back_to_target(device):
    # p == q: every draft is accepted unless its q is 0; force rejection with an off-support token.
    vocab = 6
    probs = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    draft = probs.expand(3, 2, vocab).clone()
    target = probs.expand(3, 3, vocab).clone()
    tokens = torch.tensor([[0, 1], [3, 3], [1, 2]])  # q(0) = 0: cannot pass u * 0 < 0
    uniforms = torch.tensor([[0.1, 0.1, 0.3], [0.2, 0.2, 0.9], [0.5, 0.5, 0.6]], dtype=torch.float64)
    native, reference = both(tokens, draft, target, 0.7, uniforms=uniforms, device=device)
    assert_same(native, reference)
    assert native.num_accepted.tolist() == [0, 0, 2]
    assert native.tokens[0, 0].item() == 1 and native.tokens[1, 0].item() == 2  # sampled from p by u_K
    assert native.tokens[2].tolist() == [1, 2, 2]  # both drafts kept, then the bonus from p with u = 0.6


@pytest.mark.parametrize("vocab", [8, 1001])
def test_greedy_ties_break_to_lowest_id(vocab, device):
    flat = torch.full((2, 2, vocab), 1.0 / vocab)
    target = torch.full((2, 3, vocab), 1.0 / vocab)
    greedy = torch.tensor([True, True])
    tokens = torch.tensor([[0, 0], [3, 0]])
    native, reference = both(tokens, flat, target, 0.5, greedy=greedy, device=device)
    assert_same(native, reference)
    assert native.tokens.tolist() == [[0, 0, 0], [0, -1, -1]]  # every id tied
    target[:, :, vocab - 3:] = 2.0 / vocab  # three tied maxima: the lowest wins
    tokens = torch.tensor([[vocab - 3, vocab - 3], [vocab - 2, 0]])
    native, reference = both(tokens, flat, target, 0.5, greedy=greedy, device=device)
    assert_same(native, reference)
    assert native.tokens.tolist() == [[vocab - 3, vocab - 3, vocab - 3], [vocab - 3, -1, -1]]


TIED_AT = (7, 40_000)  # with V - 5: maxima in different vocabulary chunks of both CPU layouts and the split kernels


@pytest.mark.parametrize("vocab", [70_001, 200_003])
@pytest.mark.parametrize("batch", [1, 3])  # one request goes by vocabulary chunks on the CPU, three by rows
def test_greedy_ties_across_vocabulary_chunks_break_to_lowest_id(batch, vocab, device):
    """Tied maxima far apart: each chunk finds its own, and the merge of the chunks' argmaxes keeps the lowest id,
    from probabilities, from logits at temperature 0 and for drafts given as tokens only."""
    num_positions = 2
    target = torch.full((batch, num_positions + 1, vocab), 0.5 / vocab)
    target[..., [*TIED_AT, vocab - 5]] = 0.1
    draft = torch.full((batch, num_positions, vocab), 1.0 / vocab)
    tokens = torch.full((batch, num_positions), vocab - 5)  # a tied maximum, but not the lowest: rejected
    greedy = torch.ones(batch, dtype=torch.bool)
    expected = [[TIED_AT[0]] + [-1] * num_positions] * batch
    native, reference = both(tokens, draft, target, 1.0, greedy=greedy, device=device)
    assert_same(native, reference)
    assert native.tokens.tolist() == expected
    from_logits = on_device(device, dx.verify_logits, tokens, draft.log(), target.log(), 1.0, temperature=0.0)
    assert from_logits.tokens.tolist() == expected
    tokens_only = on_device(device, dx.verify, tokens, None, target, 1.0, greedy=greedy)
    assert tokens_only.tokens.tolist() == expected


def test_tiny_and_huge_probabilities():
    vocab = 1000
    generator = torch.Generator().manual_seed(9)
    draft = torch.rand(4, 3, vocab, generator=generator) * 1e-30
    target = torch.rand(4, 4, vocab, generator=generator) * 1e30
    draft[..., 17] = 1e-38
    tokens = torch.randint(0, vocab, (4, 3), generator=generator)
    uniforms = torch.rand(4, 4, generator=generator, dtype=torch.float64)
    native, reference = both(tokens, draft, target, 0.25, uniforms=uniforms)
    assert_same(native, reference)


def test_empty_batch(device):
    _, draft, target = random_problem(0, 3, 10)
    draft, target, tokens = draft.to(device), target.to(device), torch.zeros(0, 3, dtype=torch.int64, device=device)
    result = dx.verify(tokens, draft, target, 0.5)
    assert result.tokens.shape == (0, 4) and result.num_accepted.shape == (0,)
    assert result.tokens.device.type == torch.device(device).type
    assert dx.verify_logits(tokens, draft, target, 0.5).accept_prob.shape == (0, 3)
    assert dx.mix(draft, target, 0.5).shape == (0, 3, 10)
    assert dx.token_stats(draft, target[:, :3], tokens).total_variation.shape == (0, 3)


def test_k_zero(device):
    tokens, draft, target = random_problem(5, 0, 10, seed=2)
    native, reference = both(tokens, draft, target, 0.5, seed=3, device=device)
    assert_same(native, reference)
    assert native.tokens.shape == (5, 1) and torch.all(native.num_accepted == 0)


def test_int32_tokens_and_padding_past_num_draft():
    tokens, draft, target = random_problem(4, 4, 64, seed=11)
    padded = tokens.clone()
    padded[:, 2:] = -1  # ignored: past num_draft
    num_draft = torch.tensor([2, 1, 0, 2])
    native, reference = both(padded.int(), draft, target, 0.6, num_draft=num_draft, seed=5)
    assert_same(native, reference)
    assert torch.all(native.num_accepted <= num_draft)
    assert torch.all(native.accept_prob[:, 2:] == 0)


def test_bonus_row_follows_num_draft(device):
    # All drafts accepted (w = 0, each in its target's support): the bonus of row b must come from target row
    # num_draft[b].
    vocab = 5
    draft = torch.full((3, 3, vocab), 0.2)
    target = torch.zeros(3, 4, vocab)
    for position in range(4):
        target[:, position, position] = 1.0
    tokens = torch.arange(3).repeat(3, 1)
    native = on_device(device, dx.verify, tokens, draft, target, 0.0, num_draft=torch.tensor([0, 2, 3]), seed=0)
    assert native.tokens.tolist() == [[0, -1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3]]
