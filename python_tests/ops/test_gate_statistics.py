"""gate_statistics and gate_keeps_logits: the fused op against its float64 reference and the plain-PyTorch test
(gate_keeps), with and without the draft's distributions, rows read in place, mixed dtypes, the target's own
temperature, the edges (V = 1, no residual, a drafted token of probability near 1, ids outside the vocabulary, rows
without a finite logit, empty shapes) and its argument errors.

Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is visible); the opcheck is in
test_verify_api.py::test_opcheck and the builds' bitwise agreement in test_logits.py."""

import math

import pytest
import torch

from diversed_ext import ops
from helpers import DTYPES, on_device, ruled_out_logits

# log p(x) is read from one logit; E_r[log p] is a float32 ratio of float64 sums of float32 terms
DRAFTED_TOLERANCE = 1e-5
REJECTED_TOLERANCE = 1e-4


def gate_case(batch, positions, vocab, dtype, seed, scale=3.0):
    """ruled_out_logits' logits and temperatures (a greedy row, taken at 1) and drafted tokens [B, T]: half of them
    each position's target argmax, so that near-certain tokens are drafted too."""
    draft, target, temperature = ruled_out_logits(batch, positions, vocab, torch.float32, seed, scale)
    tokens = torch.randint(0, vocab, (batch, positions), generator=torch.Generator().manual_seed(seed + 1))
    tokens[::2] = target.argmax(-1)[::2]
    return tokens, draft.to(dtype), target.to(dtype), temperature


def assert_statistics_close(statistics, expected):
    torch.testing.assert_close(statistics.drafted_logprob, expected.drafted_logprob, atol=DRAFTED_TOLERANCE,
                               rtol=DRAFTED_TOLERANCE)
    torch.testing.assert_close(statistics.rejected_logprob, expected.rejected_logprob, atol=REJECTED_TOLERANCE,
                               rtol=REJECTED_TOLERANCE)


@pytest.mark.parametrize("tokens_only", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 7, 129, 4099, 49152])
def test_matches_the_float64_reference(device, dtype, vocab, tokens_only):
    """V = 4099 leaves a tail after the last group of lanes and spans two blocks; 49152 is SmolLM2's."""
    tokens, draft, target, temperature = gate_case(4, 3, vocab, dtype, seed=vocab)
    draft = None if tokens_only else draft
    statistics = on_device(device, ops.gate_statistics, tokens, target, draft, temperature=temperature)
    assert statistics.drafted_logprob.shape == (4, 3) and statistics.rejected_logprob.dtype == torch.float32
    assert_statistics_close(statistics, ops.gate_statistics_reference(tokens, target, draft, temperature=temperature))


@pytest.mark.parametrize("tokens_only", [False, True])
def test_the_keeps_equal_the_plain_pytorch_test(device, tokens_only):
    """gate_keeps_logits against gate_keeps on the same rows' probabilities, over margins from sd's test to keeping
    almost everything; positions within 1e-3 nats of the boundary are left out (float32 ties)."""
    tokens, draft, target, temperature = gate_case(4, 8, 300, torch.float32, seed=3)
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(-1, 1, 1)
    log_p = (target / scale).log_softmax(-1).flatten(0, 1)
    q = None if tokens_only else (draft / scale).softmax(-1).flatten(0, 1)
    statistics = ops.gate.residual_statistics(tokens.flatten(), q, log_p)
    kept_any = 0
    for margin in (-1.0, 0.0, 0.5, 2.0, 4.0, 10.0):
        fused = on_device(device, ops.gate_keeps_logits, margin, tokens, target, None if tokens_only else draft,
                          temperature=temperature).flatten()
        expected = ops.gate_keeps(margin, tokens.flatten(), q, log_p)
        clear = (statistics.drafted_logprob - (statistics.rejected_logprob - margin)).abs() > 1e-3
        assert torch.equal(fused[clear], expected[clear]), margin
        kept_any += int(fused.sum())
    assert 0 < kept_any < 6 * fused.numel()  # the margins cover both outcomes


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.bfloat16)])
def test_draft_probabilities_read_as_they_lie(device, dtypes):
    """draft_probs (a server's draft distributions, vLLM's draft_probs) against the reference and against the plain
    test on the same rows, read in place or as [B, T, V]; the temperature then divides the target alone."""
    tokens, draft, target, temperature = gate_case(4, 3, 4099, torch.float32, seed=8)
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(-1, 1, 1)
    probs, target = (draft / scale).softmax(-1).to(dtypes[0]), target.to(dtypes[1])
    statistics = on_device(device, ops.gate_statistics, tokens, target, draft_probs=probs, temperature=temperature)
    reference = ops.gate_statistics_reference(tokens, target, draft_probs=probs, temperature=temperature)
    assert_statistics_close(statistics, reference)
    rows, flat = torch.arange(12).reshape(4, 3).flip(0), probs.reshape(12, -1)
    in_place = on_device(device, ops.gate_statistics, tokens, target, temperature=temperature, draft_probs=flat,
                         draft_rows=rows)
    gathered = on_device(device, ops.gate_statistics, tokens, target, temperature=temperature, draft_probs=flat[rows])
    assert torch.equal(in_place.rejected_logprob, gathered.rejected_logprob)
    log_p = (target.float() / scale).log_softmax(-1).flatten(0, 1)
    plain = ops.gate.residual_statistics(tokens.flatten(), probs.flatten(0, 1), log_p)
    torch.testing.assert_close(statistics.rejected_logprob.flatten(), plain.rejected_logprob, atol=REJECTED_TOLERANCE,
                               rtol=REJECTED_TOLERANCE)


