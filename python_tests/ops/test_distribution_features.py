"""distribution_features: the fused op against float64 formulas and its PyTorch reference, at the edges (V = 1, rows
ruled out entirely, -inf entries, T = 0), with values only check_inputs=False lets through, rows read in place through
target_rows / draft_rows, the target's own temperature, mixed dtypes, and its argument errors.

Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is visible); the opcheck is in
test_verify_api.py::test_opcheck and the builds' bitwise agreement in test_logits.py."""

import math

import pytest
import torch

import diversed_ext as dx
from helpers import DTYPES, on_device, ruled_out_logits

TOLERANCE = 3e-6  # every dtype alike: the logits are read exactly as they lie


def expected_features(draft_logits, target_logits, temperature, target_temperature=None):
    """The five features in float64, written out; temperature [B] (0 counts as 1), which divides the target logits
    too unless target_temperature [B] is given."""
    def scale(values):
        return torch.where(values > 0, values, torch.ones_like(values)).double().view(-1, 1, 1)

    q = (draft_logits.double() / scale(temperature)).softmax(-1)
    p = (target_logits.double() / scale(temperature if target_temperature is None else target_temperature)).softmax(-1)
    vocab = draft_logits.shape[-1]

    def entropy(probs):
        if vocab == 1:
            return torch.zeros(probs.shape[:-1], dtype=torch.float64)
        return -(probs * probs.clamp_min(1e-300).log()).sum(-1) / math.log(vocab)

    return torch.stack([entropy(q), entropy(p), q.amax(-1), p.amax(-1), 0.5 * (p - q).abs().sum(-1)], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 7, 129, 4099, 49152])
def test_matches_float64_and_reference(device, dtype, vocab):
    """V = 4099 leaves a tail after the last group of lanes and spans two softmax blocks; 49152 is SmolLM2's."""
    draft, target, temperature = ruled_out_logits(4, 3, vocab, dtype, seed=vocab)
    features = on_device(device, dx.distribution_features, draft, target, temperature=temperature)
    assert features.shape == (4, 3, len(dx.DISTRIBUTION_FEATURES)) and features.dtype == torch.float32
    expected = expected_features(draft, target, temperature)
    torch.testing.assert_close(features.double(), expected, atol=TOLERANCE, rtol=0)
    reference = dx.distribution_features_reference(draft, target, temperature=temperature)
    torch.testing.assert_close(features, reference, atol=2 * TOLERANCE, rtol=0)


def test_sharp_rows_against_float64(device):
    """Logits spread over hundreds of nats: most masses underflow to 0 (exp's flush below -87.3), which must cost the
    entropies nothing measurable."""
    draft, target, temperature = ruled_out_logits(4, 3, 1000, torch.float32, seed=2, scale=60.0)
    features = on_device(device, dx.distribution_features, draft, target, temperature=temperature)
    torch.testing.assert_close(features.double(), expected_features(draft, target, temperature), atol=3e-6, rtol=0)
    assert float(features[..., 2:4].min()) > 0.5  # the rows are sharp indeed


def test_scalar_temperature_is_every_rows(device):
    draft, target, _ = ruled_out_logits(3, 2, 33, torch.float32, seed=1)
    with_float = on_device(device, dx.distribution_features, draft, target, temperature=0.6)
    with_tensor = on_device(device, dx.distribution_features, draft, target, temperature=torch.full((3,), 0.6))
    assert torch.equal(with_float, with_tensor)


def test_edges(device):
    uniform = torch.zeros(8)
    one_hot = torch.tensor([0.0] + [float("-inf")] * 7)
    ruled_out = torch.full((8,), float("-inf"))
    draft = torch.stack([uniform, one_hot, one_hot, ruled_out, ruled_out]).unsqueeze(0)
    target = torch.stack([uniform, uniform, one_hot, uniform, ruled_out]).unsqueeze(0)
    features = on_device(device, dx.distribution_features, draft, target, check_inputs=False)[0]
    torch.testing.assert_close(features, torch.tensor([
        [1.0, 1.0, 1 / 8, 1 / 8, 0.0],  # the same uniform rows
        [0.0, 1.0, 1.0, 1 / 8, 7 / 8],  # a one-hot draft
        [0.0, 0.0, 1.0, 1.0, 0.0],  # both one-hot at the same id: no spread, no disagreement
        [0.0, 1.0, 0.0, 1 / 8, 0.5],  # a draft without a finite logit has no mass
        [0.0, 0.0, 0.0, 0.0, 0.0],  # neither has any
    ]), atol=1e-6, rtol=0)
    single = on_device(device, dx.distribution_features, torch.zeros(2, 3, 1), torch.ones(2, 3, 1))  # V = 1
    torch.testing.assert_close(single, torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0]).expand(2, 3, 5))
    assert on_device(device, dx.distribution_features, torch.zeros(2, 0, 5), torch.zeros(2, 0, 5)).shape == (2, 0, 5)
    assert on_device(device, dx.distribution_features, torch.zeros(0, 3, 5), torch.zeros(0, 3, 5)).shape == (0, 3, 5)


