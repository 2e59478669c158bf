"""Tokens the target forbids (a server's hard constraints: bad words, allowed token ids, a -inf or -100 logit bias,
min_tokens) are kept out whatever the weight: such a draft verifies with w = 1 (never accepted, accept_prob 0, its
correction drawn from the residual), greedy rows take the argmax of nu over the target's support, FLy never defers such
a draft, and no emitted token is one the target forbids. Native kernels against the reference on identical uniforms,
on every path. Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is visible)."""

import pytest
import torch

import diversed_ext as dx
from diversed_ext.ops import MIN_TARGET_MASS
from helpers import (DTYPES, FORBIDDEN_FORMS, assert_keeps_constraints, assert_same, assert_verify_close,
                     forbidden_case, on_device)

WEIGHTS = ["0", "0.5", "1", "per_token"]


def weight_of(name, batch, num_positions, seed):
    """A weight form: a float, or per-token weights [B, K] with a quarter set to 0 (as a gate that keeps drafts
    outright sets them)."""
    if name != "per_token":
        return float(name)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.rand(batch, num_positions, generator=generator)
    return torch.where(torch.rand(batch, num_positions, generator=generator) < 0.25, 0.0, weight)


def verify_case(device, form, tokens, draft, target, weight, kwargs, **extra):
    """The native call on `device` and the reference on the CPU, compared: bit for bit from probabilities, token for
    token from logits. Returns the native result (on the CPU)."""
    logits = form.startswith("logits")
    native_op, reference_op = (dx.verify_logits, dx.verify_logits_reference) if logits else (dx.verify,
                                                                                              dx.verify_reference)
    native = on_device(device, native_op, tokens, draft, target, weight, **kwargs, **extra)
    reference = reference_op(tokens, draft, target, weight, **kwargs, **extra)
    (assert_verify_close if logits else assert_same)(native, reference)
    return native


@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("form", FORBIDDEN_FORMS)
def test_forbidden_drafts_match_the_reference_and_keep_the_constraints(form, weight, device):
    """Mixed greedy and sampled rows, ragged num_draft, every weight form: the reference's tokens, and nothing
    forbidden emitted. At w = 0 without the rule about half the rows would emit a forbidden draft."""
    tokens, draft, target, forbidden, kwargs = forbidden_case(48, 4, 29, form, seed=WEIGHTS.index(weight))
    w = weight_of(weight, 48, 4, seed=1)
    native = verify_case(device, form, tokens, draft, target, w, kwargs)
    assert_keeps_constraints(native, tokens, forbidden)
    drafted = torch.arange(4).unsqueeze(0) < kwargs["num_draft"].unsqueeze(1)
    hits = forbidden[:, :4].gather(2, tokens.unsqueeze(-1)).squeeze(-1) & drafted
    assert hits.sum() > 20  # the case does draft forbidden tokens


@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("form", FORBIDDEN_FORMS)
def test_an_id_outside_the_vocabulary_verifies_as_a_forbidden_draft(form, weight, device):
    """What vLLM hands over when it schedules asynchronously: a draft its grammar rejects, replaced by -1 after the
    draft was sampled. Without checks such an id (here -1, V, 2^40 and -2^40 in turn) verifies as the forbidden token
    itself: the same tokens, accepted counts and accept_prob on identical uniforms, natively and in the reference. (At
    w = 0 with a draft distribution, keeping the row's own w would draw the correction from p, not the residual.)"""
    batch, num_positions, vocab = 48, 4, 29
    tokens, draft, target, forbidden, kwargs = forbidden_case(batch, num_positions, vocab, form,
                                                              seed=11 + WEIGHTS.index(weight))
    w = weight_of(weight, batch, num_positions, seed=3)
    hits = forbidden[:, :num_positions].gather(2, tokens.unsqueeze(-1)).squeeze(-1)
    marks = torch.tensor([-1, vocab, 2**40, -(2**40)])[torch.arange(batch * num_positions) % 4]
    marked = torch.where(hits, marks.reshape(batch, num_positions), tokens)
    as_token = verify_case(device, form, tokens, draft, target, w, kwargs, check_inputs=False)
    as_mark = verify_case(device, form, marked, draft, target, w, kwargs, check_inputs=False)
    assert_same(as_mark, as_token)
    drafted = torch.arange(num_positions).unsqueeze(0) < kwargs["num_draft"].unsqueeze(1)
    assert (hits & drafted).sum() > 20


