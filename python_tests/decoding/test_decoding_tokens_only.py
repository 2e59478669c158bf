"""The decoding loop with drafts verified on their tokens alone (``draft_mode``, a callable ``drafter``): greedy and
sampled output laws, acceptance, the callable's contract and batch invariance (tiny random Llama pairs, the
exact laws and the chi-square test from helpers).

With q one-hot at the drafted x, nu = w p + (1 - w) q keeps x with probability w p(x) + 1 - w and a rejection draws
from p without x, so every position emits a token of nu: for w = 1 the target, whatever the draft proposes.
"""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

from diversed_ext.decoding import NgramDrafter, SpeculativeDecoder  # noqa: E402
from diversed_ext.decoding import batch as batch_module  # noqa: E402
from helpers import (P_VALUE_FLOOR, PROMPT, SMALL_VOCAB, WIDE_VOCAB, assert_prompts_decode_as_alone,  # noqa: E402
                     chi_square_cells_p_value, exact_joint, exact_speculative_joint, sequences)

PROMPTS = [PROMPT, [5], [7, 7, 8, 30, 2, 11], [4, 9, 4, 9, 4]]
SAMPLES = 2000


class OneHotModel(torch.nn.Module):
    """A "model" whose next-token law is one-hot at ``pick(input_ids)`` (logits 0 there, -inf elsewhere): the q the
    verifier sees when a drafter hands over its tokens alone, for the exact laws of helpers/stats.py."""

    def __init__(self, pick, vocab):
        super().__init__()
        self.pick, self.vocab = pick, vocab

    def forward(self, input_ids):
        one_hot = torch.nn.functional.one_hot(self.pick(input_ids), self.vocab).bool()
        return type("Output", (), {"logits": torch.where(one_hot, 0.0, float("-inf"))})()


def argmax_of(model):
    """The one-hot law of a greedy draft: ``model``'s argmax."""
    return OneHotModel(lambda input_ids: model(input_ids).logits.argmax(-1), model.config.vocab_size)


def samples_of(decoder, length, count=SAMPLES):
    """``count`` continuations of PROMPT, copy i with seed i, decoded together (each as it would be alone)."""
    output = decoder.generate([PROMPT] * count, max_new_tokens=length, seed=0)
    return [tuple(tokens.tolist()) for tokens in output.sequences]


def constant_drafter(token):
    return lambda context, k: [token] * k


# ---- what the verifier gets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_mode", ["distributions", "tokens", "sampled_tokens"])
def test_the_verifier_gets_draft_logits_only_in_distributions_mode(wide_pair, monkeypatch, draft_mode):
    target, draft = wide_pair
    verify, seen = batch_module.verify_logits, []

    def recording_verify(draft_tokens, draft_logits, *args, **kwargs):
        if "num_draft" in kwargs:  # the verifier's call, not the draft sampling's
            seen.append(draft_logits)
        return verify(draft_tokens, draft_logits, *args, **kwargs)

    monkeypatch.setattr(batch_module, "verify_logits", recording_verify)
    decoder = SpeculativeDecoder(target, draft, method="static", weight=0.5, max_draft=3, draft_mode=draft_mode)
    decoder.generate(PROMPTS, max_new_tokens=8, seed=0)
    assert seen and all((logits is not None) == (draft_mode == "distributions") for logits in seen)


@pytest.mark.parametrize("draft_mode", ["tokens", "sampled_tokens"])
def test_tokens_only_drafts_are_the_argmax_or_samples_of_the_draft(wide_pair, draft_mode):
    """A tokens-only draft model proposes its argmax at any temperature; "sampled_tokens" samples its softmax."""
    target, draft = wide_pair
    # w = 0 keeps every draft, so each round emits its drafts, then the bonus token.
    decoder = SpeculativeDecoder(target, draft, method="static", weight=0.0, max_draft=3, temperature=2.0,
                                 draft_mode=draft_mode)
    output = decoder.generate(PROMPTS, max_new_tokens=13, seed=3)
    argmax_drafts = drafts = 0
    for prompt, generation in zip(PROMPTS, output.generations):
        sequence, position = list(prompt) + generation.tokens.tolist(), len(prompt)
        for stats in generation.rounds:
            assert stats.accepted == stats.drafted
            for token in stats.draft_tokens:
                assert sequence[position] == token
                with torch.inference_mode():
                    argmax_drafts += token == int(draft(torch.tensor([sequence[:position]])).logits[0, -1].argmax())
                drafts += 1
                position += 1
            position += 1
    assert drafts > 20
    if draft_mode == "tokens":
        assert argmax_drafts == drafts
    else:
        assert argmax_drafts < drafts  # at T = 2 some samples are not the argmax


