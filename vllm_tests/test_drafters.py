"""The plugin verifying drafters other than a draft model, in real V1 engines on the default pair's target: vLLM's
n-gram lookup and suffix decoding (tokens only, nothing drafted where nothing matches), EAGLE (greedy drafts) and
EAGLE-3 (a reduced draft vocabulary, probabilistic drafts) heads built in the test with random weights, and the
trained EAGLE-3 drafter for the default pair. Each engine: verified by diversed_ext, w = 0 keeps every real draft,
w = 1 greedy equals vLLM without speculation, the lossy rules raise acceptance, and no head request's draft goes
without its hidden states. One engine per drafter, few short requests."""

from __future__ import annotations

import pytest
from drafters import NGRAM_CONFIG, REPEATING_PROMPTS, build_eagle, build_eagle3, start_drafter_engine, trained_eagle3
from engines import chat, counts_during, stop_engine, worker_status
from laws import greedy_tokens

TOKENS = 48
HEAD = "default"  # in an eagle3 engine, the head trained on EAGLE-3 states (python_tests check which one loads)
# EAGLE heads with random weights accept almost nothing at w = 1: each step emits one token, so fewer, shorter requests
EAGLE_PROMPTS = REPEATING_PROMPTS[:4]
EAGLE_TOKENS = 32


def _sampled(llm, extra_args, prompts=REPEATING_PROMPTS, tokens=TOKENS):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=tokens, seed=index, extra_args=extra_args)
              for index in range(len(prompts))]
    return llm.chat([chat(prompt) for prompt in prompts], params, use_tqdm=False)


def _rate(delta: dict) -> float:
    return delta["accepted"] / delta["drafted"]


def _assert_verified_by_diversed(llm) -> None:
    statuses = worker_status(llm)
    assert statuses
    for status in statuses:
        assert status["sampler"] == "DiversedRejectionSampler" and status["verifier"] == "diversed", status
        assert status["verified_without_head"] == 0, status


# Lookup drafters (tokens only, nothing drafted where nothing matches): n-gram lookup in the request's own tokens, and
# suffix decoding (arctic_inference's suffix trees over the prompt and earlier responses, built by the test).
LOOKUPS = {"ngram": NGRAM_CONFIG, "suffix": {"method": "suffix"}}


@pytest.fixture(scope="module", params=sorted(LOOKUPS))
def lookup(request, pair):
    if request.param == "suffix":
        from suffix_decoding import suffix_decoding_on_path

        with suffix_decoding_on_path():  # this process checks arctic_inference is there, the engine's imports it
            llm = start_drafter_engine(pair, LOOKUPS["suffix"], {"weight": 1.0})
    else:
        llm = start_drafter_engine(pair, LOOKUPS[request.param], {"weight": 1.0})
    yield llm
    stop_engine(llm)


def test_lookup_weight_zero_keeps_every_real_draft(lookup):
    _assert_verified_by_diversed(lookup)
    delta = counts_during(lookup, lambda: _sampled(lookup, {"diversed_weight": 0.0}))
    assert delta["drafted"] > 20 and delta["accepted"] == delta["drafted"] and delta["weight_sum"] == 0.0, delta


def test_lookup_greedy_at_weight_one_equals_no_speculation(lookup, baseline):
    tokens = []
    delta = counts_during(lookup, lambda: tokens.extend(greedy_tokens(lookup, {"diversed_weight": 1.0})))
    assert delta["drafted"] > 0, "the lookup drafted nothing: the test would not exercise verification"
    assert tokens == baseline["greedy"]


# Suffix decoding does not draft alike twice: after a batch that ran the same way, its cache of earlier responses makes
# the next batch's drafts differ from run to run. FLy's kept drafts then moved its acceptance between 0.18 and 0.60
# over three runs (sd's 0.25), so with it FLy is checked for verifying and keeping drafts, not for its gain; w = 0.5
# and the gate stayed 0.52-0.75 in those runs.
GAIN_UNSTABLE = {"suffix": ("fly",)}