def test_unchecked_bad_values_stay_in_the_unit_interval(device):
    """NaN and +inf logits, which check_inputs=False lets through, give values in [0, 1] (a row they touch has no
    mass), as the reference does."""
    draft, target, temperature = ruled_out_logits(4, 6, 37, torch.float32, seed=9)
    generator = torch.Generator().manual_seed(0)
    for logits in (draft, target):
        logits[torch.rand(logits.shape, generator=generator) < 0.02] = float("nan")
    draft[1, 2, 5] = float("inf")
    target[2, 0] = float("-inf")
    features = on_device(device, dx.distribution_features, draft, target, temperature=temperature, check_inputs=False)
    assert bool(((features >= 0) & (features <= 1)).all())
    reference = dx.distribution_features_reference(draft, target, temperature=temperature, check_inputs=False)
    torch.testing.assert_close(features, reference, atol=1e-5, rtol=0)


def bad_feature_cases():
    draft, target, _ = ruled_out_logits(2, 3, 9, torch.float32, seed=4)
    rows = torch.randn(6, 9, generator=torch.Generator().manual_seed(5))
    index = torch.tensor([[0, 1, 2], [3, 4, 5]])
    too_far = torch.tensor([[0, 1, 2], [3, 4, 6]])
    masked_rows = rows.clone()
    masked_rows[4] = float("-inf")
    nan_draft = draft.clone()
    nan_draft[0, 1, 1] = float("nan")
    masked = target.clone()
    masked[1, 2] = float("-inf")
    return {
        "NaN logits": (lambda: dx.distribution_features(nan_draft, target), ValueError, "draft_logits.*NaN"),
        "row without a finite logit": (lambda: dx.distribution_features(draft, masked), ValueError,
                                       "target_logits.*-inf"),
        "positions differ": (lambda: dx.distribution_features(draft, target[:, :2]), ValueError,
                             "target_logits.*positions"),
        "vocabularies differ": (lambda: dx.distribution_features(draft, target[..., :8]), ValueError,
                                "target_logits.*vocabulary"),
        "float64 logits": (lambda: dx.distribution_features(draft.double(), target), TypeError, "draft_logits"),
        "index out of range": (lambda: dx.distribution_features(draft, rows, target_rows=too_far), ValueError,
                               "target_rows\\[1, 2\\] = 6 is outside \\[0, R\\)"),
        "negative index": (lambda: dx.distribution_features(rows, target, draft_rows=-too_far), ValueError,
                           "draft_rows\\[0, 1\\] = -1 is outside"),
        "indexed row without a finite logit": (lambda: dx.distribution_features(draft, masked_rows, target_rows=index),
                                               ValueError, "target_logits row 4 .*-inf"),
        "index shape": (lambda: dx.distribution_features(draft, rows, target_rows=index[:, :2]), ValueError,
                        "target_rows must have shape \\[B, T\\]"),
        "float index": (lambda: dx.distribution_features(draft, rows, target_rows=index.float()), TypeError,
                        "target_rows must be int32 or int64"),
        "3-D tensor with an index": (lambda: dx.distribution_features(draft, target, target_rows=index), ValueError,
                                     "target_logits must have 2 dimensions"),
        "no rows to index": (lambda: dx.distribution_features(draft, rows[:0], target_rows=index), ValueError,
                             "target_logits has no rows"),
        "both indexed, 1-D index": (lambda: dx.distribution_features(rows, rows, target_rows=index[0],
                                                                     draft_rows=index), ValueError, "target_rows"),
        "target_temperature shape": (lambda: dx.distribution_features(draft, target, target_temperature=torch.ones(3)),
                                     ValueError, "target_temperature"),
        "2-D logits": (lambda: dx.distribution_features(draft[0], target[0]), ValueError, "draft_logits"),
        "integer logits": (lambda: dx.distribution_features(draft.long(), target.long()), TypeError, "draft_logits"),
        "temperature shape": (lambda: dx.distribution_features(draft, target, temperature=torch.ones(3)), ValueError,
                              "temperature"),
        "negative temperature": (lambda: dx.distribution_features(draft, target, temperature=-1.0), ValueError,
                                 "temperature"),
    }


