"""Batched decoding: prompts decoded together give each prompt the tokens it gets alone, whatever its neighbours and
the batch size; ragged rows, EOS mid-batch, refill of finished slots and the length edges (tiny random Llama pairs
from helpers/models.py).

Exact token equality is asserted on float64 models (whose products go through torch.mm: there a
batched product differs from a one-row product only in the last bits of a double, which no sampled or greedy decision
of these tests comes near), and on float32 models, whose products the lean runner computes over packed weights in
an order that does not depend on the row count, so their batched passes equal one-row passes bit for bit.

Where a GPU is visible the ragged rows also run on CUDA, and a CUDA round's waits for the device are counted: one per
draft pass, one for the verifier's results, none in the head, the gate or the verify call.
"""

import copy
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext import philox_uniforms  # noqa: E402
from diversed_ext.decoding import Fly, Gate, SpeculativeDecoder, batch  # noqa: E402
from diversed_ext.decoding.transfers import device_tensor, read_back  # noqa: E402
from diversed_ext.head import DISTRIBUTION_FEATURES, EnsembleHead  # noqa: E402
from helpers import (PROMPT, assert_prompts_decode_as_alone, models_on_device, requires_cuda,  # noqa: E402
                     sequences, wide_pair_models)

PROMPTS = [PROMPT, [3], [5, 1, 4, 4, 2, 7, 7, 0, 9], [2, 2], [8, 6, 1], [0, 1, 2, 3, 4, 5]]
METHODS = [("ar", {}), ("sd", {}), ("static", {"weight": 0.4}), ("diversed", {"head": None})]


def smooth_head(draft_hidden, target_hidden):
    """A per-token head that works in any float dtype: w from both hidden states, in (0, 1)."""
    return torch.sigmoid(draft_hidden.sum(-1) - target_hidden.sum(-1))


def make_decoder(pair, method, kwargs, temperature, fast_forward=True, max_draft=3):
    target, draft = pair
    kwargs = dict(kwargs, head=smooth_head) if method == "diversed" and kwargs.get("head") is None else kwargs
    return SpeculativeDecoder(target, draft if method != "ar" else None, method=method, max_draft=max_draft,
                              temperature=temperature, fast_forward=fast_forward, **kwargs)


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast-forward", "hf-forward"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method,kwargs", METHODS, ids=[method for method, _ in METHODS])
def test_prompt_tokens_do_not_depend_on_batch_size_or_neighbours(double_pair, method, kwargs, temperature,
                                                                 fast_forward):
    decoder = make_decoder(double_pair, method, kwargs, temperature, fast_forward)
    alone = assert_prompts_decode_as_alone(decoder, PROMPTS, max_new_tokens=14)
    assert any(len(tokens) < 14 for tokens in alone)  # an EOS ended a row mid-batch


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast-forward", "hf-forward"])
def test_greedy_sd_equals_greedy_ar_batched(double_pair, fast_forward):
    ar = make_decoder(double_pair, "ar", {}, 0.0, fast_forward).generate(PROMPTS, max_new_tokens=20, batch_size=4)
    for method, kwargs in [("sd", {}), ("static", {"weight": 1.0})]:
        output = make_decoder(double_pair, method, kwargs, 0.0, fast_forward).generate(PROMPTS, max_new_tokens=20,
                                                                                        batch_size=4)
        assert sequences(output) == sequences(ar)
        assert sum(stats.accepted for rounds in output.rounds for stats in rounds) > 0


def test_finished_slots_are_refilled_before_the_batch_empties(double_pair):
    decoder = make_decoder(double_pair, "static", {"weight": 0.5}, 1.0)
    sizes, members = [], []
    step_batch = decoder.step_batch

    def spy(states):
        sizes.append(len(states))
        members.append({id(state) for state in states})
        return step_batch(states)

    decoder.step_batch = spy
    # EOS ends some rows early, so rows finish at different rounds and slots free up while others still run.
    output = decoder.generate(PROMPTS, max_new_tokens=12, eos_token_id=[4], seed=3, batch_size=2)
    assert len({len(tokens) for tokens in output.sequences}) > 1
    assert max(sizes) == 2
    # Some round mixes a row that was already running with a row that joined after another finished.
    assert any(before & after and before != after for before, after in zip(members, members[1:]))