@pytest.mark.parametrize("form", FORBIDDEN_FORMS)
def test_forbidden_drafts_given_as_tokens_only(form, device):
    """Tokens-only drafts (q one-hot at x): a forbidden x is rejected even at w = 0, where any allowed x is kept, and
    the correction comes from p (the residual of a one-hot q at a token p forbids)."""
    tokens, _, target, forbidden, kwargs = forbidden_case(48, 4, 29, form, seed=5)
    for weight in (0.0, 0.6, weight_of("per_token", 48, 4, seed=2)):
        native = verify_case(device, form, tokens, None, target, weight, kwargs)
        assert_keeps_constraints(native, tokens, forbidden)
        if isinstance(weight, float) and weight == 0.0:  # each allowed draft is kept, a forbidden one ends the row
            drafted = torch.arange(4).unsqueeze(0) < kwargs["num_draft"].unsqueeze(1)
            hits = forbidden[:, :4].gather(2, tokens.unsqueeze(-1)).squeeze(-1) & drafted
            expected = torch.where(hits.any(1), hits.long().argmax(1), kwargs["num_draft"])
            assert torch.equal(native.num_accepted.long(), expected)


@pytest.mark.parametrize("form", FORBIDDEN_FORMS)
def test_forbidden_drafts_read_in_place(form, device):
    """Rows read through target_rows / draft_rows give what their padded tensors give, constraints kept."""
    batch, num_positions, vocab = 24, 3, 31
    tokens, draft, target, forbidden, kwargs = forbidden_case(batch, num_positions, vocab, form, seed=9)
    generator = torch.Generator().manual_seed(4)
    target_order = torch.randperm(batch * (num_positions + 1), generator=generator)
    draft_order = torch.randperm(batch * num_positions, generator=generator)
    target_flat = target.reshape(-1, vocab)[target_order].contiguous()
    draft_flat = draft.reshape(-1, vocab)[draft_order].contiguous()
    rows = dict(target_rows=target_order.argsort().reshape(batch, num_positions + 1),
                draft_rows=draft_order.argsort().reshape(batch, num_positions))
    for weight in (0.0, weight_of("per_token", batch, num_positions, seed=3)):
        in_place = verify_case(device, form, tokens, draft_flat, target_flat, weight, kwargs, **rows)
        padded = verify_case(device, form, tokens, draft, target, weight, kwargs)
        assert_same(in_place, padded)
        assert_keeps_constraints(in_place, tokens, forbidden)


def fly_forbidden_case(forbid):
    """K = 3, one request per row kind: the target agrees with every draft but position 0's, where x_0 is rejected
    (u_0 = 0.9999 > nu / q) with positions 1 and 2 passing, so a window of 2 with threshold 0 defers it when the
    target allows x_0 (p_0(x_0) = 1e-3) and must not when it forbids it (p_0(x_0) = 0)."""
    vocab = 6
    draft = torch.full((2, 3, vocab), 0.04)
    draft[:, :, 2] = 0.8  # the drafted token everywhere
    target = torch.full((2, 4, vocab), 0.2)
    target[:, :, 2] = 0.0
    target[:, 1:3, 2] = 0.8  # positions 1 and 2 keep their draft (nu >= q)
    target[:, 1:3, :2] = 0.1
    target[:, 1:3, 3:] = 0.0
    target[:, 0, 2] = 0.0 if forbid else 1e-3
    target[:, 0, 3] -= 0.0 if forbid else 1e-3
    tokens = torch.full((2, 3), 2)
    kwargs = dict(uniforms=torch.tensor([[0.9999, 0.5, 0.5, 0.3]] * 2, dtype=torch.float64),
                  greedy=torch.tensor([False, True]), fly_window=2, fly_threshold=0.0)
    return tokens, draft, target, kwargs


def test_fly_never_defers_a_forbidden_draft(device):
    for forbid in (False, True):
        tokens, draft, target, kwargs = fly_forbidden_case(forbid)
        native = on_device(device, dx.verify, tokens, draft, target, 1.0, **kwargs)
        assert_same(native, dx.verify_reference(tokens, draft, target, 1.0, **kwargs))
        if forbid:
            assert native.num_accepted.tolist() == [0, 0]
            assert torch.all(native.tokens[:, 0] != 2)
        else:  # the control: the same rejection of an allowed draft is deferred, so the test above has power
            assert native.num_accepted.tolist() == [3, 3]


@pytest.mark.parametrize("form", FORBIDDEN_FORMS)
def test_fly_with_forbidden_drafts_matches_the_reference(form, device):
    """Random FLy settings over constrained rows (threshold 0, so every window that passes defers): the reference's
    walk, and no forbidden draft kept."""
    tokens, draft, target, forbidden, kwargs = forbidden_case(64, 5, 23, form, seed=12)
    generator = torch.Generator().manual_seed(7)
    fly = dict(fly_window=torch.randint(0, 4, (64,), generator=generator), fly_threshold=0.0)
    for weight in (0.0, 1.0, weight_of("per_token", 64, 5, seed=8)):
        native = verify_case(device, form, tokens, draft, target, weight, kwargs, **fly)
        assert_keeps_constraints(native, tokens, forbidden)


