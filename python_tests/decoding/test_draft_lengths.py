"""Draft-length policies: each rule on its own, then in the decoding loop (the output law, greedy exactness, batch
invariance, rows that stop independently) on tiny random Llama pairs, and the comparison table."""

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

from diversed_ext.decoding import (DRAFT_LENGTHS, ConfidenceDraftLength, DraftLengthPolicy, GainDraftLength,  # noqa
                                   HeuristicDraftLength, NgramDrafter, RoundOutcome, SpeculativeDecoder)
from diversed_ext.decoding.draft_lengths import cheapest_threshold, make_policy  # noqa: E402
from diversed_ext.research.draft_length_report import best_fixed, draft_length_table, paired_speedup  # noqa: E402
from diversed_ext.research.harness import with_draft_lengths  # noqa: E402
from diversed_ext.research.report import MethodResult  # noqa: E402
from helpers import (PROMPT, SMALL_VOCAB, assert_prompts_decode_as_alone, chi_square_cells_p_value,  # noqa: E402
                     exact_joint, sequences)

ADAPTIVE = [name for name in DRAFT_LENGTHS if name != "fixed"]


def outcome(drafted, accepted, draft_probs=(), accept_probs=None, weight=1.0):
    accept_probs = [1.0] * accepted + [0.0] * (drafted - accepted) if accept_probs is None else accept_probs
    return RoundOutcome(drafted, accepted, list(accept_probs), list(draft_probs), [weight] * drafted)


# ---- the rules alone -------------------------------------------------------------------------------------------------


def test_fixed_drafts_the_cap_every_round():
    policy = make_policy("fixed", 5)
    memory = policy.start()
    assert policy.budget(memory) == 5 and policy.keep_drafting(memory, [0.01]) and not policy.reads_draft_probs


def test_heuristic_grows_by_two_and_shrinks_by_one_within_its_bounds():
    policy = HeuristicDraftLength(max_draft=8)
    memory = policy.start()
    assert policy.budget(memory) == 5  # transformers' starting value
    policy.update(memory, outcome(5, 5))
    assert policy.budget(memory) == 7
    policy.update(memory, outcome(7, 7))
    assert policy.budget(memory) == 8  # capped
    for _ in range(10):
        policy.update(memory, outcome(3, 1))
    assert policy.budget(memory) == 1  # never below one
    policy.update(memory, outcome(0, 0))  # a round with nothing drafted changes nothing
    assert policy.budget(memory) == 1
    assert HeuristicDraftLength(max_draft=3).budget(HeuristicDraftLength(max_draft=3).start()) == 3


def test_cheapest_threshold_minimises_false_positives_plus_three_false_negatives():
    # kept drafts at 0.9, 0.8, 0.3; missed at 0.6, 0.2. Thresholds and FPR + 3 FNR:
    # inf: 0 + 3 = 3; 0.9: 0 + 2 = 2; 0.8: 0 + 1 = 1; 0.6: 0.5 + 1 = 1.5; 0.3: 0.5 + 0 = 0.5; 0.2: 1 + 0 = 1.
    assert cheapest_threshold([0.9, 0.8, 0.3, 0.6, 0.2], [1, 1, 1, 0, 0]) == 0.3
    # Every miss above every kept draft: no threshold beats drafting everything (0.1: cost 1 against 3 at inf).
    assert cheapest_threshold([0.1, 0.9], [1, 0]) == 0.1


def test_confidence_stops_below_its_threshold_and_refits_it_per_request():
    policy = ConfidenceDraftLength(max_draft=8)
    memory = policy.start()
    assert policy.keep_drafting(memory, [0.9, 0.45]) and not policy.keep_drafting(memory, [0.9, 0.35])
    # Judged pairs are the kept drafts and the first miss; later drafts were never judged.
    policy.update(memory, outcome(4, 2, draft_probs=[0.9, 0.8, 0.2, 0.7]))
    assert memory.draft_probs == [0.9, 0.8, 0.2] and memory.kept == [1, 1, 0]
    policy.update(memory, outcome(3, 3, draft_probs=[0.3, 0.35, 0.5]))
    assert memory.threshold == 0.3  # six pairs, both outcomes: refitted
    assert policy.start().threshold == 0.4  # another request starts afresh
    fixed = ConfidenceDraftLength(max_draft=8, adaptive=False)
    fixed_memory = fixed.start()
    fixed.update(fixed_memory, outcome(4, 2, draft_probs=[0.9, 0.8, 0.2, 0.7]))
    assert fixed_memory.threshold == 0.4 and not fixed_memory.draft_probs


