"""Edges of the four ops that once went wrong: underflowing temperatures, empty inputs, rows without mass under the
checks, the reference against the kernels on hostile inputs, and where a seed is drawn."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import diversed_ext as dx
from diversed_ext.ops import MIN_TEMPERATURE
from diversed_ext.ops._inputs import seed_tensor
from helpers import on_device, poisoned_verify_inputs, random_logits, random_problem


@pytest.mark.parametrize("tiny", [1e-38, 1e-45, MIN_TEMPERATURE / 2])
def test_temperatures_below_the_threshold_are_greedy(device, tiny):
    tokens, draft, target = random_logits(6, 3, 50, seed=4)
    uniforms = torch.rand(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    greedy = on_device(device, dx.verify_logits, tokens, draft, target, 0.5, temperature=0.0, uniforms=uniforms)
    for verify in (dx.verify_logits, dx.verify_logits_reference):
        result = on_device(device, verify, tokens, draft, target, 0.5, temperature=tiny, uniforms=uniforms)
        torch.testing.assert_close(result.tokens, greedy.tokens, rtol=0, atol=0)
        # Greedy rows do not all collapse to id 0, which is what an overflowing 1 / T produced.
        assert bool((result.tokens[:, 0] != 0).any())
    mixture = on_device(device, dx.mix, draft, target, 0.5, from_logits=True, temperature=tiny)
    torch.testing.assert_close(mixture.sum(-1), torch.ones(6, 3), rtol=0, atol=1e-5)
    stats = on_device(device, dx.token_stats, draft, target[:, :3], tokens, from_logits=True, temperature=tiny)
    assert all(bool(torch.isfinite(value).all()) for value in stats)


def test_empty_positions_give_empty_results(device):
    draft = torch.rand(3, 0, 7)
    stats = on_device(device, dx.token_stats, draft, torch.rand(3, 0, 7), torch.zeros(3, 0, dtype=torch.int64))
    assert all(tuple(value.shape) == (3, 0) for value in stats)
    mixture = on_device(device, dx.mix, draft, torch.rand(3, 1, 7), 0.5)
    assert tuple(mixture.shape) == (3, 0, 7)


def test_rows_without_mass_are_rejected_only_where_they_are_read():
    tokens, draft, target = random_problem(3, 4, 11, seed=2)
    num_draft = torch.tensor([4, 2, 0])
    padded_draft, padded_target = draft.clone(), target.clone()
    padded_draft[1, 2:] = 0.0  # past num_draft: never read, so zero padding is allowed
    padded_target[1, 3:] = 0.0
    dx.verify(tokens, padded_draft, padded_target, 0.5, num_draft=num_draft, seed=0)
    tiny_draft = draft.clone()
    tiny_draft[0, 3] = 1e-25  # a draft row is a distribution at any scale
    dx.verify(tokens, tiny_draft, target, 0.5, num_draft=num_draft, seed=0)
    # zeros, or a target row below its support (2^-64) everywhere: the kernels would emit a token of probability 0
    for name, tensor, index, fill in (("draft_probs", draft, (0, 3), 0.0), ("target_probs", target, (2, 0), 0.0),
                                      ("target_probs", target, (2, 0), 1e-25)):
        broken = tensor.clone()
        broken[index] = fill
        args = (tokens, broken, target) if name == "draft_probs" else (tokens, draft, broken)
        where = rf"\[{index[0]}, {index[1]}\]"
        with pytest.raises(ValueError, match=rf"{name} has a row with no probability mass.*{where}"):
            dx.verify(*args, 0.5, num_draft=num_draft, seed=0)


@pytest.mark.parametrize("seed", range(6))
def test_reference_follows_the_kernels_on_hostile_inputs(seed):
    """Unchecked garbage (NaN, negative and out-of-range uniforms and weights, ids, num_draft, greedy rows): the
    references sanitise it by the kernels' rules, so both give the same result."""
    tokens, draft, target, weight, uniforms, num_draft, greedy = poisoned_verify_inputs(9, 4, 13, seed=seed)
    kwargs = dict(num_draft=num_draft, greedy=greedy, uniforms=uniforms, check_inputs=False)
    native = dx.verify(tokens, draft, target, weight, **kwargs)
    reference = dx.verify_reference(tokens, draft, target, weight, **kwargs)
    torch.testing.assert_close(native.num_accepted, reference.num_accepted, rtol=0, atol=0)
    torch.testing.assert_close(native.tokens, reference.tokens, rtol=0, atol=0)
    torch.testing.assert_close(native.accept_prob, reference.accept_prob, rtol=0, atol=0)


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_drawn_seed_is_made_on_its_device(device):
    torch.manual_seed(0)
    with OpLog() as log:
        seeds, per_row = seed_tensor(None, 4, torch.device(device))
    assert seeds.device.type == device and not per_row and bool((seeds == seeds[0]).all())
    assert not any("copy" in op or "_to_copy" in op for op in log.ops), log.ops  # no host-to-device round trip


@pytest.mark.parametrize("method, weight", [("sd", None), ("static", 0.5)])
def test_the_loop_treats_an_underflowing_temperature_as_greedy(wide_pair, method, weight):
    """temperature=1e-40 once crashed in the draft's sampling (softmax of logits / T is NaN); now it decodes exactly
    what temperature 0 decodes."""
    pytest.importorskip("transformers")
    from helpers import PROMPT

    from diversed_ext.decoding import SpeculativeDecoder

    target, draft = wide_pair
    outputs = [SpeculativeDecoder(target, draft, method=method, weight=weight, max_draft=3, temperature=temperature)
               .generate(PROMPT, max_new_tokens=12, seed=5).sequences[0].tolist() for temperature in (0.0, 1e-40)]
    assert outputs[0] == outputs[1]
