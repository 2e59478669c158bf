"""Rows read in place (target_rows / draft_rows) and verify_logits' target_temperature.

The row form must give exactly what the padded tensors it describes give, the reference must agree with it, and bad
indices must be named with checks and stay harmless without them. Tests that take `device` run on the CPU and on CUDA
(skipped where no GPU is visible)."""

import pytest
import torch
from scipy.stats import chisquare

import diversed_ext as dx
from helpers import (DTYPES, assert_same, assert_verify_close, assert_verify_result_in_range, dispatched, on_device,
                     requires_cuda)


def row_index(num_draft, width, extra, row_count, generator):
    """int64 [B, width]: random rows of [0, row_count) (repeats and any order) at the positions a request reads
    (< num_draft + extra), -1 padding elsewhere."""
    index = torch.randint(0, row_count, (num_draft.shape[0], width), generator=generator)
    read = torch.arange(width).unsqueeze(0) < (num_draft + extra).unsqueeze(1)
    return torch.where(read, index, -1)


def rows_case(batch, num_positions, vocab, *, dtype=torch.float32, logits=False, tokens_only=False, seed=0):
    """A ragged verify case in the row form: (tokens, draft_rows_tensor or None, target_rows_tensor, index kwargs,
    common kwargs). Unread rows of both row tensors hold NaN (no read may reach them), and the padded tensors the
    case describes are gather_padded's."""
    generator = torch.Generator().manual_seed(seed)
    target_count, draft_count = 2 * batch + 3, batch * max(num_positions, 1) + 2
    target = torch.randn(target_count, vocab, generator=generator) * 3
    draft = torch.randn(draft_count, vocab, generator=generator) * 3
    if not logits:
        target, draft = target.softmax(-1), draft.softmax(-1)
    target[-1] = draft[-1] = float("nan")  # never indexed below
    num_draft = torch.randint(0, num_positions + 1, (batch,), generator=generator)
    target_rows = row_index(num_draft, num_positions + 1, 1, target_count - 1, generator)
    draft_rows = row_index(num_draft, num_positions, 0, draft_count - 1, generator)
    tokens = torch.randint(0, vocab, (batch, num_positions), generator=generator)
    common = dict(num_draft=num_draft,
                  uniforms=torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64))
    weight = torch.rand(batch, num_positions, generator=generator)
    greedy = torch.rand(batch, generator=generator) < 0.3
    if logits:
        common["temperature"] = torch.where(greedy, 0.0, torch.rand(batch, generator=generator) + 0.5)
    else:
        common["greedy"] = greedy
    rows = dict(target_rows=target_rows, draft_rows=None if tokens_only else draft_rows)
    return tokens, None if tokens_only else draft.to(dtype), target.to(dtype), weight, rows, common


def gather_padded(draft, target, rows):
    """The [B, K, V] / [B, K+1, V] tensors a row case describes (padding indices read row 0)."""
    def padded(values, index):
        return None if values is None else values[index.clamp(min=0)]
    return padded(draft, rows["draft_rows"]), padded(target, rows["target_rows"])


@pytest.mark.parametrize("tokens_only", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 257])
@pytest.mark.parametrize("num_positions", [0, 1, 4])
@pytest.mark.parametrize("logits", [False, True])
def test_rows_equal_padded_and_reference(logits, num_positions, vocab, dtype, tokens_only, device):
    tokens, draft, target, weight, rows, common = rows_case(6, num_positions, vocab, dtype=dtype, logits=logits,
                                                            tokens_only=tokens_only, seed=vocab + num_positions)
    native_op = dx.verify_logits if logits else dx.verify
    reference_op = dx.verify_logits_reference if logits else dx.verify_reference
    in_place = on_device(device, native_op, tokens, draft, target, weight, **rows, **common)
    padded_draft, padded_target = gather_padded(draft, target, rows)
    assert_same(in_place, on_device(device, native_op, tokens, padded_draft, padded_target, weight, **common))
    assert_same(in_place, on_device(device, native_op, tokens, draft, target, weight, **rows, **common,
                                         check_inputs=False))
    reference = reference_op(tokens, draft, target, weight, **rows, **common)
    (assert_verify_close if logits else assert_same)(in_place, reference)


