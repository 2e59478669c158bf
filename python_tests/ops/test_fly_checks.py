"""FLy's argument rules (errors naming the argument), the unchecked path (no host sync, memory-safe clamping) and
opcheck of the op schemas with FLy's arguments."""

import pytest
import torch

import diversed_ext as dx
from helpers import fly_logits_case, fly_probs_case
from helpers import (DTYPES, assert_verify_result_in_range, dispatched, on_device, poisoned_verify_inputs,
                     requires_cuda)


@pytest.fixture(scope="module")
def problem():
    tokens, draft, target, _ = fly_probs_case(batch=4, num_positions=3, vocab=16, seed=1)
    return tokens, draft, target


@pytest.mark.parametrize("op", ["verify", "verify_logits", "verify_reference", "verify_logits_reference"])
@pytest.mark.parametrize("fly,error,words", [
    (dict(fly_window=3), ValueError, "fly_window must be < K = 3"),
    (dict(fly_window=torch.tensor([0, 1, 3, 0])), ValueError, "fly_window must be < K = 3"),
    (dict(fly_window=-1), ValueError, "fly_window must be >= 0"),
    (dict(fly_window=torch.tensor([0, -2, 1, 0])), ValueError, "fly_window must be >= 0"),
    (dict(fly_window=1.5), TypeError, "fly_window must be an int"),
    (dict(fly_window=torch.ones(4)), TypeError, "fly_window must be an integer tensor"),
    (dict(fly_window=torch.ones(3, dtype=torch.int64)), ValueError, "fly_window must be an int or have shape [B]"),
    (dict(fly_window=1, fly_threshold=float("nan")), ValueError, "fly_threshold must be >= 0 and not NaN"),
    (dict(fly_window=1, fly_threshold=-0.1), ValueError, "fly_threshold must be >= 0"),
    (dict(fly_window=1, fly_threshold=torch.tensor([0.1, float("nan"), 0.2, 0.3])), ValueError,
     "fly_threshold contains NaN"),
    (dict(fly_window=1, fly_threshold=torch.tensor([0.1, -1.0, 0.2, 0.3])), ValueError, "fly_threshold must be >= 0"),
    (dict(fly_window=1, fly_top_k=0), ValueError, "fly_top_k must lie in [1, 32]"),
    (dict(fly_window=1, fly_top_k=33), ValueError, "fly_top_k must lie in [1, 32]"),
    (dict(fly_window=1, fly_top_k=2.0), TypeError, "fly_top_k must be an int"),
])
def test_bad_fly_settings_raise_naming_the_argument(problem, op, fly, error, words):
    tokens, draft, target = problem
    values = target.log() if "logits" in op else target
    draft_values = draft.log() if "logits" in op else draft
    with pytest.raises(error) as raised:
        getattr(dx, op)(tokens, draft_values, values, 0.5, **fly)
    assert words in str(raised.value)


@pytest.fixture(scope="module")
def two_drafts():
    """K = 2, with uniforms (seed 1, w = 1) where a window of 1 defers the rejections of rows 0 and 3."""
    tokens, draft, target, _ = fly_probs_case(batch=4, num_positions=2, vocab=16, seed=1)
    return (tokens, draft, target, 1.0), dict(seed=1, fly_threshold=0.0, check_inputs=False)


def test_a_window_of_k_or_more_defers_nothing_without_checks(two_drafts):
    """Unchecked, W >= K and negative per-request windows reach the kernels, which treat them as 0 (off), as the
    references do: a window of K or more never fits after a rejection, so a narrower call (vLLM's V1 step is as wide as
    its longest draft) must not defer where a wider one could not (clamped to K - 1 = 1, it would)."""
    problem, kwargs = two_drafts
    off = dx.verify(*problem, **kwargs)
    assert off.num_accepted.tolist() != dx.verify(*problem, fly_window=1, **kwargs).num_accepted.tolist()
    for window in (2, 100, torch.tensor([5, -3, 2, 9])):
        for verify in (dx.verify, dx.verify_reference):
            result = verify(*problem, fly_window=window, **kwargs)
            assert torch.equal(result.tokens, off.tokens), (verify.__name__, window)
            assert torch.equal(result.num_accepted, off.num_accepted)


def test_an_out_of_range_window_turns_off_only_its_own_row(two_drafts):
    """Per-request windows [1, -1, 1, 2] with K = 2: rows 1 and 3 verify as FLy off, rows 0 and 2 as with a window of
    1 for every request, in the kernels and the references alike."""
    problem, kwargs = two_drafts
    off = dx.verify(*problem, **kwargs)
    on = dx.verify(*problem, fly_window=1, **kwargs)
    for verify in (dx.verify, dx.verify_reference):
        mixed = verify(*problem, fly_window=torch.tensor([1, -1, 1, 2]), **kwargs)
        for row, expected in ((0, on), (1, off), (2, on), (3, off)):
            assert torch.equal(mixed.tokens[row], expected.tokens[row]), (verify.__name__, row)
    assert not torch.equal(on.tokens[3], off.tokens[3]), "row 3 should tell the two apart"


