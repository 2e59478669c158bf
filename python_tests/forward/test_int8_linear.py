"""diversed::int8_pack / int8_linear against torch's dynamically quantised linear layer (quantize_dynamic, fbgemm)
over uint8's whole range: torch's int8 weights and scales, torch's quantisation of the input, exact integer sums.

The op quantises its input as torch does, so the int32 sums are the same and the outputs differ only by float
rounding in the rescaling: the comparisons below allow a few ulps of the output's magnitude, far below one step of
the input's quantisation (which would move an output by x_scale * w_scale * |w|, i.e. about 1e-3 relative)."""

import warnings

import pytest
import torch

from diversed_ext.forward.int8 import Int8Linear, int8_linear, pack_int8
from helpers import requires_pinned_quantised_layer, torch_full_range_product, use_cpu_build

ROUNDING = 2e-6  # relative to the largest output: float rounding of the rescaling, nothing more


def float_layer(out_features, in_features, bias, seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias)


def int8_layer(out_features, in_features, bias, seed):
    """torch's own dynamically quantised layer (the oracle) of a seeded float layer."""
    with warnings.catch_warnings():  # torch.ao's quantisation announces its deprecation on every call
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(float_layer(out_features, in_features, bias, seed)),
            {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, torch.qint8)[0]


def parts_of(layer):
    """(int8 weight, scale per output feature, bias) of torch's quantised layer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weight, bias = layer._weight_bias()
        return weight.int_repr(), weight.q_per_channel_scales().float(), bias


def our_parts(out_features, in_features, bias, seed):
    """(int8 weight, scale, bias) of the package's own int8 layer, for the tests that need no oracle."""
    return Int8Linear.from_float(float_layer(out_features, in_features, bias, seed)).parts()


def assert_matches_layer(layer, x):
    expected = torch_full_range_product(x, *parts_of(layer)).float()
    got = int8_linear(x, pack_int8([parts_of(layer)]))
    assert got.shape == expected.shape
    tolerance = ROUNDING * max(1.0, float(expected.abs().max()))
    assert float((got - expected).abs().max()) <= tolerance