@pytest.mark.parametrize("logits", [False, True])
def test_one_index_alone_and_a_vllm_layout(logits, device):
    """Either index without the other, and the layout a server holds: target rows flattened and ragged (each request's
    K+1 rows contiguous), draft rows by request slot [slots, K, V] viewed as [slots * K, V]."""
    batch, num_positions, vocab = 5, 3, 300
    generator = torch.Generator().manual_seed(7)
    padded_target = torch.randn(batch, num_positions + 1, vocab, generator=generator) * 2
    padded_draft = torch.randn(batch, num_positions, vocab, generator=generator) * 2
    if not logits:
        padded_target, padded_draft = padded_target.softmax(-1), padded_draft.softmax(-1)
    num_draft = torch.tensor([3, 0, 2, 1, 3])
    starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), num_draft[:-1] + 1]), 0)
    flat_target = torch.cat([padded_target[b, : n + 1] for b, n in enumerate(num_draft.tolist())])
    target_rows = torch.where(torch.arange(num_positions + 1) <= num_draft.unsqueeze(1),
                              starts.unsqueeze(1) + torch.arange(num_positions + 1), -1).to(torch.int32)
    slots = torch.tensor([6, 1, 4, 0, 2])  # request b's drafts live in slot slots[b] of 8
    by_slot = torch.full((8, num_positions, vocab), float("nan"))
    by_slot[slots] = padded_draft
    draft_rows = slots.unsqueeze(1) * num_positions + torch.arange(num_positions)
    tokens = torch.randint(0, vocab, (batch, num_positions), generator=generator)
    common = dict(num_draft=num_draft, uniforms=torch.rand(batch, num_positions + 1, generator=generator,
                                                           dtype=torch.float64))
    op = dx.verify_logits if logits else dx.verify
    padded = on_device(device, op, tokens, padded_draft, padded_target, 0.6, **common)
    by_rows = by_slot.reshape(-1, vocab)
    assert_same(padded, on_device(device, op, tokens, by_rows, flat_target, 0.6, target_rows=target_rows,
                                       draft_rows=draft_rows, **common))
    assert_same(padded, on_device(device, op, tokens, padded_draft, flat_target, 0.6, target_rows=target_rows,
                                       **common))
    assert_same(padded, on_device(device, op, tokens, by_rows, padded_target, 0.6, draft_rows=draft_rows,
                                       **common))


@requires_cuda
@pytest.mark.parametrize("logits", [False, True])
def test_rows_on_both_cuda_kernel_families(logits, cuda_kernels):
    """The split kernels (each request's vocabulary over many blocks, softmax normalisers by row chunks) read through
    the indices as the block kernels do; a vocabulary wide enough to split."""
    tokens, draft, target, weight, rows, common = rows_case(5, 3, 20011, logits=logits, seed=29)
    op = dx.verify_logits if logits else dx.verify
    in_place = on_device("cuda", op, tokens, draft, target, weight, **rows, **common)
    padded_draft, padded_target = gather_padded(draft, target, rows)
    assert_same(in_place, on_device("cuda", op, tokens, padded_draft, padded_target, weight, **common))