# ---- greedy ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["draft model", "ngram", "constant"])
def test_greedy_tokens_only_sd_equals_greedy_ar_token_for_token(wide_pair, source):
    target, draft = wide_pair
    ar = SpeculativeDecoder(target, method="ar", temperature=0).generate(PROMPTS, max_new_tokens=24)
    drafter = {"draft model": None, "ngram": NgramDrafter(2), "constant": constant_drafter(20)}[source]
    decoder = SpeculativeDecoder(target, draft if drafter is None else None, method="sd", max_draft=3,
                                 temperature=0, draft_mode="tokens", drafter=drafter)
    output = decoder.generate(PROMPTS, max_new_tokens=24)
    assert sequences(output) == sequences(ar)
    summary = output.summary()
    assert 0 < summary.accepted < summary.drafted  # both paths ran: some drafts kept, some corrected


def test_an_oracle_drafter_is_always_accepted(wide_pair):
    """A callable proposing the target's own greedy continuation: every draft kept, K + 1 tokens a round."""
    target, _ = wide_pair
    ar = SpeculativeDecoder(target, method="ar", temperature=0)

    def oracle(context, k):
        return ar.generate(context, max_new_tokens=k).sequences[0].tolist()

    output = SpeculativeDecoder(target, method="sd", max_draft=3, temperature=0, drafter=oracle).generate(
        PROMPTS, max_new_tokens=17)
    assert sequences(output) == sequences(ar.generate(PROMPTS, max_new_tokens=17))
    for rounds in output.rounds:
        assert [stats.emitted for stats in rounds] == [4] * 4 + [1]  # the last round has one token left: no draft
        assert all(stats.accepted == stats.drafted for stats in rounds)


# ---- sampled: the output law -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_mode", ["tokens", "sampled_tokens"])
def test_sampled_tokens_only_sd_follows_the_target(small_pair, draft_mode):
    target, draft = small_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", max_draft=2, draft_mode=draft_mode)
    samples = samples_of(decoder, 3)
    assert chi_square_cells_p_value(samples, exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB)) > P_VALUE_FLOOR
    # The same samples clearly reject the draft's law, or the test could not fail.
    assert chi_square_cells_p_value(samples, exact_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight=0.0)) < 1e-6


def test_sampled_output_with_a_callable_drafter_follows_the_mixture(small_pair):
    """A drafter proposing token 1 everywhere: sd follows the target, static w = 0.5 the rounds' law with q one-hot
    at 1; each sample set rejects the other's law, so the test can fail."""
    target, _ = small_pair
    constant = OneHotModel(lambda input_ids: torch.ones_like(input_ids), SMALL_VOCAB)
    laws = {weight: exact_speculative_joint(target, constant, PROMPT, 3, SMALL_VOCAB, weight, 1.0, max_draft=2)
            for weight in (1.0, 0.5)}
    assert laws[1.0] == pytest.approx(exact_joint(target, None, PROMPT, 3, SMALL_VOCAB), abs=1e-6)
    for weight, other in ((1.0, 0.5), (0.5, 1.0)):
        decoder = SpeculativeDecoder(target, method="static", weight=weight, max_draft=2,
                                     drafter=constant_drafter(1))
        samples = samples_of(decoder, 3)
        assert chi_square_cells_p_value(samples, laws[weight]) > P_VALUE_FLOOR
        assert chi_square_cells_p_value(samples, laws[other]) < 1e-6


def test_static_tokens_only_follows_the_mixture_with_one_hot_drafts(small_pair):
    """Static w over greedy tokens-only drafts: the exact law of the rounds with q one-hot at the draft's argmax,
    which the same samples tell apart from the law with the draft's distributions."""
    target, draft = small_pair
    weight, temperature, max_draft = 0.5, 0.8, 3
    decoder = SpeculativeDecoder(target, draft, method="static", weight=weight, max_draft=max_draft,
                                 temperature=temperature, draft_mode="tokens")
    samples = samples_of(decoder, 3)
    law = exact_speculative_joint(target, argmax_of(draft), PROMPT, 3, SMALL_VOCAB, weight, temperature, max_draft)
    assert abs(sum(law.values()) - 1) < 1e-6
    assert chi_square_cells_p_value(samples, law) > P_VALUE_FLOOR
    with_distributions = exact_speculative_joint(target, draft, PROMPT, 3, SMALL_VOCAB, weight, temperature,
                                                 max_draft)
    assert chi_square_cells_p_value(samples, with_distributions) < 1e-6


