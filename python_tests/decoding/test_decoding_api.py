"""The decoding loop's API: stopping, the head, round statistics and argument errors (tiny random Llama pairs from
helpers/models.py)."""

import itertools
import math

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.decoding import GenerationOutput, SpeculativeDecoder, summarize  # noqa: E402
from helpers import PROMPT  # noqa: E402


class RecordingHead(torch.nn.Module):
    """Stand-in for the DIVERSED head: returns a constant weight and keeps every input it saw."""

    def __init__(self, value):
        super().__init__()
        self.value = value
        self.calls = []

    def forward(self, draft_hidden, target_hidden):
        self.calls.append((draft_hidden.clone(), target_hidden.clone()))
        return torch.full(draft_hidden.shape[:2], self.value)


class LinearHead(torch.nn.Module):
    """A tiny learned-style head: sigmoid of a linear map of both hidden states."""

    def __init__(self, draft_size, target_size):
        super().__init__()
        torch.manual_seed(5)
        self.linear = torch.nn.Linear(draft_size + target_size, 1)

    def forward(self, draft_hidden, target_hidden):
        return torch.sigmoid(self.linear(torch.cat([draft_hidden, target_hidden], dim=-1))).squeeze(-1)


# ---- stopping --------------------------------------------------------------------------------------------------------


def test_max_new_tokens_edges(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="static", weight=0.3, max_draft=5)
    empty = decoder.generate(PROMPT, max_new_tokens=0, seed=0).generations[0]
    assert empty.tokens.numel() == 0 and empty.rounds == [] and empty.finish_reason == "length"
    one = decoder.generate(PROMPT, max_new_tokens=1, seed=0).generations[0]
    assert len(one.tokens) == 1 and len(one.rounds) == 1 and one.rounds[0].drafted == 0
    for length, seed in itertools.product([2, 5, 6, 7, 13], range(4)):
        generation = decoder.generate(PROMPT, max_new_tokens=length, seed=seed).generations[0]
        assert len(generation.tokens) == length and generation.finish_reason == "length"
        assert all(stats.drafted <= length - 1 for stats in generation.rounds)


def test_greedy_stops_right_after_eos(wide_pair):
    target, draft = wide_pair
    ar = SpeculativeDecoder(target, method="ar", temperature=0)
    full = ar.generate(PROMPT, max_new_tokens=30).sequences[0].tolist()
    # An EOS whose first occurrence is a few tokens in: the output must stop right there, with the EOS kept.
    position = next(index for index, token in enumerate(full) if index >= 2 and token not in full[:index])
    eos = full[position]
    for method, weight in [("ar", None), ("sd", None), ("static", 1.0)]:
        decoder = SpeculativeDecoder(target, draft if method != "ar" else None, method=method, weight=weight,
                                     max_draft=4, temperature=0)
        generation = decoder.generate(PROMPT, max_new_tokens=30, eos_token_id=eos).generations[0]
        assert generation.tokens.tolist() == full[:position + 1]
        assert generation.finish_reason == "eos"


@pytest.mark.parametrize("weight", [0.0, 0.6, 1.0])
def test_sampled_output_never_runs_past_eos(wide_pair, weight):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="static", weight=weight, max_draft=4)
    eos_ids = [5, 9]
    reasons = set()
    for seed in range(12):
        generation = decoder.generate(PROMPT, max_new_tokens=25, eos_token_id=eos_ids, seed=seed).generations[0]
        tokens = generation.tokens.tolist()
        reasons.add(generation.finish_reason)
        assert not set(tokens[:-1]) & set(eos_ids)
        if generation.finish_reason == "eos":
            assert tokens[-1] in eos_ids
        else:
            assert len(tokens) == 25
        assert sum(stats.emitted for stats in generation.rounds) == len(tokens)
        # A drafted EOS ends the draft: nothing past it is ever proposed.
        assert all(stats.drafted <= 4 for stats in generation.rounds)
    assert "eos" in reasons


# ---- the head --------------------------------------------------------------------------------------------------------


