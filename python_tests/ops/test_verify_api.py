"""Seeds, bad inputs, robustness without checks, custom-op registration, torch.compile and the GIL.

Tests that take `device` run on the CPU and on CUDA (skipped where no GPU is visible)."""

import functools
import threading
import time

import pytest
import torch

import diversed_ext as dx
from helpers import DTYPES, assert_verify_result_in_range, on_device, poisoned_verify_inputs, random_problem


def problem(batch=3, num_positions=2, vocab=11, seed=0):
    return random_problem(batch, num_positions, vocab, seed=seed)


# ----------------------------------------------------------------------------------------------------------- seeds
def test_seed_reproduces_and_offset_changes_the_draw():
    tokens, draft, target = problem(64, 4, 50)
    first = dx.verify(tokens, draft, target, 0.5, seed=17, offset=3)
    again = dx.verify(tokens, draft, target, 0.5, seed=17, offset=3)
    moved = dx.verify(tokens, draft, target, 0.5, seed=17, offset=4)
    assert torch.equal(first.tokens, again.tokens)
    assert not torch.equal(first.tokens, moved.tokens)


def test_manual_seed_makes_unseeded_calls_repeatable():
    tokens, draft, target = problem(64, 4, 50)
    torch.manual_seed(5)
    first = dx.verify(tokens, draft, target, 0.5)
    torch.manual_seed(5)
    again = dx.verify(tokens, draft, target, 0.5)
    assert torch.equal(first.tokens, again.tokens)


def test_per_row_seed_is_independent_of_batch_neighbours():
    tokens, draft, target = problem(8, 4, 40, seed=1)
    seeds = torch.arange(100, 108, dtype=torch.int64)
    batched = dx.verify(tokens, draft, target, 0.5, seed=seeds, offset=9)
    other_tokens, other_draft, other_target = problem(8, 4, 40, seed=2)
    for row in range(8):
        # Put row `row` at index 5 of a batch of unrelated requests.
        mixed_tokens, mixed_draft, mixed_target = other_tokens.clone(), other_draft.clone(), other_target.clone()
        mixed_tokens[5], mixed_draft[5], mixed_target[5] = tokens[row], draft[row], target[row]
        mixed_seeds = torch.arange(900, 908, dtype=torch.int64)
        mixed_seeds[5] = seeds[row]
        alone = dx.verify(mixed_tokens, mixed_draft, mixed_target, 0.5, seed=mixed_seeds, offset=9)
        assert torch.equal(alone.tokens[5], batched.tokens[row])


def test_per_row_seed_is_independent_of_batch_position(device):
    tokens, draft, target = random_problem(6, 3, 500, seed=5)
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    full = on_device(device, dx.verify, tokens, draft, target, 0.4, seed=seeds, offset=9)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled = on_device(device, dx.verify, tokens[order], draft[order], target[order], 0.4, seed=seeds[order],
                         offset=9)
    assert torch.equal(full.tokens[order], shuffled.tokens)
    assert torch.equal(full.num_accepted[order], shuffled.num_accepted)


def test_philox_uniforms_are_uniform_and_distinct():
    uniforms = dx.philox_uniforms(torch.tensor([1, 2], dtype=torch.int64), 0, 50_000, per_row_seed=True)
    assert uniforms.min() >= 0 and uniforms.max() < 1
    assert abs(uniforms.mean().item() - 0.5) < 0.01
    assert not torch.equal(uniforms[0], uniforms[1])


@pytest.mark.parametrize("per_row_seed", [False, True])
@pytest.mark.parametrize("offset", [0, 9, 2**33 + 5, "per row"])
def test_native_philox_uniforms_equal_the_pytorch_generator(per_row_seed, offset):
    """On the CPU philox_uniforms runs the kernels' own generator; the integer-op PyTorch version (used on other
    devices) must give the same bits, for negative and 64-bit seeds, offsets past 2**32 and per-row offsets."""
    from diversed_ext.ops._philox import philox_uniforms_torch

    seeds = torch.tensor([0, 1, -7, 2**40 + 3, -(2**62), 2**63 - 1], dtype=torch.int64)
    if offset == "per row":
        offset = torch.tensor([0, 3, 2**32, 2**33 + 1, 5, 2**62], dtype=torch.int64)
    for num_positions in (0, 1, 7):
        native = dx.philox_uniforms(seeds, offset, num_positions, per_row_seed)
        assert native.shape == (6, num_positions) and native.dtype == torch.float64
        assert torch.equal(native, philox_uniforms_torch(seeds, offset, num_positions, per_row_seed))