def test_greedy_takes_the_argmax_over_the_support(device):
    """w = 0: nu = q, whose argmax (token 1) the target forbids; the greedy row emits the argmax of q over the
    support, token 3, and rejects a drafted 1 (accept_prob 0) while keeping a drafted 3."""
    draft = torch.tensor([[[0.1, 0.5, 0.05, 0.3, 0.05]]]).repeat(2, 1, 1)
    target = torch.tensor([[[0.4, 0.0, 0.4, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]]).repeat(2, 1, 1)
    tokens = torch.tensor([[1], [3]])
    for verifier in (dx.verify, dx.verify_logits):
        values = (draft, target) if verifier is dx.verify else (draft.log(), target.log())
        mode = dict(greedy=True) if verifier is dx.verify else dict(temperature=0.0)
        result = on_device(device, verifier, tokens, *values, 0.0, **mode)
        assert result.tokens.tolist() == [[3, -1], [3, 4]]
        assert result.accept_prob.tolist() == [[0.0], [1.0]]


def test_the_threshold_of_the_support():
    """A target probability below MIN_TARGET_MASS (2^-64) counts as zero, one above it does not; at w = 0 the
    drafted token shows which (rejected, or kept with probability 1)."""
    assert MIN_TARGET_MASS == 2.0 ** -64
    for p, kept in ((0.0, False), (1e-40, False), (1e-30, False), (0.5 * MIN_TARGET_MASS, False),
                    (2.0 * MIN_TARGET_MASS, True), (1e-12, True)):
        target = torch.tensor([[[p, 1.0 - p, 0.0], [0.5, 0.5, 0.0]]])
        draft = torch.tensor([[[0.9, 0.05, 0.05]]])
        for verifier in (dx.verify, dx.verify_reference):
            result = verifier(torch.tensor([[0]]), draft, target, 0.0, seed=1)
            assert result.num_accepted.item() == int(kept), (p, verifier)
            assert result.accept_prob.item() == float(kept)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORBIDDEN_FORMS)
def test_forbidden_drafts_in_every_dtype(form, dtype, device):
    tokens, draft, target, forbidden, kwargs = forbidden_case(32, 3, 37, form, seed=21, dtype=dtype)
    native = verify_case(device, form, tokens, draft, target, 0.0, kwargs)
    assert_keeps_constraints(native, tokens, forbidden)


@pytest.mark.parametrize("vocab", [1, 2, 7, 4099])
def test_all_tokens_but_one_forbidden(vocab, device):
    """Each target row allows one token: every emitted token at a drafted position is that row's token, at any weight,
    greedy or sampled, from probabilities and from logits (V = 1: the one token is always allowed and kept)."""
    batch, num_positions = 12, 3
    generator = torch.Generator().manual_seed(vocab)
    allowed = torch.randint(0, vocab, (batch, num_positions + 1), generator=generator)
    target = torch.nn.functional.one_hot(allowed, vocab).float()
    draft = torch.rand(batch, num_positions, vocab, generator=generator).softmax(-1)
    tokens = torch.randint(0, vocab, (batch, num_positions), generator=generator)
    greedy = torch.arange(batch) % 2 == 0
    for weight in (0.0, 0.5, 1.0):
        for verifier, values, mode in ((dx.verify, (draft, target), dict(greedy=greedy)),
                                       (dx.verify_logits, (draft.log(), target.log()),
                                        dict(temperature=torch.where(greedy, 0.0, 1.0)))):
            result = on_device(device, verifier, tokens, *values, weight, seed=3, **mode)
            emitted = torch.arange(num_positions + 1).unsqueeze(0) <= result.num_accepted.long().unsqueeze(1)
            assert torch.equal(result.tokens[emitted], allowed[emitted])
            kept = (tokens == allowed[:, :num_positions]).long().cumprod(1).sum(1)
            assert torch.equal(result.num_accepted.long(), kept)


def test_chunked_vocabulary_layout_keeps_the_constraints():
    """One request over a long vocabulary takes the CPU's chunked layout (and the split CUDA kernels' cut)."""
    for form in ("probs_zero", "logits_bias"):
        tokens, draft, target, forbidden, kwargs = forbidden_case(1, 3, 70_001, form, seed=2)
        for weight in (0.0, 0.5):
            native = verify_case("cpu", form, tokens, draft, target, weight, kwargs)
            assert_keeps_constraints(native, tokens, forbidden)
