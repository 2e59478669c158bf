"""FLy as an option of the verify ops: the native kernels against the references bit for bit on identical uniforms
(probabilities and logits, drafts with and without distributions, greedy and sampled rows, ragged rows, per-request
settings, every weight form, the row-index forms, every dtype), and FLy off giving today's results."""

import pytest
import torch

import diversed_ext as dx
from helpers import fly_logits_case, fly_probs_case
from helpers import DTYPES, on_device


def assert_same(result, expected, exact=True):
    """Tokens and counts equal; accept_prob bit for bit from probabilities, to float rounding from logits (the
    kernels' exp is a polynomial, the reference's torch's own)."""
    assert torch.equal(result.tokens, expected.tokens)
    assert torch.equal(result.num_accepted, expected.num_accepted)
    if exact:
        assert torch.equal(result.accept_prob, expected.accept_prob)
    else:
        assert torch.allclose(result.accept_prob, expected.accept_prob, atol=1e-5)


def weight_of(kind, batch, num_positions, seed=7):
    generator = torch.Generator().manual_seed(seed)
    if kind == "static":
        return 0.7
    if kind == "request":
        return torch.rand(batch, generator=generator)
    return torch.rand(batch, num_positions, generator=generator)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens_only", [False, True])
@pytest.mark.parametrize("weight_kind", ["static", "request", "token"])
def test_probs_match_the_reference(dtype, tokens_only, weight_kind, device):
    tokens, draft, target, kwargs = fly_probs_case(seed=len(weight_kind) + 10, dtype=dtype)
    draft = None if tokens_only else draft
    weight = weight_of(weight_kind, *tokens.shape)
    result = on_device(device, dx.verify, tokens, draft, target, weight, **kwargs)
    assert_same(result, dx.verify_reference(tokens, draft, target, weight, **kwargs))


@pytest.mark.parametrize("logits", [False, True])
def test_the_cases_defer(logits):
    """The random cases above exercise deferral: FLy keeps more drafts than the exact test alone, never fewer."""
    case, op = (fly_logits_case, dx.verify_logits) if logits else (fly_probs_case, dx.verify)
    deferred = 0
    for seed in range(8):
        tokens, draft, target, kwargs = case(seed=seed)
        plain = {k: v for k, v in kwargs.items() if not k.startswith("fly_")}
        with_fly = op(tokens, draft, target, 0.7, **kwargs).num_accepted
        without = op(tokens, draft, target, 0.7, **plain).num_accepted
        assert bool((with_fly >= without).all())
        deferred += int((with_fly > without).sum())
    assert deferred >= 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens_only", [False, True])
@pytest.mark.parametrize("weight_kind", ["static", "request", "token"])
def test_logits_match_the_reference(dtype, tokens_only, weight_kind, device):
    tokens, draft, target, kwargs = fly_logits_case(seed=len(weight_kind) + 3, dtype=dtype)
    draft = None if tokens_only else draft
    weight = weight_of(weight_kind, *tokens.shape)
    result = on_device(device, dx.verify_logits, tokens, draft, target, weight, **kwargs)
    assert_same(result, dx.verify_logits_reference(tokens, draft, target, weight, **kwargs), exact=False)


def test_entropy_comes_from_the_target_temperature(device):
    """With target_temperature, FLy's entropy is the target's as divided by it: the reference says which rows defer."""
    tokens, draft, target, kwargs = fly_logits_case(seed=11)
    kwargs["target_temperature"] = torch.rand(tokens.shape[0], generator=torch.Generator().manual_seed(2)) + 0.5
    result = on_device(device, dx.verify_logits, tokens, draft, target, 0.8, **kwargs)
    assert_same(result, dx.verify_logits_reference(tokens, draft, target, 0.8, **kwargs), exact=False)


@pytest.mark.parametrize("logits", [False, True])
def test_row_index_forms_match_the_reference(logits, device):
    """target_rows / draft_rows read in place, shuffled rows of one flat tensor."""
    case = fly_logits_case if logits else fly_probs_case
    tokens, draft, target, kwargs = case(batch=12, seed=21)
    batch, num_positions = tokens.shape
    generator = torch.Generator().manual_seed(4)
    target_order = torch.randperm(batch * (num_positions + 1), generator=generator)
    draft_order = torch.randperm(batch * num_positions, generator=generator)
    flat_target = torch.empty_like(target.reshape(-1, target.shape[-1]))
    flat_target[target_order] = target.reshape(-1, target.shape[-1])
    flat_draft = torch.empty_like(draft.reshape(-1, draft.shape[-1]))
    flat_draft[draft_order] = draft.reshape(-1, draft.shape[-1])
    rows = dict(target_rows=target_order.reshape(batch, -1), draft_rows=draft_order.reshape(batch, -1))
    op, reference = (dx.verify_logits, dx.verify_logits_reference) if logits else (dx.verify, dx.verify_reference)
    result = on_device(device, op, tokens, flat_draft, flat_target, 0.6, **rows, **kwargs)
    assert_same(result, on_device(device, op, tokens, draft, target, 0.6, **kwargs))  # padded, same kernels
    assert_same(result, reference(tokens, flat_draft, flat_target, 0.6, **rows, **kwargs), exact=not logits)