def test_native_philox_uniforms_checks_and_opcheck():
    seeds = torch.tensor([4, 5], dtype=torch.int64)
    torch.library.opcheck(torch.ops.diversed.philox_uniforms.default, (seeds, torch.tensor([0, 2**40]), 3, False))
    with pytest.raises(RuntimeError, match="offsets"):
        torch.ops.diversed.philox_uniforms(seeds, torch.tensor([1]), 3, False)
    with pytest.raises(RuntimeError, match="seeds"):
        torch.ops.diversed.philox_uniforms(seeds.int(), torch.tensor([1, 2]), 3, False)
    with pytest.raises(RuntimeError, match="num_positions"):
        torch.ops.diversed.philox_uniforms(seeds, torch.tensor([1, 2]), -1, False)


@pytest.mark.parametrize("arguments, error, words", [
    ((torch.tensor([1, 2]), 1.7, 3), TypeError, "offset must be an int, got float"),
    ((torch.tensor([1, 2]), -1, 3), ValueError, "offset must lie in [0, 2**63)"),
    ((torch.tensor([1, 2]), torch.tensor([1, 2, 3]), 3), TypeError, "offset must be an int or an integer tensor [B]"),
    ((torch.tensor(5), 0, 3), TypeError, "seeds must be an integer tensor [B]"),
    ((torch.tensor([1.0, 2.0]), 0, 3), TypeError, "seeds must be an integer tensor [B]"),
    ((torch.tensor([1, 2]), 0, -1), ValueError, "num_positions must be an int >= 0"),
])
def test_philox_uniforms_names_a_bad_argument(arguments, error, words):
    """The Python function checks what the op would truncate (a float offset) or fail on without naming it."""
    with pytest.raises(error) as raised:
        dx.philox_uniforms(*arguments, True)
    assert words in str(raised.value)


