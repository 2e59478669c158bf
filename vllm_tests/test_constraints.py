"""Hard constraints kept at w = 0 on the V1 runner: one engine, one batch of requests restricted by
``allowed_token_ids``, ``bad_words`` and ``min_tokens`` beside unconstrained ones. A drafted token that the processed
target rules out is never kept, whatever the weight, so no emitted token breaks its request's constraint; the
unconstrained requests of the same batch keep their gain from w < 1. ``logit_bias`` and ``min_p`` are refused by vLLM
itself when speculative decoding is on."""

from __future__ import annotations

import pytest
from constraints import CONSTRAINED, FREE_DIVERSED, FREE_EXACT, rate, refused_with_speculation, run_batch
from engines import start_engine, stop_engine

PROMPTS_PER_KIND = 8
TOKENS = 48  # 8 x 48 = 384 tokens of each kind


@pytest.fixture(scope="module")
def outcome(pair):
    llm = start_engine(pair, diversed={"weight": 1.0})
    try:
        tallies = run_batch(llm, PROMPTS_PER_KIND, TOKENS)
        refusals = refused_with_speculation(llm)
    finally:
        stop_engine(llm)
    print({kind: dict(entry, acceptance=round(rate(entry), 3)) for kind, entry in tallies.items()})  # for -s runs
    return tallies, refusals


@pytest.mark.parametrize("kind", CONSTRAINED)
def test_no_emitted_token_breaks_its_requests_constraint(outcome, kind):
    tallies, _ = outcome
    entry = tallies[kind]
    assert entry["violations"] == 0, tallies
    assert entry["tokens"] >= PROMPTS_PER_KIND * TOKENS // 2 and entry["drafted"] > 50, entry


def test_unconstrained_requests_of_the_batch_keep_their_gain(outcome):
    tallies, _ = outcome
    free, exact = tallies[FREE_DIVERSED], tallies[FREE_EXACT]
    assert exact["drafted"] > 50 and free["drafted"] > 50
    assert rate(free) > rate(exact), tallies
    # constraints that rule out only a few tokens leave most drafts kept at w = 0
    for kind in ("bad_words", "min_tokens"):
        assert rate(tallies[kind]) > rate(exact), (kind, tallies)


def test_vllm_refuses_logit_bias_and_min_p_with_speculation(outcome):
    _, refusals = outcome
    assert len(refusals) == 2 and all("not yet supported with speculative decoding" in error
                                      for error in refusals), refusals