@pytest.mark.parametrize("case", list(bad_feature_cases()))
def test_bad_inputs(case):
    call, error, pattern = bad_feature_cases()[case]
    with pytest.raises(error, match=pattern):
        call()


def test_native_checks_back_the_python_layer():
    """The op's own checks (the last line of defence) refuse what the Python layer would."""
    draft, target, temperature = ruled_out_logits(2, 3, 9, torch.float32, seed=4)
    op = torch.ops.diversed.distribution_features
    with pytest.raises(RuntimeError, match="distribution_features.*temperature"):
        op(draft, target, torch.ones(3))
    with pytest.raises(RuntimeError, match="distribution_features: target must be \\[2, 3, V\\]"):
        op(draft, target[:, :2].contiguous(), temperature)
    with pytest.raises(RuntimeError, match="distribution_features.*float32, bfloat16 or float16, or both float64"):
        op(draft, target.double(), temperature)
    rows, index = target.reshape(6, 9), torch.arange(6).reshape(2, 3)
    with pytest.raises(RuntimeError, match="distribution_features.*target_rows"):
        op(draft, rows, temperature, index[:, :2].contiguous())
    with pytest.raises(RuntimeError, match="distribution_features.*with draft_rows, draft must be 2-D"):
        op(draft, target, temperature, None, index)
    with pytest.raises(RuntimeError, match="distribution_features.*target_temperature"):
        op(draft, target, temperature, None, None, torch.ones(3))