def test_rows_draft_ragged_counts_in_one_round(double_pair):
    decoder = make_decoder(double_pair, "sd", {}, 1.0, max_draft=4)
    # EOS drafts stop a row's drafting early, so rows of one round propose different numbers of tokens.
    output = decoder.generate(PROMPTS, max_new_tokens=12, eos_token_id=[2, 7], seed=5)
    first_rounds = [rounds[0].drafted for rounds in output.rounds]
    assert all(count <= 4 for count in first_rounds)
    per_round = {}
    for rounds in output.rounds:
        for index, stats in enumerate(rounds):
            per_round.setdefault(index, set()).add(stats.drafted)
    assert any(len(counts) > 1 for counts in per_round.values())


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2])
def test_length_edges_batched(double_pair, max_new_tokens):
    decoder = make_decoder(double_pair, "sd", {}, 1.0, max_draft=8)  # K far above what is left
    output = decoder.generate(PROMPTS, max_new_tokens=max_new_tokens, seed=0, batch_size=4)
    for generation in output.generations:
        assert len(generation.tokens) == max_new_tokens and generation.finish_reason == "length"
        assert len(generation.rounds) == (0 if max_new_tokens == 0 else len(generation.rounds))
        assert all(stats.drafted <= max_new_tokens - 1 for stats in generation.rounds)
    if max_new_tokens == 1:
        assert all(generation.rounds[0].drafted == 0 for generation in output.generations)


def test_head_sees_every_drafted_token_of_the_round_once(double_pair):
    calls = []

    def head(draft_hidden, target_hidden):
        calls.append((draft_hidden.shape, target_hidden.shape))
        return smooth_head(draft_hidden, target_hidden)

    target, draft = double_pair
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=head, max_draft=3)
    output = decoder.generate(PROMPTS[:4], max_new_tokens=10, seed=1)
    drafted_per_round = {}
    for rounds in output.rounds:
        for index, stats in enumerate(rounds):
            drafted_per_round[index] = drafted_per_round.get(index, 0) + stats.drafted
    expected = [count for _, count in sorted(drafted_per_round.items()) if count]
    assert [shape[1] for shape, _ in calls] == expected
    assert all(shape[0] == 1 and other[:2] == shape[:2] for shape, other in calls)


def test_round_statistics_are_per_row_with_shared_times(double_pair):
    decoder = make_decoder(double_pair, "static", {"weight": 0.5}, 1.0)
    output = decoder.generate(PROMPTS, max_new_tokens=15, seed=2)
    assert output.summary().new_tokens == 15 * len(PROMPTS)
    first = [rounds[0] for rounds in output.rounds]
    assert len({stats.round_seconds for stats in first}) == 1  # every row of the first round: the round's time
    assert output.seconds > 0 and output.tokens_per_second == pytest.approx(15 * len(PROMPTS) / output.seconds)
    for generation in output.generations:
        assert sum(stats.emitted for stats in generation.rounds) == len(generation.tokens)


def test_float32_rows_equal_one_row_passes_exactly():
    """The lean runner's float products sum every output in the same order whatever the row count, and attention
    runs row by row: a float32 model's batched pass is, row for row, bit for bit the pass over that row alone."""
    target, _ = wide_pair_models()
    decoder = SpeculativeDecoder(target, None, method="ar")
    runner = decoder._target_runner
    assert runner.projections[0].qkv.float is not None  # the packed float path is the one under test
    feeds = [PROMPT, [3], [5, 1, 4, 4, 2]]
    batched, hidden, _ = runner.run_rows(feeds, [None] * 3, [len(feed) for feed in feeds], True)
    alone = [runner(feed, None, len(feed), True) for feed in feeds]
    assert torch.equal(batched, torch.cat([logits for logits, _, _ in alone]))
    assert torch.equal(hidden, torch.cat([states for _, states, _ in alone]))


