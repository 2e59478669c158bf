"""diversed::value_flags, the native pass behind check_inputs=True on the CPU: each row's flags against the same facts
computed with torch, for every dtype, bad values in the vector body and in the scalar tail, and every build."""

import pytest
import torch

from diversed_ext.ops import _values
from helpers import use_cpu_build

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BUILDS = ["default", "avx2", "baseline"]  # default: the widest build the CPU has


def expected_flags(values: torch.Tensor, from_logits: bool) -> torch.Tensor:
    values = values.double()
    no_mass = ~(values > float("-inf")).any(-1) if from_logits else ~(values > 0).any(-1)  # NaN compares false
    no_target_mass = torch.zeros_like(no_mass) if from_logits else ~(values >= _values.MIN_TARGET_MASS).any(-1)
    return (torch.isnan(values).any(-1).int() * _values.FLAG_NAN
            + (values < 0).any(-1).int() * _values.FLAG_NEGATIVE
            + (values == float("inf")).any(-1).int() * _values.FLAG_POSITIVE_INFINITY
            + no_mass.int() * _values.FLAG_NO_MASS
            + no_target_mass.int() * _values.FLAG_NO_TARGET_MASS)


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
    rows.append(torch.full((1, vocab), 2.0 ** -70))  # positive, all below the target's support
    at_support = torch.zeros(1, vocab)
    at_support[0, vocab // 2] = 2.0 ** -64  # exactly at it: in the support
    rows.append(at_support)
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
        use_cpu_build(monkeypatch, build)
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
    no_mass = _values.FLAG_NO_MASS | _values.FLAG_NO_TARGET_MASS
    assert torch.equal(torch.ops.diversed.value_flags(torch.rand(3, 0), False), torch.full((3,), no_mass,
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


def spoiled_logit_pair(batch: int, num_positions: int, vocab: int, dtype: torch.dtype):
    """Draft [B, K, V] and target [B, K+1, V] logits where some rows carry one bad value each (NaN, +inf, all -inf) in
    rows the verifier reads, in rows it never reads (past num_draft, the bonus row after a rejection), and a NaN after
    a leading block of masked (-inf) logits, which the online softmax skips without summing."""
    generator = torch.Generator().manual_seed(batch * 1000 + vocab)
    draft = torch.randn(batch, num_positions, vocab, generator=generator)
    target = torch.randn(batch, num_positions + 1, vocab, generator=generator)
    bad_values = (float("nan"), float("inf"))
    for b in range(batch):
        for position in range(num_positions + 1):
            kind = (b * 7 + position * 3) % 6
            row = target[b, position] if (b + position) % 2 else draft[b, min(position, num_positions - 1)]
            if kind < 2:
                row[(b * 131 + position * 17) % vocab] = bad_values[kind]
            elif kind == 2:
                row.fill_(float("-inf"))
            elif kind == 3 and vocab > 4096:
                row[:4096] = float("-inf")
                row[100] = float("nan")
    return draft.to(dtype), target.to(dtype)


@pytest.mark.parametrize("batch,vocab", [(1, 5000), (5, 5000), (4, 37), (3, 70_001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checked_verify_logits_refuses_every_spoiled_pair(dtype, batch, vocab):
    """Bad values in rows read or never read, after masked blocks, in either tensor: a checked call refuses them all,
    naming the tensor value_flags finds first (the draft's before the target's)."""
    import diversed_ext as dx

    draft, target = spoiled_logit_pair(batch, 3, vocab, dtype)
    tokens = torch.randint(0, vocab, (batch, 3), generator=torch.Generator().manual_seed(vocab))
    draft_bad = bool((torch.ops.diversed.value_flags(draft, True) & _values.LOGIT_ERRORS).any())
    with pytest.raises(ValueError, match="draft_logits" if draft_bad else "target_logits"):
        dx.verify_logits(tokens, draft, target, 0.6, num_draft=torch.arange(batch) % 4, seed=1)


def test_checked_verify_logits_names_the_tensor_of_a_bad_value_in_a_row_never_read():
    import diversed_ext as dx
    draft, target = torch.randn(2, 3, 50), torch.randn(2, 4, 50)
    tokens = torch.randint(0, 50, (2, 3))
    tokens[0, 2] = 50  # past row 0's num_draft: ignored
    dx.verify_logits(tokens, draft, target, 0.5, num_draft=torch.tensor([1, 3]), seed=1)
    tokens[1, 1] = -3
    with pytest.raises(ValueError, match=r"draft_tokens\[1, 1\] = -3 is outside \[0, V\) with V = 50"):
        dx.verify_logits(tokens, draft, target, 0.5, num_draft=torch.tensor([1, 3]), seed=1)
    tokens[1, 1], tokens[0, 2] = 4, 5
    target[0, 3, 7] = float("nan")  # past row 0's bonus row (num_draft 1): never read
    with pytest.raises(ValueError, match="target_logits contains NaN"):
        dx.verify_logits(tokens, draft, target, 0.5, num_draft=torch.tensor([1, 3]), seed=1)
    draft[1, 2].fill_(float("-inf"))
    with pytest.raises(ValueError, match="draft_logits has a row whose logits are all -inf"):
        dx.verify_logits(tokens, draft, target.nan_to_num(0.0), 0.5, seed=1)