def test_unchecked_bad_probabilities_count_as_no_mass(device):
    tokens, draft, target, _ = gate_case(2, 3, 33, torch.float32, seed=12)
    probs = draft.softmax(-1)
    probs[0, 0, :5] = torch.tensor([float("nan"), -0.5, float("inf"), 2.0, 0.0])
    statistics = on_device(device, ops.gate_statistics, tokens, target, draft_probs=probs, check_inputs=False)
    assert_statistics_close(statistics, ops.gate_statistics_reference(tokens, target, draft_probs=probs,
                                                                      check_inputs=False))


def test_margin_per_position_and_nan_ungated(device):
    tokens, draft, target, temperature = gate_case(3, 4, 64, torch.float32, seed=5)
    margin = torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) * 6
    margin[1] = math.nan
    keep = on_device(device, ops.gate_keeps_logits, margin, tokens, target, draft, temperature=temperature)
    for row in range(3):
        for position in range(4):
            alone = ops.gate_keeps_logits(float(margin[row, position]), tokens[row:row + 1, position:position + 1],
                                          target[row:row + 1, position:position + 1],
                                          draft[row:row + 1, position:position + 1],
                                          temperature=temperature[row:row + 1])
            assert bool(keep[row, position]) == bool(alone[0, 0])
    assert not keep[1].any()


@pytest.mark.parametrize("margin, error, words", [
    (float("inf"), ValueError, "margin must be a finite number of nats, got inf"),
    ("1", TypeError, "margin must be a finite number of nats"),
    (torch.tensor([[1, 2]]), TypeError, "margin must be a float or a floating-point tensor"),
])
def test_a_bad_margin_is_named(margin, error, words):
    """The gate's margin by its rule (an infinite one would keep every draft the target allows); NaN stays 'no gate'
    and a tensor's values are not read."""
    tokens, logits = torch.tensor([[1, 0]]), torch.randn(1, 2, 5)
    assert not ops.gate_keeps_logits(math.nan, tokens, logits).any()
    for keep in (lambda: ops.gate_keeps_logits(margin, tokens, logits),
                 lambda: ops.gate_keeps(margin, tokens[0], None, logits[0].log_softmax(-1))):
        with pytest.raises(error, match=words):
            keep()


def test_a_near_certain_draft_keeps_its_residual_exact(device):
    """A drafted token of probability 1 - 3e-9 leaves a residual of mass 3e-9: the op sums the residual itself
    (never 1 - p(x), which float32 rounds to 0), so E_r[log p] matches float64."""
    vocab = 1000
    target = torch.zeros(1, 2, vocab)
    target[..., 7] = 26.0  # p(7) = 1 / (1 + 999 e^-26)
    tokens = torch.tensor([[7, 3]])
    statistics = on_device(device, ops.gate_statistics, tokens, target)
    log_z = math.log(math.exp(26.0) + vocab - 1)
    assert math.isclose(float(statistics.rejected_logprob[0, 0]), -log_z, rel_tol=1e-6)  # r uniform off x
    assert math.isclose(float(statistics.drafted_logprob[0, 0]), 26.0 - log_z, abs_tol=1e-6)
    # drafting a token off the peak: the residual is everything else, dominated by the peak (log p ~ -5e-9, which
    # float32's normaliser resolves only to ~1e-7)
    residual = torch.cat([torch.tensor([26.0 - log_z]), torch.full((vocab - 2,), -log_z)]).double()
    mass = residual.exp()
    assert math.isclose(float(statistics.rejected_logprob[0, 1]), float((mass * residual).sum() / mass.sum()),
                        abs_tol=1e-6)