def test_shared_rows_sample_the_mixture(device):
    """The law, once: 40000 requests that all read the same two target rows and one draft row emit nu."""
    samples, vocab, weight = 40_000, 8, 0.4
    generator = torch.Generator().manual_seed(11)
    draft = (torch.randn(vocab, generator=generator) * 1.5).softmax(-1)
    target = (torch.randn(vocab, generator=generator) * 1.5).softmax(-1)
    tokens = torch.multinomial(draft, samples, replacement=True, generator=generator).reshape(-1, 1)
    target_rows = torch.tensor([[1, 0]]).expand(samples, 2).contiguous()  # the bonus row is row 0 (unused here)
    draft_rows = torch.zeros(samples, 1, dtype=torch.int64)
    result = on_device(device, dx.verify, tokens, draft.unsqueeze(0), torch.stack([draft, target]), weight,
                       target_rows=target_rows, draft_rows=draft_rows, seed=5)
    counts = torch.bincount(result.tokens[:, 0], minlength=vocab).double()
    mixture = (weight * target + (1 - weight) * draft).double()
    assert chisquare(counts.numpy(), (mixture / mixture.sum() * samples).numpy()).pvalue > 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_of_the_row_forms(dtype, device):
    tokens, draft, target, weight, rows, common = rows_case(4, 3, 20, dtype=dtype, seed=3)
    _, logit_draft, logit_target, _, _, logit_common = rows_case(4, 3, 20, dtype=dtype, logits=True, seed=3)
    named = (*rows.items(), *common.items(), ("tokens", tokens), ("weight", weight),
             ("temperature", logit_common["temperature"]))
    put = {name: value.to(device) for name, value in named}
    target_rows, draft_rows = put["target_rows"], put["draft_rows"]
    probs_args = (put["tokens"], draft.to(device), target.to(device), put["weight"], put["num_draft"], put["greedy"],
                  put["uniforms"], None, 0, False, 1.0, None)
    torch.library.opcheck(torch.ops.diversed.verify_probs.default, probs_args + (target_rows, draft_rows))
    torch.library.opcheck(torch.ops.diversed.verify_probs.default, probs_args[:1] + (None,) + probs_args[2:]
                          + (target_rows, None))
    logits_args = (put["tokens"], logit_draft.to(device), logit_target.to(device), put["weight"], put["num_draft"],
                   put["temperature"], put["uniforms"], None, 0, False, 1.0, 1.0, None, target_rows, draft_rows)
    target_temperature = torch.full((4,), 0.75, device=device)
    torch.library.opcheck(torch.ops.diversed.verify_logits.default, logits_args + (target_temperature, None))
    torch.library.opcheck(torch.ops.diversed.verify_logits.default, logits_args + (None, 1.0))


def test_unchecked_row_forms_dispatch_only_the_op():
    """Without checks, indices in the op's layout (int64) and a target temperature (float or float32 [B]) go to the op
    untouched: no torch op runs before it, so nothing syncs with the device; int32 indices are converted, once."""
    tokens, draft, target, weight, rows, common = rows_case(4, 3, 30, logits=True, seed=31)
    del common["uniforms"]
    for target_temperature in (None, 1.0, torch.ones(4)):
        ops = dispatched(lambda: dx.verify_logits(tokens, draft, target, weight, **rows, **common, seed=2,
                                                  target_temperature=target_temperature, check_inputs=False))
        assert ops == ["diversed.verify_logits"], ops
    probs = {"target_rows": rows["target_rows"], "draft_rows": rows["draft_rows"], "num_draft": common["num_draft"]}
    draft, target = draft.softmax(-1), target.softmax(-1)
    ops = dispatched(lambda: dx.verify(tokens, draft, target, weight, **probs, check_inputs=False))
    assert ops == ["diversed.verify_probs"], ops
    narrow = {**probs, "target_rows": rows["target_rows"].int()}
    ops = dispatched(lambda: dx.verify(tokens, draft, target, weight, **narrow, check_inputs=False))
    assert ops.count("diversed.verify_probs") == 1 and "aten._to_copy" in ops, ops


# ------------------------------------------------------------------------------------------- bad indices
def bad_row_cases():
    tokens, draft, target, weight, rows, common = rows_case(4, 3, 20, seed=5)
    def case(**change):
        kwargs = {**rows, **common, **change}
        return tokens, draft, target, weight, kwargs
    read_index = int(torch.nonzero(rows["target_rows"] >= 0)[-1][0])
    too_far = rows["target_rows"].clone()
    too_far[read_index, 0] = target.shape[0]
    negative = rows["draft_rows"].clone()
    negative[int(torch.nonzero(rows["draft_rows"] >= 0)[0][0]), 0] = -1
    return [
        (case(target_rows=too_far), ValueError,
         r"target_rows\[\d+, 0\] = 11 is outside \[0, R\) with R = 11 rows of target_probs"),
        (case(draft_rows=negative), ValueError, r"draft_rows\[\d+, 0\] = -1 is outside \[0, R\)"),
        (case(target_rows=rows["target_rows"][:, :3]), ValueError, r"target_rows must have shape \[B, K\+1\]"),
        (case(draft_rows=rows["draft_rows"].float()), TypeError, "draft_rows must be int32 or int64"),
        (case(target_rows=rows["target_rows"].to("meta")), ValueError, "target_rows is on meta"),
        ((tokens, None, target, weight, {**rows, **common}), ValueError, "draft_rows indexes the rows of draft_probs"),
        ((tokens, draft, target.unsqueeze(0), weight, {**rows, **common}), ValueError, r"target_probs must have 2"),
        ((tokens, draft, target[:0], weight, {**rows, **common}), ValueError, "target_probs has no rows"),
    ]