def test_head_sees_the_last_hidden_states_of_both_models(wide_pair):
    target, draft = wide_pair
    head = RecordingHead(0.0)  # w = 0 keeps every draft, so the drafts are the output tokens
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=head, max_draft=3)
    output = decoder.generate(PROMPT, max_new_tokens=14, seed=0)
    tokens = PROMPT + output.sequences[0].tolist()
    with torch.inference_mode():
        target_hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        draft_hidden = draft(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    context = len(PROMPT)
    rounds = output.rounds[0]
    assert len(head.calls) == sum(stats.drafted > 0 for stats in rounds)
    for stats, (seen_draft, seen_target) in zip(rounds, head.calls):
        k = stats.drafted
        assert seen_draft.shape == (1, k, draft.config.hidden_size)
        assert seen_target.shape == (1, k, target.config.hidden_size)
        # Draft i is predicted at position context - 1 + i, the position whose hidden state the head must get.
        positions = slice(context - 1, context - 1 + k)
        torch.testing.assert_close(seen_target[0], target_hidden[positions], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(seen_draft[0], draft_hidden[positions], rtol=1e-4, atol=1e-4)
        context += stats.emitted


def test_rounds_record_the_drafts_and_the_weights_the_head_chose(wide_pair):
    target, draft = wide_pair
    head = LinearHead(draft.config.hidden_size, target.config.hidden_size)
    output = SpeculativeDecoder(target, draft, method="diversed", head=head, max_draft=3).generate(
        PROMPT, max_new_tokens=12, seed=0)
    tokens = output.sequences[0].tolist()
    emitted = 0
    for stats in output.rounds[0]:
        assert len(stats.draft_tokens) == len(stats.weights) == stats.drafted
        assert all(0.0 < weight < 1.0 for weight in stats.weights)
        # The accepted drafts are the round's first output tokens.
        assert list(stats.draft_tokens[:stats.accepted]) == tokens[emitted:emitted + stats.accepted][:stats.emitted]
        emitted += stats.emitted
    static = SpeculativeDecoder(target, draft, method="static", weight=0.5, max_draft=3).generate(
        PROMPT, max_new_tokens=6, seed=0)
    assert all(stats.weights == () and len(stats.draft_tokens) == stats.drafted for stats in static.rounds[0])


def test_head_weight_one_reproduces_sd_and_zero_accepts_all(wide_pair):
    target, draft = wide_pair
    sd = SpeculativeDecoder(target, draft, method="sd", max_draft=3).generate(PROMPT, max_new_tokens=30, seed=9)
    ones = SpeculativeDecoder(target, draft, method="diversed", head=RecordingHead(1.0), max_draft=3)
    assert ones.generate(PROMPT, max_new_tokens=30, seed=9).sequences[0].tolist() == sd.sequences[0].tolist()
    zeros = SpeculativeDecoder(target, draft, method="diversed", head=RecordingHead(0.0), max_draft=3)
    rounds = zeros.generate(PROMPT, max_new_tokens=30, seed=9).rounds[0]
    assert all(stats.accepted == stats.drafted for stats in rounds)
    assert all(stats.head_seconds >= 0 for stats in rounds)


def test_learned_style_head_runs_end_to_end(wide_pair):
    target, draft = wide_pair
    head = LinearHead(draft.config.hidden_size, target.config.hidden_size)
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=head, max_draft=3)
    output = decoder.generate([PROMPT, [2, 2]], max_new_tokens=20, seed=1)
    assert [len(tokens) for tokens in output.sequences] == [20, 20]


def test_head_returning_the_wrong_shape_is_rejected(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=lambda d, t: torch.ones(1, 1, 7),
                                 max_draft=3)
    with pytest.raises(ValueError, match="head must return one weight per drafted token"):
        decoder.generate(PROMPT, max_new_tokens=10, seed=0)


def test_a_head_on_another_device_than_the_target_is_refused_with_the_fix(wide_pair):
    from diversed_ext.head import EnsembleHead

    head = EnsembleHead(16, 16).to("meta")  # any device but the target's: a machine without a GPU has meta
    with pytest.raises(ValueError, match=r"head is on meta and the target on cpu.*head\.to\('cpu'\)"):
        SpeculativeDecoder(*wide_pair, method="diversed", head=head)
    SpeculativeDecoder(*wide_pair, method="diversed", head=head.to_empty(device="cpu"))


# ---- statistics ------------------------------------------------------------------------------------------------------


def test_round_statistics_add_up(wide_pair):
    target, draft = wide_pair
    output = SpeculativeDecoder(target, draft, method="static", weight=0.5, max_draft=3).generate(
        [PROMPT, [3]], max_new_tokens=25, seed=4)
    summary = output.summary()
    rounds = [stats for generation_rounds in output.rounds for stats in generation_rounds]
    assert summary.new_tokens == sum(stats.emitted for stats in rounds) == 50
    assert summary.target_passes == len(rounds)
    assert 0 < summary.acceptance_rate <= 1
    assert summary.tokens_per_pass == pytest.approx(50 / len(rounds))
    for stats in rounds:
        assert stats.accepted <= stats.drafted <= 3
        assert min(stats.draft_seconds, stats.target_seconds, stats.verify_seconds, stats.head_seconds) >= 0
        assert stats.round_seconds >= stats.draft_seconds + stats.target_seconds + stats.verify_seconds
        assert stats.overhead_seconds >= 0
    assert 0 <= summary.overhead_fraction < 1
    assert summarize(output.generations) == summary

    ar = SpeculativeDecoder(target, method="ar").generate(PROMPT, max_new_tokens=10, seed=0).summary()
    assert ar.target_passes == 10 and ar.tokens_per_pass == 1 and math.isnan(ar.acceptance_rate)
    assert isinstance(output, GenerationOutput)


# ---- argument errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    ({"method": "beam"}, ValueError, "method must be one of"),
    ({"method": "static"}, ValueError, "needs weight"),
    ({"method": "static", "weight": 1.5}, ValueError, r"weight must be a number in \[0, 1\]"),
    ({"method": "static", "weight": -0.1}, ValueError, r"weight must be a number in \[0, 1\]"),
    ({"method": "static", "weight": float("nan")}, ValueError, r"weight must be a number in \[0, 1\]"),
    ({"method": "static", "weight": "0.5"}, TypeError, "weight must be a number"),
    ({"method": "sd", "weight": 0.5}, ValueError, "method 'sd' is the w = 1 case"),
    ({"method": "diversed"}, ValueError, "needs head"),
    ({"method": "diversed", "head": 3}, TypeError, "head must be callable"),
    ({"method": "sd", "head": RecordingHead(1.0)}, ValueError, "head applies only"),
    ({"method": "sd", "max_draft": 0}, ValueError, r"max_draft \(K\) must be >= 1"),
    ({"method": "sd", "max_draft": -2}, ValueError, r"max_draft \(K\) must be >= 1"),
    ({"method": "sd", "max_draft": 2.0}, TypeError, "max_draft must be an int"),
    ({"method": "sd", "temperature": -1.0}, ValueError, "temperature must be"),
    ({"method": "sd", "temperature": float("nan")}, ValueError, "temperature must be"),
])
def test_bad_decoder_arguments_name_the_argument(wide_pair, kwargs, error, match):
    target, draft = wide_pair
    with pytest.raises(error, match=match):
        SpeculativeDecoder(target, draft, **kwargs)