@pytest.mark.parametrize("method,kwargs", METHODS)
def test_float32_pair_gives_each_prompt_its_own_tokens_at_any_batch_size(method, kwargs):
    """So on float32 models, too, a prompt's sampled tokens do not depend on its neighbours or the batch size."""
    pair = wide_pair_models()
    outputs = [make_decoder(pair, method, kwargs, 1.0).generate(PROMPTS, max_new_tokens=12, seed=5, batch_size=size)
               for size in (1, 4)]
    for one, four in zip(*(output.generations for output in outputs)):
        assert torch.equal(one.tokens, four.tokens)


def test_int8_draft_rows_equal_one_row_passes_exactly():
    """The lean runner quantises each row's activations on their own, so an int8 draft's batched pass is, row for
    row, bit for bit the pass over that row alone (a shared per-call quantisation would fail this)."""
    from diversed_ext.forward.llama_runner import LlamaRunner
    from diversed_ext.forward import quantize_int8

    target, _ = wide_pair_models()
    runner = LlamaRunner(quantize_int8(target))
    assert runner.projections[0].qkv.int8 is not None  # the fused int8 path is the one under test
    feeds = [PROMPT, [3], [5, 1, 4, 4, 2]]
    cached = runner([7, 7, 1], None, 1, True)[2]  # a row with a prefix already cached
    batched, hidden, _ = runner.run_rows(feeds + [[2]], [None] * 3 + [copy.deepcopy(cached)], [1, 1, 2, 1], True)
    alone = [runner(feed, None, count, True) for feed, count in zip(feeds, [1, 1, 2])]
    alone.append(runner([2], copy.deepcopy(cached), 1, True))
    assert torch.equal(batched, torch.cat([logits for logits, _, _ in alone]))
    assert torch.equal(hidden, torch.cat([states for _, states, _ in alone]))


def test_philox_uniforms_take_per_row_offsets():
    seeds = torch.tensor([3, 3, 9, 2**40], dtype=torch.int64)
    offsets = torch.tensor([0, 7, 2**33 + 5, 1], dtype=torch.int64)
    batched = philox_uniforms(seeds, offsets, 5, True)
    for row in range(4):
        alone = philox_uniforms(seeds[row:row + 1], int(offsets[row]), 5, True)
        assert torch.equal(batched[row:row + 1], alone)
    assert not torch.equal(batched[0], batched[1])


@pytest.mark.parametrize("batch_size,error,match", [
    (0, ValueError, "batch_size must be >= 1"),
    (-3, ValueError, "batch_size must be >= 1"),
    (2.0, TypeError, "batch_size must be an int"),
    (True, TypeError, "batch_size must be an int"),
])
def test_bad_batch_size_names_the_argument(wide_pair, batch_size, error, match):
    target, draft = wide_pair
    with pytest.raises(error, match=match):
        SpeculativeDecoder(target, draft, method="sd").generate(PROMPTS, max_new_tokens=3, batch_size=batch_size)