@pytest.mark.parametrize("case, error, match", bad_row_cases())
def test_bad_indices_are_named(case, error, match):
    tokens, draft, target, weight, kwargs = case
    with pytest.raises(error, match=match):
        dx.verify(tokens, draft, target, weight, **kwargs)
    with pytest.raises(error, match=match):
        dx.verify_reference(tokens, draft, target, weight, **kwargs)
    # Structural mistakes are named with or without checks; a meta tensor among CPU ones sends an unchecked call to
    # the shape-only kernel, whichever argument it is, so only checked calls compare devices.
    if "outside" not in match and "meta" not in match:
        with pytest.raises(error, match=match):
            dx.verify(tokens, draft, target, weight, **kwargs, check_inputs=False)


@pytest.mark.parametrize("logits", [False, True])
def test_checks_read_only_the_rows_read(logits):
    """NaN in rows no position reads (and -1 padding at unread positions) passes the checks; NaN in a row read
    fails them, naming the tensor and the row."""
    tokens, draft, target, weight, rows, common = rows_case(5, 3, 40, logits=logits, seed=9)
    op = dx.verify_logits if logits else dx.verify
    op(tokens, draft, target, weight, **rows, **common)  # the NaN rows of rows_case are never read
    name = "draft_logits" if logits else "draft_probs"
    read_row = int(rows["draft_rows"][rows["draft_rows"] >= 0][0])
    draft[read_row, 3] = float("nan")
    with pytest.raises(ValueError, match=f"{name} (row {read_row} .*)?contains NaN"):
        op(tokens, draft, target, weight, **rows, **common)


def test_a_target_row_read_needs_mass_in_the_support():
    """A target row read in place whose entries are all positive but below 2^-64 leaves the verifier no token it may
    emit: refused, naming the row; a draft row of such values is a distribution and passes."""
    tokens, draft, target, weight, rows, common = rows_case(5, 3, 40, logits=False, seed=9)
    draft[int(rows["draft_rows"][rows["draft_rows"] >= 0][0])] = 2.0 ** -70
    dx.verify(tokens, draft, target, weight, **rows, **common)
    read_row = int(rows["target_rows"][rows["target_rows"] >= 0][0])
    target[read_row] = 2.0 ** -70
    with pytest.raises(ValueError, match=rf"target_probs row {read_row} .* has no probability mass \(nothing at"):
        dx.verify(tokens, draft, target, weight, **rows, **common)


@pytest.mark.parametrize("logits", [False, True])
def test_garbage_indices_without_checks_are_clamped(logits, device):
    """check_inputs=False: indices anywhere in int64 read rows clamped into [0, R), as the reference clamps them;
    outputs stay in range (outputs are poisoned before each call, see conftest.py)."""
    batch, num_positions, vocab = 16, 4, 37
    tokens, draft, target, weight, rows, common = rows_case(batch, num_positions, vocab, logits=logits, seed=13)
    generator = torch.Generator().manual_seed(2)
    for name, count in (("target_rows", target.shape[0]), ("draft_rows", draft.shape[0])):
        garbage = torch.randint(-(2**40), 2**40, rows[name].shape, generator=generator)
        edges = torch.tensor([-1, count, -(2**63), 2**63 - 1])
        rows[name] = torch.where(torch.rand(rows[name].shape, generator=generator) < 0.5, garbage,
                                 edges[torch.randint(0, 4, rows[name].shape, generator=generator)])
    op, reference_op = (dx.verify_logits, dx.verify_logits_reference) if logits else (dx.verify, dx.verify_reference)
    native = on_device(device, op, tokens, draft, target, weight, **rows, **common, check_inputs=False)
    assert_verify_result_in_range(native, num_positions, vocab)
    reference = reference_op(tokens, draft, target, weight, **rows, **common, check_inputs=False)
    (assert_verify_close if logits else assert_same)(native, reference)


