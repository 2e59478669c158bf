"""diversed::value_flags, the native pass behind check_inputs=True on the CPU: each row's flags against the same facts
computed with torch, for every dtype, bad values in the vector body and in the scalar tail, and every build."""

import pytest
import torch

from diversed_ext.ops import _values

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BUILDS = ["default", "avx2", "baseline"]


def expected_flags(values: torch.Tensor, from_logits: bool) -> torch.Tensor:
    values = values.double()
    no_mass = ~(values > float("-inf")).any(-1) if from_logits else ~(values > 0).any(-1)  # NaN compares false
    return (torch.isnan(values).any(-1).int() * _values.FLAG_NAN
            + (values < 0).any(-1).int() * _values.FLAG_NEGATIVE
            + (values == float("inf")).any(-1).int() * _values.FLAG_POSITIVE_INFINITY
            + no_mass.int() * _values.FLAG_NO_MASS)


def spoiled_rows(vocab: int, dtype: torch.dtype, from_logits: bool) -> torch.Tensor:
    """Rows with one kind of bad value each, at the start, in the middle and in the last (tail) element."""
    generator = torch.Generator().manual_seed(vocab)
    good = torch.randn(1, vocab, generator=generator) if from_logits else torch.rand(1, vocab, generator=generator)
    rows = [good.clone()]
    for position in (0, vocab // 2, vocab - 1):
        for bad in (float("nan"), -0.5, float("inf"), float("-inf")):
            row = good.clone()
            row[0, position] = bad
            rows.append(row)
    rows.append(torch.zeros(1, vocab))
    rows.append(torch.full((1, vocab), float("-inf")))
    both = good.clone()
    both[0, 0], both[0, -1] = float("nan"), float("inf")
    rows.append(both)
    return torch.cat(rows).to(dtype)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("vocab", [1, 7, 16, 37, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flags_equal_torch(dtype, vocab, from_logits, build, monkeypatch):
    if build != "default":
        monkeypatch.setenv("DIVERSED_CPU_CAPABILITY", build)
    values = spoiled_rows(vocab, dtype, from_logits)
    flags = torch.ops.diversed.value_flags(values, from_logits)
    assert flags.dtype == torch.int32 and flags.shape == values.shape[:-1]
    assert torch.equal(flags, expected_flags(values, from_logits))


def test_leading_dimensions_empty_inputs_and_bad_arguments():
    values = torch.rand(2, 3, 5)
    values[1, 2, 4] = float("nan")
    flags = torch.ops.diversed.value_flags(values, False)
    assert flags.shape == (2, 3) and int(flags[1, 2]) == _values.FLAG_NAN and int(flags.sum()) == _values.FLAG_NAN
    assert torch.ops.diversed.value_flags(torch.rand(0, 4, 9), False).shape == (0, 4)
    assert torch.equal(torch.ops.diversed.value_flags(torch.rand(3, 0), False), torch.full((3,), _values.FLAG_NO_MASS,
                                                                                          dtype=torch.int32))
    strided = torch.rand(4, 10)[:, ::2]
    assert torch.equal(torch.ops.diversed.value_flags(strided, False), expected_flags(strided, False))
    with pytest.raises(RuntimeError, match="floating"):
        torch.ops.diversed.value_flags(torch.ones(2, 3, dtype=torch.int64), False)
    with pytest.raises(RuntimeError, match="dimension"):
        torch.ops.diversed.value_flags(torch.tensor(1.0), False)


def test_opcheck():
    values = torch.rand(3, 4, 33)
    torch.library.opcheck(torch.ops.diversed.value_flags.default, (values, False))
    torch.library.opcheck(torch.ops.diversed.value_flags.default, (values.log(), True))


def test_checks_read_the_flags_once(monkeypatch):
    """A passing check of a CPU tensor runs the native pass once per tensor and never reads values in Python."""
    calls = []
    native = torch.ops.diversed.value_flags

    def counting(values, from_logits):
        calls.append(values.shape)
        return native(values, from_logits)

    monkeypatch.setattr(_values, "_native_flags", lambda tensor, from_logits: counting(tensor, from_logits))
    draft, target = torch.rand(2, 3, 11), torch.rand(2, 4, 11)
    _values.check_verify_probabilities(draft, target, None, "draft_probs", "target_probs")
    _values.check_values(target, "target_logits", from_logits=True)
    assert calls == [draft.shape, target.shape, target.shape]