def test_speculative_methods_need_a_draft(wide_pair):
    target, _ = wide_pair
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(target, None, method="sd")
    SpeculativeDecoder(target, None, method="ar")  # the target alone needs none


@pytest.mark.parametrize("prompt,kwargs,error,match", [
    ([], {}, TypeError, "input_ids must be"),
    (torch.tensor([], dtype=torch.int64), {}, ValueError, "at least one token"),
    ([1, 99], {}, ValueError, r"token ids must be in \[0, 32\)"),
    ([1, -1], {}, ValueError, r"token ids must be in \[0, 32\)"),
    (torch.zeros(1, 2, 3, dtype=torch.int64), {}, ValueError, "1-D"),
    (torch.zeros(3), {}, TypeError, "integer token ids"),
    ([1, 2], {"max_new_tokens": -1}, ValueError, "max_new_tokens must be"),
    ([1, 2], {"eos_token_id": "x"}, TypeError, "eos_token_id must be"),
    ([1, 2], {"seed": 1.5}, TypeError, "seed must be an int"),
])
def test_bad_generate_arguments_name_the_argument(wide_pair, prompt, kwargs, error, match):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd")
    with pytest.raises(error, match=match):
        decoder.generate(prompt, **{"max_new_tokens": 3, **kwargs})


def test_step_after_the_end_is_an_error(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd")
    state = decoder.start(PROMPT, max_new_tokens=2, seed=0)
    while not state.finished:
        decoder.step(state)
    with pytest.raises(RuntimeError, match="has finished"):
        decoder.step(state)
