"""Int8Linear and quantize_weight: torch's dynamically quantised linear layer (quantize_dynamic, per-channel weights)
over uint8's whole range, applied to each row of the input alone, without torch's quantised tensors, checked against
torch's quantisation of the weights and of each row; and the layer's plain-torch arithmetic where the native ops are
missing, against the native product."""

import warnings

import pytest
import torch

from diversed_ext.forward import int8 as int8_module
from diversed_ext.forward.int8 import Int8Linear, quantize_weight
from helpers import requires_pinned_quantised_layer, torch_full_range_product

ROUNDING = 2e-6  # relative to the largest output: float rounding of the rescaling, nothing more


def torch_quantised(linear):
    """torch's own dynamically quantised copy of ``linear`` (the oracle)."""
    with warnings.catch_warnings():  # torch.ao's quantisation announces its deprecation on every call
        warnings.simplefilter("ignore")
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        return torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear: qconfig},
                                                      torch.qint8)[0]


def torch_weight(layer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return layer._weight_bias()[0]


def weights_to_quantise():
    """Random weights over six decades, rows of different decades in one weight, an all-zero one, one element, and one
    whose entries sit exactly half a step from the grid (ties, rounded to even) with the largest |w| on the negative
    side (-127.5 steps: -128)."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(37, 53, generator=generator) * 10.0 ** power for power in range(-4, 2)]
    weights.append(torch.randn(6, 9, generator=generator) * torch.logspace(-4, 1, 6).unsqueeze(1))
    weights += [torch.zeros(8, 5), torch.tensor([[0.3]])]
    ties = torch.tensor([[-127.5, 0.5, 1.5, 2.5, -2.5, 126.5, 127.0]]) * (0.02 / 127.5)
    weights.append(ties)
    return weights


@requires_pinned_quantised_layer
def test_quantize_weight_is_quantize_dynamics_bit_for_bit():
    for weight in weights_to_quantise():
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            linear.weight.copy_(weight)
        expected = torch_weight(torch_quantised(linear))
        quantised, scale = quantize_weight(weight)
        assert quantised.dtype == torch.int8 and torch.equal(quantised, expected.int_repr())
        assert scale.dtype == torch.float32 and torch.equal(scale.double(), expected.q_per_channel_scales())
        assert torch.equal(Int8Linear(quantised, scale).dequantized_weight(), expected.dequantize())
    assert int(quantize_weight(weights_to_quantise()[-1])[0][0, 0]) == -128


@requires_pinned_quantised_layer
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (2, 3, 24)])
def test_the_layer_computes_torchs_full_range_product_for_each_row_alone(bias, shape):
    torch.manual_seed(len(shape) + shape[0])
    linear = torch.nn.Linear(24, 40, bias=bias)
    ours = Int8Linear.from_float(linear)
    weight = torch_weight(torch_quantised(linear))
    parts = (weight.int_repr(), weight.q_per_channel_scales(), linear.bias)
    for shift in (0.0, 1.5, -1.5):  # both signs, all positive, all negative
        x = torch.randn(shape) * 2.0 + shift
        x[(0,) * (x.dim() - 1)] *= 100.0  # an outlier row: quantised with the rest it would coarsen them
        rows = x.reshape(-1, 24).split(1)
        expected = torch.cat([torch_full_range_product(row, *parts) for row in rows]).float().view(*shape[:-1], 40)
        got = ours(x)
        assert got.shape == expected.shape == (*shape[:-1], 40)
        assert float((got - expected).abs().max()) <= ROUNDING * max(1.0, float(expected.abs().max()))


def input_cases():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, 64, generator=generator), torch.rand(2, 64, generator=generator) + 1.0,
            -torch.rand(2, 64, generator=generator) - 1.0, torch.zeros(1, 64),
            torch.randn(2, 64, generator=generator) * 1e-7,  # every input rounds to the zero point
            torch.randn(2, 64, generator=generator) * 1e-3,  # below the smallest input scale, which then applies
            torch.randn(4, 64, generator=generator) * 1e4,
            torch.randn(2, 3, 64, generator=generator)]


@pytest.mark.parametrize("index", range(len(input_cases())))
def test_without_native_ops_the_layer_computes_the_same_sums(index, monkeypatch):
    """A verify-only build has no int8_linear: the layer then quantises its input with the same parameters and sums
    exactly in float64. Equal to the native product up to one input rounding step at an exact .5 (float against
    double arithmetic) and the float epilogue."""
    torch.manual_seed(2)
    layer = Int8Linear.from_float(torch.nn.Linear(64, 48, bias=True))
    x = input_cases()[index]
    native = layer(x).double()
    monkeypatch.setattr(int8_module, "forward_ops_built", lambda: False)
    plain = layer(x).double()
    assert plain.shape == native.shape
    span = max(float(x.max()), 0.0) - min(float(x.min()), 0.0)
    step = max(span / 255, 6.1e-5) * float(layer.scale.max()) * 127  # one input step against the largest |w|
    assert float((plain - native).abs().max()) <= step + 1e-5 * float(native.abs().max())
    assert float((plain - native).abs().mean()) <= 1e-4 * max(float(native.abs().mean()), 1e-6)
    assert layer(torch.empty(0, 64)).shape == (0, 48)


def test_buffers_changed_or_replaced_are_seen_and_round_trip_through_a_state_dict():
    torch.manual_seed(3)
    layer = Int8Linear.from_float(torch.nn.Linear(16, 12, bias=True))
    x = torch.randn(2, 16)
    before = layer(x)
    with torch.no_grad():
        layer.weight.copy_(-layer.weight.clamp(min=-127))
        layer.bias.add_(1.0)
    after = layer(x)
    fresh = Int8Linear(layer.weight.clone(), layer.scale.clone(), layer.bias.clone())
    assert torch.equal(after, fresh(x)) and not torch.allclose(before, after)
    layer.weight = torch.zeros_like(layer.weight)  # a buffer replaced, not changed in place
    assert torch.equal(layer(x), layer.bias.expand(2, 12))
    layer.weight = fresh.weight.clone()
    copy = Int8Linear(torch.zeros(12, 16, dtype=torch.int8), 1.0, torch.zeros(12))
    copy.load_state_dict(layer.state_dict())
    assert torch.equal(copy(x), after)
    assert set(layer.state_dict()) == {"weight", "scale", "bias"}
    assert "in_features=16, out_features=12" in repr(layer)


def test_bad_arguments_name_what_is_wrong():
    weight = torch.zeros(4, 3, dtype=torch.int8)
    with pytest.raises(TypeError, match="Int8Linear.*int8"):
        Int8Linear(weight.float(), 1.0)
    with pytest.raises(TypeError, match="Int8Linear.*2-D"):
        Int8Linear(torch.zeros(3, dtype=torch.int8), 1.0)
    for scale in (0.0, -1.0, float("inf"), float("nan"), torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.ones(3)):
        with pytest.raises(ValueError, match="Int8Linear.*scale"):
            Int8Linear(weight, scale)
    assert torch.equal(Int8Linear(weight, 0.5).scale, torch.full((4,), 0.5))  # one number: every row's
    with pytest.raises(ValueError, match="Int8Linear.*bias"):
        Int8Linear(weight, 1.0, torch.zeros(3))
    layer = Int8Linear(weight, 1.0)
    with pytest.raises(TypeError, match="input"):
        layer(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="input"):
        layer(torch.zeros(2, 5))