def test_unchecked_poisoned_inputs_stay_in_range(device):
    """Garbage everywhere only check_inputs=False lets through, with garbage FLy settings: results are well formed and
    the references' (which sanitise the same way)."""
    tokens, draft, target, weight, uniforms, num_draft, greedy = poisoned_verify_inputs(16, 5, 23, seed=4)
    generator = torch.Generator().manual_seed(1)
    fly = dict(fly_window=torch.randint(-4, 12, (16,), generator=generator),
               fly_threshold=torch.tensor([float("nan"), float("inf")] + [0.0] * 14), check_inputs=False)
    args = (tokens, draft, target, weight)
    kwargs = dict(uniforms=uniforms, num_draft=num_draft, greedy=greedy, **fly)
    result = on_device(device, dx.verify, *args, **kwargs)
    assert_verify_result_in_range(result, 5, 23)
    expected = dx.verify_reference(*args, **kwargs)
    assert torch.equal(result.num_accepted, expected.num_accepted)
    assert torch.equal(result.tokens, expected.tokens)


def test_unchecked_fly_settings_dispatch_only_the_op(problem):
    """Without checks, FLy's settings as numbers or in the op's layout (int64 / float32 [B]) go to the op untouched:
    no torch op runs before it, so nothing syncs with the device."""
    tokens, draft, target = problem
    draft_logits, target_logits = draft.log(), target.log()
    window = torch.tensor([1, 0, 2, 1])
    threshold = torch.tensor([0.1, 0.2, 0.3, 0.4])
    for fly in (dict(fly_window=2), dict(fly_window=window, fly_threshold=threshold, fly_top_k=5),
                dict(fly_window=window, fly_threshold=0.5)):
        ops = dispatched(lambda: dx.verify(tokens, draft, target, 0.5, seed=1, check_inputs=False, **fly))
        assert ops == ["diversed.verify_probs"]
        ops = dispatched(lambda: dx.verify_logits(tokens, draft_logits, target_logits, 0.5, seed=1,
                                                  check_inputs=False, **fly))
        assert ops == ["diversed.verify_logits"]


def test_fly_settings_outside_the_op_layout_are_converted(problem):
    tokens, draft, target = problem
    kwargs = dict(seed=2, check_inputs=False)
    converted = dx.verify(tokens, draft, target, 0.5, fly_window=torch.tensor([1, 0, 2, 1], dtype=torch.int32),
                          fly_threshold=torch.tensor(0.2, dtype=torch.float64), **kwargs)
    given = dx.verify(tokens, draft, target, 0.5, fly_window=torch.tensor([1, 0, 2, 1]), fly_threshold=0.2, **kwargs)
    assert torch.equal(converted.tokens, given.tokens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_with_fly(dtype, device):
    tokens, draft, target, kwargs = fly_probs_case(batch=4, num_positions=3, vocab=20, dtype=dtype, seed=2)
    _, logit_draft, logit_target, logit_kwargs = fly_logits_case(batch=4, num_positions=3, vocab=20, dtype=dtype)
    put = lambda value: value.to(device)  # noqa: E731
    fly = (put(kwargs["fly_window"]), put(kwargs["fly_threshold"]), 0, 0.3, 3)
    fly_values = (None, None, 2, 0.1, 4)
    probs_args = (put(tokens), put(draft), put(target), None, put(kwargs["num_draft"]), put(kwargs["greedy"]),
                  put(kwargs["uniforms"]), None, 0, False, 0.5, None, None, None)
    for fly_args in (fly, fly_values):
        torch.library.opcheck(torch.ops.diversed.verify_probs.default, probs_args + fly_args)
    logits_args = (put(tokens), put(logit_draft), put(logit_target), None, put(logit_kwargs["num_draft"]),
                   put(logit_kwargs["temperature"]), put(logit_kwargs["uniforms"]), None, 0, False, 0.5, 1.0, None,
                   None, None, None, None)
    for fly_args in (fly, fly_values):
        torch.library.opcheck(torch.ops.diversed.verify_logits.default, logits_args + fly_args)


def test_the_op_refuses_a_top_k_it_cannot_keep(problem):
    tokens, draft, target = problem
    with pytest.raises(RuntimeError, match="fly_top_k must lie in"):
        torch.ops.diversed.verify_probs(tokens, draft, target, None, None, None, None, None, 0, False, 0.5, 1, None,
                                        None, None, None, 1, 0.3, 64)


@requires_cuda
@pytest.mark.parametrize("cuda_kernels", ["split"], indirect=True)
def test_the_split_cuda_kernels_refuse_fly(problem, cuda_kernels):
    """The split kernels decide a request's length before any block has read a whole row, which FLy's entropy
    needs: they refuse a call that may defer, and run one that may not."""
    tokens, draft, target = (tensor.cuda() for tensor in problem)
    for fly in (dict(fly_window=1), dict(fly_window=torch.tensor([0, 1, 0, 0], device="cuda"))):
        with pytest.raises(RuntimeError, match="not supported by the split CUDA kernels"):
            dx.verify(tokens, draft, target, 0.5, seed=1, **fly)
    assert dx.verify(tokens, draft, target, 0.5, seed=1, fly_window=0).tokens.shape == (4, 4)


@requires_cuda
@pytest.mark.parametrize("cuda_kernels", ["split"], indirect=True)
def test_a_refused_seedless_call_leaves_the_cuda_generator_alone(problem, cuda_kernels):
    """A seedless call takes its place in torch's CUDA generator; one the split kernels refuse takes none, so the
    next seedless call draws what it would have drawn without the refused one."""
    tokens, draft, target = (tensor.cuda() for tensor in problem)
    before = torch.cuda.get_rng_state()
    with pytest.raises(RuntimeError, match="not supported by the split CUDA kernels"):
        dx.verify(tokens, draft, target, 0.5, fly_window=1)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    dx.verify(tokens, draft, target, 0.5)
    assert not torch.equal(torch.cuda.get_rng_state(), before)