def row_tensors(batch, positions, vocab, dtypes, seed):
    """Target rows [R, V] and draft rows [Rd, V] of feature_case's logits, more rows than positions read, and the
    indices [B, T] that read them: shuffled, with repeats."""
    draft, target, temperature = ruled_out_logits(batch, positions, vocab, torch.float32, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    target_rows = torch.cat([target.reshape(-1, vocab), torch.randn(3, vocab, generator=generator)])
    draft_rows = torch.cat([torch.randn(2, vocab, generator=generator), draft.reshape(-1, vocab)])
    target_index = torch.randperm(target_rows.shape[0], generator=generator)[:batch * positions].reshape(batch, -1)
    draft_index = torch.randint(0, draft_rows.shape[0], (batch, positions), generator=generator)
    draft_index[0, 0] = draft_index[-1, -1]  # one row read twice
    return draft_rows.to(dtypes[0]), target_rows.to(dtypes[1]), draft_index, target_index, temperature


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.bfloat16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("vocab", [1, 7, 4099])
def test_rows_read_in_place_are_the_gathered_rows(device, dtypes, vocab):
    """Every row read through an index gives, bit for bit, what the same row gathered into [B, T, V] gives, whichever
    tensor is indexed, for a draft and a target of the same or different dtypes (each read as it lies)."""
    draft_rows, target_rows, draft_index, target_index, temperature = row_tensors(4, 3, vocab, dtypes, seed=vocab)
    gathered = on_device(device, dx.distribution_features, draft_rows[draft_index], target_rows[target_index],
                         temperature=temperature)
    both = on_device(device, dx.distribution_features, draft_rows, target_rows, temperature=temperature,
                     target_rows=target_index, draft_rows=draft_index)
    target_only = on_device(device, dx.distribution_features, draft_rows[draft_index], target_rows,
                            temperature=temperature, target_rows=target_index.int())
    draft_only = on_device(device, dx.distribution_features, draft_rows, target_rows[target_index],
                           temperature=temperature, draft_rows=draft_index)
    for features in (both, target_only, draft_only):
        assert torch.equal(features, gathered)
    expected = expected_features(draft_rows[draft_index], target_rows[target_index], temperature)
    torch.testing.assert_close(both.double(), expected, atol=TOLERANCE, rtol=0)
    reference = dx.distribution_features_reference(draft_rows, target_rows, temperature=temperature,
                                                   target_rows=target_index, draft_rows=draft_index)
    torch.testing.assert_close(both, reference, atol=2 * TOLERANCE, rtol=0)


def test_mixed_dtypes_read_as_they_lie(device):
    """A bfloat16 draft beside float32 target logits reads each exactly: the same features as the draft widened."""
    draft, target, temperature = ruled_out_logits(4, 3, 129, torch.float32, seed=3)
    mixed = on_device(device, dx.distribution_features, draft.bfloat16(), target, temperature=temperature)
    widened = on_device(device, dx.distribution_features, draft.bfloat16().float(), target, temperature=temperature)
    assert torch.equal(mixed, widened)


def test_target_temperature_divides_the_target_rows(device):
    """target_temperature takes the target rows at a temperature of their own (0 counts as 1), the draft rows staying
    at ``temperature``: a server's target rows already divided by the request's temperature, with 1.0."""
    draft, target, temperature = ruled_out_logits(4, 3, 129, torch.float32, seed=6)
    target_temperature = torch.tensor([0.5, 2.0, 0.0, 1.0])
    features = on_device(device, dx.distribution_features, draft, target, temperature=temperature,
                         target_temperature=target_temperature)
    expected = expected_features(draft, target, temperature, target_temperature)
    torch.testing.assert_close(features.double(), expected, atol=TOLERANCE, rtol=0)
    reference = dx.distribution_features_reference(draft, target, temperature=temperature,
                                                   target_temperature=target_temperature)
    torch.testing.assert_close(features, reference, atol=2 * TOLERANCE, rtol=0)
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(-1, 1, 1)
    served = on_device(device, dx.distribution_features, draft, target / scale, temperature=temperature,
                       target_temperature=1.0)
    torch.testing.assert_close(served, on_device(device, dx.distribution_features, draft, target,
                                                 temperature=temperature), atol=2e-6, rtol=0)


def test_unchecked_indices_outside_are_clamped(device):
    """check_inputs=False reads no index on the host: one outside [0, R) is clamped into it, as the reference
    clamps it, so no read leaves the tensor."""
    draft_rows, target_rows, draft_index, target_index, temperature = row_tensors(2, 3, 33, (torch.float32,) * 2, 8)
    target_index[0, 1], target_index[1, 2] = -5, 10 ** 9
    draft_index[1, 0] = draft_rows.shape[0]
    features = on_device(device, dx.distribution_features, draft_rows, target_rows, temperature=temperature,
                         target_rows=target_index, draft_rows=draft_index, check_inputs=False)
    clamped = on_device(device, dx.distribution_features, draft_rows, target_rows, temperature=temperature,
                        target_rows=target_index.clamp(0, target_rows.shape[0] - 1),
                        draft_rows=draft_index.clamp(0, draft_rows.shape[0] - 1))
    assert torch.equal(features, clamped)
    reference = dx.distribution_features_reference(draft_rows, target_rows, temperature=temperature,
                                                   target_rows=target_index, draft_rows=draft_index,
                                                   check_inputs=False)
    torch.testing.assert_close(features, reference, atol=2 * TOLERANCE, rtol=0)


def test_rows_edges(device):
    """No positions to read: [B, 0] indices into a tensor without rows give [B, 0, 5]; B and T come from target_rows
    when both tensors are read through indices."""
    no_positions = torch.zeros(3, 0, dtype=torch.int64)
    empty = on_device(device, dx.distribution_features, torch.zeros(0, 5), torch.zeros(0, 5),
                      target_rows=no_positions, draft_rows=no_positions)
    assert empty.shape == (3, 0, 5)
    first_row = torch.zeros(2, 5, dtype=torch.int64)
    one_row = on_device(device, dx.distribution_features, torch.zeros(1, 4), torch.zeros(1, 4), target_rows=first_row,
                        draft_rows=first_row)
    torch.testing.assert_close(one_row, torch.tensor([1.0, 1.0, 0.25, 0.25, 0.0]).expand(2, 5, 5))