# ------------------------------------------------------------------------------------------------------ bad inputs
def bad_input_cases():
    tokens, draft, target = problem()
    cases = {
        "draft_probs not a tensor": ((tokens, draft.tolist(), target, 0.5), {}, TypeError, "draft_probs"),
        "integer draft_probs": ((tokens, draft.long(), target, 0.5), {}, TypeError, "draft_probs"),
        "float64 target": ((tokens, draft, target.double(), 0.5), {}, TypeError, "target_probs"),
        "float64 draft beside a float32 target": ((tokens, draft.double(), target, 0.5), {}, TypeError,
                                                  "draft_probs must be float32, bfloat16 or float16"),
        "draft rank": ((tokens, draft[0], target, 0.5), {}, ValueError, "draft_probs"),
        "target rank": ((tokens, draft, target[0], 0.5), {}, ValueError, "target_probs"),
        "batch mismatch": ((tokens, draft, target[:2], 0.5), {}, ValueError, "batch"),
        "K mismatch": ((tokens, draft, target[:, :2], 0.5), {}, ValueError, "K\\+1"),
        "V mismatch": ((tokens, draft, target[..., :5], 0.5), {}, ValueError, "vocabulary"),
        "V zero": ((tokens, draft[..., :0], target[..., :0], 0.5), {}, ValueError, "V must be positive"),
        "float tokens": ((tokens.float(), draft, target, 0.5), {}, TypeError, "draft_tokens"),
        "token shape": ((tokens[:, :1], draft, target, 0.5), {}, ValueError, "draft_tokens"),
        "tokens transposed": ((tokens.t().contiguous(), draft, target, 0.5), {}, ValueError, "draft_tokens"),
        "token id too large": ((tokens.clone().fill_(11), draft, target, 0.5), {}, ValueError, "draft_tokens"),
        "negative token id": ((tokens.clone().fill_(-1), draft, target, 0.5), {}, ValueError, "draft_tokens"),
        "negative prob": ((tokens, draft - 1, target, 0.5), {}, ValueError, "draft_probs.*negative"),
        "NaN prob": ((tokens, draft, target.clone().fill_(float("nan")), 0.5), {}, ValueError, "target_probs.*NaN"),
        "inf prob": ((tokens, draft, target.clone().fill_(float("inf")), 0.5), {}, ValueError, "target_probs.*infinite"),
        "weight above 1": ((tokens, draft, target, 1.5), {}, ValueError, "weight"),
        "weight tensor below 0": ((tokens, draft, target, torch.full((3,), -0.1)), {}, ValueError, "weight"),
        "weight NaN": ((tokens, draft, target, torch.full((3, 2), float("nan"))), {}, ValueError, "weight.*NaN"),
        "weight shape": ((tokens, draft, target, torch.full((4,), 0.5)), {}, ValueError, "weight"),
        "weight type": ((tokens, draft, target, "0.5"), {}, TypeError, "weight"),
        "integer weight tensor": ((tokens, draft, target, torch.ones(3, dtype=torch.int64)), {}, TypeError, "weight"),
        "num_draft above K": ((tokens, draft, target, 0.5), {"num_draft": torch.tensor([0, 3, 1])}, ValueError,
                              "num_draft"),
        "num_draft negative": ((tokens, draft, target, 0.5), {"num_draft": torch.tensor([0, -1, 1])}, ValueError,
                               "num_draft"),
        "num_draft float": ((tokens, draft, target, 0.5), {"num_draft": torch.ones(3)}, TypeError, "num_draft"),
        "greedy dtype": ((tokens, draft, target, 0.5), {"greedy": torch.ones(3)}, TypeError, "greedy"),
        "greedy shape": ((tokens, draft, target, 0.5), {"greedy": torch.ones(2, dtype=torch.bool)}, ValueError,
                         "greedy"),
        "uniform equal to 1": ((tokens, draft, target, 0.5), {"uniforms": torch.ones(3, 3)}, ValueError, "uniforms"),
        "uniform NaN": ((tokens, draft, target, 0.5), {"uniforms": torch.full((3, 3), float("nan"))}, ValueError,
                        "uniforms.*NaN"),
        "uniform shape": ((tokens, draft, target, 0.5), {"uniforms": torch.zeros(3, 2)}, ValueError, "uniforms"),
        "uniforms and seed": ((tokens, draft, target, 0.5), {"uniforms": torch.zeros(3, 3), "seed": 1}, ValueError,
                              "seed"),
        "seed type": ((tokens, draft, target, 0.5), {"seed": 1.5}, TypeError, "seed"),
        "seed shape": ((tokens, draft, target, 0.5), {"seed": torch.ones(2, dtype=torch.int64)}, ValueError, "seed"),
        "offset negative": ((tokens, draft, target, 0.5), {"offset": -1}, ValueError, "offset"),
        "offset type": ((tokens, draft, target, 0.5), {"offset": 1.0}, TypeError, "offset"),
    }
    return cases


@pytest.mark.parametrize("verifier", [dx.verify, dx.verify_reference], ids=["native", "reference"])
@pytest.mark.parametrize("case", list(bad_input_cases()))
def test_bad_input_raises_naming_the_argument(verifier, case):
    args, kwargs, error, pattern = bad_input_cases()[case]
    with pytest.raises(error, match=pattern):
        verifier(*args, **kwargs)


# Cases that need no value read: an unchecked call must name the argument just the same, although it hands tensors
# that look ready straight to the op.
VALUE_CASES = {"token id too large", "negative token id", "negative prob", "NaN prob", "inf prob",
               "weight tensor below 0", "weight NaN", "num_draft above K", "num_draft negative", "uniform equal to 1", "uniform NaN"}


@pytest.mark.parametrize("case", [case for case in bad_input_cases() if case not in VALUE_CASES])
def test_unchecked_call_still_names_the_argument_of_a_structural_mistake(case):
    args, kwargs, error, pattern = bad_input_cases()[case]
    with pytest.raises(error, match=pattern):
        dx.verify(*args, check_inputs=False, **kwargs)