@pytest.mark.parametrize("top_k", [1, 2, 5, 32])
def test_every_top_k_matches_the_reference(top_k, device):
    tokens, draft, target, kwargs = fly_probs_case(seed=top_k, vocab=40)
    kwargs["fly_top_k"] = top_k
    kwargs["fly_threshold"] = kwargs["fly_threshold"] * (1 + top_k / 4)  # larger k, larger entropies
    result = on_device(device, dx.verify, tokens, draft, target, 0.9, **kwargs)
    assert_same(result, dx.verify_reference(tokens, draft, target, 0.9, **kwargs))


def test_a_top_k_beyond_the_vocabulary_sums_the_whole_row(device):
    tokens, draft, target, kwargs = fly_probs_case(seed=2, vocab=2, num_positions=4)
    kwargs.update(fly_top_k=3, fly_threshold=0.4)
    result = on_device(device, dx.verify, tokens, draft, target, 1.0, **kwargs)
    assert_same(result, dx.verify_reference(tokens, draft, target, 1.0, **kwargs))


@pytest.mark.parametrize("logits", [False, True])
def test_fly_off_gives_todays_results_bit_for_bit(logits, device):
    case = fly_logits_case if logits else fly_probs_case
    tokens, draft, target, kwargs = case(seed=5)
    plain = {k: v for k, v in kwargs.items() if not k.startswith("fly_")}
    op = dx.verify_logits if logits else dx.verify
    today = on_device(device, op, tokens, draft, target, 0.5, **plain)
    for off in (dict(fly_window=0), dict(fly_window=torch.zeros(tokens.shape[0], dtype=torch.int64)),
                dict(fly_window=0, fly_threshold=0.0, fly_top_k=7)):
        assert_same(on_device(device, op, tokens, draft, target, 0.5, **plain, **off), today)


@pytest.mark.parametrize("greedy", [False, True])
def test_every_rejection_deferred_keeps_all_drafts_and_draws_the_bonus(greedy, device):
    """K = 4, W = 1: positions 0 and 2 fail the exact test, 1 and 3 pass it; with tau = 0 both failures are deferred,
    so the row keeps its K drafts and ends with the bonus from p_K."""
    vocab = 6
    target = torch.full((1, 5, vocab), 0.1)
    target[..., 0] = 0.5  # the argmax everywhere
    draft = torch.full((1, 4, vocab), 1.0 / vocab)
    tokens = torch.tensor([[3, 0, 4, 0]])
    uniforms = torch.tensor([[0.999, 0.0, 0.999, 0.0, 0.3]], dtype=torch.float64)  # p/q = 0.6 < 0.999 rejects
    kwargs = dict(uniforms=uniforms, greedy=torch.tensor([greedy]), fly_window=1, fly_threshold=0.0)
    plain = on_device(device, dx.verify, tokens, draft, target, 1.0, uniforms=uniforms, greedy=torch.tensor([greedy]))
    assert int(plain.num_accepted[0]) == 0
    result = on_device(device, dx.verify, tokens, draft, target, 1.0, **kwargs)
    assert int(result.num_accepted[0]) == 4
    assert torch.equal(result.tokens[0, :4], tokens[0])
    assert_same(result, dx.verify_reference(tokens, draft, target, 1.0, **kwargs))
    if greedy:
        assert int(result.tokens[0, 4]) == 0
    # The window must pass: position 3 failing too leaves the deferral of 2 undone, and the row ends there.
    failing = uniforms.clone()
    failing[0, 3] = 0.999
    tokens[0, 3] = 5
    result = on_device(device, dx.verify, tokens, draft, target, 1.0, **{**kwargs, "uniforms": failing})
    assert int(result.num_accepted[0]) == 2


def test_a_draft_without_target_mass_is_never_deferred(device):
    vocab = 5
    target = torch.full((2, 3, vocab), 0.25)
    target[:, :, 4] = 0.0
    draft = torch.full((2, 2, vocab), 0.2)
    tokens = torch.tensor([[4, 1], [4, 1]])  # p(4) = 0: the exact test rejects, and FLy may not defer it
    kwargs = dict(uniforms=torch.zeros(2, 3, dtype=torch.float64), greedy=torch.tensor([False, True]), fly_window=1,
                  fly_threshold=0.0)
    result = on_device(device, dx.verify, tokens, draft, target, 1.0, **kwargs)
    assert result.num_accepted.tolist() == [0, 0]
    assert_same(result, dx.verify_reference(tokens, draft, target, 1.0, **kwargs))


def test_one_draft_position_has_no_window(device):
    """K = 1: no window fits (W < K), so FLy changes nothing; an unchecked larger window is clamped to 0."""
    tokens, draft, target, kwargs = fly_probs_case(num_positions=1, seed=8)
    plain = {k: v for k, v in kwargs.items() if not k.startswith("fly_")}
    today = on_device(device, dx.verify, tokens, draft, target, 0.5, **plain)
    assert_same(on_device(device, dx.verify, tokens, draft, target, 0.5, **plain, fly_window=0), today)
    clamped = on_device(device, dx.verify, tokens, draft, target, 0.5, check_inputs=False, **plain, fly_window=5,
                        fly_threshold=0.0)
    assert_same(clamped, today)
