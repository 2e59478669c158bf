"""A draft and a target of different dtypes (float32, bfloat16, float16 each), as a server holds them: the draft's
logits in the model's bfloat16 or float16 beside float32 processed target rows. The kernels read each tensor as it
lies, with no copy: the result is bit for bit the result on both tensors widened to float32 (every element is read as
float32 exactly), and the reference agrees. Tests that take `device` run on the CPU and on CUDA (skipped where no GPU
is visible)."""

import itertools

import pytest
import torch

import diversed_ext as dx
from helpers import (DTYPES, assert_same, assert_verify_close, dispatched, fly_logits_case, fly_probs_case,
                     logits_verify_case, on_device, random_problem)

PAIRS = [pytest.param(draft, target, id=f"{str(draft)[6:]}-{str(target)[6:]}")
         for draft, target in itertools.product(DTYPES, DTYPES)]


def widened(tensor):
    return None if tensor is None else tensor.float()


@pytest.mark.parametrize("vocab", [1, 37, 4101])
@pytest.mark.parametrize("draft_dtype, target_dtype", PAIRS)
def test_mixed_probabilities_read_as_they_lie(draft_dtype, target_dtype, vocab, device):
    tokens, draft, target = random_problem(24, 3, vocab, seed=vocab)
    draft, target = draft.to(draft_dtype), target.to(target_dtype)
    generator = torch.Generator().manual_seed(1)
    kwargs = dict(num_draft=torch.randint(0, 4, (24,), generator=generator), greedy=torch.arange(24) % 3 == 0,
                  uniforms=torch.rand(24, 4, generator=generator, dtype=torch.float64))
    weight = torch.rand(24, 3, generator=generator)
    mixed = on_device(device, dx.verify, tokens, draft, target, weight, **kwargs)
    assert_same(mixed, on_device(device, dx.verify, tokens, widened(draft), widened(target), weight, **kwargs))
    assert_same(mixed, dx.verify_reference(tokens, draft, target, weight, **kwargs))


@pytest.mark.parametrize("vocab", [37, 4101])
@pytest.mark.parametrize("draft_dtype, target_dtype", PAIRS)
def test_mixed_logits_read_as_they_lie(draft_dtype, target_dtype, vocab, device):
    """Greedy and sampled rows, ragged, per-token weights, the target at its own temperature and not."""
    tokens, draft, target, weight, kwargs = logits_verify_case(3, vocab, torch.float32)
    draft, target = draft.to(draft_dtype), target.to(target_dtype)
    for extra in ({}, dict(target_temperature=1.0)):
        mixed = on_device(device, dx.verify_logits, tokens, draft, target, weight, **kwargs, **extra)
        wide = on_device(device, dx.verify_logits, tokens, widened(draft), widened(target), weight, **kwargs, **extra)
        assert_same(mixed, wide)
        assert_verify_close(mixed, dx.verify_logits_reference(tokens, draft, target, weight, **kwargs, **extra))


