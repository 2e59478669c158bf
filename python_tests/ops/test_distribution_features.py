"""distribution_features: the fused op against float64 formulas and its PyTorch reference, at the edges (V = 1, rows
ruled out entirely, -inf entries, T = 0), with values only check_inputs=False lets through, and its argument errors.

Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is visible); the opcheck is in
test_verify_api.py::test_opcheck and the builds' bitwise agreement in test_logits.py."""

import math

import pytest
import torch

import diversed_ext as dx
from helpers import DTYPES, on_device

TOLERANCE = 3e-6  # every dtype alike: the logits are read exactly as they lie


def expected_features(draft_logits, target_logits, temperature):
    """The five features in float64, written out; temperature [B] (0 counts as 1)."""
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).double().view(-1, 1, 1)
    q = (draft_logits.double() / scale).softmax(-1)
    p = (target_logits.double() / scale).softmax(-1)
    vocab = draft_logits.shape[-1]

    def entropy(probs):
        if vocab == 1:
            return torch.zeros(probs.shape[:-1], dtype=torch.float64)
        return -(probs * probs.clamp_min(1e-300).log()).sum(-1) / math.log(vocab)

    return torch.stack([entropy(q), entropy(p), q.amax(-1), p.amax(-1), 0.5 * (p - q).abs().sum(-1)], dim=-1)


def feature_case(batch, positions, vocab, dtype, seed, scale=3.0):
    """Logits [B, T, V] with a quarter of every row's entries ruled out (-inf) but each row's first, per-row
    temperatures with a greedy row."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(batch, positions, vocab, generator=generator) * scale
    target = torch.randn(batch, positions, vocab, generator=generator) * scale
    for logits in (draft, target):
        ruled_out = torch.rand(logits.shape, generator=generator) < 0.25
        ruled_out[..., 0] = False
        logits[ruled_out] = float("-inf")
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.7])[:batch]
    return draft.to(dtype), target.to(dtype), temperature


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 7, 129, 4099, 49152])
def test_matches_float64_and_reference(device, dtype, vocab):
    """V = 4099 leaves a tail after the last group of lanes and spans two softmax blocks; 49152 is SmolLM2's."""
    draft, target, temperature = feature_case(4, 3, vocab, dtype, seed=vocab)
    features = on_device(device, dx.distribution_features, draft, target, temperature=temperature)
    assert features.shape == (4, 3, len(dx.DISTRIBUTION_FEATURES)) and features.dtype == torch.float32
    expected = expected_features(draft, target, temperature)
    torch.testing.assert_close(features.double(), expected, atol=TOLERANCE, rtol=0)
    reference = dx.distribution_features_reference(draft, target, temperature=temperature)
    torch.testing.assert_close(features, reference, atol=2 * TOLERANCE, rtol=0)


def test_sharp_rows_against_float64(device):
    """Logits spread over hundreds of nats: most masses underflow to 0 (exp's flush below -87.3), which must cost the
    entropies nothing measurable."""
    draft, target, temperature = feature_case(4, 3, 1000, torch.float32, seed=2, scale=60.0)
    features = on_device(device, dx.distribution_features, draft, target, temperature=temperature)
    torch.testing.assert_close(features.double(), expected_features(draft, target, temperature), atol=3e-6, rtol=0)
    assert float(features[..., 2:4].min()) > 0.5  # the rows are sharp indeed


def test_scalar_temperature_is_every_rows(device):
    draft, target, _ = feature_case(3, 2, 33, torch.float32, seed=1)
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
    draft, target, temperature = feature_case(4, 6, 37, torch.float32, seed=9)
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
    draft, target, _ = feature_case(2, 3, 9, torch.float32, seed=4)
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
        "dtypes differ": (lambda: dx.distribution_features(draft, target.half()), TypeError, "same dtype"),
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
    draft, target, temperature = feature_case(2, 3, 9, torch.float32, seed=4)
    op = torch.ops.diversed.distribution_features
    with pytest.raises(RuntimeError, match="distribution_features.*temperature"):
        op(draft, target, torch.ones(3))
    with pytest.raises(RuntimeError, match="distribution_features.*\\[B, T, V\\]"):
        op(draft, target[:, :2].contiguous(), temperature)
    with pytest.raises(RuntimeError, match="distribution_features.*dtypes differ"):
        op(draft, target.half(), temperature)
