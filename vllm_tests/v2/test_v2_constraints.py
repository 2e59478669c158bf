"""Hard constraints kept at w = 0 on the V2 runner (under Triton's interpreter): one engine, one batch of requests
restricted by ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` beside unconstrained ones. V2's own sampling
parameters process every target row; a drafted token they rule out is never kept, whatever the weight, so no emitted
token breaks its request's constraint, and the unconstrained requests of the batch keep their gain from w < 1."""

from __future__ import annotations

import pytest
from constraints import CONSTRAINED, FREE_DIVERSED, FREE_EXACT, rate, run_batch
from engines import V2_ARGS, start_engine, stop_engine

PROMPTS_PER_KIND = 4
TOKENS = 32  # 4 x 32 = 128 tokens of each kind: the interpreter takes about 100 ms a token


@pytest.fixture(scope="module")
def tallies(pair):
    llm = start_engine(pair, diversed={"weight": 1.0}, **V2_ARGS)
    try:
        outcome = run_batch(llm, PROMPTS_PER_KIND, TOKENS)
    finally:
        stop_engine(llm)
    print({kind: dict(entry, acceptance=round(rate(entry), 3)) for kind, entry in outcome.items()})  # for -s runs
    return outcome


@pytest.mark.parametrize("kind", CONSTRAINED)
def test_no_emitted_token_breaks_its_requests_constraint(tallies, kind):
    entry = tallies[kind]
    assert entry["violations"] == 0, tallies
    assert entry["tokens"] >= PROMPTS_PER_KIND * TOKENS // 2 and entry["drafted"] > 20, entry


def test_unconstrained_requests_of_the_batch_keep_their_gain(tallies):
    free, exact = tallies[FREE_DIVERSED], tallies[FREE_EXACT]
    assert exact["drafted"] > 20 and free["drafted"] > 20
    assert rate(free) > rate(exact), tallies
    for kind in ("bad_words", "min_tokens"):
        assert rate(tallies[kind]) > rate(exact), (kind, tallies)