def test_lookup_weights_gate_and_fly_raise_acceptance(lookup, request):
    exact = counts_during(lookup, lambda: _sampled(lookup, {"diversed_weight": 1.0}))
    half = counts_during(lookup, lambda: _sampled(lookup, {"diversed_weight": 0.5}))
    gated = counts_during(lookup, lambda: _sampled(lookup, {"diversed_weight": 1.0, "diversed_gate_margin": 1.0}))
    fly = counts_during(lookup, lambda: _sampled(lookup, {"diversed_weight": 1.0, "diversed_fly_window": 1,
                                                          "diversed_fly_threshold": 0.0}))
    wide = counts_during(lookup, lambda: _sampled(lookup, {"diversed_weight": 1.0, "diversed_gate_margin": 1e6}))
    print("acceptance at w = 1, w = 0.5, gate margin 1, FLy, gate margin 1e6:", exact, half, gated, fly, wide)
    assert min(exact["drafted"], half["drafted"], gated["drafted"], fly["drafted"], wide["drafted"]) > 20
    unstable = GAIN_UNSTABLE.get(request.node.callspec.params["lookup"], ())
    rules = {"half": half, "gated": gated, "fly": fly}
    assert min(_rate(delta) for name, delta in rules.items() if name not in unstable) > _rate(exact), (exact, rules)
    assert fly["accepted"] > 0, fly
    assert wide["accepted"] == wide["drafted"], wide
    _assert_verified_by_diversed(lookup)


def test_ngram_with_heads_is_refused_at_startup(pair):
    with pytest.raises(RuntimeError, match="'ngram': its drafts are token ids without hidden states"):
        start_drafter_engine(pair, NGRAM_CONFIG, {"weight": 1.0, "heads": [HEAD]})


# EAGLE with greedy drafts (tokens only); EAGLE-3 with a reduced draft vocabulary and probabilistic drafts (the
# verifier reads q, -inf outside the draft's ids, and the head's features read it too), with random weights and as
# trained for the default pair: (method, checkpoint, draft_sample_method).
EAGLE_ENGINES = {"eagle": ("eagle", build_eagle, "greedy"), "eagle3": ("eagle3", build_eagle3, "probabilistic"),
                 "eagle3-trained": ("eagle3", lambda pair, folder: trained_eagle3(), "probabilistic")}
# Acceptance at w = 1 the trained drafter must reach: five times EAGLE-3's with random weights (0.008)
TRAINED_RATE_AT_ONE = 0.04


@pytest.fixture(scope="module", params=sorted(EAGLE_ENGINES))
def eagle(request, pair, tmp_path_factory):
    method, build, draft_sample_method = EAGLE_ENGINES[request.param]
    folder = build(pair, tmp_path_factory.mktemp(request.param))
    llm = start_drafter_engine(pair, {"method": method, "model": str(folder),
                                      "draft_sample_method": draft_sample_method},
                               {"weight": 1.0, "heads": [HEAD]})
    yield llm
    stop_engine(llm)


def test_eagle_weights_zero_half_one_and_the_gate(eagle, baseline, request):
    _assert_verified_by_diversed(eagle)
    none, half, exact, gated = (
        counts_during(eagle, lambda: _sampled(eagle, extra_args, EAGLE_PROMPTS, EAGLE_TOKENS))
        for extra_args in ({"diversed_weight": 0.0}, {"diversed_weight": 0.5}, {"diversed_weight": 1.0},
                           {"diversed_weight": 1.0, "diversed_gate_margin": 4.0}))
    name = request.node.callspec.params["eagle"]
    print(name, "acceptance at w = 0, 0.5, 1 and the gate (margin 4):", none, half, exact, gated)
    assert min(none["drafted"], half["drafted"], exact["drafted"], gated["drafted"]) > 50
    assert none["accepted"] == none["drafted"], none
    assert _rate(half) > _rate(exact), (half, exact)
    if name == "eagle3-trained":
        assert _rate(exact) > TRAINED_RATE_AT_ONE and _rate(gated) > _rate(exact), (exact, gated)
    assert greedy_tokens(eagle, {"diversed_weight": 1.0}) == baseline["greedy"]


def test_eagle_a_head_reads_the_drafters_hidden_states(eagle, request):
    delta = counts_during(eagle, lambda: _sampled(eagle, {"diversed_head": HEAD}, EAGLE_PROMPTS, EAGLE_TOKENS))
    assert delta["drafted"] > 50 and delta["verified_without_head"] == 0, delta
    mean_weight = delta["weight_sum"] / delta["drafted"]
    print(request.node.callspec.params["eagle"], "default head: mean w", mean_weight, "acceptance", _rate(delta))
    assert 0.0 < mean_weight < 1.0, mean_weight
    _assert_verified_by_diversed(eagle)