def test_gain_drafts_on_confident_drafts_and_stops_on_doubtful_ones():
    policy = GainDraftLength(max_draft=8, weight=1.0)
    memory = policy.start()
    assert policy.keep_drafting(memory, [0.99, 0.99, 0.99])
    assert not policy.keep_drafting(memory, [0.99, 0.02])
    # w = 0 keeps every draft: nothing is ever worth stopping for.
    assert GainDraftLength(max_draft=8, weight=0.0).keep_drafting(memory, [0.01] * 7)
    # A draft pass dearer than a target pass is not worth one more draft at even odds.
    assert not GainDraftLength(max_draft=8, weight=1.0, draft_cost=5.0).keep_drafting(memory, [0.6])
    # A free draft is worth drafting whenever the chain can still be kept.
    assert GainDraftLength(max_draft=8, weight=1.0, draft_cost=0.0).keep_drafting(memory, [0.5, 0.5])


def test_gain_learns_each_requests_rejections_from_the_verifiers_acceptance_probabilities():
    policy = GainDraftLength(max_draft=8, weight=1.0)
    hopeful, hopeless = policy.start(), policy.start()
    for _ in range(6):
        # Drafts with q(x) = 0.5: one request sees them always kept, the other kept with probability 0.1.
        policy.update(hopeful, outcome(3, 3, draft_probs=[0.5] * 3, accept_probs=[1.0] * 3))
        policy.update(hopeless, outcome(3, 0, draft_probs=[0.5] * 3, accept_probs=[0.1] * 3))
    assert policy.keep_probability(hopeful, 0.5) > 0.85 > 0.2 > policy.keep_probability(hopeless, 0.5)
    assert policy.keep_drafting(hopeful, [0.5, 0.5, 0.5]) and not policy.keep_drafting(hopeless, [0.5])
    # A head's weight is learnt per request too: a head at w = 0 keeps everything, whatever the draft's doubt.
    head_policy = GainDraftLength(max_draft=8, weight=None)
    memory = head_policy.start()
    for _ in range(20):
        head_policy.update(memory, outcome(3, 3, draft_probs=[0.2] * 3, accept_probs=[1.0] * 3, weight=0.0))
    assert head_policy.keep_probability(memory, 0.8) > 0.9


@pytest.mark.parametrize("kwargs, error, match", [
    ({"draft_length": "longest"}, ValueError, "draft_length must be one of"),
    ({"draft_length": 3}, TypeError, "draft_length must be a policy name"),
    ({"draft_length": "fixed", "draft_cost": 0.1}, ValueError, "draft_cost applies to draft_length='gain'"),
    ({"draft_length": "gain", "draft_cost": -1.0}, ValueError, "draft_cost must be a finite number"),
    ({"draft_length": "gain", "draft_cost": math.nan}, ValueError, "draft_cost must be a finite number"),
    ({"draft_length": GainDraftLength(4), "draft_cost": 0.1}, ValueError, "set it on the policy object"),
])
def test_bad_draft_lengths_are_refused_by_name(wide_pair, kwargs, error, match):
    target, draft = wide_pair
    with pytest.raises(error, match=match):
        SpeculativeDecoder(target, draft, method="sd", **kwargs)


@pytest.mark.parametrize("name", ["confidence", "gain"])
def test_rules_that_read_the_drafts_probabilities_need_a_draft_model(wide_pair, name):
    target, _ = wide_pair
    with pytest.raises(ValueError, match="callable drafter"):
        SpeculativeDecoder(target, method="sd", drafter=NgramDrafter(), draft_length=name)
    decoder = SpeculativeDecoder(target, method="sd", drafter=NgramDrafter(), draft_length="heuristic", max_draft=4)
    assert decoder.generate(PROMPT, max_new_tokens=12, seed=0).summary().new_tokens == 12


# ---- in the loop -----------------------------------------------------------------------------------------------------


def test_fixed_by_name_is_the_loop_of_before(wide_pair):
    target, draft = wide_pair
    default = SpeculativeDecoder(target, draft, method="static", weight=0.5, max_draft=3)
    named = SpeculativeDecoder(target, draft, method="static", weight=0.5, max_draft=3,
                               draft_length=DraftLengthPolicy(3))
    prompts = [PROMPT, [5, 9], [7, 7, 8]]
    first, second = default.generate(prompts, max_new_tokens=20, seed=3), named.generate(prompts, max_new_tokens=20,
                                                                                         seed=3)
    assert sequences(first) == sequences(second)
    left = 20  # no EOS: only the length budget cuts a round short
    for stats in first.rounds[0]:
        assert stats.drafted == min(3, left - 1)
        left -= stats.emitted


@pytest.mark.parametrize("name", ADAPTIVE)
def test_adaptive_rows_stop_independently_within_their_cap(wide_pair, name):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", max_draft=5, draft_length=name)
    output = decoder.generate([PROMPT, [5, 9], [7, 7, 8], [30, 1]], max_new_tokens=40, seed=11)
    drafted = [stats.drafted for rounds in output.rounds for stats in rounds]
    assert max(drafted) <= 5
    assert len(set(drafted)) >= 3  # the lengths really vary
    # Within one batched round, rows drafted different lengths: no row waits for another.
    first_rounds = [rounds[2].drafted for rounds in output.rounds]
    later = [[rounds[index].drafted for rounds in output.rounds if len(rounds) > index] for index in range(2, 8)]
    assert any(len(set(counts)) > 1 for counts in later), first_rounds