def test_meta_device_mismatch_is_reported():
    tokens, draft, target = problem()
    with pytest.raises(ValueError, match="target_probs.*device"):
        dx.verify(tokens, draft, target.to("meta"), 0.5)


@pytest.mark.parametrize("on_meta", ["draft_tokens", "draft_probs", "target_probs", "weight", "num_draft"])
def test_an_unchecked_call_with_one_tensor_on_meta_names_it(on_meta):
    """The dispatcher sends a mix of meta and real tensors to the fake kernel, which must refuse it, not hand back
    unwritten memory as tokens."""
    tokens, draft, target = problem()
    batch, num_positions = tokens.shape
    args = {"draft_tokens": tokens, "draft_probs": draft, "target_probs": target,
            "weight": torch.full((batch, num_positions), 0.5), "num_draft": torch.full((batch,), num_positions)}
    args[on_meta] = args[on_meta].to("meta")
    with pytest.raises(ValueError, match=f"{on_meta} is on meta"):
        dx.verify(**args, seed=1, check_inputs=False)


@pytest.mark.parametrize("on_meta", ["temperature", "uniforms"])
def test_an_unchecked_logits_call_with_its_temperature_or_uniforms_on_meta_is_refused(on_meta):
    tokens, draft, target = problem()
    batch, num_positions = tokens.shape
    given = {"temperature": torch.ones(batch), "uniforms": torch.rand(batch, num_positions + 1, dtype=torch.float64)}
    with pytest.raises(ValueError, match=f"{on_meta} is on meta"):
        dx.verify_logits(tokens, draft.log(), target.log(), 0.5, check_inputs=False,
                         **{on_meta: given[on_meta].to("meta")})


# ------------------------------------------------------------------------------------- robustness without checks
@pytest.mark.parametrize("dtype", DTYPES)
def test_poisoned_inputs_never_escape_the_vocabulary(dtype, device):
    batch, num_positions, vocab = 64, 4, 37
    for extreme_ids in (False, True):
        tokens, draft, target, weight, uniforms, num_draft, greedy = poisoned_verify_inputs(
            batch, num_positions, vocab, extreme_ids=extreme_ids)
        for kwargs in ({"uniforms": uniforms}, {"seed": 3}):
            result = on_device(device, dx.verify, tokens, draft.to(dtype), target.to(dtype), weight,
                               num_draft=num_draft, greedy=greedy, check_inputs=False, **kwargs)
            assert_verify_result_in_range(result, num_positions, vocab)


def test_out_of_range_ids_count_as_rejected_without_checks(device):
    for seed, greedy in ((0, False), (1, False), (1, True)):
        tokens, draft, target = problem(4, 2, 9, seed=seed)
        tokens[:, 0] = torch.tensor([-1, 9, 1000, -(2**40)])
        result = on_device(device, dx.verify, tokens, draft, target, 0.0, greedy=greedy, check_inputs=False, seed=1)
        assert torch.all(result.num_accepted == 0)
        assert torch.all(result.accept_prob[:, 0] == 0)
        assert torch.all((result.tokens[:, 0] >= 0) & (result.tokens[:, 0] < 9))