# ---- acceptance ------------------------------------------------------------------------------------------------------


def test_static_tokens_only_accepts_more_than_sd_tokens_only(wide_pair):
    target, draft = wide_pair
    acceptance = {}
    for method, weight in (("sd", None), ("static", 0.5)):
        decoder = SpeculativeDecoder(target, draft, method=method, weight=weight, max_draft=3, draft_mode="tokens")
        acceptance[method] = decoder.generate(PROMPTS * 4, max_new_tokens=32, seed=0).summary().acceptance_rate
    # A draft is kept with probability w p(x) + 1 - w against p(x) (acceptance counts the drafts after a rejection,
    # which are never tested, as drafted).
    assert 0 < acceptance["sd"] < 0.9
    assert acceptance["static"] > acceptance["sd"] + 0.1, acceptance


# ---- the callable drafter's contract ---------------------------------------------------------------------------------


def test_the_drafter_sees_the_tokens_so_far_and_a_budget_that_fits(wide_pair):
    target, _ = wide_pair
    calls = []

    def drafter(context, k):
        calls.append((list(context), k))
        context.append(99)  # a copy: the request's tokens stay as they are
        return [3] * (k - 1)  # fewer than asked is allowed

    output = SpeculativeDecoder(target, method="static", weight=0.3, max_draft=4, drafter=drafter).generate(
        PROMPT, max_new_tokens=10, seed=1)
    generated = output.sequences[0].tolist()
    assert calls and 99 not in generated
    emitted = 0
    for (context, k), stats in zip(calls, output.rounds[0]):
        assert context == PROMPT + generated[:emitted]
        assert k == min(4, 10 - emitted - 1) and stats.drafted == k - 1
        emitted += stats.emitted


def test_drafter_proposals_stop_after_an_eos(wide_pair):
    target, _ = wide_pair
    output = SpeculativeDecoder(target, method="static", weight=0.0, max_draft=4,
                                drafter=lambda context, k: [6, 2, 8, 8][:k]).generate(PROMPT, max_new_tokens=10,
                                                                                        eos_token_id=2, seed=0)
    assert output.rounds[0][0].draft_tokens == (6, 2)
    assert output.sequences[0].tolist() == [6, 2]  # w = 0 keeps both, and the EOS ends the generation


@pytest.mark.parametrize("returned,error,match", [
    ("abc", TypeError, "drafter must return a list of int token ids, got str"),
    (None, TypeError, "drafter must return a list of int token ids, got NoneType"),
    ([1.0, 2.0], TypeError, "element of type float"),
    ([True], TypeError, "element of type bool"),
    (torch.zeros(2, 2, dtype=torch.int64), TypeError, "2-D"),
    (torch.tensor([0.5]), TypeError, "torch.float32 tensor"),
    ([1, 2, 3, 4], ValueError, r"drafter returned 4 tokens; it was asked for at most k = 3"),
    ([1, WIDE_VOCAB], ValueError, rf"drafter returned token ids outside \[0, {WIDE_VOCAB}\): \[{WIDE_VOCAB}\]"),
    ([-1], ValueError, r"outside \[0, 32\): \[-1\]"),
])
def test_a_bad_drafter_output_is_a_clear_error(wide_pair, returned, error, match):
    target, _ = wide_pair
    decoder = SpeculativeDecoder(target, method="sd", max_draft=3, drafter=lambda context, k: returned)
    with pytest.raises(error, match=match):
        decoder.generate(PROMPT, max_new_tokens=8, seed=0)


def test_a_drafter_may_return_a_tensor_or_a_tuple(wide_pair):
    target, _ = wide_pair
    outputs = [SpeculativeDecoder(target, method="sd", max_draft=3, drafter=drafter).generate(
        PROMPTS, max_new_tokens=9, seed=5) for drafter in (constant_drafter(4), lambda context, k: (4,) * k,
                                                           lambda context, k: torch.full((k,), 4))]
    assert sequences(outputs[0]) == sequences(outputs[1]) == sequences(outputs[2])


