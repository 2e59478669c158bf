"""The lean forward's native ops: float products over packed weights (diversed::float_pack / float_linear) and every
layer of a Llama in one call (diversed::int8_llama_layers, float_llama_layers), against plain PyTorch and the
op-by-op path, across the CPU builds, for batch invariance, memory safety on bad arguments, and opcheck."""

import copy

import pytest
import torch

from diversed_ext.forward.llama_runner import LlamaRunner
from diversed_ext.forward import quantize_int8
from diversed_ext.forward.float_linear import float_linear, pack_float
from helpers import FORWARD_CONFIGS, FORWARD_SCHEDULE, FORWARD_VOCAB, forward_llama, use_cpu_build

BUILDS = ["avx512", "avx2", "baseline"]  # DIVERSED_CPU_CAPABILITY caps the build; a CPU without one runs a narrower


def packed_linear(out_features, in_features, bias, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias_tensor = torch.randn(out_features, generator=generator) if bias else None
    return weight, bias_tensor, pack_float([(weight, bias_tensor)])


# ------------------------------------------------------------------------------------------------ float_linear

@pytest.mark.parametrize("out_features,in_features", [(1, 1), (17, 5), (16, 16), (33, 63), (200, 576), (49, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("bias", [False, True])
def test_float_linear_matches_float64(out_features, in_features, rows, bias):
    weight, bias_tensor, packed = packed_linear(out_features, in_features, bias, seed=out_features * rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    expected = torch.nn.functional.linear(x.double(), weight.double(),
                                          None if bias_tensor is None else bias_tensor.double())
    got = float_linear(x, packed)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # An in-order float sum of in_features products: error within in_features ulps of the terms' magnitude.
    bound = in_features * 1.2e-7 * float((x.abs().double() @ weight.abs().double().t()).max()) + 1e-6
    assert float((got.double() - expected).abs().max()) <= bound


def test_float_linear_fuses_parts_and_keeps_leading_dimensions():
    parts = [packed_linear(n, 24, bias, seed=n)[:2] for n, bias in ((10, True), (7, False), (16, True))]
    packed = pack_float(parts)
    x = torch.randn(2, 3, 24)
    expected = torch.cat([torch.nn.functional.linear(x, weight, bias) for weight, bias in parts], dim=-1)
    torch.testing.assert_close(float_linear(x, packed), expected, rtol=1e-5, atol=1e-5)
    assert float_linear(torch.zeros(0, 24), packed).shape == (0, 33)


def test_float_products_have_no_int8_length_bound():
    """Float products sum in float, so rows longer than the int8 products' int32 bound (65,793 inputs) are packed and
    multiplied like any other."""
    in_features = 65_794
    weight = torch.randn(2, in_features, generator=torch.Generator().manual_seed(4))
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(5))
    expected = torch.nn.functional.linear(x.double(), weight.double())
    got = float_linear(x, pack_float([(weight, None)]))
    bound = in_features * 1.2e-7 * float((x.abs().double() @ weight.abs().double().t()).max())
    assert float((got.double() - expected).abs().max()) <= bound


def test_float_linear_rows_never_depend_on_their_neighbours():
    """Each output is summed in the same order whatever the row count: a row's result is bit for bit the same alone
    or among 1..19 other rows (MKL changes its algorithm with the row count)."""
    _, _, packed = packed_linear(70, 100, True, seed=3)
    x = torch.randn(20, 100)
    alone = torch.cat([float_linear(x[row:row + 1], packed) for row in range(20)])
    for rows in (2, 5, 8, 9, 16, 20):
        assert torch.equal(float_linear(x[:rows], packed), alone[:rows])


@pytest.mark.parametrize("build", BUILDS[1:])
def test_float_linear_builds_agree_bit_for_bit(build, monkeypatch):
    _, _, packed = packed_linear(37, 45, True, seed=5)
    x = torch.randn(11, 45)
    x[3, 4] = float("nan")  # NaN stays in its row and column
    default = float_linear(x, packed)
    use_cpu_build(monkeypatch, build)
    torch.testing.assert_close(float_linear(x, packed), default, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(default[3]).all() and not torch.isnan(default[[0, 1, 2, 4]]).any()


def test_float_ops_name_their_bad_arguments():
    weight, bias, packed = packed_linear(20, 8, True, seed=1)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.diversed.float_linear(torch.randn(2, 8), packed.packed, bias, 33)  # another tile count
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.diversed.float_linear(torch.randn(2, 9), packed.packed, bias, 20)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.diversed.float_linear(torch.randn(2, 8), packed.packed, bias[:5], 20)
    with pytest.raises(RuntimeError, match="input"):
        torch.ops.diversed.float_linear(torch.randn(2, 8).double(), packed.packed, bias, 20)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.diversed.float_pack(torch.zeros(3))
    with pytest.raises(TypeError, match="float32"):
        pack_float([(weight.double(), None)])
    with pytest.raises(ValueError, match="in_features"):
        pack_float([(weight, None), (torch.randn(4, 9), None)])


def test_float_ops_opcheck():
    weight, bias, packed = packed_linear(21, 13, True, seed=7)
    torch.library.opcheck(torch.ops.diversed.float_pack.default, (weight,))
    for x in (torch.randn(1, 13), torch.randn(2, 3, 13)):
        torch.library.opcheck(torch.ops.diversed.float_linear.default, (x, packed.packed, bias, 21))
    torch.library.opcheck(torch.ops.diversed.float_linear.default, (torch.randn(9, 13), packed.packed, None, 21))


# ------------------------------------------------------------------------------------------------ llama layers

KINDS = ["int8", "float"]


def native_runner(kind="int8", name="gqa", seed=2):
    model = forward_llama(seed, **FORWARD_CONFIGS[name])
    runner = LlamaRunner(quantize_int8(model) if kind == "int8" else model)
    assert runner.native is not None and runner.native.int8 == (kind == "int8")  # the native path is under test
    return runner


def python_runner(runner):
    """The same model through the op-by-op path (the native layers switched off)."""
    other = copy.copy(runner)
    other.native = None
    return other


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(FORWARD_CONFIGS))
def test_native_layers_match_the_op_by_op_path(kind, name):
    """Along the decoding schedule (feeds and crops), the native layers give the op-by-op path's logits up to float
    rounding (which can move an int8 activation across one quantisation step now and then)."""
    native = native_runner(kind, name)
    reference = python_runner(native)
    native_cache = reference_cache = None
    generator = torch.Generator().manual_seed(11)
    for step in FORWARD_SCHEDULE:
        if step < 0:
            native_cache.crop(step)
            reference_cache.crop(step)
            continue
        feed = torch.randint(0, FORWARD_VOCAB, (step,), generator=generator).tolist()
        logits, hidden, native_cache = native(feed, native_cache, step, True)
        expected_logits, expected_hidden, reference_cache = reference(feed, reference_cache, step, True)
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hidden, expected_hidden, rtol=1e-4, atol=1e-4)
        assert native_cache.get_seq_length() == reference_cache.get_seq_length()


@pytest.mark.parametrize("kind", KINDS)
def test_native_rows_equal_one_row_passes_exactly(kind):
    runner = native_runner(kind, "multi-head")
    feeds = [[1, 5, 9, 2, 30, 4, 4], [3], [8, 8]]
    batched, hidden, _ = runner.run_rows(feeds, [None] * 3, [len(feed) for feed in feeds], True)
    alone = [runner(feed, None, len(feed), True) for feed in feeds]
    assert torch.equal(batched, torch.cat([logits for logits, _, _ in alone]))
    assert torch.equal(hidden, torch.cat([states for _, states, _ in alone]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("build", BUILDS[1:])
def test_native_layers_builds_agree_bit_for_bit(kind, build, monkeypatch):
    runner = native_runner(kind, "biases")
    feeds = [[1, 5, 9, 2, 30, 4, 4], [3], [8, 8]]
    default, _, _ = runner.run_rows(feeds, [None] * 3, [len(feed) for feed in feeds], False)
    use_cpu_build(monkeypatch, build)
    again, _, _ = runner.run_rows(feeds, [None] * 3, [len(feed) for feed in feeds], False)
    assert torch.equal(again, default)


@pytest.mark.parametrize("kind", KINDS)
def test_native_layers_poisoned_scratch_changes_nothing(kind, monkeypatch):
    """Under the test hook every scratch buffer starts as NaN: a value read before it is written would show."""
    runner = native_runner(kind, "head-dim-16")
    feeds = [[1, 2, 3, 4], [5]]
    # conftest turns poisoning on for every test: unset here, so the first run really is the clean one.
    monkeypatch.delenv("DIVERSED_POISON_OUTPUTS", raising=False)
    clean, _, _ = runner.run_rows(feeds, [None] * 2, [4, 1], False)
    monkeypatch.setenv("DIVERSED_POISON_OUTPUTS", "1")
    poisoned, _, _ = runner.run_rows(feeds, [None] * 2, [4, 1], False)
    assert torch.equal(clean, poisoned) and torch.isfinite(clean).all()


def native_call(runner, tokens=3, capacity=16, cache_length=0, **overrides):
    """(op, keyword arguments) of one native call for one row, with any argument replaced."""
    layers = runner.native
    keys = torch.zeros(len(runner.layers), runner.num_kv_heads, capacity, runner.head_dim)
    arguments = dict(states=torch.randn(tokens, runner.model.config.hidden_size), norms=list(layers.norms),
                     packed=[weights.packed for weights in layers.products],
                     biases=[weights.bias for weights in layers.products],
                     cos=torch.ones(tokens, runner.head_dim), sin=torch.zeros(tokens, runner.head_dim),
                     keys=[keys], values=[keys.clone()], cache_lengths=[cache_length], row_counts=[tokens],
                     num_heads=layers.num_heads, eps=layers.eps, attention_scale=layers.attention_scale)
    op = torch.ops.diversed.float_llama_layers
    if layers.int8:
        op = torch.ops.diversed.int8_llama_layers
        arguments.update(col_sums=[weights.col_sums for weights in layers.products],
                         w_scales=[weights.w_scale for weights in layers.products])
    arguments.update(overrides)
    return op, arguments


@pytest.mark.parametrize("kind", KINDS)
def test_native_layers_refuse_bad_arguments_by_name(kind):
    runner = native_runner(kind)
    op, arguments = native_call(runner)
    op(**arguments)  # the unchanged call runs
    packed = arguments["packed"]
    cache = (len(runner.layers), runner.num_kv_heads)
    bad = {
        "room": dict(cache_length=14),  # 14 cached + 3 new > capacity 16
        "row_counts": dict(row_counts=[2]),
        "cos": dict(cos=torch.ones(3, runner.head_dim + 2)),
        "num_heads": dict(num_heads=3),
        "norms": dict(norms=arguments["norms"][:-1]),
        r"norms\[1\]": dict(norms=[arguments["norms"][0], arguments["norms"][1][:-1], *arguments["norms"][2:]]),
        r"packed\[1\] \(layer 0, o\)": dict(packed=[packed[0], packed[1][:-1], *packed[2:]]),
        r"packed\[6\] \(layer 1, gate_up\)": dict(packed=[*packed[:6], packed[6].double(), *packed[7:]]),
        "keys": dict(keys=[torch.zeros(*cache, 16, runner.head_dim + 2)]),
        "values": dict(values=[torch.zeros(*cache, 32, runner.head_dim)]),  # keys hold 16 positions
        "multiple of 16": dict(keys=[torch.zeros(*cache, 8, runner.head_dim)],
                               values=[torch.zeros(*cache, 8, runner.head_dim)]),
        "states": dict(states=torch.randn(3, 5)),
        "biases": dict(biases=[None] * (len(packed) - 1)),
    }
    if kind == "int8":
        bad[r"col_sums\[1\]"] = dict(col_sums=[arguments["col_sums"][0], arguments["col_sums"][1][:-1],
                                                *arguments["col_sums"][2:]])
    for match, overrides in bad.items():
        with pytest.raises(RuntimeError, match=match):
            op(**native_call(runner, **overrides)[1])


def test_int8_layers_refuse_a_down_projection_longer_than_the_int32_bound():
    """A down projection reads `intermediate` inputs per row: one past 65,793 could overflow its int32 sums, so the
    layers refuse it by name before any product runs, even when every part is shaped consistently."""
    runner = native_runner("int8")
    intermediate = (2 ** 31 - 1) // (255 * 128) + 1
    hidden = runner.model.config.hidden_size
    packed, col_sums = torch.ops.diversed.int8_pack(torch.zeros(2 * intermediate, hidden, dtype=torch.int8))
    _, arguments = native_call(runner, tokens=1)
    replace = {"packed": packed, "col_sums": col_sums, "w_scales": torch.ones(2 * intermediate), "biases": None}
    for name, part in replace.items():  # layer 0's gate_up made consistent with the longer down projection
        arguments[name] = [*arguments[name][:2], part, *arguments[name][3:]]
    with pytest.raises(RuntimeError, match=r"product 3 may have at most 65793 input features"):
        torch.ops.diversed.int8_llama_layers(**arguments)


@pytest.mark.parametrize("kind", KINDS)
def test_native_layers_opcheck(kind):
    op, arguments = native_call(native_runner(kind, "biases"), tokens=2, cache_length=1)
    torch.library.opcheck(op.default, (), arguments)


def test_models_outside_the_native_path_keep_the_op_by_op_forward():
    draft = quantize_int8(forward_llama(2, hidden_act="gelu"))
    assert LlamaRunner(draft).native is None  # not a SiLU MLP
    assert LlamaRunner(forward_llama(1).double()).native is None  # float64 products are not packed