def test_a_bad_prompt_late_in_the_list_fails_before_any_work(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd")
    decoder.step_batch = None  # any round would fail with a TypeError instead of the prompt's error
    with pytest.raises(ValueError, match="token ids must be"):
        decoder.generate([PROMPT, [1, 99]], max_new_tokens=3)


def test_step_batch_refuses_finished_and_repeated_states(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd")
    state = decoder.start(PROMPT, max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match="appears twice"):
        decoder.step_batch([state, state])
    other = decoder.start([3], max_new_tokens=1, seed=0)
    decoder.step_batch([state, other])
    assert other.finished
    with pytest.raises(RuntimeError, match="has finished"):
        decoder.step_batch([state, other])


@pytest.mark.parametrize("method,kwargs", [("static", {"weight": 0.5}), ("diversed", {"head": None})],
                         ids=["static", "diversed"])
def test_ragged_rows_on_the_device_decode_as_alone(double_pair, device, method, kwargs):
    decoder = make_decoder(models_on_device(double_pair, device), method, kwargs, temperature=1.0)
    alone = assert_prompts_decode_as_alone(decoder, PROMPTS, max_new_tokens=14)
    assert any(len(tokens) < 14 for tokens in alone)  # an EOS ended a row mid-batch


# ---- host syncs of a CUDA round ----------------------------------------------------------------------------------


def test_transfers_carry_values_exactly(device):
    values = [[0, 5, -1], [2**40 + 1, 7, 3]]
    assert device_tensor(values, torch.int64, device).tolist() == values
    tokens = torch.tensor(values, device=device)
    probs = torch.rand(2, 3, device=device)
    flags = torch.tensor([True, False], device=device)
    empty = torch.zeros(0, 4, device=device)
    assert read_back(tokens, probs, flags, empty) == [values, probs.tolist(), [True, False], []]

# The round's steps between the target pass and the read-back of its results: none may wait on the device.
DEVICE_SIDE_STEPS = ["_shared_vocab_logits", "_weights", "_draft_tensor", "_gated", "_verify"]
SYNC_CASES = [("sd", {}, 0.0), ("sd", {}, 1.0), ("diversed", {"head": None}, 1.0),
              ("diversed", {"head": "features"}, 1.0), ("static", {"weight": 0.5, "gate": Gate(1.0)}, 1.0),
              ("fly", {"fly": Fly(window=1)}, 1.0), ("sd", {"draft_mode": "tokens"}, 1.0)]


class UncountedRunner:
    """A model runner whose passes run with the sync check off: their waits are the model code's, not the round's."""

    def __init__(self, runner):
        self.runner = runner

    def run_rows(self, *args):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return self.runner.run_rows(*args)
        finally:
            torch.cuda.set_sync_debug_mode("warn")


def round_syncs(decoder, states, monkeypatch) -> tuple[list, dict]:
    """(where each host sync of one round was made, outside the model passes, as "file:line"; the count inside each
    device-side step), seen by torch's sync debug mode, which warns at every synchronising CUDA call."""
    decoder._target_runner = UncountedRunner(decoder._target_runner)
    decoder._draft_runner = UncountedRunner(decoder._draft_runner)
    spans = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in DEVICE_SIDE_STEPS:
            def counted(*args, _step=getattr(batch, name), _name=name, **kwargs):
                start = len(caught)
                try:
                    return _step(*args, **kwargs)
                finally:
                    spans.append((_name, start, len(caught)))
            monkeypatch.setattr(batch, name, counted)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            decoder.step_batch(states)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # The words of torch's warning at a synchronising call (not those of its one-time notice that the debug mode is a
    # prototype, which the first set_sync_debug_mode of a process gives).
    syncs = ["called a synchronizing CUDA operation" in str(warning.message) for warning in caught]
    places = [f"{os.path.basename(warning.filename)}:{warning.lineno}" for warning, sync in zip(caught, syncs) if sync]
    return places, {name: sum(syncs[start:end]) for name, start, end in spans}


@requires_cuda
@pytest.mark.parametrize("method,kwargs,temperature", SYNC_CASES,
                         ids=["sd-greedy", "sd", "diversed", "diversed-features", "static-gate", "fly",
                              "sd-tokens-only"])
def test_a_cuda_round_waits_once_per_draft_pass_and_once_for_its_results(wide_pair, method, kwargs, temperature,
                                                                        monkeypatch):
    if kwargs.get("head") == "features":  # a head that also reads both models' distributions
        kwargs = dict(kwargs, head=EnsembleHead(16, 16, features=DISTRIBUTION_FEATURES).to("cuda"))
    # Timing for real waits for the device on purpose: what is counted here is the decoding itself.
    decoder = make_decoder(models_on_device(wide_pair, "cuda"), method, dict(kwargs, synchronize_timing=False),
                           temperature, max_draft=4)
    states = [decoder.start(prompt, max_new_tokens=40, seed=index) for index, prompt in enumerate(PROMPTS[:3])]
    decoder.step_batch(states)  # the first round reads the prompts and allocates
    places, inside = round_syncs(decoder, states, monkeypatch)
    assert inside == {name: 0 for name in DEVICE_SIDE_STEPS}
    assert [stats.drafted for stats in states[0].rounds] == [4, 4]
    assert len(places) == 4 + 1, places  # the drafted tokens of each of the 4 draft passes, then the verifier's results