@requires_pinned_quantised_layer
@pytest.mark.parametrize("out_features,in_features,rows", [(1, 1, 1), (17, 5, 1), (16, 4, 1), (33, 63, 3),
                                                          (96, 130, 4), (50, 7, 5), (576, 576, 1), (200, 1536, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_quantised_layer(out_features, in_features, rows, bias):
    layer = int8_layer(out_features, in_features, bias, seed=out_features + in_features + rows)
    generator = torch.Generator().manual_seed(rows)
    for shift in (0.0, 1.5, -1.5):  # inputs of both signs, all positive (zero point 0), all negative (zero point 255)
        assert_matches_layer(layer, torch.randn(rows, in_features, generator=generator) * 2.0 + shift)


@requires_pinned_quantised_layer
@pytest.mark.parametrize("scale", [0.0, 1e-7, 1e4])
def test_matches_the_layer_on_zero_tiny_and_large_inputs(scale):
    """Zero input (scale falls back to 0.1), tiny inputs (the minimum scale kicks in), large ones."""
    layer = int8_layer(40, 24, True, seed=1)
    assert_matches_layer(layer, torch.randn(3, 24, generator=torch.Generator().manual_seed(2)) * scale)


@requires_pinned_quantised_layer
def test_leading_dimensions_and_zero_rows():
    layer = int8_layer(10, 12, True, seed=3)
    packed = pack_int8([parts_of(layer)])
    x = torch.randn(2, 3, 12)
    assert int8_linear(x, packed).shape == (2, 3, 10)
    torch.testing.assert_close(int8_linear(x, packed), torch_full_range_product(x, *parts_of(layer)).float(), rtol=0,
                               atol=1e-5)
    assert int8_linear(torch.empty(0, 12), packed).shape == (0, 10)
    assert int8_linear(torch.empty(4, 0, 12), packed).shape == (4, 0, 10)


def test_fused_parts_equal_separate_calls():
    """q/k/v read the same input, so one call over the three packed together gives each part's own output exactly."""
    parts = [our_parts(n, 24, bias, seed=n) for n, bias in ((32, False), (8, True), (8, False))]
    x = torch.randn(3, 24)
    fused = int8_linear(x, pack_int8(parts))
    separate = [int8_linear(x, pack_int8([part])) for part in parts]
    assert torch.equal(fused, torch.cat(separate, dim=-1))


def exact_integer_product(x, weight, scale, bias):
    """The layer's arithmetic written out in Python: the input quantised per tensor to [0, 255], exact integer sums,
    then the float rescaling (rounded differently from the kernel's fused epilogue: a few ulps)."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    x_scale = (high - low) / 255 if high > low else 0.1
    zero_point = min(255, max(0, round(-low / x_scale)))
    quantised = torch.clamp(torch.round(x / x_scale + zero_point), 0, 255).to(torch.int64)
    sums = (quantised - zero_point) @ weight.to(torch.int64).t()
    return sums.double() * (x_scale * scale) + (0 if bias is None else bias.double())


@pytest.mark.parametrize("rows,in_features", [(1, 576), (9, 1536), (4, 63)])
def test_matches_the_exact_integer_arithmetic(rows, in_features):
    """Against the arithmetic itself, whatever torch version: equal up to one input rounding step at an exact .5
    (x / scale computed as x * (1 / scale) in the kernel) and the float epilogue."""
    weight, scale, bias = our_parts(48, in_features, True, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(11)) * 2.0 + 0.5
    got = int8_linear(x, pack_int8([(weight, scale, bias)])).double()
    expected = exact_integer_product(x, weight, scale, bias)
    step = (max(float(x.max()), 0.0) - min(float(x.min()), 0.0)) / 255 * float(scale.max()) * 127  # one input step
    assert float((got - expected).abs().max()) <= step + 1e-4 * float(expected.abs().max())
    assert float((got - expected).abs().mean()) <= 1e-3 * float(expected.abs().mean())


@pytest.mark.parametrize("build", ["default", "avx2", "baseline"])
def test_extreme_weights_and_inputs_sum_exactly(build, monkeypatch):
    """Weights at -128 and 127 against inputs at 255, the top of the quantised range: pair sums of 65,280 in size,
    which a saturating u8 x s8 instruction (int16) would get wrong. Every build must give the exact integer sums."""
    if build != "default":
        use_cpu_build(monkeypatch, build)
    in_features = 64
    weight = torch.full((32, in_features), -128, dtype=torch.int8)
    weight[16:] = 127
    x = torch.full((3, in_features), 5.0)
    x[1, ::2] = 0.0  # inputs alternate between both ends of the range
    x[2, 0] = -1e-3  # a zero point of 0 with every other input at the top
    got = int8_linear(x, pack_int8([(weight, 0.01, None)]), row_groups=[1, 1, 1]).double()
    expected = torch.cat([exact_integer_product(row[None], weight, 0.01, None) for row in x])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("build", ["default", "avx2", "baseline"])
def test_row_groups_give_each_group_what_it_gets_alone(build, monkeypatch):
    """Sequences stacked into one call (a batched decoding pass) each get exactly their own call's result, though
    their ranges differ widely (one group all positive, one around zero, one large)."""
    if build != "default":
        use_cpu_build(monkeypatch, build)
    layer = int8_layer(40, 37, True, seed=8)
    packed = pack_int8([parts_of(layer)])
    generator = torch.Generator().manual_seed(9)
    groups = [torch.rand(3, 37, generator=generator) + 1.0, torch.randn(1, 37, generator=generator),
              torch.randn(2, 37, generator=generator) * 50.0]
    stacked = int8_linear(torch.cat(groups), packed, row_groups=[3, 1, 2])
    alone = torch.cat([int8_linear(group, packed) for group in groups])
    assert torch.equal(stacked, alone)
    assert not torch.equal(int8_linear(torch.cat(groups), packed), alone)  # one shared quantisation differs
    assert torch.equal(int8_linear(torch.cat(groups), packed, row_groups=[6]), int8_linear(torch.cat(groups), packed))
    assert_matches_layer(layer, groups[1])  # a group alone is still the layer's own arithmetic


MAX_IN_FEATURES = (2 ** 31 - 1) // (255 * 128)  # the longest rows whose int32 sums of u8 x s8 cannot overflow


@pytest.mark.parametrize("build", ["default", "avx2", "baseline"])
def test_the_longest_rows_allowed_sum_exactly_and_longer_ones_are_refused(build, monkeypatch):
    """At the bound, every input at 255 against weights at -128 sums to -2,147,483,520, within int32; a row one
    longer could overflow, so int8_pack and int8_linear refuse it."""
    if build != "default":
        use_cpu_build(monkeypatch, build)
    weight = torch.full((16, MAX_IN_FEATURES), -128, dtype=torch.int8)
    weight[8:] = 127
    x = torch.ones(2, MAX_IN_FEATURES)
    got = int8_linear(x, pack_int8([(weight, 1.0, None)])).double()
    x_scale = 1.0 / 255  # inputs all at 1.0: zero point 0, each quantised to 255
    expected = torch.tensor([-128.0] * 8 + [127.0] * 8, dtype=torch.float64) * 255 * MAX_IN_FEATURES * x_scale
    torch.testing.assert_close(got, expected.expand(2, 16), rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match=f"at most {MAX_IN_FEATURES}"):
        torch.ops.diversed.int8_pack(torch.zeros(1, MAX_IN_FEATURES + 1, dtype=torch.int8))
    packed = pack_int8([(weight[:, :-1].contiguous(), 1.0, None)])  # a valid packing to hand the op a longer input
    with pytest.raises(RuntimeError, match=f"at most {MAX_IN_FEATURES}"):
        torch.ops.diversed.int8_linear(torch.ones(1, MAX_IN_FEATURES + 1), packed.packed, packed.col_sums,
                                       packed.w_scale, None)


def test_bad_row_groups_are_refused_by_both_checks():
    packed = pack_int8([our_parts(8, 8, False, seed=10)])
    x = torch.randn(3, 8)
    for groups in ([1, 1], [2, 2], [3, 0], [-1, 4]):
        with pytest.raises(ValueError, match="row_groups"):
            int8_linear(x, packed, row_groups=groups)
        with pytest.raises(RuntimeError, match="row_groups"):
            int8_linear(x, packed, row_groups=groups, check=False)


@pytest.mark.parametrize("rows", [1, 2, 5, 7])  # the AVX2 tiles take rows in pairs, the VNNI ones in fours
@pytest.mark.parametrize("build", ["avx2", "baseline"])
def test_every_build_equals_the_widest(build, rows, monkeypatch):
    """The widest build this CPU runs (VNNI on AVX-512 CPUs, else AVX2) against the narrower ones: identical bits."""
    packed = pack_int8([our_parts(70, 45, True, seed=4)])
    x = torch.randn(rows, 45) * 3.0
    widest = int8_linear(x, packed)
    use_cpu_build(monkeypatch, build)
    assert torch.equal(int8_linear(x, packed), widest)


@pytest.mark.parametrize("in_features", [9, 40])  # the scalar loops only, and 16-lane vectors with a tail
def test_non_finite_inputs_stay_memory_safe_and_agree_across_builds(in_features, monkeypatch):
    packed = pack_int8([our_parts(20, in_features, False, seed=5)])
    cases = [torch.randn(2, in_features) for _ in range(3)]
    cases[0][0, 3], cases[0][1, 0] = float("nan"), float("inf")
    cases[1][:, 5] = float("nan")
    cases[2][:] = float("nan")
    default = [int8_linear(x, packed) for x in cases]
    for build in ("avx2", "baseline"):
        use_cpu_build(monkeypatch, build)
        for x, expected in zip(cases, default):
            assert expected.shape == (2, 20)
            torch.testing.assert_close(int8_linear(x, packed), expected, rtol=0, atol=0, equal_nan=True)


def test_bad_arguments_name_the_argument():
    weight, scale, bias = our_parts(16, 8, True, seed=6)
    packed = pack_int8([(weight, scale, bias)])
    with pytest.raises(ValueError, match="input"):
        int8_linear(torch.randn(2, 9), packed)
    with pytest.raises(TypeError, match="input"):
        int8_linear(torch.randn(2, 8, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="weights"):
        pack_int8([])
    with pytest.raises(TypeError, match=r"weights\[0\]"):
        pack_int8([(weight.float(), scale, bias)])
    with pytest.raises(ValueError, match=r"weights\[1\].*in_features"):
        pack_int8([(weight, scale, bias), (weight[:, :4].contiguous(), scale, None)])
    with pytest.raises(ValueError, match=r"weights\[0\].*scale"):
        pack_int8([(weight, 0.0, bias)])
    with pytest.raises(ValueError, match=r"weights\[0\].*bias"):
        pack_int8([(weight, scale, bias[:3])])
    # The native op checks its own arguments too: never a read past a buffer.
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.diversed.int8_linear(torch.randn(1, 8), packed.packed[:-1], packed.col_sums, packed.w_scale, None)
    with pytest.raises(RuntimeError, match="col_sums"):
        torch.ops.diversed.int8_linear(torch.randn(1, 8), packed.packed, packed.col_sums[:3], packed.w_scale, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.diversed.int8_linear(torch.randn(1, 8), packed.packed, packed.col_sums, packed.w_scale,
                                       packed.bias[:2])
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.diversed.int8_pack(torch.zeros(3, dtype=torch.int8))


def test_opcheck():
    weight, scale, bias = our_parts(21, 13, True, seed=7)
    torch.library.opcheck(torch.ops.diversed.int8_pack.default, (weight,))
    packed = pack_int8([(weight, scale, bias)])
    for x in (torch.randn(1, 13), torch.randn(2, 3, 13)):
        torch.library.opcheck(torch.ops.diversed.int8_linear.default,
                              (x, packed.packed, packed.col_sums, packed.w_scale, packed.bias))
    torch.library.opcheck(torch.ops.diversed.int8_linear.default,
                          (torch.randn(4, 13), packed.packed, packed.col_sums, packed.w_scale, None))
    torch.library.opcheck(torch.ops.diversed.int8_linear.default,
                          (torch.randn(5, 13), packed.packed, packed.col_sums, packed.w_scale, packed.bias, [2, 3]))