# ------------------------------------------------------------------------------------------- target_temperature
@pytest.mark.parametrize("dtype", DTYPES)
def test_target_temperature_equal_to_the_temperature_changes_nothing(dtype, device):
    tokens, draft, target, weight, rows, common = rows_case(6, 3, 300, dtype=dtype, logits=True, seed=17)
    plain = on_device(device, dx.verify_logits, tokens, draft, target, weight, **rows, **common)
    same = on_device(device, dx.verify_logits, tokens, draft, target, weight, **rows, **common,
                     target_temperature=common["temperature"])
    assert_same(plain, same)


@pytest.mark.parametrize("exact", [True, False])
def test_target_logits_divided_beforehand(exact, device):
    """The server's form: target logits already divided by the temperature, target_temperature=1. Powers of two
    divide exactly, so the result is bit for bit the undivided call's; other temperatures round x / T and x * (1 / T)
    differently, so accept_prob agrees to float rounding (and on these fixed seeds the tokens exactly)."""
    batch, num_positions, vocab = 8, 3, 300
    tokens, draft, _, weight, rows, common = rows_case(batch, num_positions, vocab, logits=True, seed=19)
    temperature = torch.tensor([0.5, 2.0, 0.25, 0.0, 4.0, 1.0, 0.0, 0.5] if exact else
                               [0.7, 1.3, 0.9, 0.0, 2.2, 1.1, 0.0, 0.6])
    common["temperature"] = temperature
    # Each request reads rows of its own, so each row can be divided by its request's temperature (greedy rows: 1).
    target = torch.randn(batch * (num_positions + 1), vocab, generator=torch.Generator().manual_seed(4)) * 3
    rows["target_rows"] = torch.arange(batch * (num_positions + 1)).reshape(batch, num_positions + 1)
    divisor = torch.where(temperature > 0, temperature, 1.0).repeat_interleave(num_positions + 1).unsqueeze(1)
    divided = target / divisor
    plain = on_device(device, dx.verify_logits, tokens, draft, target, weight, **rows, **common)
    pre = on_device(device, dx.verify_logits, tokens, draft, divided, weight, **rows, **common, target_temperature=1.0)
    assert_verify_close(pre, dx.verify_logits_reference(tokens, draft, divided, weight, **rows, **common,
                                                        target_temperature=1.0))
    if exact:
        assert_same(plain, pre)
    else:
        assert_verify_close(plain, pre)


def test_target_temperature_is_checked():
    tokens, draft, target, weight, rows, common = rows_case(4, 2, 30, logits=True, seed=23)
    with pytest.raises(ValueError, match="target_temperature must be a finite number >= 0"):
        dx.verify_logits(tokens, draft, target, weight, **rows, **common, target_temperature=-1.0)
    with pytest.raises(ValueError, match="target_temperature contains NaN"):
        dx.verify_logits(tokens, draft, target, weight, **rows, **common,
                         target_temperature=torch.full((4,), float("nan")))
    with pytest.raises(ValueError, match=r"target_temperature must be a float or have shape \[B\]"):
        dx.verify_logits(tokens, draft, target, weight, **rows, **common, target_temperature=torch.ones(3))
    with pytest.raises(ValueError, match="target_temperature must be finite and >= 0, got inf"):
        dx.verify_logits(tokens, draft, target, weight, **rows, **common,
                         target_temperature=torch.tensor([1.0, float("inf"), 1.0, 1.0]))


def test_position_rows_index_the_first_positions_of_slots_in_place():
    values = torch.randn(3, 4, 5)
    rows, index = dx.ops.position_rows(values, 2)
    assert rows.data_ptr() == values.data_ptr() and rows.shape == (12, 5)
    assert index.dtype == torch.int64 and index.tolist() == [[0, 1], [4, 5], [8, 9]]
    rows, index = dx.ops.position_rows(values, slots=torch.tensor([2, 0], dtype=torch.int32))
    assert index.dtype == torch.int64 and torch.equal(rows[index], values[[2, 0]])
    with pytest.raises(ValueError, match=r"width must lie in \[0, P\] with P = 4 positions per slot, got 5"):
        dx.ops.position_rows(values, 5)  # would read the next slot's first row
    with pytest.raises(ValueError, match=r"values must have shape \[S, P, V\], got \[12, 5\]"):
        dx.ops.position_rows(values.flatten(0, 1))
