"""What a call of the public ops dispatches: an unchecked call with default arguments is the custom op and nothing else.

A float weight, an absent num_draft / greedy / seed and a float temperature travel to the op as scalars or None, so
no aten.full / aten.zeros / aten.randint runs in Python before it (the op draws its own seed on the device).
"""

import pytest
import torch

import diversed_ext as dx
from helpers import dispatched, random_problem


@pytest.fixture
def problem():
    return random_problem(3, 4, 50, seed=7)


def test_unchecked_verify_with_defaults_dispatches_only_the_op(problem):
    tokens, draft, target = problem
    assert dispatched(lambda: dx.verify(tokens, draft, target, 0.5, check_inputs=False)) == ["diversed.verify_probs"]
    assert dispatched(lambda: dx.verify(tokens, draft, target, 1.0, seed=3, offset=2, check_inputs=False)) == [
        "diversed.verify_probs"]


def test_unchecked_verify_logits_with_defaults_dispatches_only_the_op(problem):
    tokens, draft, target = problem
    draft_logits, target_logits = draft.log(), target.log()
    for temperature in (1.0, 0.7, 0.0):
        ops = dispatched(lambda: dx.verify_logits(tokens, draft_logits, target_logits, 0.5, temperature=temperature,
                                                  check_inputs=False))
        assert ops == ["diversed.verify_logits"], ops


def test_unchecked_tensors_in_the_op_layout_dispatch_only_the_op(problem):
    """Per-request seeds, per-token weights, greedy flags, draft lengths and temperatures that are already in the op's
    layout go to it untouched: still one op."""
    tokens, draft, target = problem
    batch, num_positions = tokens.shape
    tensors = {"num_draft": torch.full((batch,), 2), "seed": torch.arange(batch)}
    weight = torch.full((batch, num_positions), 0.5)
    greedy, temperature = torch.zeros(batch, dtype=torch.bool), torch.ones(batch)
    draft_logits, target_logits = draft.log(), target.log()
    ops = dispatched(lambda: dx.verify(tokens, draft, target, weight, greedy=greedy, check_inputs=False, **tensors))
    assert ops == ["diversed.verify_probs"]
    ops = dispatched(lambda: dx.verify_logits(tokens, draft_logits, target_logits, weight, temperature=temperature,
                                              check_inputs=False, **tensors))
    assert ops == ["diversed.verify_logits"]


def test_unchecked_tensors_outside_the_op_layout_are_converted(problem):
    """int32 ids and seeds, a [B] weight, non-contiguous probabilities and a 0-d temperature are refused by the op as
    they are; the call then converts them and gives what the converted arguments give."""
    tokens, draft, target = problem
    batch, num_positions = tokens.shape
    seeds = torch.arange(batch)
    weight = torch.tensor([0.2, 0.5, 0.9])
    strided_draft = torch.cat([draft, draft], dim=-1)[..., :draft.shape[-1]]
    assert not strided_draft.is_contiguous()
    odd = dx.verify(tokens.int(), strided_draft, target, weight, seed=seeds.int(), check_inputs=False)
    plain = dx.verify(tokens, draft, target, weight.unsqueeze(1).expand(batch, num_positions).contiguous(), seed=seeds,
                      check_inputs=False)
    for a, b in zip(odd, plain):
        assert torch.equal(a, b)
    odd = dx.verify_logits(tokens.int(), draft.log(), target.log(), 0.5, temperature=torch.tensor(0.7), seed=seeds,
                           check_inputs=False)
    plain = dx.verify_logits(tokens, draft.log(), target.log(), 0.5, temperature=0.7, seed=seeds, check_inputs=False)
    for a, b in zip(odd, plain):
        assert torch.equal(a, b)


def test_scalar_defaults_give_what_their_tensors_give(problem):
    """Scalars and None in the op are the same call as the tensors they stand for."""
    tokens, draft, target = problem
    batch, num_positions = tokens.shape
    full = torch.ops.diversed.verify_probs(
        tokens, draft, target, torch.full((batch, num_positions), 0.25), torch.full((batch,), num_positions),
        torch.zeros(batch, dtype=torch.bool), None, torch.full((batch,), 11), 3, False)
    lean = torch.ops.diversed.verify_probs(tokens, draft, target, None, None, None, None, None, 3, False, 0.25, 11)
    for a, b in zip(full, lean):
        assert torch.equal(a, b)


def test_a_seed_drawn_by_the_op_is_the_one_the_reference_draws(problem):
    """With no seed and no uniforms the op draws torch.randint(0, 2**63 - 1) from the default generator, as the
    reference does, so torch.manual_seed repeats both alike."""
    tokens, draft, target = problem
    torch.manual_seed(123)
    native = dx.verify(tokens, draft, target, 0.6, check_inputs=False)
    after_native = torch.rand(1)
    torch.manual_seed(123)
    reference = dx.verify_reference(tokens, draft, target, 0.6, check_inputs=False)
    after_reference = torch.rand(1)
    assert torch.equal(native.tokens, reference.tokens)
    assert torch.equal(native.num_accepted, reference.num_accepted)
    assert torch.equal(after_native, after_reference)  # one draw each


def test_explicit_uniforms_draw_no_seed(problem):
    tokens, draft, target = problem
    uniforms = torch.rand(tokens.shape[0], tokens.shape[1] + 1, dtype=torch.float64)
    state = torch.get_rng_state()
    dx.verify(tokens, draft, target, 0.5, uniforms=uniforms, check_inputs=False)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("batch", [1, 5])
def test_both_thread_layouts_match_the_reference(batch):
    """One request with a long vocabulary is split by vocabulary chunks; several go by rows. Both give the
    reference's tokens on identical uniforms, from probabilities and from logits, sampled and greedy rows alike."""
    tokens, draft, target = random_problem(batch, 3, 70_000, seed=batch, sharpness=1.0)
    uniforms = torch.rand(batch, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(batch))
    for greedy in (False, True):
        native = dx.verify(tokens, draft, target, 0.7, greedy=greedy, uniforms=uniforms, check_inputs=False)
        reference = dx.verify_reference(tokens, draft, target, 0.7, greedy=greedy, uniforms=uniforms,
                                        check_inputs=False)
        assert torch.equal(native.tokens, reference.tokens)
        assert torch.equal(native.accept_prob, reference.accept_prob)
    draft_logits, target_logits = draft.log(), target.log()
    native = dx.verify_logits(tokens, draft_logits, target_logits, 0.7, temperature=0.9, uniforms=uniforms)
    reference = dx.verify_logits_reference(tokens, draft_logits, target_logits, 0.7, temperature=0.9,
                                           uniforms=uniforms)
    assert torch.equal(native.tokens, reference.tokens)


def test_unchecked_arguments_that_need_converting_reach_the_op_once(problem):
    """int32 ids and seeds, a [B] weight or a 0-d temperature are converted before the op, which then runs once: the
    call never tries the op first and calls it again after its refusal."""
    tokens, draft, target = problem
    batch = tokens.shape[0]
    weight, seeds = torch.full((batch,), 0.5), torch.arange(batch, dtype=torch.int32)
    ops = dispatched(lambda: dx.verify(tokens.int(), draft, target, weight, seed=seeds, check_inputs=False))
    assert ops.count("diversed.verify_probs") == 1, ops
    ops = dispatched(lambda: dx.verify_logits(tokens.int(), draft.log(), target.log(), weight,
                                              temperature=torch.tensor(0.7), seed=seeds, check_inputs=False))
    assert ops.count("diversed.verify_logits") == 1, ops