def test_edges(device):
    uniform = torch.zeros(8)
    one_hot = torch.tensor([0.0] + [float("-inf")] * 7)
    ruled_out = torch.full((8,), float("-inf"))
    target = torch.stack([uniform, uniform, one_hot, one_hot, ruled_out]).unsqueeze(0)
    draft = torch.stack([uniform, one_hot, one_hot, uniform, uniform]).unsqueeze(0)
    tokens = torch.tensor([[2, 0, 0, 0, 0]])
    with_draft = on_device(device, ops.gate_statistics, tokens, target, draft, check_inputs=False)
    log8 = math.log(8)
    torch.testing.assert_close(with_draft.drafted_logprob[0], torch.tensor([-log8, -log8, 0.0, 0.0, -math.inf]))
    # p = q (rows 0 and 2) and a target without mass (row 4) have no residual; row 1's is uniform off 0; row 3's
    # target is one-hot where q has 1/8: the residual is that 7/8 at id 0
    torch.testing.assert_close(with_draft.rejected_logprob[0],
                               torch.tensor([math.inf, -log8, math.inf, 0.0, math.inf]))
    alone = on_device(device, ops.gate_statistics, tokens, target, check_inputs=False)
    torch.testing.assert_close(alone.rejected_logprob[0], torch.tensor([-log8, -log8, math.inf, math.inf, math.inf]))
    assert not on_device(device, ops.gate_keeps_logits, 1e6, tokens, target, check_inputs=False)[0, 2:].any()
    # V = 1: the drafted token is certain and nothing is ever rejected
    single = on_device(device, ops.gate_statistics, torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3, 1))
    assert torch.equal(single.drafted_logprob, torch.zeros(2, 3))
    assert torch.equal(single.rejected_logprob, torch.full((2, 3), math.inf))
    for shape in ((2, 0), (0, 3)):
        empty = on_device(device, ops.gate_statistics, torch.zeros(shape, dtype=torch.int64), torch.zeros(*shape, 5))
        assert empty.drafted_logprob.shape == shape


def test_ids_outside_the_vocabulary_and_unchecked_bad_values_are_never_kept(device):
    """vLLM's -1 (a draft that must be rejected) and an id past V get log p = -inf, the residual of a draft that put
    nothing on the vocabulary (p itself); NaN and +inf logits, which check_inputs=False lets through, keep nothing."""
    tokens, draft, target, temperature = gate_case(4, 6, 37, torch.float32, seed=9)
    tokens[0, :2] = torch.tensor([-1, 37])
    statistics = on_device(device, ops.gate_statistics, tokens, target, temperature=temperature, check_inputs=False)
    assert torch.equal(statistics.drafted_logprob[0, :2], torch.full((2,), -math.inf))
    log_p = target[0, :2].double().log_softmax(-1)  # row 0's temperature is 1
    negative_entropy = torch.where(log_p > -math.inf, log_p.exp() * log_p, torch.zeros_like(log_p)).sum(-1)
    torch.testing.assert_close(statistics.rejected_logprob[0, :2], negative_entropy.float(), atol=1e-5, rtol=1e-5)
    generator = torch.Generator().manual_seed(0)
    for logits in (draft, target):
        logits[torch.rand(logits.shape, generator=generator) < 0.02] = float("nan")
    target[1, 2, 5] = float("inf")
    keep = on_device(device, ops.gate_keeps_logits, 1e6, tokens, target, draft, temperature=temperature,
                     check_inputs=False)
    touched = target.isnan().any(-1) | (target == math.inf).any(-1)
    assert not keep[touched].any() and not keep[0, :2].any()
    reference = ops.gate_statistics_reference(tokens, target, draft, temperature=temperature, check_inputs=False)
    assert torch.equal(ops.gate.keeps(1e6, reference), keep)


def indexed_case(dtypes, seed):
    """Row tensors [R, V] of gate_case's logits (more rows than positions, shuffled, one row read twice), the indices
    [B, T] that read them, and the gathered [B, T, V] tensors."""
    tokens, draft, target, temperature = gate_case(3, 4, 4099, torch.float32, seed=seed)
    generator = torch.Generator().manual_seed(seed + 2)
    target_rows = torch.cat([target.reshape(-1, 4099), torch.randn(3, 4099, generator=generator)]).to(dtypes[1])
    draft_rows = torch.cat([torch.randn(2, 4099, generator=generator), draft.reshape(-1, 4099)]).to(dtypes[0])
    target_index = torch.randperm(target_rows.shape[0], generator=generator)[:12].reshape(3, 4)
    draft_index = torch.randint(0, draft_rows.shape[0], (3, 4), generator=generator)
    draft_index[0, 0] = draft_index[-1, -1]
    return tokens, draft_rows, target_rows, draft_index, target_index, temperature


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.bfloat16), (torch.float32, torch.float16)])
def test_rows_in_place_equal_the_gathered_rows_bit_for_bit(device, dtypes):
    tokens, draft_rows, target_rows, draft_index, target_index, temperature = indexed_case(dtypes, seed=11)
    in_place = on_device(device, ops.gate_statistics, tokens, target_rows, draft_rows, temperature=temperature,
                         target_rows=target_index, draft_rows=draft_index.to(torch.int32))
    gathered = on_device(device, ops.gate_statistics, tokens, target_rows[target_index], draft_rows[draft_index],
                         temperature=temperature)
    assert torch.equal(in_place.drafted_logprob, gathered.drafted_logprob)
    assert torch.equal(in_place.rejected_logprob, gathered.rejected_logprob)
    alone = on_device(device, ops.gate_statistics, tokens, target_rows, temperature=temperature,
                      target_rows=target_index)
    alone_gathered = on_device(device, ops.gate_statistics, tokens, target_rows[target_index],
                               temperature=temperature)
    assert torch.equal(alone.rejected_logprob, alone_gathered.rejected_logprob)
    reference = ops.gate_statistics_reference(tokens, target_rows, draft_rows, temperature=temperature,
                                              target_rows=target_index, draft_rows=draft_index)
    assert_statistics_close(in_place, reference)