# ------------------------------------------------------------------------------------------- custom op machinery
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype, device):
    """torch.library.opcheck on all five ops: schema, fake kernel, and dispatch agree with the real kernel."""
    batch, num_positions, vocab = 4, 3, 20
    tokens, draft, target = (t.to(device) for t in random_problem(batch, num_positions, vocab, seed=3, dtype=dtype))
    weight = torch.full((batch, num_positions), 0.5, device=device)
    num_draft = torch.tensor([3, 1, 0, 2], device=device)
    seeds = torch.arange(batch, dtype=torch.int64, device=device)
    greedy = torch.tensor([False, True, False, False], device=device)
    uniforms = torch.rand(batch, num_positions + 1, dtype=torch.float64, device=device)
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0], device=device)
    for explicit in (None, uniforms):  # Philox draws from per-row seeds, or explicit uniforms
        torch.library.opcheck(torch.ops.diversed.verify_probs.default,
                              (tokens, draft, target, weight, num_draft, greedy, explicit, seeds, 5, True))
        torch.library.opcheck(torch.ops.diversed.verify_logits.default,
                              (tokens, draft, target, weight, num_draft, temperature, explicit, seeds, 0,
                               explicit is None))
    for from_logits in (False, True):
        torch.library.opcheck(torch.ops.diversed.token_stats.default,
                              (draft, target[:, :num_positions].contiguous(), tokens, temperature, from_logits))
        torch.library.opcheck(torch.ops.diversed.mix.default, (draft, target, weight, temperature, from_logits))
    torch.library.opcheck(torch.ops.diversed.distribution_features.default,
                          (draft, target[:, :num_positions].contiguous(), temperature))
    # the draft read through an index beside a target of another dtype, at a temperature of its own
    rows = torch.arange(batch * num_positions, device=device).reshape(batch, num_positions).flip(0).contiguous()
    other_dtype = torch.float32 if draft.dtype == torch.bfloat16 else torch.bfloat16
    torch.library.opcheck(torch.ops.diversed.distribution_features.default,
                          (draft.reshape(-1, draft.shape[-1]), target[:, :num_positions].to(other_dtype).contiguous(),
                           temperature, None, rows, torch.ones(batch, device=device)))
    # the gate's statistics: tokens only on the target rows read in place, and with a draft of another dtype
    target_rows = target.reshape(-1, target.shape[-1])
    torch.library.opcheck(torch.ops.diversed.gate_statistics.default,
                          (tokens, None, target_rows, temperature, rows.contiguous()))
    torch.library.opcheck(torch.ops.diversed.gate_statistics.default,
                          (tokens, draft, target[:, :num_positions].to(other_dtype).contiguous(), temperature, None,
                           None, torch.ones(batch, device=device)))
    torch.library.opcheck(torch.ops.diversed.gate_statistics.default,
                          (tokens, draft.reshape(-1, draft.shape[-1]).softmax(-1), target_rows, temperature,
                           rows.contiguous(), rows.contiguous(), None, True))


def test_torch_compile_fullgraph_traces_verify():
    tokens, draft, target = problem(4, 3, 30)
    uniforms = torch.rand(4, 4, dtype=torch.float64)

    def step(tokens, draft, target, weight, uniforms):
        return dx.verify(tokens, draft, target, weight, uniforms=uniforms, check_inputs=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    weight = torch.rand(4, 3)
    expected = step(tokens, draft, target, weight, uniforms)
    got = compiled(tokens, draft, target, weight, uniforms)
    assert torch.equal(expected.tokens, got.tokens)
    assert torch.equal(expected.num_accepted, got.num_accepted)


def test_cpu_kernel_registered():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("diversed::verify_probs", "CPU")


def test_native_call_releases_the_gil():
    # A Python thread ticking every millisecond must land inside a native call. How often it does depends on the
    # call's length and on the scheduler (a busy machine may not run the ticker for a while), so calls are repeated,
    # on a larger problem while one is too short to hold two ticks, until one shows it. Only ticks in the middle half
    # of a call count: the Python around the kernel may let the ticker in even when the kernel holds the GIL.
    ticks = []
    done = threading.Event()

    def count_ticks():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    counter = threading.Thread(target=count_ticks, daemon=True)
    counter.start()
    try:
        batch, call = 8, None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if call is None:
                tokens, draft, target = random_problem(batch, 8, 200_000, seed=0)
                greedy = torch.ones(batch, dtype=torch.bool)
                call = functools.partial(dx.verify, tokens, draft, target, 0.5, greedy=greedy, check_inputs=False,
                                         seed=0)
                call()  # warm-up
            ticks.clear()
            start = time.perf_counter()
            call()
            end = time.perf_counter()
            quarter = (end - start) / 4
            if sum(start + quarter < t < end - quarter for t in list(ticks)) >= 2:
                return
            if end - start < 0.02 and batch < 32:  # too short for two ticks in its middle: a larger problem
                batch, call = batch * 2, None
    finally:
        done.set()
        counter.join()
    pytest.fail("no Python progress in the middle of any native call for 60 s: the GIL was held")