@pytest.mark.parametrize("kwargs,error,match", [
    ({"method": "diversed", "head": lambda d, t: d.sum(-1) * 0 + 0.5}, ValueError,
     r"drafter \(a callable\) works with methods 'sd' and 'static', not 'diversed': the head"),
    ({"method": "ar"}, ValueError, r"drafter \(a callable\) works with methods 'sd' and 'static', not 'ar'"),
    ({"method": "sd", "draft_mode": "distributions"}, ValueError, "drafter gives tokens only"),
    ({"method": "sd", "drafter": 3}, TypeError, "drafter must be callable"),
    ({"method": "sd", "draft": "model"}, ValueError, r"draft model \(draft=\) or a callable drafter"),
])
def test_bad_drafter_arguments_name_the_argument(wide_pair, kwargs, error, match):
    target, _ = wide_pair
    kwargs = {"drafter": constant_drafter(1), **kwargs}
    with pytest.raises(error, match=match):
        SpeculativeDecoder(target, kwargs.pop("draft", None), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "sd", "draft_mode": "probs"}, "draft_mode must be one of distributions, tokens, sampled_tokens"),
    ({"method": "ar", "draft_mode": "tokens"}, "draft_mode applies to methods with a draft"),
])
def test_bad_draft_mode_names_the_argument(wide_pair, kwargs, match):
    target, draft = wide_pair
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, draft, **kwargs)


# ---- batches and seeds -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"method": "static", "weight": 0.5, "draft_mode": "tokens"},
    {"method": "sd", "draft_mode": "sampled_tokens"},
    {"method": "static", "weight": 0.4, "drafter": NgramDrafter(2)},
], ids=["static-tokens", "sd-sampled-tokens", "static-ngram"])
def test_prompt_tokens_do_not_depend_on_batch_size_or_neighbours(wide_pair, kwargs):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, None if "drafter" in kwargs else draft, max_draft=3, **kwargs)
    alone = assert_prompts_decode_as_alone(decoder, PROMPTS, seed=40, max_new_tokens=14, eos=(5, 9))
    # The same requests in reverse order, each with its own seed.
    reverse = decoder.generate(PROMPTS[::-1], max_new_tokens=14, eos_token_id=[5, 9], seed=[43, 42, 41, 40])
    assert sequences(reverse) == alone[::-1]


def test_diversed_with_tokens_only_drafts_still_feeds_its_head(wide_pair):
    """The head reads the draft model's hidden states (and distributions when it wants them) while the verifier
    goes without the draft's distributions: w = 1 from the head then reproduces tokens-only sd."""
    target, draft = wide_pair
    seen = []

    class Head(torch.nn.Module):
        wants_distributions = True

        def forward(self, draft_hidden, target_hidden, distributions):
            seen.append(distributions)
            return torch.ones(draft_hidden.shape[:2])

    diversed = SpeculativeDecoder(target, draft, method="diversed", head=Head(), max_draft=3, draft_mode="tokens")
    sd = SpeculativeDecoder(target, draft, method="sd", max_draft=3, draft_mode="tokens")
    assert sequences(diversed.generate(PROMPTS, max_new_tokens=12, seed=2)) == sequences(
        sd.generate(PROMPTS, max_new_tokens=12, seed=2))
    assert seen and all(features.shape[-1] == 5 and torch.isfinite(features).all() for features in seen)


# ---- the n-gram drafter ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("context,k,max_n,expected", [
    ([1, 2, 3, 9, 8, 1, 2, 3], 2, 3, [9, 8]),  # the longest suffix that occurs earlier, and what followed it
    ([5, 6, 5, 7, 5], 3, 1, [7, 5]),  # the latest earlier occurrence; fewer than k when the context ends
    ([4, 1, 2, 7, 1, 2], 5, 3, [7, 1, 2]),  # no 3-gram match, the 2-gram [1, 2] matches
    ([1, 2, 3], 4, 3, []),  # no match at all
    ([3], 2, 3, []),
])
def test_ngram_drafter_proposes_what_followed_the_last_match(context, k, max_n, expected):
    assert NgramDrafter(max_n)(context, k) == expected


@pytest.mark.parametrize("kwargs,match", [({"max_n": 0}, "max_n must be an int >= 1"),
                                          ({"min_n": 1.5}, "min_n must be an int >= 1"),
                                          ({"max_n": 2, "min_n": 3}, "must not exceed")])
def test_ngram_drafter_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NgramDrafter(**kwargs)