@pytest.mark.parametrize("name", ADAPTIVE)
@pytest.mark.parametrize("method, weight, draft_mode", [("sd", None, None), ("static", 0.5, None),
                                                        ("sd", None, "tokens")])
def test_a_prompts_tokens_do_not_depend_on_its_neighbours(wide_pair, name, method, weight, draft_mode):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method=method, weight=weight, max_draft=4, draft_length=name,
                                 draft_mode=draft_mode)
    assert_prompts_decode_as_alone(decoder, [PROMPT, [5, 9], [7, 7, 8], [30, 1], [2]])


@pytest.mark.parametrize("name", ADAPTIVE)
@pytest.mark.parametrize("draft_mode", [None, "tokens"])
def test_greedy_sd_still_equals_greedy_ar(wide_pair, name, draft_mode):
    target, draft = wide_pair
    ar = SpeculativeDecoder(target, method="ar", temperature=0)
    sd = SpeculativeDecoder(target, draft, method="sd", max_draft=6, temperature=0, draft_length=name,
                            draft_mode=draft_mode)
    prompts = [PROMPT, [5], [7, 7, 8, 30, 2, 11]]
    output = sd.generate(prompts, max_new_tokens=24)
    assert sequences(output) == sequences(ar.generate(prompts, max_new_tokens=24))
    summary = output.summary()
    assert 0 < summary.accepted < summary.drafted


@pytest.mark.parametrize("name, draft_mode, draft_cost", [("heuristic", None, None), ("confidence", None, None),
                                                          ("gain", None, 0.1), ("gain", "sampled_tokens", 0.2)])
def test_sd_under_adaptive_lengths_follows_the_target_distribution(small_pair, name, draft_mode, draft_cost):
    target, draft = small_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", max_draft=3, draft_length=name, draft_mode=draft_mode,
                                 draft_cost=draft_cost)
    samples, first_round = [], set()
    for seed in range(2000):
        output = decoder.generate(PROMPT, max_new_tokens=3, seed=seed)
        samples.append(tuple(output.sequences[0].tolist()))
        first_round.add(output.rounds[0][0].drafted)
    if name != "heuristic":  # the heuristic changes its length between rounds only
        # Within the first round (budget 2), the rule stopped after one draft for some draws, not for others: the
        # stops depend on the drafts, which is what could bias the law.
        assert first_round == {1, 2}
    assert chi_square_cells_p_value(samples, exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB)) > 1e-4
    # The test can fail: the same samples reject the draft's own law.
    assert chi_square_cells_p_value(samples, exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight=0.0)) < 1e-6


# ---- the comparison table --------------------------------------------------------------------------------------------


def result(label, draft_length, tokens_per_second, work):
    return MethodResult(label, 1.0, 0.5, 2.0, 0.0, -1.0, tokens_per_second, 64, 1.0, drafts_per_round=2.0,
                        batch_work=tuple(work), draft_length=draft_length)


def test_each_policy_is_compared_with_its_methods_best_fixed_k_batch_by_batch():
    results = [result("sd / K=2", "fixed", 50.0, [(40, 1.0), (60, 1.0)]),
               result("sd / K=3", "fixed", 45.0, [(44, 1.0), (46, 1.0)]),
               result("sd / gain", "gain", 55.0, [(44, 1.0), (66, 1.0)]),
               result("static w=0.5 / K=3", "fixed", 60.0, [(60, 1.0)]),
               result("static w=0.5 / gain", "gain", 66.0, [(66, 1.0)]), result("ar", "", 40.0, [(40, 1.0)])]
    best = best_fixed(results)
    assert best["sd"].label == "sd / K=2" and best["static w=0.5"].label == "static w=0.5 / K=3" and "ar" not in best
    ratio, error = paired_speedup(results[2], best["sd"])
    assert ratio == pytest.approx(1.1) and error == pytest.approx(0.0)  # 1.1x on both prompts
    # Jackknife over prompts: leaving out each prompt gives 41/40 and 70/60; their spread is the error.
    ratio, error = paired_speedup(result("x", "gain", 0.0, [(41, 1.0), (70, 1.0)]), best["sd"])
    assert ratio == pytest.approx(111 / 100)
    assert error == pytest.approx(math.sqrt(0.5 * 2 * ((41 / 40 - 70 / 60) / 2) ** 2))
    assert math.isnan(paired_speedup(results[4], best["static w=0.5"])[1])  # one batch: no error
    table = draft_length_table(results)
    assert "| sd | K=2 (best fixed) |" in table and "| sd | gain |" in table and "1.100x +- 0.000" in table
    assert "| ar |" not in table
    specs = with_draft_lengths([("ar", {"method": "ar"}), ("sd", {"method": "sd"})], ["fixed", "gain"], [2, 3])
    assert [label for label, _ in specs] == ["ar", "sd / K=2", "sd / K=3", "sd / gain"]
    assert specs[2][1] == {"method": "sd", "draft_length": "fixed", "max_draft": 3}