def test_the_target_at_a_temperature_of_its_own(device):
    """A server's target rows already divided by the request's temperature, beside draft logits that are not, read
    with target_temperature=1 give what both undivided rows at the request's temperature give."""
    tokens, draft, target, temperature = gate_case(4, 3, 257, torch.float32, seed=6)
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(-1, 1, 1)
    served = on_device(device, ops.gate_statistics, tokens, target / scale, draft, temperature=temperature,
                       target_temperature=1.0)
    assert_statistics_close(served, ops.gate_statistics_reference(tokens, target, draft, temperature=temperature))


def bad_gate_cases():
    tokens, draft, target, _ = gate_case(2, 3, 9, torch.float32, seed=4)
    rows, index = target.reshape(6, 9), torch.arange(6).reshape(2, 3)
    nan_target = target.clone()
    nan_target[1, 0, 2] = float("nan")
    return {
        "draft_rows without a draft": (lambda: ops.gate_statistics(tokens, rows, draft_rows=index, target_rows=index),
                                       ValueError, "draft_rows needs draft_logits or draft_probs"),
        "tokens shape": (lambda: ops.gate_statistics(tokens[:, :2], target), ValueError,
                         "draft_tokens must be \\[B, K\\] = \\[2, 3\\]"),
        "float tokens": (lambda: ops.gate_statistics(tokens.float(), target), TypeError, "draft_tokens"),
        "both draft kinds": (lambda: ops.gate_statistics(tokens, target, draft, draft_probs=draft.softmax(-1)),
                             ValueError, "draft_logits or draft_probs, not both"),
        "negative probabilities": (lambda: ops.gate_statistics(tokens, target, draft_probs=-draft.softmax(-1)),
                                   ValueError, "draft_probs.*negative"),
        "probability rows without an index": (lambda: ops.gate_statistics(tokens, target, draft_probs=rows,
                                                                          draft_rows=index[:, :2]), ValueError,
                                              "draft_rows"),
        "NaN target": (lambda: ops.gate_statistics(tokens, nan_target), ValueError, "target_logits.*NaN"),
        "index out of range": (lambda: ops.gate_statistics(tokens, rows, target_rows=index + 1), ValueError,
                               "target_rows\\[1, 2\\] = 6 is outside"),
        "2-D target without an index": (lambda: ops.gate_statistics(tokens, rows), ValueError, "target_logits"),
        "vocabularies differ": (lambda: ops.gate_statistics(tokens, target, draft[..., :8]), ValueError,
                                "vocabulary"),
        "temperature shape": (lambda: ops.gate_statistics(tokens, target, temperature=torch.ones(3)), ValueError,
                              "temperature"),
    }


BAD_CASES = bad_gate_cases()


@pytest.mark.parametrize("call, error, pattern", list(BAD_CASES.values()), ids=list(BAD_CASES))
def test_bad_inputs(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_native_checks_back_the_python_layer():
    tokens, draft, target, temperature = gate_case(2, 3, 9, torch.float32, seed=4)
    op = torch.ops.diversed.gate_statistics
    with pytest.raises(RuntimeError, match="gate_statistics: draft_rows needs a draft"):
        op(tokens, None, target.reshape(6, 9), temperature, torch.arange(6).reshape(2, 3), torch.zeros(2, 3).long())
    with pytest.raises(RuntimeError, match="gate_statistics.*draft_tokens"):
        op(tokens[:, :2].contiguous(), None, target, temperature)
    with pytest.raises(RuntimeError, match="gate_statistics.*draft_tokens"):
        op(tokens.int(), draft, target, temperature)
    with pytest.raises(RuntimeError, match="gate_statistics.*temperature"):
        op(tokens, draft, target, torch.ones(3))
    with pytest.raises(RuntimeError, match="gate_statistics.*float32, bfloat16 or float16, or both float64"):
        op(tokens, draft, target.double(), temperature)