@pytest.mark.parametrize("draft_dtype, target_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                       (torch.float32, torch.bfloat16)])
def test_mixed_rows_read_in_place(draft_dtype, target_dtype, device):
    """A server's layout: draft rows by request slot in the model's dtype, target rows flattened in float32, both read
    through their indices."""
    batch, num_positions, vocab = 6, 3, 53
    tokens, draft, target, weight, kwargs = logits_verify_case(num_positions, vocab, torch.float32, batch=batch)
    generator = torch.Generator().manual_seed(2)
    target_order = torch.randperm(batch * (num_positions + 1), generator=generator)
    draft_order = torch.randperm(batch * num_positions, generator=generator)
    target_flat = target.reshape(-1, vocab)[target_order].to(target_dtype).contiguous()
    draft_flat = draft.reshape(-1, vocab)[draft_order].to(draft_dtype).contiguous()
    rows = dict(target_rows=target_order.argsort().reshape(batch, num_positions + 1),
                draft_rows=draft_order.argsort().reshape(batch, num_positions))
    in_place = on_device(device, dx.verify_logits, tokens, draft_flat, target_flat, weight, **kwargs, **rows)
    padded = on_device(device, dx.verify_logits, tokens, draft.to(draft_dtype).float(), target.to(target_dtype).float(),
                       weight, **kwargs)
    assert_same(in_place, padded)
    unchecked = on_device(device, dx.verify_logits, tokens, draft_flat, target_flat, weight, check_inputs=False,
                          **kwargs, **rows)
    assert_same(unchecked, padded)


@pytest.mark.parametrize("draft_dtype, target_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_mixed_dtypes_with_fly(draft_dtype, target_dtype, device):
    tokens, draft, target, kwargs = fly_probs_case(batch=24, num_positions=4, vocab=40, seed=3)
    draft, target = draft.to(draft_dtype), target.to(target_dtype)
    mixed = on_device(device, dx.verify, tokens, draft, target, 0.4, **kwargs)
    assert_same(mixed, on_device(device, dx.verify, tokens, widened(draft), widened(target), 0.4, **kwargs))
    assert_same(mixed, dx.verify_reference(tokens, draft, target, 0.4, **kwargs))
    tokens, draft, target, kwargs = fly_logits_case(batch=24, num_positions=4, vocab=40, seed=4)
    draft, target = draft.to(draft_dtype), target.to(target_dtype)
    mixed = on_device(device, dx.verify_logits, tokens, draft, target, 0.4, **kwargs)
    assert_same(mixed, on_device(device, dx.verify_logits, tokens, widened(draft), widened(target), 0.4, **kwargs))


def test_an_unchecked_mixed_call_is_the_op_alone():
    """No conversion and no copy before the op: a bfloat16 draft beside float32 target rows goes to it as given."""
    tokens, draft, target = random_problem(4, 3, 50, seed=1)
    draft_logits, target_logits = draft.log().bfloat16(), target.log()
    ops = dispatched(lambda: dx.verify_logits(tokens, draft_logits, target_logits, 0.5, temperature=0.8,
                                              check_inputs=False))
    assert ops == ["diversed.verify_logits"], ops
    half_draft = draft.half()
    ops = dispatched(lambda: dx.verify(tokens, half_draft, target, 0.5, check_inputs=False))
    assert ops == ["diversed.verify_probs"], ops


@pytest.mark.parametrize("draft_dtype, target_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                                                       (torch.float16, torch.bfloat16)])
def test_opcheck_with_mixed_dtypes(draft_dtype, target_dtype, device):
    batch, num_positions, vocab = 4, 3, 20
    tokens, draft, target = (t.to(device) for t in random_problem(batch, num_positions, vocab, seed=3))
    draft, target = draft.to(draft_dtype), target.to(target_dtype)
    num_draft = torch.tensor([3, 1, 0, 2], device=device)
    seeds = torch.arange(batch, dtype=torch.int64, device=device)
    greedy = torch.tensor([False, True, False, False], device=device)
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0], device=device)
    torch.library.opcheck(torch.ops.diversed.verify_probs.default,
                          (tokens, draft, target, None, num_draft, greedy, None, seeds, 5, True, 0.5))
    torch.library.opcheck(torch.ops.diversed.verify_logits.default,
                          (tokens, draft.log(), target.log(), None, num_draft, temperature, None, seeds, 0, True))
    flat = target.reshape(-1, vocab)
    rows = torch.arange(batch * (num_positions + 1), device=device).reshape(batch, num_positions + 1)
    torch.library.opcheck(torch.ops.diversed.verify_logits.default,
                          (tokens, draft.log(), flat.log(), None, num_draft, temperature, None, seeds, 0, True, 0.5,
                           1.0, None, rows))


def test_mixed_dtypes_trace_under_torch_compile():
    tokens, draft, target = random_problem(4, 3, 30, seed=2)
    draft_logits, target_logits = draft.log().bfloat16(), target.log()
    uniforms = torch.rand(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def step(tokens, draft, target, uniforms):
        return dx.verify_logits(tokens, draft, target, 0.5, uniforms=uniforms, check_inputs=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert_same(compiled(tokens, draft_logits, target_logits, uniforms),
                step(tokens, draft_logits, target_logits, uniforms))


def test_dtypes_outside_the_three_are_refused_naming_the_argument():
    tokens, draft, target = random_problem(3, 2, 11, seed=4)
    for check_inputs in (True, False):
        with pytest.raises(TypeError, match="draft_logits must be float32, bfloat16 or float16"):
            dx.verify_logits(tokens, draft.log().double(), target.log(), 0.5, check_inputs=check_inputs)
        with pytest.raises(TypeError, match="target_probs must be float32, bfloat16 or float16"):
            dx.verify(tokens, draft.half(), target.double(), 0.5, check_inputs=check_inputs)
    # The op itself (the last line of defence) names the rule.
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        torch.ops.diversed.verify_logits(tokens, draft.log().double(), target.log(), None, None, None, None, None)
    with pytest.raises(RuntimeError, match="target must be float32, bfloat16, float16 or float64"):
        torch.ops.diversed.verify_probs(tokens, None, target.long(), None, None, None, None, None)
    # token_stats and mix still take one dtype.
    with pytest.raises(TypeError, match="same dtype"):
        dx.token_stats(draft.bfloat16(), target[:, :2], tokens)
    with pytest.raises(TypeError, match="same dtype"):
        dx.mix(draft.bfloat16(), target, 0.5)
